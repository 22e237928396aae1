"""Triton kernels of DynamicTokenNorm's full-resolution passes (Shao et al., ICLR 2022, Eqs. 2, 4,
5), each followed by the function that launches it.

Tokens x are (B, N, C) in float16, bfloat16 or float32, read as they are; everything is computed
and accumulated in float32, and the outputs have x's dtype. A program holds whole tokens (all C
channels, ``C_BLOCK`` = the next power of two), so the intra-token statistics of Eq. 2 never leave
its registers. H, W and N are runtime arguments: a new resolution launches the same compiled
kernels. Cell tensors (the cell moments, dL/dm) are contiguous (B, Hp, Wp, C) images: the cell
moments in float32, dL/dm in :func:`cell_gradient_dtype`.

The positional products (Eq. 5, m = P_x (P_y T) by the two factors of P^h) are formed on chip
inside the passes over the tokens, over the nonzero bands of P_y and P_x: a row of P has about
11 nonzero weights in float32 at the paper's initialisation (positional.truncated_softmax), and
:func:`spans` finds every row's and column's nonzero span on the device (no host
synchronisation; a wider P costs time, not correctness). By the traffic model (bytes of the
operands of every launch), doing them as separate passes, even in Triton, would write and read
the moments T, u = P_x T and m = P_y u, two float32 values per cell and channel each: 16 C bytes
per token without pooling, against 3 C e for the whole fused forward (C channels of e bytes: 6 C
in float16), and 16 C / pool^2 with pooling, more than the rest of the forward at pool 2.

The cells are the tokens without pooling (T = (x - centre, (x - centre)^2) read from x itself)
and pool x pool blocks of tokens with pooling (T from the cell moments that :func:`statistics`
writes once, float32: the cell mean and the mean of squares about it; the second moment about
the centre is that plus the squared mean about the centre, or, in the reference code's
convention, the square of the pooled mean alone). Eq. 2 is never stored: a program holds whole
tokens, and every pass that reads a token forms its mean and variance again. Every pass with
pooling reads a token row of a tile of cells at a time (:func:`_cell_columns`). Forward:
:func:`statistics` (with pooling the cell moments, in one read of x; without, only the centre, from
a sample of the tokens), then :func:`output`, whose programs each take a tile of cells of one cell
row (with pooling two tiles), read the band of cells, cached, and form v = P_y T for the columns of
the band and m = P_x v in registers, once per cell, before x of the cells' tokens is read (again)
for y, a tile at a time, token row after token row (Eqs. 2, 4, 5): with pooling x read twice, y
written once and the cell moments written once and read once; without pooling x read once (and a
17th of it for the centre) and y written once.

Backward, :func:`fused_backward` passes one tensor between two passes, dL/dm (two values per cell
and channel: float32 for float32 tokens; for 16-bit tokens float16, each cell's values divided by
their largest magnitude, which is kept in float32), since dL/dT of a cell needs dL/dm of its whole
band. Pass 1 (a program per token row, or with pooling per CELLS_PER_PROGRAM cells of a cell row, in
tiles of cells) forms m of a tile's cells again (with pooling of a group of tiles), once per cell,
then D1 and D2 of the cells' tokens, token row after token row, writes dL/dm (with pooling the sum
over the cell's tokens) and the sums for the parameters (written per program and added up afterwards
in a fixed order: no float atomics), then reads its dL/dm back from cache for its share of the
gradient of P_y (sum of dL/dm u over the band's rows of u, in tiles of :func:`_rows_tile` cells).
Pass 2 (a program per tile of cell columns and block of cell rows, walking its cell rows;
:func:`_row_blocks`) forms m again and dL/du = P_y^T dL/dm and dL/dT = P_x^T dL/du over the bands,
once per cell, then dx of the cells' tokens (the per-token terms formed again instead of stored),
token row after token row, and adds up its cells' columns of the gradient of P_x in place (the
program holding the cells owns them: deterministic, no atomics). Without pooling a cell is a token,
and a tile of cells a tile of a token row. The gradients of P are exact on the bands and zero
elsewhere, where P is an exact zero and the softmax passes no gradient; they are written per image
(and program or row block) and added up afterwards. Forming the products once per cell rather than
once per token is what pooling saves on chip (pool^2 times fewer multiply-adds for m). Without
pooling backward moves about 5 C e + 4 C f bytes per token (f bytes per value of dL/dm, 4 or 2):
dL/dm, which only a recomputation of m over the band of every neighbour (the band squared) would
avoid, is most of the rest; with pooling dL/dm and the cell moments are pool^2 times smaller, and
what both passes read beyond the bound of a design fused as far as the math allows
(tools/analysis/benchmark_norm.py) is the per-program sums.

Every launch is recorded with the bytes of its operands (:func:`.base.record_launch`); with meta
tensors the launches are only recorded, which gives the traffic of any shape without a GPU. What the
passes read again from cache (the bands around every tile) is counted in Triton's interpreter by
tools/analysis/kernel_loads.py.
"""
import torch
import triton
import triton.language as tl

from .base import record_launch

__all__ = ['statistics', 'output', 'fused_backward', 'specializations', 'cell_gradient_dtype',
           'TOKEN_POINTERS', 'GRADIENT_POINTERS', 'INDEX_POINTERS', 'spans']

#: Elements of a token tile (TILE tokens x C_BLOCK channels) per thread of a program: a pass holds
#: several such tiles (x, dL/dy, the cell statistics, ...) in registers.
ELEMENTS_PER_THREAD = 8
#: Cells of one cell row a program of the passes with pooling covers: its partial sums are
#: written once.
CELLS_PER_PROGRAM = 16
#: Without pooling the centre is the mean of one token in CENTRE_STRIDE. Rows of P sum to 1, so the
#: statistics about any per-channel constant are the same; one near the tokens' values keeps the
#: second moment about it free of cancellation, and a sample is as near as the mean of all
#: tokens: the forward then reads x once, not twice. A prime stride walks across the columns of
#: every token grid whose width it does not divide, rather than down a few of them.
CENTRE_STRIDE = 17
#: Entries of a row of a positional factor one step of the search for its nonzero span reads.
SPAN_BLOCK = 128
#: Programs the dx pass (backward pass 2) aims for, a few per multiprocessor of a large GPU:
#: where an image has fewer tiles of cell columns, its cell rows are split into blocks ...
DX_PROGRAMS = 512
#: ... as long as the partial gradients of P_x of the blocks stay within this share of x's bytes
PARTIAL_SHARE = 1 / 32


def _bytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


#: Pointer arguments of the kernels to tensors of the tokens' dtype, to dL/dm (of
#: :func:`cell_gradient_dtype`), and to int32 tensors (the nonzero spans of the positional
#: factors); all others are float32.
TOKEN_POINTERS = ('x_ptr', 'g_ptr', 'y_ptr', 'dx_ptr')
GRADIENT_POINTERS = ('dm_first_ptr', 'dm_second_ptr')
INDEX_POINTERS = ('spans_ptr', 'span_y_ptr', 'span_x_ptr')


