"""Triton kernels of DynamicTokenNorm's full-resolution passes (Shao et al., ICLR 2022, Eqs. 2, 4,
5), each followed by the function that launches it.

Tokens x are (B, N, C) in float16, bfloat16 or float32, read as they are; everything is computed
and accumulated in float32, and the outputs have x's dtype. A program holds whole tokens (all C
channels, ``C_BLOCK`` = the next power of two), so the intra-token statistics of Eq. 2 never leave
its registers. H, W, N and the strides are runtime arguments: a new resolution launches the same
compiled kernels. Cell tensors (the products m, their gradients) are strided (B, Hp, Wp, heads, d)
views with a contiguous last dimension, as in the CPU kernels.

With pooling, forward: :func:`statistics` (Eq. 2 per token and, per cell, the mean of x and the
sum of squares about it, in one read of x), then the positional products on the cell grid
(PyTorch, in ``function.py``), then :func:`output` (Eqs. 4-5: one read of x, one write of y).
Backward: :func:`token_gradients` (dL/dm of every cell and the sums over the tokens for the
parameters, one read of x and dL/dy; the sums are written per program and added up afterwards, in
a fixed order: no float atomics), the products backwards, then :func:`input_gradient` (one read of
x and dL/dy, one write of dx), which recomputes the per-token terms instead of storing them.

Without pooling the cells are the tokens, and the products are fused into the passes over the
tokens. By the traffic model (bytes of the operands of every launch, per token, for C channels
of e bytes), doing them as separate passes, even in Triton, would write and read the moments
T, u = P_x T and m = P_y u, two float32 values per token and channel each (8 C bytes, 16 C
written and read back, against 3 C e for the whole fused forward: 6 C in float16), so
the products are formed on chip instead: a row of P has about 11 nonzero weights in float32 at
the paper's initialisation (positional.truncated_softmax), and :func:`spans` finds every row's
and column's nonzero span on the device (no host synchronisation; a wider P costs time, not
correctness). :func:`fused_output` reads each token's band of neighbours, cached, and forms
u = P_x T for the rows of the band and m = P_y u in registers (x read twice forward: statistics
and output, as with pooling). Backward, :func:`fused_backward` passes one tensor between two
passes, dL/dm (two float32 values per token and channel), since dL/dT of a token needs dL/dm of
its whole band: pass 1 (a program per token row) forms m again, writes dL/dm and the sums, then
reads its row's dL/dm back from cache for its share of the gradient of P_y (sum of dL/dm u over
the band's rows of u); pass 2 (a program per column tile, walking the rows) forms
dL/du = P_y^T dL/dm and dL/dT = P_x^T dL/du over the bands, and dx, and adds up its columns of
the gradient of P_x in place (the program owns them: deterministic, no atomics). The gradients
of P are exact on the bands and zero elsewhere, where P is an exact zero and the softmax passes
no gradient; they are written per image and added over the images afterwards. Backward thus
moves about 5 C e + 16 C bytes per token: dL/dm, which only a recomputation of m over the band of
every neighbour (the band squared) would avoid, is most of it.

Every launch is recorded with the bytes of its operands (:func:`.base.record_launch`); with meta
tensors the launches are only recorded, which gives the traffic of any shape without a GPU.
"""
import torch
import triton
import triton.language as tl

from .base import record_launch

__all__ = ['statistics', 'output', 'token_gradients', 'input_gradient', 'specializations',
           'TOKEN_POINTERS', 'INDEX_POINTERS', 'spans', 'fused_output',
           'fused_backward']

#: Elements of a token tile (TILE tokens x C_BLOCK channels) per thread of a program: a pass holds
#: several such tiles (x, dL/dy, the cell statistics, ...) in registers.
ELEMENTS_PER_THREAD = 8
#: Tokens a program of the per-token passes without pooling covers (its partial sums are
#: written once: more tokens per program, fewer partial sums to add up).
TOKENS_PER_PROGRAM = 256
#: Cells of one cell row a program of the passes with pooling covers.
CELLS_PER_PROGRAM = 8
#: Entries of a row of a positional factor one step of the search for its nonzero span reads.
SPAN_BLOCK = 128


def _bytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


#: Pointer arguments of the kernels to tensors of the tokens' dtype, and to int32 tensors (the
#: nonzero spans of the positional factors); all others are float32.
TOKEN_POINTERS = ('x_ptr', 'g_ptr', 'y_ptr', 'dx_ptr')
INDEX_POINTERS = ('spans_ptr', 'span_y_ptr', 'span_x_ptr')


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


def _tiles(C):
    return max(1, TOKENS_PER_PROGRAM // _tile(C))


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
def _row_tile(ptr, H, W, C, TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """The tile of program (row = b * H + i, block) of a pass over token rows: b, i, the columns
    j, their validity, the tokens within the image, and the tokens of ``ptr`` as float32."""
    row, block = tl.program_id(0), tl.program_id(1)
    b, i = row // H, row % H
    j = block * TILE + tl.arange(0, TILE)
    valid = j < W
    tokens = i * W + j
    x, mask = _load_tokens(_image(ptr, b, H * W * C), tokens, valid, C, C_BLOCK)
    return b, i, j, valid, tokens, x, mask


@triton.jit
def _cell_row(ci, cj, r, pool, H, W, S_BLOCK: tl.constexpr):
    """The tokens (within the image) of token row r of cell (ci, cj), and which are real."""
    j = cj * pool + tl.arange(0, S_BLOCK)
    i = ci * pool + r
    valid = (j < W) & (tl.arange(0, S_BLOCK) < pool) & (i < H)
    return i * W + j, valid


@triton.jit
def _ln_statistics(x, mask, C, n_var):
    """Eq. 2 per token: the mean, and the variance about it divided by n_var (two passes)."""
    mean = tl.sum(x, axis=1) / C
    diff = tl.where(mask, x - mean[:, None], 0.0)
    return mean, tl.sum(diff * diff, axis=1) / n_var


@triton.jit
def _cell_offsets(ci, cj, cols, d, si, sj, sh):
    """Offsets [TILE, C_BLOCK] of channel ``cols`` of cells (ci, cj) in one image of a strided
    (B, Hp, Wp, heads, d) view (see :func:`_image`)."""
    head, k = cols // d, cols % d
    return ci * si + cj[:, None] * sj + (head * sh + k)[None, :]


@triton.jit
def _inter_token(first_ptr, second_ptr, offsets, mask):
    """With pooling, P^h T_0 and the inter-token variance of the cells at ``offsets``."""
    first = tl.load(first_ptr + offsets, mask=mask, other=0.0)
    second = tl.load(second_ptr + offsets, mask=mask, other=0.0)
    return first, second


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
@triton.jit(do_not_specialize=['N', 'C'])
def _token_statistics_kernel(x_ptr, mean_ptr, var_ptr, partial_ptr, N, C, n_var,
                             TILE: tl.constexpr, TILES: tl.constexpr, C_BLOCK: tl.constexpr):
    """Without pooling: Eq. 2 for TILE * TILES tokens of image b, and their sum per channel."""
    b, p = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, C_BLOCK)
    total = tl.zeros([C_BLOCK], tl.float32)
    for t in range(TILES):
        tokens = (p * TILES + t) * TILE + tl.arange(0, TILE)
        valid = tokens < N
        x, mask = _load_tokens(_image(x_ptr, b, N * C), tokens, valid, C, C_BLOCK)
        mean, var = _ln_statistics(x, mask, C, n_var)
        tl.store(_image(mean_ptr, b, N) + tokens, mean, mask=valid)
        tl.store(_image(var_ptr, b, N) + tokens, var, mask=valid)
        total += tl.sum(x, axis=0)
    tl.store(partial_ptr + (b * tl.num_programs(1) + p).to(tl.int64) * C + cols, total,
             mask=cols < C)


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _cell_statistics_kernel(x_ptr, mean_ptr, var_ptr, cell_mean_ptr, cell_m2_ptr, H, W, C,
                            pool, n_var, CELLS: tl.constexpr, S_BLOCK: tl.constexpr,
                            C_BLOCK: tl.constexpr):
    """With pooling: Eq. 2 for the tokens of CELLS cells of cell row ci of image b, and per cell
    the mean of x and the sum of squares about it (rows merged as in Chan et al.)."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + pool - 1) // pool, (W + pool - 1) // pool
    b, ci = row // Hp, row % Hp
    cols = tl.arange(0, C_BLOCK)
    x_image = _image(x_ptr, b, H * W * C)
    for c in range(CELLS):
        cj = block * CELLS + c
        if cj < Wp:
            count = tl.zeros([C_BLOCK], tl.float32)
            mean = tl.zeros([C_BLOCK], tl.float32)
            m2 = tl.zeros([C_BLOCK], tl.float32)
            for r in range(0, pool):
                tokens, valid = _cell_row(ci, cj, r, pool, H, W, S_BLOCK)
                x, mask = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
                mu, var = _ln_statistics(x, mask, C, n_var)
                tl.store(_image(mean_ptr, b, H * W) + tokens, mu, mask=valid)
                tl.store(_image(var_ptr, b, H * W) + tokens, var, mask=valid)
                n = tl.sum(valid.to(tl.float32), axis=0)
                row_mean = tl.sum(x, axis=0) / tl.maximum(n, 1.0)
                diff = tl.where(mask, x - row_mean[None, :], 0.0)
                row_m2 = tl.sum(diff * diff, axis=0)
                total = count + n
                delta = row_mean - mean
                share = n / tl.maximum(total, 1.0)
                mean += delta * share
                m2 += row_m2 + delta * delta * count * share
                count = total
            out = (row * Wp + cj).to(tl.int64) * C + cols
            tl.store(cell_mean_ptr + out, mean, mask=cols < C)
            tl.store(cell_m2_ptr + out, m2, mask=cols < C)


def statistics(x, grid, n_var):
    """Eq. 2 per token, float32 (B, N, 1) each, and the cell moments of x: without pooling the
    per-image channel sums (B, P, C) of P programs; with pooling the cell means and the sums of
    squares about them, (B, Hp, Wp, C) each."""
    B, N, C = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    mean_ln, var_ln = torch.empty(B, N, 1, **f32), torch.empty(B, N, 1, **f32)
    spec = _statistics_spec(C, grid.pool)
    if not grid.pooled:
        programs = triton.cdiv(N, _tile(C) * _tiles(C))
        partial = torch.empty(B, programs, C, **f32)
        _launch('triton.token_statistics', spec, (B, programs), [x], [mean_ln, var_ln, partial],
                x, mean_ln, var_ln, partial, N, C, float(n_var))
        return mean_ln, var_ln, partial
    cell_mean = torch.empty(B, grid.Hp, grid.Wp, C, **f32)
    cell_m2 = torch.empty_like(cell_mean)
    _launch('triton.cell_statistics', spec,
            (B * grid.Hp, triton.cdiv(grid.Wp, CELLS_PER_PROGRAM)), [x],
            [mean_ln, var_ln, cell_mean, cell_m2], x, mean_ln, var_ln, cell_mean, cell_m2,
            grid.H, grid.W, C, grid.pool, float(n_var))
    return mean_ln, var_ln, (cell_mean, cell_m2)


def _cells_spec(cell_kernel, C, pool):
    """(kernel, constexprs, num_warps) of a pass with pooling that walks the cells of a cell row."""
    return (cell_kernel, dict(CELLS=CELLS_PER_PROGRAM, S_BLOCK=triton.next_power_of_2(pool),
                              C_BLOCK=_c_block(C)), _warps(C))


def _statistics_spec(C, pool):
    if pool == 1:  # walks the tokens of an image
        return (_token_statistics_kernel, dict(TILE=_tile(C), TILES=_tiles(C), C_BLOCK=_c_block(C)),
                _warps(C))
    return _cells_spec(_cell_statistics_kernel, C, pool)


# ---------------------------------------------------------------------------- output
@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _output_kernel(x_ptr, mean_ptr, var_ptr, first_ptr, second_ptr, centre_ptr, ratios_ptr,
                   weight_ptr, bias_ptr, y_ptr, H, W, C, pool, d, sb, si, sj, sh, eps,
                   TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """With pooling: Eqs. 4 and 5 for TILE tokens of token row i of image b."""
    b, i, j, valid, tokens, x, mask = _row_tile(x_ptr, H, W, C, TILE, C_BLOCK)
    cols = tl.arange(0, C_BLOCK)
    cell = _cell_offsets(i // pool, j // pool, cols, d, si, sj, sh)
    first, var_it = _inter_token(_image(first_ptr, b, sb), _image(second_ptr, b, sb), cell, mask)
    centre = tl.load(centre_ptr + b * C + cols, mask=cols < C, other=0.0)[None, :]
    _store_output(y_ptr, mean_ptr, var_ptr, ratios_ptr, weight_ptr, bias_ptr, b, H * W, C,
                  tokens, valid, x, mask, first, var_it, centre, eps, C_BLOCK)


@triton.jit
def _store_output(y_ptr, mean_ptr, var_ptr, ratios_ptr, weight_ptr, bias_ptr, b, N, C, tokens,
                  valid, x, mask, first, var_it, centre, eps, C_BLOCK: tl.constexpr):
    """Eqs. 4 and 5 for ``tokens`` of image b given the inter-token statistics: y stored."""
    cols = tl.arange(0, C_BLOCK)
    lam_m, kap_m, lam_v, kap_v, weight = _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK)
    bias = tl.load(bias_ptr + cols, mask=cols < C, other=0.0)[None, :]
    mean_ln = tl.load(_image(mean_ptr, b, N) + tokens, mask=valid, other=0.0)
    var_ln = tl.load(_image(var_ptr, b, N) + tokens, mask=valid, other=0.0)
    _, xhat = _normalised(x, mean_ln, var_ln, first, var_it, centre, lam_m, kap_m, lam_v, kap_v,
                          eps)
    y = xhat * weight + bias
    tl.store(_image(y_ptr, b, N * C) + tokens[:, None] * C + cols[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)


def output(x, mean_ln, var_ln, first, second, centre, ratios, weight, bias, eps, grid):
    """With pooling: y (x's shape and dtype) from x, Eq. 2 and the cell views of m (see the
    module docstring)."""
    B, N, C = x.shape
    y = x.new_empty(x.shape)
    _launch('triton.output', _output_spec(C, grid.pool),
            (B * grid.H, triton.cdiv(grid.W, _tile(C))),
            [x, mean_ln, var_ln, first, second, centre, ratios, weight, bias], [y],
            x, mean_ln, var_ln, first, second, centre, ratios, weight, bias, y, grid.H, grid.W, C,
            grid.pool, grid.d, *first.stride()[:4], float(eps))
    return y


def _output_spec(C, pool):
    return _output_kernel, dict(TILE=_tile(C), C_BLOCK=_c_block(C)), _warps(C)


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
def _row_products(x_image, centre, p_x_ptr, p_x_rows, i2, lo_x, hi_x, mask, W, C,
                  C_BLOCK: tl.constexpr):
    """u = P_x T [TILE, C_BLOCK] of token row i2 at the columns whose rows of P_x start at the
    offsets ``p_x_rows`` (their nonzero span: [lo_x, hi_x)), for the moments T = (x - centre,
    (x - centre)^2) read from ``x_image``."""
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    u_first = tl.zeros(mask.shape, tl.float32)
    u_second = tl.zeros(mask.shape, tl.float32)
    for j2 in range(lo_x, hi_x):
        t = tl.load(x_image + (i2 * W + j2) * C + cols, mask=cmask, other=0.0).to(tl.float32)
        t = tl.where(cmask, t - centre, 0.0)[None, :]
        w = tl.load(p_x_ptr + (p_x_rows + j2), mask=mask, other=0.0)
        u_first += w * t
        u_second += w * (t * t)
    return u_first, u_second


@triton.jit
def _banded_moments(x_image, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr, i, j, valid, mask,
                    H, W, C, d, C_BLOCK: tl.constexpr):
    """Without pooling, m = P_y (P_x T) (Eq. 5) of tokens (i, j) [TILE, C_BLOCK] over the nonzero
    band of P_y's row i and of P_x's rows j: u = P_x T of every row of the band is formed on chip
    (:func:`_row_products`)."""
    cols = tl.arange(0, C_BLOCK)
    head = cols // d
    lo_y, hi_y = _axis_span(span_y_ptr, i + tl.zeros([1], tl.int32), i >= 0, H)
    lo_x, hi_x = _axis_span(span_x_ptr, j, valid, W)
    p_y_row = p_y_ptr + head * H * H + i * H
    p_x_rows = head[None, :] * W * W + j[:, None] * W
    first = tl.zeros(mask.shape, tl.float32)
    second = tl.zeros(mask.shape, tl.float32)
    for i2 in range(lo_y, hi_y):
        u_first, u_second = _row_products(x_image, centre, p_x_ptr, p_x_rows, i2, lo_x, hi_x,
                                          mask, W, C, C_BLOCK)
        w = tl.load(p_y_row + i2, mask=cols < C, other=0.0)[None, :]
        first += w * u_first
        second += w * u_second
    return first, second


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _fused_output_kernel(x_ptr, mean_ptr, var_ptr, centre_ptr, p_y_ptr, p_x_ptr, span_y_ptr,
                         span_x_ptr, ratios_ptr, weight_ptr, bias_ptr, y_ptr, H, W, C, d, eps,
                         TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """Without pooling: Eqs. 4 and 5 for TILE tokens of token row i of image b, the positional
    products of their moments formed on chip (:func:`_banded_moments`) before x is loaded."""
    row, block = tl.program_id(0), tl.program_id(1)
    b, i = row // H, row % H
    j = block * TILE + tl.arange(0, TILE)
    valid = j < W
    tokens = i * W + j
    cols = tl.arange(0, C_BLOCK)
    mask = valid[:, None] & (cols < C)[None, :]
    centre = tl.load(centre_ptr + b * C + cols, mask=cols < C, other=0.0)
    x_image = _image(x_ptr, b, H * W * C)
    first, second = _banded_moments(x_image, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr, i,
                                    j, valid, mask, H, W, C, d, C_BLOCK)
    x, _ = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
    var_it = tl.maximum(second - first * first, 0.0)
    _store_output(y_ptr, mean_ptr, var_ptr, ratios_ptr, weight_ptr, bias_ptr, b, H * W, C,
                  tokens, valid, x, mask, first, var_it, centre[None, :], eps, C_BLOCK)


def fused_output(x, mean_ln, var_ln, centre, p_y, p_x, ratios, weight, bias, eps, grid):
    """Without pooling: y (x's shape and dtype) from x, Eq. 2 and the factors p_y (heads, H, H),
    p_x (heads, W, W), the products formed on chip over their nonzero bands."""
    B, N, C = x.shape
    span_y, span_x = spans(p_y), spans(p_x)
    y = x.new_empty(x.shape)
    _launch('triton.fused_output', _fused_output_spec(C),
            (B * grid.H, triton.cdiv(grid.W, _tile(C))),
            [x, mean_ln, var_ln, centre, p_y, p_x, span_y, span_x, ratios, weight, bias], [y],
            x, mean_ln, var_ln, centre, p_y, p_x, span_y, span_x, ratios, weight, bias, y,
            grid.H, grid.W, C, grid.d, float(eps))
    return y


def _fused_output_spec(C):
    return _fused_output_kernel, dict(TILE=_tile(C), C_BLOCK=_c_block(C)), _warps(C)


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


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _cell_gradients_kernel(g_ptr, x_ptr, mean_ptr, var_ptr, first_ptr, second_ptr, centre_ptr,
                           ratios_ptr, weight_ptr, dm_first_ptr, dm_second_ptr, partial_ptr, H, W,
                           C, pool, d, sb, si, sj, sh, eps, CELLS: tl.constexpr,
                           S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """With pooling: dL/dm of CELLS cells of cell row ci of image b from the sums of D1 and D2
    over their tokens, and the sums for the parameters."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + pool - 1) // pool, (W + pool - 1) // pool
    b, ci = row // Hp, row % Hp
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    centre = tl.load(centre_ptr + b * C + cols, mask=cmask, other=0.0)
    lam_m, kap_m, lam_v, kap_v, weight = _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK)
    s_xg, s_g, s_mu, s_var, s_mit, s_vit = _zero_sums(C_BLOCK)
    for c in range(CELLS):
        cj = block * CELLS + c
        if cj < Wp:
            # the cell's statistics as one row [1, C_BLOCK], broadcast over its tokens
            cell = _cell_offsets(ci, cj + tl.zeros([1], tl.int32), cols, d, si, sj, sh)
            first, var_it = _inter_token(_image(first_ptr, b, sb), _image(second_ptr, b, sb), cell,
                                         cmask[None, :])
            cell_d1 = tl.zeros([C_BLOCK], tl.float32)
            cell_d2 = tl.zeros([C_BLOCK], tl.float32)
            for r in range(0, pool):
                tokens, valid = _cell_row(ci, cj, r, pool, H, W, S_BLOCK)
                x, mask = _load_tokens(_image(x_ptr, b, H * W * C), tokens, valid, C, C_BLOCK)
                g, _ = _load_tokens(_image(g_ptr, b, H * W * C), tokens, valid, C, C_BLOCK)
                mean_ln = tl.load(_image(mean_ptr, b, H * W) + tokens, mask=valid, other=0.0)
                var_ln = tl.load(_image(var_ptr, b, H * W) + tokens, mask=valid, other=0.0)
                d1, d2, xg = _token_terms(x, g, mean_ln, var_ln, first, var_it, centre[None, :],
                                          lam_m, kap_m, lam_v, kap_v, weight, eps)
                d1, d2 = tl.where(mask, d1, 0.0), tl.where(mask, d2, 0.0)
                cell_d1 += tl.sum(d1, axis=0)
                cell_d2 += tl.sum(d2, axis=0)
                s_xg += tl.sum(tl.where(mask, xg, 0.0), axis=0)
                s_g += tl.sum(g, axis=0)
                s_mu += tl.sum(mean_ln[:, None] * d1, axis=0)
                s_var += tl.sum(var_ln[:, None] * d2, axis=0)
            first = tl.reshape(first, [C_BLOCK])
            var_it = tl.reshape(var_it, [C_BLOCK])
            s_mit += (first + centre) * cell_d1
            s_vit += var_it * cell_d2
            # dL/dm_second = dL/dvar_it [var_it > 0], dL/dm_first = dL/dmu_it - 2 m_first dm_second
            dm_second = tl.where(var_it > 0, -0.5 * tl.reshape(kap_v, [C_BLOCK]) * cell_d2, 0.0)
            dm_first = -tl.reshape(kap_m, [C_BLOCK]) * cell_d1 - 2.0 * first * dm_second
            cell = tl.reshape(cell, [C_BLOCK])
            tl.store(_image(dm_first_ptr, b, sb) + cell, dm_first, mask=cmask)
            tl.store(_image(dm_second_ptr, b, sb) + cell, dm_second, mask=cmask)
    _store_sums(partial_ptr, row * tl.num_programs(1) + block, C, s_xg, s_g, s_mu, s_var, s_mit,
                s_vit, C_BLOCK)


def token_gradients(g, x, mean_ln, var_ln, first, second, centre, ratios, weight, eps, dm, grid):
    """With pooling: dL/dm into the head-major ``dm`` (its two slots, as cell views) and the sums
    (6, C)."""
    B, N, C = x.shape
    dm_first, dm_second = (grid.from_head_major(t) for t in dm.unbind(1))
    assert dm_first.stride() == first.stride(), 'dL/dm in the layout of m'
    programs = (B * grid.Hp, triton.cdiv(grid.Wp, CELLS_PER_PROGRAM))
    partial = x.new_empty(programs[0] * programs[1], 6, C, dtype=first.dtype)
    _launch('triton.cell_gradients', _gradients_spec(C, grid.pool), programs,
            [g, x, mean_ln, var_ln, first, second, centre, ratios, weight], [dm, partial], g, x,
            mean_ln, var_ln, first, second, centre, ratios, weight, dm_first, dm_second, partial,
            grid.H, grid.W, C, grid.pool, grid.d, *first.stride()[:4], float(eps))
    return partial.sum(0)


def _gradients_spec(C, pool):
    return _cells_spec(_cell_gradients_kernel, C, pool)


# ---------------------------------------------------------------------------- backward pass 2
@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _input_gradient_kernel(g_ptr, x_ptr, mean_ptr, var_ptr, first_ptr, second_ptr, centre_ptr,
                           ratios_ptr, weight_ptr, d_first_ptr, d_second_ptr, dx_ptr, H, W, C,
                           pool, d, sb, si, sj, sh, tb, ti, tj, th, eps, n_var,
                           SECOND: tl.constexpr, TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """With pooling: dx for TILE tokens of token row i of image b: D1 + x beta + alpha (the
    gradient of Eq. 2) + (dL/dT_0 + 2 (x - centre) dL/dT_1) / n, with D1 and the per-token sums
    recomputed."""
    b, i, j, valid, tokens, x, mask = _row_tile(x_ptr, H, W, C, TILE, C_BLOCK)
    g, _ = _load_tokens(_image(g_ptr, b, H * W * C), tokens, valid, C, C_BLOCK)
    cols = tl.arange(0, C_BLOCK)
    ci, cj = i // pool, j // pool
    first, var_it = _inter_token(_image(first_ptr, b, sb), _image(second_ptr, b, sb),
                                 _cell_offsets(ci, cj, cols, d, si, sj, sh), mask)
    centre = tl.load(centre_ptr + b * C + cols, mask=cols < C, other=0.0)[None, :]
    lam_m, kap_m, lam_v, kap_v, weight = _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK)
    mean_ln = tl.load(_image(mean_ptr, b, H * W) + tokens, mask=valid, other=0.0)
    var_ln = tl.load(_image(var_ptr, b, H * W) + tokens, mask=valid, other=0.0)
    d1, d2, _ = _token_terms(x, g, mean_ln, var_ln, first, var_it, centre, lam_m, kap_m, lam_v,
                             kap_v, weight, eps)
    d1, d2 = tl.where(mask, d1, 0.0), tl.where(mask, d2, 0.0)
    # Eq. 2 backwards: dL/dvar_ln = -sum(D2 lam_v) / 2, dL/dmu_ln = -sum(D1 lam_m)
    beta = -tl.sum(d2 * lam_v, axis=1) / n_var
    alpha = -tl.sum(d1 * lam_m, axis=1) / C - beta * mean_ln
    rows = tl.minimum(H - ci * pool, pool)
    columns = tl.minimum(W - cj * pool, pool)
    inv_n = 1.0 / tl.maximum(rows * columns, 1).to(tl.float32)  # masked tokens: any n
    cell = _cell_offsets(ci, cj, cols, d, ti, tj, th)
    dT = tl.load(_image(d_first_ptr, b, tb) + cell, mask=mask, other=0.0)
    if SECOND:
        dT += 2.0 * (x - centre) * tl.load(_image(d_second_ptr, b, tb) + cell, mask=mask,
                                           other=0.0)
    dx = d1 + x * beta[:, None] + alpha[:, None] + dT * inv_n[:, None]
    tl.store(_image(dx_ptr, b, H * W * C) + tokens[:, None] * C + cols[None, :],
             dx.to(dx_ptr.dtype.element_ty), mask=mask)


def input_gradient(g, x, mean_ln, var_ln, first, second, centre, ratios, weight, eps, n_var,
                   d_first, d_second, grid):
    """dx (x's shape and dtype); d_first and d_second are cell views of dL/dT (d_second may be
    None)."""
    B, N, C = x.shape
    dx = x.new_empty(x.shape)
    second_view = d_first if d_second is None else d_second
    assert second_view.stride() == d_first.stride()
    _launch('triton.input_gradient', _input_gradient_spec(C, grid.pool, d_second is not None),
            (B * grid.H, triton.cdiv(grid.W, _tile(C))),
            [g, x, mean_ln, var_ln, first, second, centre, ratios, weight, d_first, d_second],
            [dx], g, x, mean_ln, var_ln, first, second, centre, ratios, weight, d_first,
            second_view, dx, grid.H, grid.W, C, grid.pool, grid.d, *first.stride()[:4],
            *d_first.stride()[:4], float(eps), float(n_var))
    return dx


def _input_gradient_spec(C, pool, second):
    return (_input_gradient_kernel, dict(SECOND=second, TILE=_tile(C), C_BLOCK=_c_block(C)),
            _warps(C))


# ---------------------------------------------------------------------------- fused backward
@triton.jit
def _image_constants(centre_ptr, ratios_ptr, weight_ptr, b, C, C_BLOCK: tl.constexpr):
    """Image b's centre [C_BLOCK] and the channel rows of :func:`_channel_rows`."""
    cols = tl.arange(0, C_BLOCK)
    centre = tl.load(centre_ptr + b * C + cols, mask=cols < C, other=0.0)
    lam_m, kap_m, lam_v, kap_v, weight = _channel_rows(ratios_ptr, weight_ptr, C, C_BLOCK)
    return centre, lam_m, kap_m, lam_v, kap_v, weight


@triton.jit
def _fused_token_terms(x_ptr, g_ptr, mean_ptr, var_ptr, centre, p_y_ptr, p_x_ptr, span_y_ptr,
                       span_x_ptr, lam_m, kap_m, lam_v, kap_v, weight, b, i, j, valid, H, W, C,
                       d, eps, C_BLOCK: tl.constexpr):
    """Without pooling, the tokens (i, j) of image b: x and its mask, dL/dy, Eq. 2, P^h T_0 and
    the inter-token variance (m formed on chip), D1 and D2 (zero outside the mask) and xhat g."""
    tokens = i * W + j
    x, mask = _load_tokens(_image(x_ptr, b, H * W * C), tokens, valid, C, C_BLOCK)
    g, _ = _load_tokens(_image(g_ptr, b, H * W * C), tokens, valid, C, C_BLOCK)
    mean_ln = tl.load(_image(mean_ptr, b, H * W) + tokens, mask=valid, other=0.0)
    var_ln = tl.load(_image(var_ptr, b, H * W) + tokens, mask=valid, other=0.0)
    first, second = _banded_moments(_image(x_ptr, b, H * W * C), centre, p_y_ptr, p_x_ptr,
                                    span_y_ptr, span_x_ptr, i, j, valid, mask, H, W, C, d, C_BLOCK)
    var_it = tl.maximum(second - first * first, 0.0)
    d1, d2, xg = _token_terms(x, g, mean_ln, var_ln, first, var_it, centre[None, :], lam_m, kap_m,
                              lam_v, kap_v, weight, eps)
    return x, mask, g, mean_ln, var_ln, first, var_it, tl.where(mask, d1, 0.0), \
        tl.where(mask, d2, 0.0), xg


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _fused_gradients_kernel(g_ptr, x_ptr, mean_ptr, var_ptr, centre_ptr, p_y_ptr, p_x_ptr,
                            span_y_ptr, span_x_ptr, ratios_ptr, weight_ptr, dm_first_ptr,
                            dm_second_ptr, grad_p_y_ptr, partial_ptr, H, W, C, d, heads, eps,
                            TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """Without pooling, backward pass 1 for token row i of image b: with m formed on chip, dL/dm
    of its tokens (written) and their sums for the parameters; then row i of image b's share of
    the gradient of P_y, sum over the row's tokens and each head's channels of dL/dm u for the
    rows of u = P_x T in the band (u formed again on chip, dL/dm read back from cache)."""
    row = tl.program_id(0)
    b, i = row // H, row % H
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    head = cols // d
    centre, lam_m, kap_m, lam_v, kap_v, weight = _image_constants(centre_ptr, ratios_ptr,
                                                                  weight_ptr, b, C, C_BLOCK)
    x_image = _image(x_ptr, b, H * W * C)
    dm_images = _image(dm_first_ptr, b, H * W * C), _image(dm_second_ptr, b, H * W * C)
    s_xg, s_g, s_mu, s_var, s_mit, s_vit = _zero_sums(C_BLOCK)
    for start in range(0, W, TILE):
        j = start + tl.arange(0, TILE)
        valid = j < W
        tokens = i * W + j
        x, mask, g, mean_ln, var_ln, first, var_it, d1, d2, xg = _fused_token_terms(
            x_ptr, g_ptr, mean_ptr, var_ptr, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr,
            lam_m, kap_m, lam_v, kap_v, weight, b, i, j, valid, H, W, C, d, eps, C_BLOCK)
        # dL/dm_second = dL/dvar_it [var_it > 0], dL/dm_first = dL/dmu_it - 2 m_first dm_second
        dm_second = tl.where(var_it > 0, -0.5 * kap_v * d2, 0.0)
        offsets = tokens[:, None] * C + cols[None, :]
        tl.store(dm_images[0] + offsets, -kap_m * d1 - 2.0 * first * dm_second, mask=mask)
        tl.store(dm_images[1] + offsets, dm_second, mask=mask)
        s_xg += tl.sum(tl.where(mask, xg, 0.0), axis=0)
        s_g += tl.sum(g, axis=0)
        s_mu += tl.sum(mean_ln[:, None] * d1, axis=0)
        s_var += tl.sum(var_ln[:, None] * d2, axis=0)
        s_mit += tl.sum((first + centre[None, :]) * d1, axis=0)
        s_vit += tl.sum(var_it * d2, axis=0)
    _store_sums(partial_ptr, row, C, s_xg, s_g, s_mu, s_var, s_mit, s_vit, C_BLOCK)
    tl.debug_barrier()  # dL/dm of the row, written above, is read back below
    lo_y, hi_y = _axis_span(span_y_ptr, i + tl.zeros([1], tl.int32), i >= 0, H)
    for i2 in range(0, H):
        total = tl.zeros([C_BLOCK], tl.float32)
        if (i2 >= lo_y) & (i2 < hi_y):  # elsewhere P_y is zero: a zero gradient
            for start in range(0, W, TILE):
                j = start + tl.arange(0, TILE)
                valid = j < W
                mask = valid[:, None] & cmask[None, :]
                lo_x, hi_x = _axis_span(span_x_ptr, j, valid, W)
                p_x_rows = head[None, :] * W * W + j[:, None] * W
                u_first, u_second = _row_products(x_image, centre, p_x_ptr, p_x_rows, i2, lo_x,
                                                  hi_x, mask, W, C, C_BLOCK)
                offsets = (i * W + j)[:, None] * C + cols[None, :]
                dm_first = tl.load(dm_images[0] + offsets, mask=mask, other=0.0)
                dm_second = tl.load(dm_images[1] + offsets, mask=mask, other=0.0)
                total += tl.sum(dm_first * u_first + dm_second * u_second, axis=0)
        for h in range(heads):
            tl.store(grad_p_y_ptr + ((b * heads + h) * H + i) * H + i2,
                     tl.sum(tl.where(head == h, total, 0.0), axis=0))


@triton.jit(do_not_specialize=['H', 'W', 'C'])
def _fused_input_gradient_kernel(g_ptr, x_ptr, mean_ptr, var_ptr, centre_ptr, p_y_ptr, p_x_ptr,
                                 span_y_ptr, span_x_ptr, ratios_ptr, weight_ptr, dm_first_ptr,
                                 dm_second_ptr, grad_p_x_ptr, dx_ptr, H, W, C, d, heads, eps,
                                 n_var, TILE: tl.constexpr, C_BLOCK: tl.constexpr):
    """Without pooling, backward pass 2 for TILE token columns j of image b, row after row: the
    products backwards on chip, dL/du = P_y^T dL/dm over the band of P_y's column i for every
    row of P_x whose column j is nonzero and dL/dT = P_x^T dL/du; dx (with m and the per-token
    terms formed again); and image b's share of the gradient of P_x at columns j, sum over the
    rows and each head's channels of dL/du T, accumulated in place (the program owns them)."""
    b, block = tl.program_id(0), tl.program_id(1)
    j = block * TILE + tl.arange(0, TILE)
    valid = j < W
    cols = tl.arange(0, C_BLOCK)
    cmask = cols < C
    head = cols // d
    centre, lam_m, kap_m, lam_v, kap_v, weight = _image_constants(centre_ptr, ratios_ptr,
                                                                  weight_ptr, b, C, C_BLOCK)
    dm_images = _image(dm_first_ptr, b, H * W * C), _image(dm_second_ptr, b, H * W * C)
    for j1 in range(0, W):
        for h in range(heads):
            tl.store(grad_p_x_ptr + ((b * heads + h) * W + j1) * W + j,
                     tl.zeros([TILE], tl.float32), mask=valid)
    tl.debug_barrier()
    lo_j, hi_j = _axis_span(span_x_ptr + 2 * W, j, valid, W)  # rows of P_x nonzero at columns j
    for i in range(0, H):
        tokens = i * W + j
        x, mask, g, mean_ln, var_ln, first, var_it, d1, d2, _ = _fused_token_terms(
            x_ptr, g_ptr, mean_ptr, var_ptr, centre, p_y_ptr, p_x_ptr, span_y_ptr, span_x_ptr,
            lam_m, kap_m, lam_v, kap_v, weight, b, i, j, valid, H, W, C, d, eps, C_BLOCK)
        # Eq. 2 backwards: dL/dvar_ln = -sum(D2 lam_v) / 2, dL/dmu_ln = -sum(D1 lam_m)
        beta = -tl.sum(d2 * lam_v, axis=1) / n_var
        alpha = -tl.sum(d1 * lam_m, axis=1) / C - beta * mean_ln
        t = tl.where(mask, x - centre[None, :], 0.0)
        lo_i, hi_i = _axis_span(span_y_ptr + 2 * H, i + tl.zeros([1], tl.int32), i >= 0, H)
        dT_first = tl.zeros(mask.shape, tl.float32)
        dT_second = tl.zeros(mask.shape, tl.float32)
        for j1 in range(lo_j, hi_j):
            du_first = tl.zeros([C_BLOCK], tl.float32)
            du_second = tl.zeros([C_BLOCK], tl.float32)
            for i1 in range(lo_i, hi_i):
                w = tl.load(p_y_ptr + head * H * H + i1 * H + i, mask=cmask, other=0.0)
                cell = (i1 * W + j1) * C + cols
                du_first += w * tl.load(dm_images[0] + cell, mask=cmask, other=0.0)
                du_second += w * tl.load(dm_images[1] + cell, mask=cmask, other=0.0)
            w = tl.load(p_x_ptr + (head[None, :] * W * W + j1 * W + j[:, None]), mask=mask,
                        other=0.0)
            dT_first += w * du_first[None, :]
            dT_second += w * du_second[None, :]
            share = du_first[None, :] * t + du_second[None, :] * (t * t)
            for h in range(heads):
                out = grad_p_x_ptr + ((b * heads + h) * W + j1) * W + j
                total = tl.load(out, mask=valid, other=0.0)
                tl.store(out, total + tl.sum(tl.where(head[None, :] == h, share, 0.0), axis=1),
                         mask=valid)
        tl.debug_barrier()  # the next row adds to the same entries
        dx = d1 + x * beta[:, None] + alpha[:, None] + dT_first + 2.0 * t * dT_second
        tl.store(_image(dx_ptr, b, H * W * C) + tokens[:, None] * C + cols[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=mask)


def fused_backward(g, x, mean_ln, var_ln, centre, p_y, p_x, ratios, weight, eps, n_var, grid):
    """Without pooling: dx (x's shape and dtype), the gradients of p_y and p_x and the sums
    (6, C) for the parameters, the products formed on chip over the nonzero bands; dL/dm
    (float32, two values per token and channel) is the one tensor passed between the passes."""
    B, N, C = x.shape
    H, W, heads = grid.H, grid.W, grid.heads
    span_y, span_x = spans(p_y), spans(p_x)
    f32 = dict(dtype=torch.float32, device=x.device)
    dm = torch.empty(2, B, N, C, **f32)
    grad_p_y = torch.empty(B, heads, H, H, **f32)
    partial = torch.empty(B * H, 6, C, **f32)
    common = [g, x, mean_ln, var_ln, centre, p_y, p_x, span_y, span_x, ratios, weight]
    _launch('triton.fused_gradients', _fused_gradients_spec(C), (B * H, ), common,
            [dm, grad_p_y, partial], *common, dm[0], dm[1], grad_p_y, partial, H, W, C, grid.d,
            heads, float(eps))
    grad_p_x = torch.empty(B, heads, W, W, **f32)
    dx = x.new_empty(x.shape)
    _launch('triton.fused_input_gradient', _fused_input_gradient_spec(C),
            (B, triton.cdiv(W, _tile(C))), [*common, dm], [grad_p_x, dx], *common, dm[0], dm[1],
            grad_p_x, dx, H, W, C, grid.d, heads, float(eps), float(n_var))
    return dx, grad_p_y.sum(0), grad_p_x.sum(0), partial.sum(0)


def _fused_gradients_spec(C):
    return _fused_gradients_kernel, dict(TILE=_tile(C), C_BLOCK=_c_block(C)), _warps(C)


def _fused_input_gradient_spec(C):
    return _fused_input_gradient_kernel, dict(TILE=_tile(C), C_BLOCK=_c_block(C)), _warps(C)


# ---------------------------------------------------------------------------- specialisations
def specializations(C, pool, square_of_pooled=False):
    """The compiled kernels one DTN layer of C channels and pooling ``pool`` launches, forward and
    backward, as (kernel, constexprs, num_warps): what a GPU compiles for it (the tokens' dtype
    aside). The image size is not part of it."""
    if pool == 1:  # the products fused into the passes
        return [_statistics_spec(C, pool), _spans_spec(), _fused_output_spec(C),
                _fused_gradients_spec(C), _fused_input_gradient_spec(C)]
    return [_statistics_spec(C, pool), _output_spec(C, pool), _gradients_spec(C, pool),
            _input_gradient_spec(C, pool, not square_of_pooled)]