def cell_gradient_dtype(dtype):
    """The dtype dL/dm is passed between the backward passes in for tokens of ``dtype``: float32
    for float32 tokens; for 16-bit tokens float16 scaled per cell (:func:`_store_gradient`),
    which keeps 11 significant bits of every cell's largest value, more than bfloat16 tokens
    have, at half the bytes of float32."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def _launch(name, spec, grid, reads, writes, *args):
    """Records the launch of ``spec`` = (kernel, constexprs, num_warps) and, unless the tensors
    are meta tensors (traffic counts only), launches it."""
    kernel, constexprs, num_warps = spec
    record_launch(name, _bytes(*reads), _bytes(*writes))
    if reads[0].device.type != 'meta':
        kernel[grid](*args, **constexprs, num_warps=num_warps)


def _c_block(C):
    return triton.next_power_of_2(C)


def _tile(C):
    """Tokens per tile: ELEMENTS_PER_THREAD elements of the tile per thread."""
    return max(1, min(64, ELEMENTS_PER_THREAD * 32 * _warps(C) // _c_block(C)))


def _warps(C):
    return 4 if _c_block(C) <= 256 else 8


# ---------------------------------------------------------------------------- shared pieces
@triton.jit
def _load_tokens(image_ptr, tokens, valid, C, C_BLOCK: tl.constexpr):
    """Tokens (TILE,) of one image (rows of C from ``image_ptr``), as float32 [TILE, C_BLOCK],
    zeros outside; and the mask. Offsets within an image are int32, images are int64 apart."""
    cols = tl.arange(0, C_BLOCK)
    mask = valid[:, None] & (cols[None, :] < C)
    x = tl.load(image_ptr + tokens[:, None] * C + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32), mask


@triton.jit
def _image(ptr, b, size):
    """The start of image b of a tensor of images of ``size`` elements each."""
    return ptr + b.to(tl.int64) * size


@triton.jit
def _cell_images(cell_mean_ptr, cell_var_ptr, x_image, b, size, POOLED: tl.constexpr):
    """Image b's cell means and means of squares about them (images of ``size`` values); without
    pooling the cells are the tokens, both x_image."""
    if POOLED:
        return _image(cell_mean_ptr, b, size), _image(cell_var_ptr, b, size)
    else:  # one return per specialisation: the pointers' dtypes differ
        return x_image, x_image


@triton.jit
def _gradient_images(dm_first_ptr, dm_second_ptr, scale_first_ptr, scale_second_ptr, b, cells,
                     C):
    """Image b's dL/dm (both moments, ``cells`` x C values each) and their scales per cell."""
    return ((_image(dm_first_ptr, b, cells * C), _image(dm_second_ptr, b, cells * C)),
            (_image(scale_first_ptr, b, cells), _image(scale_second_ptr, b, cells)))


@triton.jit
def _cell_columns(start, pool, W, Wp, CELLS: tl.constexpr, S_BLOCK: tl.constexpr):
    """The token columns of cells start ... start + CELLS - 1 of a cell row, S_BLOCK per cell
    (CELLS * S_BLOCK, cell after cell), and which are real; without pooling (pool = S_BLOCK = 1)
    the CELLS tokens from ``start``."""
    k = tl.arange(0, CELLS * S_BLOCK)
    cj = start + k // S_BLOCK
    j = cj * pool + k % S_BLOCK
    return j, (k % S_BLOCK < pool) & (j < W) & (cj < Wp)


@triton.jit
def _per_token(cell_values, CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """Values [CELLS, C_BLOCK] of cells repeated for the S_BLOCK token columns of each cell, as
    :func:`_cell_columns` orders them: [CELLS * S_BLOCK, C_BLOCK]."""
    if S_BLOCK == 1:
        return cell_values
    tiled = tl.broadcast_to(cell_values[:, None, :], [CELLS, S_BLOCK, C_BLOCK])
    return tl.reshape(tiled, [CELLS * S_BLOCK, C_BLOCK])


@triton.jit
def _group_tile(values, k, GROUP: tl.constexpr, CELLS: tl.constexpr, C_BLOCK: tl.constexpr):
    """Rows k CELLS ... (k + 1) CELLS - 1 of values [GROUP * CELLS, C_BLOCK] (exact: the other
    rows add zeros)."""
    if GROUP == 1:
        return values
    parts = tl.reshape(values, [GROUP, CELLS, C_BLOCK])
    return tl.sum(tl.where((tl.arange(0, GROUP) == k)[:, None, None], parts, 0.0), axis=0)


@triton.jit
def _ln_statistics(x, mask, C, n_var):
    """Eq. 2 per token: the mean, and the variance about it divided by n_var (two passes)."""
    mean = tl.sum(x, axis=1) / C
    diff = tl.where(mask, x - mean[:, None], 0.0)
    return mean, tl.sum(diff * diff, axis=1) / n_var


@triton.jit
def _normalised(x, mean_ln, var_ln, first, var_it, centre, lam_m, kap_m, lam_v, kap_v, eps):
    """Eq. 5 inside Eq. 4 without the affine: rstd and xhat [TILE, C_BLOCK]."""
    rstd = tl.rsqrt(lam_v * var_ln[:, None] + kap_v * var_it + eps)
    xhat = (x - lam_m * mean_ln[:, None] - kap_m * (first + centre)) * rstd
    return rstd, xhat


@triton.jit
def _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK: tl.constexpr):
    """lambda_m, 1 - lambda_m, lambda_v, 1 - lambda_v and the weight, each [1, C_BLOCK]."""
    cols = tl.arange(0, C_BLOCK)
    m = cols < C
    lam_m = tl.load(ratios_ptr + cols, mask=m, other=0.0)[None, :]
    kap_m = tl.load(ratios_ptr + C + cols, mask=m, other=0.0)[None, :]
    lam_v = tl.load(ratios_ptr + 2 * C + cols, mask=m, other=0.0)[None, :]
    kap_v = tl.load(ratios_ptr + 3 * C + cols, mask=m, other=0.0)[None, :]
    weight = tl.load(weight_ptr + cols, mask=m, other=0.0)[None, :]
    return lam_m, kap_m, lam_v, kap_v, weight


# ---------------------------------------------------------------------------- statistics
@triton.jit
def _cell_sums(values, CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """Sums [CELLS, C_BLOCK] over each cell's S_BLOCK token columns of values [CELLS * S_BLOCK,
    C_BLOCK] ordered as :func:`_cell_columns` orders them (the inverse of :func:`_per_token`)."""
    if S_BLOCK == 1:
        return values
    return tl.sum(tl.reshape(values, [CELLS, S_BLOCK, C_BLOCK]), axis=1)


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _cell_statistics_kernel(x_ptr, cell_mean_ptr, cell_var_ptr, partial_ptr, H, W, C, pool,
                            CELLS: tl.constexpr, TILES: tl.constexpr, S_BLOCK: tl.constexpr,
                            C_BLOCK: tl.constexpr):
    """With pooling: for TILES tiles of CELLS cells of cell row ci of image b the mean of x and
    the mean of squares about it, a token row of the tile's cells at a time (rows merged as in
    Chan et al.), and the sum of the cell means (for the centre)."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + pool - 1) // pool, (W + pool - 1) // pool
    b, ci = row // Hp, row % Hp
    cols = tl.arange(0, C_BLOCK)
    x_image = _image(x_ptr, b, H * W * C)
    total_mean = tl.zeros([C_BLOCK], tl.float32)
    for tile in range(TILES):
        start = (block * TILES + tile) * CELLS
        cjs = start + tl.arange(0, CELLS)
        j, real = _cell_columns(start, pool, W, Wp, CELLS, S_BLOCK)
        count = tl.zeros([CELLS], tl.float32)
        mean = tl.zeros([CELLS, C_BLOCK], tl.float32)
        m2 = tl.zeros([CELLS, C_BLOCK], tl.float32)
        for r in range(0, pool):
            i = ci * pool + r
            valid = real & (i < H)
            x, mask = _load_tokens(x_image, i * W + j, valid, C, C_BLOCK)
            n = tl.sum(tl.reshape(valid.to(tl.float32), [CELLS, S_BLOCK]), axis=1)
            row_mean = _cell_sums(x, CELLS, S_BLOCK, C_BLOCK) / tl.maximum(n, 1.0)[:, None]
            diff = tl.where(mask, x - _per_token(row_mean, CELLS, S_BLOCK, C_BLOCK), 0.0)
            row_m2 = _cell_sums(diff * diff, CELLS, S_BLOCK, C_BLOCK)
            total = count + n
            delta = row_mean - mean
            share = (n / tl.maximum(total, 1.0))[:, None]
            mean += delta * share
            m2 += row_m2 + delta * delta * count[:, None] * share
            count = total
        cell_mask = (cjs < Wp)[:, None] & (cols < C)[None, :]
        out = (row * Wp + cjs).to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(cell_mean_ptr + out, mean, mask=cell_mask)
        tl.store(cell_var_ptr + out, m2 / tl.maximum(count, 1.0)[:, None], mask=cell_mask)
        total_mean += tl.sum(tl.where(cell_mask, mean, 0.0), axis=0)
    tl.store(partial_ptr + (row * tl.num_programs(1) + block).to(tl.int64) * C + cols,
             total_mean, mask=cols < C)


def statistics(x, grid):
    """The cell moments of x and the centre (B, 1, 1, C): without pooling (the cells are the
    tokens) None and the mean of every CENTRE_STRIDE-th token; with pooling the cell means and the
    means of squares about them, float32 (2, B, Hp, Wp, C), and the mean of the cell means. Eq. 2
    is formed again by every pass that reads a token (all its channels are in one program): it is
    never stored."""
    B, _, C = x.shape
    if not grid.pooled:  # a sample of the tokens, summed in float32
        sample = x[:, ::CENTRE_STRIDE]
        return None, (sample.sum(1, dtype=torch.float32) / sample.shape[1]).view(B, 1, 1, C)
    f32 = dict(dtype=torch.float32, device=x.device)
    cells = torch.empty(2, B, grid.Hp, grid.Wp, C, **f32)
    programs = (B * grid.Hp, triton.cdiv(grid.Wp, CELLS_PER_PROGRAM))
    partial = torch.empty(B, grid.Hp * programs[1], C, **f32)
    _launch('triton.cell_statistics', _statistics_spec(C, grid.pool), programs, [x],
            [cells, partial], x, cells[0], cells[1], partial, grid.H, grid.W, C, grid.pool)
    return cells, (partial.sum(1) / (grid.Hp * grid.Wp)).view(B, 1, 1, C)


def _statistics_spec(C, pool):
    """(kernel, constexprs, num_warps) of the statistics pass with pooling."""
    cells, tiles = _pooled_tiles(C, pool)
    return (_cell_statistics_kernel, dict(CELLS=cells, TILES=tiles,
                                          S_BLOCK=triton.next_power_of_2(pool),
                                          C_BLOCK=_c_block(C)), _warps(C))


# ---------------------------------------------------------------------------- output
@triton.jit
def _store_output(y_ptr, ratios_ptr, weight_ptr, bias_ptr, b, N, C, tokens, x, mask, first,
                  var_it, centre, eps, n_var, C_BLOCK: tl.constexpr):
    """Eqs. 2, 4 and 5 for ``tokens`` of image b given the inter-token statistics: y stored."""
    cols = tl.arange(0, C_BLOCK)
    lam_m, kap_m, lam_v, kap_v, weight = _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK)
    bias = tl.load(bias_ptr + cols, mask=cols < C, other=0.0)[None, :]
    mean_ln, var_ln = _ln_statistics(x, mask, C, n_var)
    _, xhat = _normalised(x, mean_ln, var_ln, first, var_it, centre, lam_m, kap_m, lam_v, kap_v,
                          eps)
    y = xhat * weight + bias
    tl.store(_image(y_ptr, b, N * C) + tokens[:, None] * C + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------- banded products
@triton.jit(do_not_specialize=['L'])
def _spans_kernel(p_ptr, spans_ptr, heads, L, BLOCK: tl.constexpr):
    """The nonzero span [lo, hi) over all heads of row i of a factor P (heads, L, L) (program
    (i, 0)) and of its column i (program (i, 1)), into spans (2, L, 2); far from its peak a row of
    P is exact zeros (positional.truncated_softmax)."""
    i, column = tl.program_id(0), tl.program_id(1)
    lo = L + 0
    hi = L * 0
    for h in range(heads):
        for start in range(0, L, BLOCK):
            k = start + tl.arange(0, BLOCK)
            inside = k < L
            offsets = tl.where(column == 1, k * L + i, i * L + k)
            p = tl.load(p_ptr + h * L * L + offsets, mask=inside, other=0.0)
            nonzero = p != 0
            lo = tl.minimum(lo, tl.min(tl.where(nonzero, k, L), axis=0))
            hi = tl.maximum(hi, tl.max(tl.where(nonzero, k + 1, 0), axis=0))
    out = spans_ptr + (column * L + i) * 2
    tl.store(out, lo)
    tl.store(out + 1, hi)


def spans(p):
    """The nonzero spans (2, L, 2) int32 of the rows ([0]) and columns ([1]) of the factor p,
    found on the device: no host synchronisation."""
    heads, L = p.shape[0], p.shape[-1]
    out = torch.empty(2, L, 2, dtype=torch.int32, device=p.device)
    _launch('triton.spans', _spans_spec(), (L, 2), [p], [out], p, out, heads, L)
    return out


def _spans_spec():
    return _spans_kernel, dict(BLOCK=SPAN_BLOCK), 1


@triton.jit
def _axis_span(spans_ptr, rows, valid, L):
    """The union [lo, hi) of the spans of ``rows`` (where ``valid``) from a spans table."""
    lo = tl.min(tl.where(valid, tl.load(spans_ptr + 2 * rows, mask=valid, other=0), L), axis=0)
    hi = tl.max(tl.where(valid, tl.load(spans_ptr + 2 * rows + 1, mask=valid, other=0), 0),
                axis=0)
    return lo, hi


@triton.jit
def _moments(mean_image, spread_image, centre, offsets, mask, SPREAD: tl.constexpr):
    """The moments T at ``offsets``: the mean about the centre, t = mean - centre (zero outside
    the mask), and the second moment about the centre, t^2, plus with SPREAD the mean of squares
    about the mean from ``spread_image``. Without pooling the means are the tokens x."""
    t = tl.load(mean_image + offsets, mask=mask, other=0.0).to(tl.float32)
    t = tl.where(mask, t - centre, 0.0)
    if SPREAD:
        return t, tl.load(spread_image + offsets, mask=mask, other=0.0) + t * t
    return t, t * t


@triton.jit
def _row_products(mean_image, spread_image, centre, p_x_ptr, p_x_rows, i2, lo_x, hi_x, mask, W,
                  C, SPREAD: tl.constexpr, C_BLOCK: tl.constexpr):
    """u = P_x T [TILE, C_BLOCK] of row i2 (of tokens, or of cells with pooling: W their number)
    at the columns whose rows of P_x start at the offsets ``p_x_rows`` (their nonzero span:
    [lo_x, hi_x)), for the moments T of :func:`_moments`."""
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    u_first = tl.zeros(mask.shape, tl.float32)
    u_second = tl.zeros(mask.shape, tl.float32)
    for j2 in range(lo_x, hi_x):
        t_first, t_second = _moments(mean_image, spread_image, centre, (i2 * W + j2) * C + cols,
                                     cmask, SPREAD)
        w = tl.load(p_x_ptr + (p_x_rows + j2), mask=mask, other=0.0)
        u_first += w * t_first[None, :]
        u_second += w * t_second[None, :]
    return u_first, u_second


@triton.jit
def _banded_moments(mean_image, spread_image, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr,
                    i, j, valid, mask, H, W, C, d, SPREAD: tl.constexpr, C_BLOCK: tl.constexpr):
    """m = P^h T (Eq. 5) [TILE, C_BLOCK] of the tokens, or with pooling the cells, (i, j) of an
    H x W grid over the nonzero band of P_y's row i and of P_x's rows j. P_y and P_x act on
    different axes, so m = P_x (P_y T): for each column j2 of the band of the rows j, v = P_y T
    of that column (one vector of C_BLOCK), then m += P_x[j, j2] v. Per tile of TILE cells and a
    band of S columns and R rows that is R S + S TILE multiply-adds, where forming u = P_x T of
    every row of the band first (:func:`_row_products`) takes R S TILE."""
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    head = cols // d
    lo_y, hi_y = _axis_span(span_y_ptr, i + tl.zeros([1], tl.int32), i >= 0, H)
    lo_x, hi_x = _axis_span(span_x_ptr, j, valid, W)
    p_y_row = p_y_ptr + head * H * H + i * H
    p_x_rows = head[None, :] * W * W + j[:, None] * W
    first = tl.zeros(mask.shape, tl.float32)
    second = tl.zeros(mask.shape, tl.float32)
    for j2 in range(lo_x, hi_x):
        v_first = tl.zeros([C_BLOCK], tl.float32)
        v_second = tl.zeros([C_BLOCK], tl.float32)
        for i2 in range(lo_y, hi_y):
            t_first, t_second = _moments(mean_image, spread_image, centre,
                                         (i2 * W + j2) * C + cols, cmask, SPREAD)
            w = tl.load(p_y_row + i2, mask=cmask, other=0.0)
            v_first += w * t_first
            v_second += w * t_second
        w = tl.load(p_x_ptr + (p_x_rows + j2), mask=mask, other=0.0)
        first += w * v_first[None, :]
        second += w * v_second[None, :]
    return first, second


@triton.jit
def _inter_token_statistics(mean_image, spread_image, centre, p_y_ptr, p_x_ptr, span_y_ptr,
                            span_x_ptr, i, j, valid, mask, H, W, C, d, SPREAD: tl.constexpr,
                            C_BLOCK: tl.constexpr):
    """Eq. 5 of the tokens, or the cells, (i, j): the inter-token mean about the centre (P^h T_0)
    and the inter-token variance, from m formed on chip (:func:`_banded_moments`)."""
    first, second = _banded_moments(mean_image, spread_image, centre, p_y_ptr, p_x_ptr,
                                    span_y_ptr, span_x_ptr, i, j, valid, mask, H, W, C, d, SPREAD,
                                    C_BLOCK)
    return first, tl.maximum(second - first * first, 0.0)


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _output_kernel(x_ptr, cell_mean_ptr, cell_var_ptr, centre_ptr, p_y_ptr, p_x_ptr, span_y_ptr,
                   span_x_ptr, ratios_ptr, weight_ptr, bias_ptr, y_ptr, H, W, C, pool, d, eps,
                   n_var, POOLED: tl.constexpr, SPREAD: tl.constexpr, CELLS: tl.constexpr,
                   GROUP: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """Eqs. 4 and 5 for GROUP tiles of CELLS cells of cell row ci of image b (CELLS tokens of
    token row ci without pooling): the positional products of the GROUP * CELLS cells formed on
    chip from the band of cell moments (:func:`_banded_moments`), once per cell, then, a tile at
    a time, y of their tokens, token row after token row."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + pool - 1) // pool, (W + pool - 1) // pool
    b, ci = row // Hp, row % Hp
    group = block * GROUP * CELLS + tl.arange(0, GROUP * CELLS)
    cols = tl.arange(0, C_BLOCK)
    centre = tl.load(centre_ptr + b * C + cols, mask=cols < C, other=0.0)
    x_image = _image(x_ptr, b, H * W * C)
    mean_image, spread_image = _cell_images(cell_mean_ptr, cell_var_ptr, x_image, b, Hp * Wp * C,
                                            POOLED)
    group_first, group_var_it = _inter_token_statistics(
        mean_image, spread_image, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr, ci, group,
        group < Wp, (group < Wp)[:, None] & (cols < C)[None, :], Hp, Wp, C, d, SPREAD, C_BLOCK)
    for k in tl.static_range(GROUP):
        first = _per_token(_group_tile(group_first, k, GROUP, CELLS, C_BLOCK), CELLS, S_BLOCK,
                           C_BLOCK)
        var_it = _per_token(_group_tile(group_var_it, k, GROUP, CELLS, C_BLOCK), CELLS, S_BLOCK,
                            C_BLOCK)
        j, real = _cell_columns((block * GROUP + k) * CELLS, pool, W, Wp, CELLS, S_BLOCK)
        for r in range(0, pool):
            i = ci * pool + r
            tokens = i * W + j
            x, mask = _load_tokens(x_image, tokens, real & (i < H), C, C_BLOCK)
            _store_output(y_ptr, ratios_ptr, weight_ptr, bias_ptr, b, H * W, C, tokens, x, mask,
                          first, var_it, centre[None, :], eps, n_var, C_BLOCK)


def output(x, centre, p_y, p_x, ratios, weight, bias, eps, n_var, grid, cells=None,
           square_of_pooled=False):
    """y (x's shape and dtype) from x, the centre and the factors p_y (heads, Hp, Hp), p_x (heads,
    Wp, Wp), the products formed on chip over their nonzero bands; with pooling from the cell
    moments ``cells`` of :func:`statistics`. n_var: the divisor of Eq. 2's variance."""
    B, N, C = x.shape
    span_y, span_x = spans(p_y), spans(p_x)
    y = x.new_empty(x.shape)
    cell_args = [] if cells is None else [cells[0], cells[1]]
    reads = [x, *cell_args, centre, p_y, p_x, span_y, span_x, ratios, weight, bias]
    cell_pointers = cell_args or [centre, centre]  # without pooling: not read
    spec = _output_spec(C, grid.pool, not square_of_pooled)
    program_cells = spec[1]['CELLS'] * spec[1]['GROUP']
    _launch('triton.output', spec, (B * grid.Hp, triton.cdiv(grid.Wp, program_cells)), reads,
            [y], x, *cell_pointers, centre, p_y, p_x, span_y, span_x, ratios, weight, bias, y,
            grid.H, grid.W, C, grid.pool, grid.d, float(eps), float(n_var))
    return y


def _cells(C, pool):
    """Cells of a tile of the output and input-gradient passes: a token row of them is a tile of
    :func:`_tile` tokens (without pooling the cells are the tokens)."""
    return max(1, _tile(C) // triton.next_power_of_2(pool))


def _pooled_tiles(C, pool):
    """(cells per tile, tiles) of a program of the passes with pooling that write sums per
    program (statistics, backward pass 1): CELLS_PER_PROGRAM cells of a cell row in tiles of
    :func:`_cells` cells."""
    cells = min(_cells(C, pool), CELLS_PER_PROGRAM)
    return cells, CELLS_PER_PROGRAM // cells


def _output_spec(C, pool, spread):
    """With pooling twice the cells of :func:`_cells` per tile (besides x the output pass holds
    only its cells' statistics, which their tokens share), and the products of two tiles formed
    at once (a band's columns read fewer times per cell)."""
    return (_output_kernel, dict(POOLED=pool > 1, SPREAD=pool > 1 and spread,
                                 CELLS=_cells(C, pool) * (2 if pool > 1 else 1),
                                 GROUP=2 if pool > 1 else 1,
                                 S_BLOCK=triton.next_power_of_2(pool),
                                 C_BLOCK=_c_block(C)), _warps(C))


# ---------------------------------------------------------------------------- backward pass 1
@triton.jit
def _token_terms(x, g, mean_ln, var_ln, first, var_it, centre, lam_m, kap_m, lam_v, kap_v,
                 weight, eps):
    """D1 = g w rstd (= -dL/dmu), D2 = D1 xhat rstd (= -2 dL/dvar) and xhat g."""
    rstd, xhat = _normalised(x, mean_ln, var_ln, first, var_it, centre, lam_m, kap_m, lam_v,
                             kap_v, eps)
    d1 = g * weight * rstd
    return d1, d1 * xhat * rstd, xhat * g


@triton.jit
def _zero_sums(C_BLOCK: tl.constexpr):
    """The six sums of a program (see :func:`_store_sums`), zero."""
    zero = tl.zeros([C_BLOCK], tl.float32)
    return zero, zero, zero, zero, zero, zero


@triton.jit
def _add(total, carry, value):
    """total + value by Neumaier's compensated summation: the rounding error of every addition is
    collected in ``carry``, added to the total once at the end. Sums over many tokens that nearly
    cancel (the gradient of a bias whose dL/dy averages zero) keep float32's relative accuracy."""
    new = total + value
    error = tl.where(tl.abs(total) >= tl.abs(value), (total - new) + value, (value - new) + total)
    return new, carry + error


@triton.jit
def _token_sum(values, TOKENS: tl.constexpr, C_BLOCK: tl.constexpr):
    """The sum over the tokens of values [TOKENS, C_BLOCK] (TOKENS a power of two, at most 128),
    as a tree of pairwise sums: the rounding error grows with log2(TOKENS) in whatever order
    the additions run (the interpreter's tl.sum adds row after row). Compiled, it is the same
    reduction as tl.sum (the same shared memory and barriers on sm_90)."""
    for level in tl.static_range(7):
        if (TOKENS >> level) > 1:
            values = tl.sum(tl.reshape(values, [2, TOKENS >> (level + 1), C_BLOCK]), axis=0)
    return tl.reshape(values, [C_BLOCK])


@triton.jit
def _store_sums(partial_ptr, program, C, xg, g, mu_d1, var_d2, mit_d1, vit_d2,
                C_BLOCK: tl.constexpr):
    """The six sums over a program's tokens (see function.parameter_gradients) at row
    ``program`` of the partial sums (programs, 6, C)."""
    cols = tl.arange(0, C_BLOCK)
    m = cols < C
    out = partial_ptr + program.to(tl.int64) * 6 * C + cols
    tl.store(out, xg, mask=m)
    tl.store(out + C, g, mask=m)
    tl.store(out + 2 * C, mu_d1, mask=m)
    tl.store(out + 3 * C, var_d2, mask=m)
    tl.store(out + 4 * C, mit_d1, mask=m)
    tl.store(out + 5 * C, vit_d2, mask=m)


@triton.jit
def _image_constants(centre_ptr, ratios_ptr, weight_ptr, b, C, C_BLOCK: tl.constexpr):
    """Image b's centre [C_BLOCK] and the channel rows of :func:`_channel_rows`."""
    cols = tl.arange(0, C_BLOCK)
    centre = tl.load(centre_ptr + b * C + cols, mask=cols < C, other=0.0)
    lam_m, kap_m, lam_v, kap_v, weight = _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK)
    return centre, lam_m, kap_m, lam_v, kap_v, weight


@triton.jit
def _cell_gradient(first, var_it, d1, d2, kap_m, kap_v):
    """dL/dm of cells from the sums D1, D2 over their tokens: dL/dm_second = dL/dvar_it
    [var_it > 0], dL/dm_first = dL/dmu_it - 2 m_first dL/dm_second."""
    dm_second = tl.where(var_it > 0, -0.5 * kap_v * d2, 0.0)
    return -kap_m * d1 - 2.0 * first * dm_second, dm_second


@triton.jit
def _store_gradient(dm_image, scale_image, cells, valid, dm, mask, C, C_BLOCK: tl.constexpr):
    """dL/dm [CELLS, C_BLOCK] of ``cells`` stored in dm_image's dtype as dm / s, with s per cell
    the largest |dL/dm| over its channels (1 where all are 0), s stored in scale_image (float32):
    in float16, 11 significant bits of each cell's largest value at any magnitude."""
    cols = tl.arange(0, C_BLOCK)
    largest = tl.max(tl.where(mask, tl.abs(dm), 0.0), axis=1)
    scale = tl.where(largest > 0, largest, 1.0)
    tl.store(dm_image + cells[:, None] * C + cols[None, :],
             (dm / scale[:, None]).to(dm_image.dtype.element_ty), mask=mask)
    tl.store(scale_image + cells, scale, mask=valid)


@triton.jit
def _load_gradient(dm_image, scale_image, cells, valid, mask, C, C_BLOCK: tl.constexpr):
    """dL/dm [CELLS, C_BLOCK] of ``cells`` as :func:`_store_gradient` stored it, in float32."""
    cols = tl.arange(0, C_BLOCK)
    dm = tl.load(dm_image + cells[:, None] * C + cols[None, :], mask=mask, other=0.0)
    return dm.to(tl.float32) * tl.load(scale_image + cells, mask=valid, other=0.0)[:, None]


@triton.jit
def _rows_gradient(grad_ptr, dm_images, scale_images, mean_image, spread_image, centre, p_x_ptr,
                   span_y_ptr, span_x_ptr, i, j_start, j_stop, H, W, C, d, heads,
                   SPREAD: tl.constexpr, TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """The share of columns [j_start, j_stop) of row i (of tokens, or of cells) in the gradient
    of P_y (heads, H, H) at ``grad_ptr`` + h H^2 + i2 for every i2: sum over them and each
    head's channels of dL/dm u for the rows i2 of u = P_x T in the band of P_y's row i (u formed
    again on chip, dL/dm read back from cache); zero outside the band."""
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    head = cols // d
    lo_y, hi_y = _axis_span(span_y_ptr, i + tl.zeros([1], tl.int32), i >= 0, H)
    for i2 in range(0, H):
        total = tl.zeros([C_BLOCK], tl.float32)
        if (i2 >= lo_y) & (i2 < hi_y):  # elsewhere P_y is zero: a zero gradient
            for start in range(j_start, j_stop, TILE):
                j = start + tl.arange(0, TILE)
                valid = j < j_stop
                mask = valid[:, None] & cmask[None, :]
                lo_x, hi_x = _axis_span(span_x_ptr, j, valid, W)
                p_x_rows = head[None, :] * W * W + j[:, None] * W
                u_first, u_second = _row_products(mean_image, spread_image, centre, p_x_ptr,
                                                  p_x_rows, i2, lo_x, hi_x, mask, W, C, SPREAD,
                                                  C_BLOCK)
                dm_first = _load_gradient(dm_images[0], scale_images[0], i * W + j, valid, mask,
                                          C, C_BLOCK)
                dm_second = _load_gradient(dm_images[1], scale_images[1], i * W + j, valid, mask,
                                           C, C_BLOCK)
                total += tl.sum(dm_first * u_first + dm_second * u_second, axis=0)
        for h in range(heads):
            tl.store(grad_ptr + h * H * H + i2, tl.sum(tl.where(head == h, total, 0.0), axis=0))


@triton.jit
def _fused_token_terms(x_image, g_image, first, var_it, centre, lam_m, kap_m, lam_v, kap_v,
                       weight, tokens, valid, C, eps, n_var, C_BLOCK: tl.constexpr):
    """``tokens`` of an image, given the inter-token statistics of their cells (first = P^h T_0
    and var_it, [TILE, C_BLOCK]): x and its mask, dL/dy, Eq. 2, D1 and D2 (zero outside the
    mask) and xhat g."""
    x, mask = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
    g, _ = _load_tokens(g_image, tokens, valid, C, C_BLOCK)
    mean_ln, var_ln = _ln_statistics(x, mask, C, n_var)
    d1, d2, xg = _token_terms(x, g, mean_ln, var_ln, first, var_it, centre[None, :], lam_m, kap_m,
                              lam_v, kap_v, weight, eps)
    return x, mask, g, mean_ln, var_ln, tl.where(mask, d1, 0.0), tl.where(mask, d2, 0.0), xg


@triton.jit(do_not_specialize=['H', 'W', 'C', 'tiles'])
def _cell_gradients_kernel(g_ptr, x_ptr, cell_mean_ptr, cell_var_ptr, centre_ptr, p_y_ptr,
                           p_x_ptr, span_y_ptr, span_x_ptr, ratios_ptr, weight_ptr, dm_first_ptr,
                           dm_second_ptr, scale_first_ptr, scale_second_ptr, grad_p_y_ptr,
                           partial_ptr, H, W, C, pool, d, heads, eps, n_var, tiles,
                           POOLED: tl.constexpr, SPREAD: tl.constexpr, CELLS: tl.constexpr,
                           GROUP: tl.constexpr, ROWS_TILE: tl.constexpr,
                           S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """Backward pass 1 for ``tiles`` tiles of CELLS cells of cell row ci of image b (without
    pooling of tokens of token row ci): with m of the cells of GROUP tiles at once formed on chip
    from the band of cell moments, once per cell (a wider group reads the band's columns fewer
    times per cell; its statistics are taken a tile at a time by :func:`_group_tile`), D1 and D2
    of their tokens, token row after token row, summed over each cell's tokens into dL/dm of the
    cells (written), and the sums for the parameters; then the cells' share of the gradient of
    P_y (:func:`_rows_gradient`)."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + pool - 1) // pool, (W + pool - 1) // pool
    b, ci = row // Hp, row % Hp
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    centre, lam_m, kap_m, lam_v, kap_v, weight = _image_constants(centre_ptr, ratios_ptr,
                                                                  weight_ptr, b, C, C_BLOCK)
    x_image, g_image = _image(x_ptr, b, H * W * C), _image(g_ptr, b, H * W * C)
    mean_image, spread_image = _cell_images(cell_mean_ptr, cell_var_ptr, x_image, b, Hp * Wp * C,
                                            POOLED)
    dm_images, scale_images = _gradient_images(dm_first_ptr, dm_second_ptr, scale_first_ptr,
                                               scale_second_ptr, b, Hp * Wp, C)
    TOKENS: tl.constexpr = CELLS * S_BLOCK  # of a token row of a tile
    s_xg, s_g, s_mu, s_var, s_mit, s_vit = _zero_sums(C_BLOCK)
    c_xg, c_g, c_mu, c_var, c_mit, c_vit = _zero_sums(C_BLOCK)  # their compensations (_add)
    GROUP_CELLS: tl.constexpr = GROUP * CELLS  # of the tiles whose products are formed at once
    group_first = tl.zeros([GROUP_CELLS, C_BLOCK], tl.float32)
    group_var_it = tl.zeros([GROUP_CELLS, C_BLOCK], tl.float32)
    for tile in range(0, tiles):
        start = (block * tiles + tile) * CELLS
        if tile % GROUP == 0:  # m of the cells of this tile and the next GROUP - 1, once
            group = start + tl.arange(0, GROUP_CELLS)
            group_valid = group < Wp
            group_first, group_var_it = _inter_token_statistics(
                mean_image, spread_image, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr, ci,
                group, group_valid, group_valid[:, None] & cmask[None, :], Hp, Wp, C, d, SPREAD,
                C_BLOCK)
        cjs = start + tl.arange(0, CELLS)
        cells_valid = cjs < Wp
        cell_mask = cells_valid[:, None] & cmask[None, :]
        first = _group_tile(group_first, tile % GROUP, GROUP, CELLS, C_BLOCK)
        var_it = _group_tile(group_var_it, tile % GROUP, GROUP, CELLS, C_BLOCK)
        j, columns_valid = _cell_columns(start, pool, W, Wp, CELLS, S_BLOCK)
        cell_d1 = tl.zeros(cell_mask.shape, tl.float32)
        cell_d2 = tl.zeros(cell_mask.shape, tl.float32)
        for r in range(0, pool):  # the cell values repeated for each token row (few registers)
            i = ci * pool + r
            x, mask, g, mean_ln, var_ln, d1, d2, xg = _fused_token_terms(
                x_image, g_image, _per_token(first, CELLS, S_BLOCK, C_BLOCK),
                _per_token(var_it, CELLS, S_BLOCK, C_BLOCK), centre, lam_m, kap_m, lam_v, kap_v,
                weight, i * W + j, columns_valid & (i < H), C, eps, n_var, C_BLOCK)
            cell_d1 += _cell_sums(d1, CELLS, S_BLOCK, C_BLOCK)
            cell_d2 += _cell_sums(d2, CELLS, S_BLOCK, C_BLOCK)
            s_xg, c_xg = _add(s_xg, c_xg, _token_sum(tl.where(mask, xg, 0.0), TOKENS, C_BLOCK))
            s_g, c_g = _add(s_g, c_g, _token_sum(g, TOKENS, C_BLOCK))
            s_mu, c_mu = _add(s_mu, c_mu, _token_sum(mean_ln[:, None] * d1, TOKENS, C_BLOCK))
            s_var, c_var = _add(s_var, c_var, _token_sum(var_ln[:, None] * d2, TOKENS, C_BLOCK))
        s_mit, c_mit = _add(s_mit, c_mit,
                            _token_sum((first + centre[None, :]) * cell_d1, CELLS, C_BLOCK))
        s_vit, c_vit = _add(s_vit, c_vit, _token_sum(var_it * cell_d2, CELLS, C_BLOCK))
        dm_first, dm_second = _cell_gradient(first, var_it, cell_d1, cell_d2, kap_m, kap_v)
        cells = ci * Wp + cjs
        _store_gradient(dm_images[0], scale_images[0], cells, cells_valid, dm_first, cell_mask,
                        C, C_BLOCK)
        _store_gradient(dm_images[1], scale_images[1], cells, cells_valid, dm_second, cell_mask,
                        C, C_BLOCK)
    _store_sums(partial_ptr, row * tl.num_programs(1) + block, C, s_xg + c_xg, s_g + c_g,
                s_mu + c_mu, s_var + c_var, s_mit + c_mit, s_vit + c_vit, C_BLOCK)
    tl.debug_barrier()  # dL/dm of the cells, written above, is read back below
    image_block = b * tl.num_programs(1) + block
    cells_start, cells_stop = block * tiles * CELLS, tl.minimum((block + 1) * tiles * CELLS, Wp)
    _rows_gradient(grad_p_y_ptr + (image_block * heads * Hp + ci) * Hp, dm_images,
                   scale_images, mean_image, spread_image, centre, p_x_ptr, span_y_ptr,
                   span_x_ptr, ci, cells_start, cells_stop, Hp, Wp, C, d, heads, SPREAD,
                   ROWS_TILE, C_BLOCK)


def _rows_tile(C, pool):
    """Cells (tokens without pooling) per tile of :func:`_rows_gradient`: as many as the tokens of
    a tile of the pass (:func:`_tile`), at most a program's CELLS_PER_PROGRAM cells with pooling,
    where the pass's tiles of cells hold pool tokens for each (compiled for sm_90 without spills;
    twice as many spill at 96 channels with pooling 4). A tile of t cells reads the band of about
    t + 10 columns of each of its rows of u (paper initialisation): wider tiles, fewer reads."""
    return min(_tile(C), CELLS_PER_PROGRAM if pool > 1 else 64)


def _product_group(cells, tiles, pool):
    """Tiles of backward pass 1 whose products are formed at once (within a program's ``tiles``):
    with pooling ``pool`` of them, so that the group's two statistics take as many registers as
    one token tensor of a tile each; without pooling one. Also one at pooling 4 with tiles of 2
    cells (96 channels): grouped, ptxas holds that kernel at 128 registers on sm_90 and spills
    (compile_kernels.py)."""
    if pool == 1 or (pool > 2 and cells < 4):
        return 1
    return min(triton.next_power_of_2(pool), tiles)


def _cell_gradients_spec(C, pool, spread):
    """Tiles of :func:`_pooled_tiles` cells, or without pooling of :func:`_tile` tokens. No
    spills but one (compile_kernels.py): for bfloat16 tokens on sm_90 ptxas holds it at 128
    registers at 96 channels with pooling 4 and spills 52 bytes."""
    cells, tiles = _pooled_tiles(C, pool) if pool > 1 else (_tile(C), 1)
    return (_cell_gradients_kernel, dict(POOLED=pool > 1, SPREAD=pool > 1 and spread,
                                         CELLS=cells, GROUP=_product_group(cells, tiles, pool),
                                         ROWS_TILE=_rows_tile(C, pool),
                                         S_BLOCK=triton.next_power_of_2(pool),
                                         C_BLOCK=_c_block(C)), _warps(C))


# ---------------------------------------------------------------------------- fused backward
@triton.jit(do_not_specialize=['H', 'W', 'C', 'block_rows'])
def _input_gradient_kernel(g_ptr, x_ptr, cell_mean_ptr, cell_var_ptr, centre_ptr, p_y_ptr,
                           p_x_ptr, span_y_ptr, span_x_ptr, ratios_ptr, weight_ptr, dm_first_ptr,
                           dm_second_ptr, scale_first_ptr, scale_second_ptr, grad_p_x_ptr, dx_ptr,
                           H, W, C, pool, d, heads, eps, n_var, block_rows, POOLED: tl.constexpr,
                           SPREAD: tl.constexpr, CELLS: tl.constexpr, S_BLOCK: tl.constexpr,
                           C_BLOCK: tl.constexpr):
    """Backward pass 2 for CELLS cell columns cj of image b (CELLS token columns without
    pooling) in the cell rows of row block rb (``block_rows`` each), cell row after cell row.
    Once per cell: m formed again, and the products backwards on chip, dL/du = P_y^T dL/dm over
    the band of P_y's column ci for every row of P_x whose column cj is nonzero and dL/dT =
    P_x^T dL/du; and the cells' columns of the gradient of P_x (the share of image b's row block
    rb), sum over the cell rows and each head's channels of dL/du T, accumulated in place by this
    program, which alone holds them (deterministic, no atomics).
    Then for the cell's tokens, token row after token row, dx (the per-token terms formed again)
    = D1 + x beta + alpha (Eq. 2 backwards) + (dL/dT_0 + 2 s dL/dT_1) / n, with n the tokens of
    the cell and s = x - centre where T_1 is the cell's mean of (x - centre)^2 (SPREAD), T_0
    where it is T_0^2."""
    b, block, rb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    Hp, Wp = (H + pool - 1) // pool, (W + pool - 1) // pool
    cjs = block * CELLS + tl.arange(0, CELLS)
    cells_valid = cjs < Wp
    grad_p_x_image = grad_p_x_ptr + (b * tl.num_programs(2) + rb) * heads * Wp * Wp
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    cell_mask = cells_valid[:, None] & cmask[None, :]
    head = cols // d
    centre, lam_m, kap_m, lam_v, kap_v, weight = _image_constants(centre_ptr, ratios_ptr,
                                                                  weight_ptr, b, C, C_BLOCK)
    x_image, g_image = _image(x_ptr, b, H * W * C), _image(g_ptr, b, H * W * C)
    dx_image = _image(dx_ptr, b, H * W * C)
    mean_image, spread_image = _cell_images(cell_mean_ptr, cell_var_ptr, x_image, b, Hp * Wp * C,
                                            POOLED)
    dm_images, scale_images = _gradient_images(dm_first_ptr, dm_second_ptr, scale_first_ptr,
                                               scale_second_ptr, b, Hp * Wp, C)
    for j1 in range(0, Wp):
        for h in range(heads):
            tl.store(grad_p_x_image + (h * Wp + j1) * Wp + cjs,
                     tl.zeros([CELLS], tl.float32), mask=cells_valid)
    tl.debug_barrier()
    # the rows of P_x that are nonzero at the columns cj
    lo_j, hi_j = _axis_span(span_x_ptr + 2 * Wp, cjs, cells_valid, Wp)
    j, columns_valid = _cell_columns(block * CELLS, pool, W, Wp, CELLS, S_BLOCK)
    columns = tl.minimum(W - cjs * pool, pool)
    for ci in range(rb * block_rows, tl.minimum((rb + 1) * block_rows, Hp)):
        first, var_it = _inter_token_statistics(
            mean_image, spread_image, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr, ci, cjs,
            cells_valid, cell_mask, Hp, Wp, C, d, SPREAD, C_BLOCK)
        t_first, t_second = _moments(mean_image, spread_image, centre,
                                     (ci * Wp + cjs)[:, None] * C + cols[None, :], cell_mask,
                                     SPREAD)
        lo_i, hi_i = _axis_span(span_y_ptr + 2 * Hp, ci + tl.zeros([1], tl.int32), ci >= 0, Hp)
        dT_first = tl.zeros(cell_mask.shape, tl.float32)
        dT_second = tl.zeros(cell_mask.shape, tl.float32)
        for j1 in range(lo_j, hi_j):
            du_first = tl.zeros([C_BLOCK], tl.float32)
            du_second = tl.zeros([C_BLOCK], tl.float32)
            for i1 in range(lo_i, hi_i):
                w = tl.load(p_y_ptr + head * Hp * Hp + i1 * Hp + ci, mask=cmask, other=0.0)
                cell = i1 * Wp + j1 + tl.zeros([1], tl.int32)
                du_first += w * tl.reshape(_load_gradient(
                    dm_images[0], scale_images[0], cell, cell >= 0, cmask[None, :], C, C_BLOCK),
                    [C_BLOCK])
                du_second += w * tl.reshape(_load_gradient(
                    dm_images[1], scale_images[1], cell, cell >= 0, cmask[None, :], C, C_BLOCK),
                    [C_BLOCK])
            w = tl.load(p_x_ptr + (head[None, :] * Wp * Wp + j1 * Wp + cjs[:, None]),
                        mask=cell_mask, other=0.0)
            dT_first += w * du_first[None, :]
            dT_second += w * du_second[None, :]
            share = du_first[None, :] * t_first + du_second[None, :] * t_second
            for h in range(heads):
                out = grad_p_x_image + (h * Wp + j1) * Wp + cjs
                total = tl.load(out, mask=cells_valid, other=0.0)
                tl.store(out, total + tl.sum(tl.where(head[None, :] == h, share, 0.0), axis=1),
                         mask=cells_valid)
        tl.debug_barrier()  # the next cell row adds to the same entries
        rows = tl.minimum(H - ci * pool, pool)
        inv_n = 1.0 / tl.maximum(rows * columns, 1).to(tl.float32)  # masked cells: any n
        dT_first *= inv_n[:, None]
        dT_second *= inv_n[:, None]
        for r in range(0, pool):  # the cell values repeated for each token row (few registers)
            i = ci * pool + r
            tokens = i * W + j
            x, mask, g, mean_ln, var_ln, d1, d2, _ = _fused_token_terms(
                x_image, g_image, _per_token(first, CELLS, S_BLOCK, C_BLOCK),
                _per_token(var_it, CELLS, S_BLOCK, C_BLOCK), centre, lam_m, kap_m, lam_v, kap_v,
                weight, tokens, columns_valid & (i < H), C, eps, n_var, C_BLOCK)
            # Eq. 2 backwards: dL/dvar_ln = -sum(D2 lam_v) / 2, dL/dmu_ln = -sum(D1 lam_m)
            beta = -tl.sum(d2 * lam_v, axis=1) / n_var
            alpha = -tl.sum(d1 * lam_m, axis=1) / C - beta * mean_ln
            if SPREAD:
                spread = tl.where(mask, x - centre[None, :], 0.0)
            else:
                spread = _per_token(t_first, CELLS, S_BLOCK, C_BLOCK)
            dx = d1 + x * beta[:, None] + alpha[:, None] + \
                _per_token(dT_first, CELLS, S_BLOCK, C_BLOCK) + \
                2.0 * spread * _per_token(dT_second, CELLS, S_BLOCK, C_BLOCK)
            tl.store(dx_image + tokens[:, None] * C + cols[None, :],
                     dx.to(dx_ptr.dtype.element_ty), mask=mask)


def fused_backward(g, x, centre, p_y, p_x, ratios, weight, eps, n_var, grid,
                   cells=None, square_of_pooled=False):
    """dx (x's shape and dtype), the gradients of p_y and p_x and the sums (6, C) for the
    parameters, the products formed on chip over the nonzero bands; with pooling from the cell
    moments ``cells`` of :func:`statistics`. dL/dm (two values per cell and channel, in
    :func:`cell_gradient_dtype`, with a float32 scale per cell and value) is the one tensor passed
    between the passes."""
    B, N, C = x.shape
    H, W, heads, Hp, Wp = grid.H, grid.W, grid.heads, grid.Hp, grid.Wp
    span_y, span_x = spans(p_y), spans(p_x)
    f32 = dict(dtype=torch.float32, device=x.device)
    dm = torch.empty(2, B, Hp * Wp, C, dtype=cell_gradient_dtype(x.dtype), device=x.device)
    dm_scale = torch.empty(2, B, Hp * Wp, **f32)
    dm_args = [dm[0], dm[1], dm_scale[0], dm_scale[1]]
    common = [g, x]
    factors = [centre, p_y, p_x, span_y, span_x, ratios, weight]
    cell_args = [] if cells is None else [cells[0], cells[1]]
    spec = _cell_gradients_spec(C, grid.pool, not square_of_pooled)
    if grid.pooled:
        tiles = _pooled_tiles(C, grid.pool)[1]
    else:  # a program per token row
        tiles = triton.cdiv(W, spec[1]['CELLS'])
    programs = (B * Hp, triton.cdiv(Wp, tiles * spec[1]['CELLS']))
    grad_p_y = torch.empty(B * programs[1], heads, Hp, Hp, **f32)
    partial = torch.empty(programs[0] * programs[1], 6, C, **f32)
    cell_pointers = cell_args or [centre, centre]  # without pooling: not read
    _launch('triton.cell_gradients', spec, programs, [*common, *cell_args, *factors],
            [dm, dm_scale, grad_p_y, partial], *common, *cell_pointers, *factors, *dm_args,
            grad_p_y, partial, H, W, C, grid.pool, grid.d, heads, float(eps), float(n_var),
            tiles)
    spec = _input_gradient_spec(C, grid.pool, not square_of_pooled)
    columns = triton.cdiv(Wp, spec[1]['CELLS'])
    block_rows = triton.cdiv(Hp, _row_blocks(x, columns, Hp, heads, Wp))
    row_blocks = triton.cdiv(Hp, block_rows)
    grad_p_x = torch.empty(B * row_blocks, heads, Wp, Wp, **f32)
    dx = x.new_empty(x.shape)
    _launch('triton.input_gradient', spec, (B, columns, row_blocks),
            [*common, *cell_args, *factors, dm, dm_scale], [grad_p_x, dx], *common,
            *cell_pointers, *factors, *dm_args, grad_p_x, dx, H, W, C, grid.pool, grid.d, heads,
            float(eps), float(n_var), block_rows)
    return dx, grad_p_y.sum(0), grad_p_x.sum(0), partial.sum(0)


def _row_blocks(x, columns, Hp, heads, Wp):
    """Blocks of cell rows the dx pass splits an image's ``columns`` tiles of cells into: enough
    for about DX_PROGRAMS programs, as long as their partial gradients of P_x (one per image and
    block, float32, written and added up afterwards) stay within PARTIAL_SHARE of x's bytes."""
    B = x.shape[0]
    wanted = triton.cdiv(DX_PROGRAMS, B * columns)
    affordable = int(PARTIAL_SHARE * x.numel() * x.element_size()) // (B * heads * Wp * Wp * 4)
    return max(1, min(Hp, wanted, affordable))


def _input_gradient_spec(C, pool, spread):
    """With pooling in 8 warps (half the registers per thread of 4). ptxas holds it at 128
    registers, two programs per multiprocessor, and spills (compile_kernels.py): on sm_80 8-56
    bytes at 32 channels with pooling 4 and 64, 128 and (16-bit tokens) 192 with pooling 2; on
    sm_90 only for bfloat16 tokens at 192 channels with pooling 2 (24 bytes)."""
    return (_input_gradient_kernel, dict(POOLED=pool > 1, SPREAD=pool > 1 and spread,
                                         CELLS=_cells(C, pool),
                                         S_BLOCK=triton.next_power_of_2(pool),
                                         C_BLOCK=_c_block(C)), 8 if pool > 1 else _warps(C))


# ---------------------------------------------------------------------------- specialisations
def specializations(C, pool, square_of_pooled=False):
    """The compiled kernels one DTN layer of C channels and pooling ``pool`` launches, forward and
    backward, as (kernel, constexprs, num_warps): what a GPU compiles for it (the tokens' dtype
    aside). The image size is not part of it."""
    if pool == 1:  # the products fused into the passes
        return [_spans_spec(), _output_spec(C, 1, False),
                _cell_gradients_spec(C, 1, False), _input_gradient_spec(C, 1, False)]
    spread = not square_of_pooled
    return [_statistics_spec(C, pool), _spans_spec(), _output_spec(C, pool, spread),
            _cell_gradients_spec(C, pool, spread), _input_gradient_spec(C, pool, spread)]
