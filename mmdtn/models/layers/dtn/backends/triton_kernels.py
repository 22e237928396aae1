"""Triton kernels of DynamicTokenNorm's full-resolution passes (Shao et al., ICLR 2022, Eqs. 2, 4,
5), each followed by the function that launches it.

Tokens x are (B, N, C) in float16, bfloat16 or float32, read as they are; everything is computed
and accumulated in float32, and the outputs have x's dtype. A program holds whole tokens (all C
channels, ``C_BLOCK`` = the next power of two), so Eq. 2 never leaves its registers and is never
stored: every pass that reads a token forms its mean and variance again. H, W, the pooling and the
strides of the cell tensors are runtime arguments: a new resolution launches the same compiled
kernels.

Every pass takes a tile of cells of one cell row (without pooling a cell is a token), reads the
tile's cell values once and walks the pool token rows of its cells, a token row of the tile at a
time (:func:`_cell_columns`):

    moments          with pooling, T = (mean of x - centre, mean of (x - centre)^2) per cell,
                     written into the column-major T of :func:`..function.moments`: x read once
                     (without pooling the band products form T from the tokens where they read
                     them: :class:`..function.TokenMoments`)
    output           y from x and the products m (Eqs. 4-5): x read, y written
    token gradients  backward pass 1, from g and x: dL/dm of every cell (sums of D1 and D2 over
                     its tokens) and the sums for the parameters, per program (added up afterwards
                     in a fixed order: no float atomics)
    input gradient   backward pass 2: dx from g, x, m and dL/dT

The centre about which T is taken is the mean of every ``CENTRE_STRIDE``-th token (rows of P sum to
1, so the statistics do not depend on it; one near the tokens' values keeps the second moment about
it free of cancellation). The positional products m = P^h T (Eq. 5) run between the passes on the
cell grid, both factors of P^h in one kernel (:mod:`.triton_cells`) or one axis at a time over the
nonzero band of each (:mod:`..function`, :mod:`.triton_band`); their cell tensors travel in float32,
and the passes form the inter-token variance from m's raw second moment. An earlier design formed
the products on chip inside these passes, over the band of every tile of 2 to 4 tokens or cells: it
moved fewer bytes but took 7x LayerNorm's time on an H200 at pooling 4 and 150-400x without pooling
(docs/gpu.md, "How a layer runs"), each program walking the band of every cell it held at up to 250
registers a thread. Without pooling the passes now run fused in another way, a token row and all
channels per program, the products as row sums and matrix products (:mod:`.triton_fused`); the
passes here run with pooling, and without it for heads too wide for the fused kernels.

Every launch goes through :func:`.triton_launch.launch`, which records it with the bytes of its
operands (with meta tensors it is only recorded: the traffic of any shape without a GPU) and, on
CUDA tensors, calls the compiled kernel without Triton's argument binding after the first time.
"""
import functools

import torch
import triton
import triton.language as tl

from .triton_launch import cdiv, launch

__all__ = ['sample_centre', 'moments', 'output', 'token_gradients', 'input_gradient',
           'specializations', 'TOKEN_POINTERS']

#: Elements of a token tile (tokens x C_BLOCK channels) per thread of a program: a pass holds
#: several such tiles (x, dL/dy, the cell statistics, ...) in registers.
ELEMENTS_PER_THREAD = 8
#: The share of a tile of :func:`_tile` tokens a token row of the backward passes takes: they
#: hold more token tensors (compiled for sm_90 without spills, the pool token rows unrolled).
BACKWARD_SHARE = 0.5
#: Cells the token-gradients pass covers per program with pooling, and tokens without: its sums
#: for the parameters are written once per program.
CELLS_PER_PROGRAM = 16
TOKENS_PER_PROGRAM = 64
#: The centre is the mean of one token in CENTRE_STRIDE: a prime stride walks across the columns
#: of every token grid whose width it does not divide, rather than down a few of them.
CENTRE_STRIDE = 17

#: The sums over the tokens per channel that the backward passes give for the parameters (rows of
#: (programs, 4, C)): xhat g, g, (mu_ln - mu_it) D1 and (var_ln - var_it) D2 (D1 = -dL/dmu, D2 =
#: -2 dL/dvar), and, by row, (row, factor) of the gradient each is a multiple of: the weight's, the
#: bias's, and those of lambda_mean and lambda_var with 1 - lambda tied to lambda (Eq. 5's
#: mixtures, whose two ratios the gates set together: :mod:`.triton_ratios`). The gradients of
#: lambda and 1 - lambda apart (:data:`..function.PARAMETER_SUMS`, six sums) are never needed.
TIED_SUMS = ((0, 1.0), (1, 1.0), (2, -1.0), (3, -0.5))
#: Rows of the sums per program and channel (for the kernels, which take it as a constexpr).
SUM_ROWS = tl.constexpr(len(TIED_SUMS))

#: Pointer arguments of the kernels to tensors of the tokens' dtype; all others are float32 but
#: the fused passes' dL/dm and its exponents (:data:`.triton_fused.GRADIENT_POINTERS`,
#: :data:`.triton_fused.EXPONENT_POINTERS`).
TOKEN_POINTERS = ('x_ptr', 'g_ptr', 'y_ptr', 'dx_ptr')
#: Runtime integers that change with the resolution: never specialised (no recompilation). The
#: channel count C and head width d are not among them: Triton specialises them (a multiple of
#: 16, as in every layer of PVT-Tiny and Swin-T and all but PVTv2-b0's first stage, whose heads
#: have 8 channels, lets it read 8 or 16 bytes of tokens at a time instead of 2), once per layer;
#: except in the output kernel (:data:`_SIZES_AND_CHANNELS`). On sm_120
#: the token gradients keep an 8-byte stack frame specialised (none without; no spills).
_SIZES = ['H', 'W', 'm_sb', 'm_srow', 'm_scol', 'm_shead', 't_sb', 't_srow', 't_scol',
          't_shead']
#: :data:`_SIZES` and C and d: for the output kernel, which specialised on them spilled 8 bytes on
#: sm_80 for float32 tokens (``compile_kernels.py``).
_SIZES_AND_CHANNELS = _SIZES + ['C', 'd']


def _c_block(C):
    return triton.next_power_of_2(C)


def _warps(C):
    return 4 if _c_block(C) <= 256 else 8


def _tile(C):
    """Tokens per tile: ELEMENTS_PER_THREAD elements of the tile per thread."""
    return max(1, min(64, ELEMENTS_PER_THREAD * 32 * _warps(C) // _c_block(C)))


def _cells(C, pool, share=1):
    """Cells per tile: a token row of them is a tile of ``share`` x :func:`_tile` tokens."""
    return max(1, int(_tile(C) * share) // triton.next_power_of_2(pool))


def _layout(t):
    """The strides (image, cell row, cell column, head) of a cell tensor viewed as (B, Hp, Wp,
    heads, d); the channels of a head are contiguous."""
    assert t.dim() == 5 and t.stride(4) == 1, (tuple(t.shape), t.stride())
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3)


def _tiling(C, pool, share=1, **constexprs):
    """(kernel constexprs, num_warps) of a pass over tiles of :func:`_cells` cells."""
    return dict(POOL=pool, CELLS=_cells(C, pool, share), S_BLOCK=triton.next_power_of_2(pool),
                C_BLOCK=_c_block(C), **constexprs), _warps(C)


# ---------------------------------------------------------------------------- shared pieces
@triton.jit
def _image(ptr, b, size):
    """The start of image b of a tensor of images of ``size`` elements each."""
    return ptr + b.to(tl.int64) * size


@triton.jit
def _load_tokens(image_ptr, tokens, valid, C, C_BLOCK: tl.constexpr):
    """Tokens (TILE,) of one image (rows of C from ``image_ptr``), as float32 [TILE, C_BLOCK],
    zeros outside; and the mask. Offsets within an image are int32, images are int64 apart."""
    cols = tl.arange(0, C_BLOCK)
    mask = valid[:, None] & (cols[None, :] < C)
    x = tl.load(image_ptr + tokens[:, None] * C + cols[None, :], mask=mask, other=0.0)
    return x.to(tl.float32), mask


@triton.jit
def _cell_tile(b, ci, start, Wp, C, d, s_b, s_row, s_col, s_head, CELLS: tl.constexpr,
               C_BLOCK: tl.constexpr):
    """Offsets (int64) [CELLS, C_BLOCK] of cells start ... start + CELLS - 1 of cell row ci of
    image b in a cell tensor of the strides of :func:`_layout`, and the mask of the real ones."""
    cols = tl.arange(0, C_BLOCK)
    cjs = start + tl.arange(0, CELLS)
    channel = (cols // d).to(tl.int64) * s_head + cols % d
    cell = b.to(tl.int64) * s_b + ci.to(tl.int64) * s_row + cjs.to(tl.int64) * s_col
    return cell[:, None] + channel[None, :], (cjs < Wp)[:, None] & (cols < C)[None, :]


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
def _cell_counts(ci, start, H, W, pool, CELLS: tl.constexpr):
    """Real tokens of cells start ... start + CELLS - 1 of cell row ci (at least 1), float32."""
    cjs = start + tl.arange(0, CELLS)
    rows = tl.minimum(pool, H - ci * pool)
    cols = tl.maximum(tl.minimum(pool, W - cjs * pool), 0)
    return tl.maximum(rows * cols, 1).to(tl.float32)


@triton.jit
def _per_token(cell_values, CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """Values [CELLS, C_BLOCK] of cells repeated for the S_BLOCK token columns of each cell, as
    :func:`_cell_columns` orders them: [CELLS * S_BLOCK, C_BLOCK]."""
    if S_BLOCK == 1:
        return cell_values
    tiled = tl.broadcast_to(cell_values[:, None, :], [CELLS, S_BLOCK, C_BLOCK])
    return tl.reshape(tiled, [CELLS * S_BLOCK, C_BLOCK])


@triton.jit
def _cell_sums(values, CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """Sums [CELLS, C_BLOCK] over each cell's S_BLOCK token columns of values [CELLS * S_BLOCK,
    C_BLOCK] ordered as :func:`_cell_columns` orders them (the inverse of :func:`_per_token`)."""
    if S_BLOCK == 1:
        return values
    return tl.sum(tl.reshape(values, [CELLS, S_BLOCK, C_BLOCK]), axis=1)


@triton.jit
def _halves(values, ROWS: tl.constexpr, C_BLOCK: tl.constexpr):
    """values [ROWS, C_BLOCK], ROWS a power of two: the first half plus the second."""
    if ROWS > 1:
        values = tl.sum(tl.reshape(values, [2, ROWS // 2, C_BLOCK]), axis=0)
    return values


@triton.jit
def _token_sums(values, TOKENS: tl.constexpr, C_BLOCK: tl.constexpr):
    """Sums [C_BLOCK] over the TOKENS rows of values (a power of two, at most 64) as a tree of
    pairs: a rounding error that grows with log2(TOKENS), whichever order the target sums in."""
    values = _halves(values, TOKENS, C_BLOCK)
    values = _halves(values, TOKENS // 2, C_BLOCK)
    values = _halves(values, TOKENS // 4, C_BLOCK)
    values = _halves(values, TOKENS // 8, C_BLOCK)
    values = _halves(values, TOKENS // 16, C_BLOCK)
    values = _halves(values, TOKENS // 32, C_BLOCK)
    return tl.reshape(values, [C_BLOCK])


@triton.jit
def _channel_row(ptr, C, C_BLOCK: tl.constexpr):
    """C float32 values from ``ptr`` as [1, C_BLOCK], zeros past C."""
    cols = tl.arange(0, C_BLOCK)
    return tl.load(ptr + cols, mask=cols < C, other=0.0)[None, :]


@triton.jit
def _program_tile(H, W, POOL: tl.constexpr, CELLS: tl.constexpr):
    """The image b, cell row ci and first cell of a program (row b Hp + ci, block of CELLS
    cells), and the cells per row Wp."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + POOL - 1) // POOL, (W + POOL - 1) // POOL
    return row // Hp, row % Hp, block * CELLS, Wp


@triton.jit
def _ratio_rows(ratios_ptr, C, n, BLOCK: tl.constexpr):
    """lambda_mean, 1 - lambda_mean, lambda_var, 1 - lambda_var of the n channels from
    ``ratios_ptr`` in the ratios (4, C), each [1, BLOCK]."""
    return (_channel_row(ratios_ptr, n, BLOCK), _channel_row(ratios_ptr + C, n, BLOCK),
            _channel_row(ratios_ptr + 2 * C, n, BLOCK),
            _channel_row(ratios_ptr + 3 * C, n, BLOCK))


@triton.jit
def _inter_token(m_first_ptr, m_second_ptr, offsets, cell_mask, CELLS: tl.constexpr,
                 S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """The products m of a tile's cells: the first moment about the centre and the inter-token
    variance var_it = m_second - m_first^2 (clamped at 0; m_second = P T_1 is the raw second
    moment), per cell [CELLS, C_BLOCK] and per token."""
    first = tl.load(m_first_ptr + offsets, mask=cell_mask, other=0.0)
    second = tl.load(m_second_ptr + offsets, mask=cell_mask, other=0.0)
    var_it = tl.maximum(second - first * first, 0.0)
    return (first, var_it, _per_token(first, CELLS, S_BLOCK, C_BLOCK),
            _per_token(var_it, CELLS, S_BLOCK, C_BLOCK))


@triton.jit
def _normalised(x, mask, C, n_var, mean_it, var_it, lam_m, kap_m, lam_v, kap_v, eps):
    """Eq. 2 per token (the mean as a sum / C, the variance about it / n_var), then Eq. 5 inside
    Eq. 4 without the affine: mean_ln, var_ln (TILE,), rstd and xhat [TILE, C_BLOCK]."""
    mean_ln = tl.sum(x, axis=1) / C
    diff = tl.where(mask, x - mean_ln[:, None], 0.0)
    var_ln = tl.sum(diff * diff, axis=1) / n_var
    rstd, xhat = _standardised(x, mean_ln[:, None], var_ln[:, None], mean_it, var_it, lam_m,
                               kap_m, lam_v, kap_v, eps)
    return mean_ln, var_ln, rstd, xhat


@triton.jit
def _standardised(x, mean_ln, var_ln, mean_it, var_it, lam_m, kap_m, lam_v, kap_v, eps):
    """Eq. 5 inside Eq. 4 without the affine: rstd = 1 / sqrt(sigma2 + eps) and xhat = (x - mu)
    rstd, from Eq. 2's mean_ln, var_ln and the inter-token mean_it, var_it (broadcast)."""
    rstd = tl.rsqrt(lam_v * var_ln + kap_v * var_it + eps)
    return rstd, (x - lam_m * mean_ln - kap_m * mean_it) * rstd


# ---------------------------------------------------------------------------- moments
@triton.jit(do_not_specialize=_SIZES)
def _moments_kernel(x_ptr, centre_ptr, t_first_ptr, t_second_ptr, H, W, C, d, t_sb, t_srow,
                    t_scol, t_shead, SQUARE: tl.constexpr, POOL: tl.constexpr, CELLS: tl.constexpr,
                    S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """T of CELLS cells of cell row ci of image b (pooling): the mean of x - centre over each
    cell's real tokens and the mean of its square, or with ``SQUARE`` (the reference code's
    convention) the square of the first."""
    b, ci, start, Wp = _program_tile(H, W, POOL, CELLS)
    centre = _channel_row(centre_ptr + b * C, C, C_BLOCK)
    x_image = _image(x_ptr, b, H * W * C)
    j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
    first = tl.zeros([CELLS, C_BLOCK], tl.float32)
    second = tl.zeros([CELLS, C_BLOCK], tl.float32)
    for r in tl.static_range(POOL):
        i = ci * POOL + r
        x, mask = _load_tokens(x_image, i * W + j, real & (i < H), C, C_BLOCK)
        diff = tl.where(mask, x - centre, 0.0)
        first += _cell_sums(diff, CELLS, S_BLOCK, C_BLOCK)
        if not SQUARE:
            second += _cell_sums(diff * diff, CELLS, S_BLOCK, C_BLOCK)
    n = _cell_counts(ci, start, H, W, POOL, CELLS)[:, None]
    first = first / n
    second = first * first if SQUARE else second / n
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, t_sb, t_srow, t_scol, t_shead, CELLS,
                                    C_BLOCK)
    tl.store(t_first_ptr + offsets, first, mask=cell_mask)
    tl.store(t_second_ptr + offsets, second, mask=cell_mask)


def sample_centre(x):
    """The centre of the moments, (B, 1, 1, C) float32: the mean of every CENTRE_STRIDE-th token
    (a 17th of x read)."""
    return x[:, None, ::CENTRE_STRIDE].mean(2, keepdim=True, dtype=torch.float32)


def moments(x, centre, grid, square_of_pooled=False):
    """T of :func:`..function.moments` with pooling, column-major (heads, Wp, 2, B, Hp, d) float32,
    from x and the centre (B, 1, 1, C)."""
    B, _, C = x.shape
    T = torch.empty(grid.column_major, dtype=torch.float32, device=x.device)
    first, second = (grid.from_column_major(T[:, :, k]) for k in range(2))
    spec = _moments_spec(C, grid.pool, square_of_pooled)
    programs = (B * grid.Hp, cdiv(grid.Wp, spec[1]['CELLS']))
    launch('triton.moments', spec, programs, [x, centre], [T], x, centre.contiguous(), first,
           second, grid.H, grid.W, C, grid.d, *_layout(first))
    return T


@functools.lru_cache(maxsize=None)
def _moments_spec(C, pool, square_of_pooled):
    constexprs, warps = _tiling(C, pool, SQUARE=square_of_pooled)
    return _moments_kernel, constexprs, warps


# ---------------------------------------------------------------------------- output
@triton.jit(do_not_specialize=_SIZES_AND_CHANNELS)
def _output_kernel(x_ptr, m_first_ptr, m_second_ptr, centre_ptr, ratios_ptr, weight_ptr,
                   bias_ptr, y_ptr, H, W, C, d, m_sb, m_srow, m_scol, m_shead, eps, n_var,
                   POOL: tl.constexpr, CELLS: tl.constexpr,
                   S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """y of the tokens of CELLS cells of cell row ci of image b (Eqs. 2, 4, 5)."""
    b, ci, start, Wp = _program_tile(H, W, POOL, CELLS)
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, m_sb, m_srow, m_scol, m_shead, CELLS,
                                    C_BLOCK)
    first_cells, var_it_cells, first, var_it = _inter_token(
        m_first_ptr, m_second_ptr, offsets, cell_mask, CELLS, S_BLOCK, C_BLOCK)
    mean_it = first + _channel_row(centre_ptr + b * C, C, C_BLOCK)
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr, C, C, C_BLOCK)
    weight, bias = _channel_row(weight_ptr, C, C_BLOCK), _channel_row(bias_ptr, C, C_BLOCK)
    cols = tl.arange(0, C_BLOCK)
    x_image, y_image = _image(x_ptr, b, H * W * C), _image(y_ptr, b, H * W * C)
    j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
    for r in tl.static_range(POOL):
        tokens = (ci * POOL + r) * W + j
        x, mask = _load_tokens(x_image, tokens, real & (ci * POOL + r < H), C, C_BLOCK)
        mean_ln, var_ln, rstd, xhat = _normalised(x, mask, C, n_var, mean_it, var_it, lam_m,
                                                  kap_m, lam_v, kap_v, eps)
        y = xhat * weight + bias  # Eq. 4
        tl.store(y_image + tokens[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask)


def output(x, centre, m_first, m_second, ratios, weight, bias, eps, n_var, grid):
    """y (x's shape and dtype) from x, the centre (B, 1, 1, C) and the products m of Eq. 5, each
    moment a (B, Hp, Wp, heads, d) float32 view of the cells."""
    B, _, C = x.shape
    y = torch.empty_like(x)
    spec = _output_spec(C, grid.pool)
    programs = (B * grid.Hp, cdiv(grid.Wp, spec[1]['CELLS']))
    launch('triton.output', spec, programs, [x, m_first, m_second, centre, ratios, weight, bias],
           [y], x, m_first, m_second, centre.contiguous(), ratios, weight, bias, y, grid.H,
           grid.W, C, grid.d, *_layout(m_first), float(eps), float(n_var))
    return y


@functools.lru_cache(maxsize=None)
def _output_spec(C, pool):
    constexprs, warps = _tiling(C, pool)
    return _output_kernel, constexprs, warps


# ---------------------------------------------------------------------------- backward pass 1
@triton.jit(do_not_specialize=_SIZES)
def _token_gradients_kernel(x_ptr, g_ptr, m_first_ptr, m_second_ptr, centre_ptr, ratios_ptr,
                            weight_ptr, dm_first_ptr, dm_second_ptr, partial_ptr, H, W, C, d,
                            m_sb, m_srow, m_scol, m_shead, eps, n_var, POOL: tl.constexpr,
                            CELLS: tl.constexpr, TILES: tl.constexpr, S_BLOCK: tl.constexpr,
                            C_BLOCK: tl.constexpr):
    """For TILES tiles of CELLS cells of cell row ci of image b: with D1 = g w rstd (= -dL/dmu)
    and D2 = D1 xhat rstd (= -2 dL/dvar), dL/dm of every cell with respect to the raw moments and
    the program's sums of :data:`TIED_SUMS` (4, C)."""
    b, ci, first_cell, Wp = _program_tile(H, W, POOL, CELLS * TILES)
    cols = tl.arange(0, C_BLOCK)
    centre = _channel_row(centre_ptr + b * C, C, C_BLOCK)
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr, C, C, C_BLOCK)
    weight = _channel_row(weight_ptr, C, C_BLOCK)
    x_image, g_image = _image(x_ptr, b, H * W * C), _image(g_ptr, b, H * W * C)
    xhat_g = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    g_sum = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    # mu D1 and var D2 of Eq. 2's statistics and of the inter-token ones, summed apart and
    # subtracted at the end: summed as differences, sm_86 and sm_89 spilled 24 bytes (C = 96,
    # pooling 4: Swin-T's stage 1)
    mean_ln_d1 = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    var_ln_d2 = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    mean_it_d1 = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    var_it_d2 = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    for tile in range(TILES):
        start = first_cell + tile * CELLS
        offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, m_sb, m_srow, m_scol, m_shead,
                                        CELLS, C_BLOCK)
        first, var_it, first_t, var_it_t = _inter_token(m_first_ptr, m_second_ptr, offsets,
                                                        cell_mask, CELLS, S_BLOCK, C_BLOCK)
        mean_it = first_t + centre
        j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
        d1_cells = tl.zeros([CELLS, C_BLOCK], tl.float32)
        d2_cells = tl.zeros([CELLS, C_BLOCK], tl.float32)
        for r in range(0, POOL):  # not unrolled: registers
            tokens = (ci * POOL + r) * W + j
            valid = real & (ci * POOL + r < H)
            x, mask = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
            g, _ = _load_tokens(g_image, tokens, valid, C, C_BLOCK)
            mean_ln, var_ln, rstd, xhat = _normalised(x, mask, C, n_var, mean_it, var_it_t,
                                                      lam_m, kap_m, lam_v, kap_v, eps)
            d1 = g * weight * rstd
            d2 = d1 * xhat * rstd
            d1_cells += _cell_sums(d1, CELLS, S_BLOCK, C_BLOCK)
            d2_cells += _cell_sums(d2, CELLS, S_BLOCK, C_BLOCK)
            xhat_g += xhat * g
            g_sum += g
            mean_ln_d1 += mean_ln[:, None] * d1
            var_ln_d2 += var_ln[:, None] * d2
            mean_it_d1 += mean_it * d1
            var_it_d2 += var_it_t * d2
        # dL/dm_second = dL/dvar_it [var_it > 0], dL/dm_first = dL/dmu_it - 2 m_first dL/dm_second
        dm_second = tl.where(var_it > 0, -0.5 * kap_v * d2_cells, 0.0)
        dm_first = -kap_m * d1_cells - 2.0 * first * dm_second
        tl.store(dm_first_ptr + offsets, dm_first, mask=cell_mask)
        tl.store(dm_second_ptr + offsets, dm_second, mask=cell_mask)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    partial = partial_ptr + program.to(tl.int64) * SUM_ROWS * C + cols
    tl.store(partial, _token_sums(xhat_g, CELLS * S_BLOCK, C_BLOCK), mask=cols < C)
    tl.store(partial + C, _token_sums(g_sum, CELLS * S_BLOCK, C_BLOCK), mask=cols < C)
    mean_d1 = _token_sums(mean_ln_d1 - mean_it_d1, CELLS * S_BLOCK, C_BLOCK)
    var_d2 = _token_sums(var_ln_d2 - var_it_d2, CELLS * S_BLOCK, C_BLOCK)
    tl.store(partial + 2 * C, mean_d1, mask=cols < C)
    tl.store(partial + 3 * C, var_d2, mask=cols < C)


def token_gradients(g, x, centre, m_first, m_second, ratios, weight, eps, n_var, grid):
    """dL/dm, head-major (heads, 2, B, Hp, Wp, d) float32, and every program's sums (programs, 4,
    C) for the parameters (:data:`TIED_SUMS`, :func:`parameter_gradients`), from g, x, the centre
    and the products m (as in :func:`output`)."""
    B, _, C = x.shape
    dm = torch.empty(grid.head_major, dtype=torch.float32, device=x.device)
    dm_first, dm_second = (grid.from_head_major(t) for t in dm.unbind(1))
    spec = _token_gradients_spec(C, grid.pool)
    programs = (B * grid.Hp, cdiv(grid.Wp, spec[1]['CELLS'] * spec[1]['TILES']))
    partial = torch.empty(programs[0] * programs[1], SUM_ROWS.value, C, dtype=torch.float32,
                          device=x.device)
    launch('triton.token_gradients', spec, programs,
           [g, x, m_first, m_second, centre, ratios, weight], [dm, partial], x, g, m_first,
           m_second, centre.contiguous(), ratios, weight, dm_first, dm_second, partial, grid.H,
           grid.W, C, grid.d, *_layout(m_first), float(eps), float(n_var))
    return dm, partial


@triton.jit(do_not_specialize=['programs', 'C'])
def _parameter_gradients_kernel(partial_ptr, ratios_ptr, weight_ptr, bias_ptr, programs, C,
                                SUMS: tl.constexpr, BLOCK_P: tl.constexpr,
                                BLOCK_C: tl.constexpr):
    """Row ``program_id(1)`` of the programs' sums (programs, len(SUMS), C), added up over the
    programs in a fixed order (BLOCK_P at a time) for the channels of block ``program_id(0)``,
    times its factor into the gradient that SUMS (:data:`TIED_SUMS`) takes it for: the weight,
    the bias or a row of the ratios'."""
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row = tl.program_id(1)
    total = tl.zeros([BLOCK_C], tl.float32)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        at = (p[:, None] * len(SUMS) + row).to(tl.int64) * C + c[None, :]
        mask = (p < programs)[:, None] & (c < C)[None, :]
        total += tl.sum(tl.load(partial_ptr + at, mask=mask, other=0.0), axis=0)
    for gradient in tl.static_range(len(SUMS)):  # weight, bias, then the ratios' rows
        if row == SUMS[gradient][0]:
            value = total * SUMS[gradient][1]
            if gradient == 0:
                tl.store(weight_ptr + c, value, mask=c < C)
            elif gradient == 1:
                tl.store(bias_ptr + c, value, mask=c < C)
            else:
                tl.store(ratios_ptr + (gradient - 2) * C + c, value, mask=c < C)


def parameter_gradients(partial):
    """The gradients of the ratios, weight and bias (C, each its own tensor) from the per-program
    sums (programs, 4, C) of :data:`TIED_SUMS`: one launch, a program per row and block of
    channels. The ratios' is (2, C), those of lambda_mean and lambda_var with 1 - lambda tied to
    lambda (as :func:`.triton_parameters.run_parameters_backward` takes it)."""
    programs, rows, C = partial.shape
    ratios, weight, bias = (partial.new_empty(shape) for shape in ((2, C), (C, ), (C, )))
    spec = _parameter_gradients_spec()
    launch('triton.parameter_gradients', spec, (cdiv(C, spec[1]['BLOCK_C']), rows), [partial],
           [ratios, weight, bias], partial, ratios, weight, bias, programs, C)
    return ratios, weight, bias


def _parameter_gradients_spec():
    return _parameter_gradients_kernel, dict(SUMS=TIED_SUMS, BLOCK_P=256, BLOCK_C=32), 4


@functools.lru_cache(maxsize=None)
def _token_gradients_spec(C, pool):
    """Tiles of the backward passes' cells (BACKWARD_SHARE), CELLS_PER_PROGRAM cells
    (TOKENS_PER_PROGRAM tokens without pooling) per program."""
    cells = min(_cells(C, pool, BACKWARD_SHARE), CELLS_PER_PROGRAM)
    tiles = (CELLS_PER_PROGRAM if pool > 1 else TOKENS_PER_PROGRAM) // cells
    constexprs, warps = _tiling(C, pool, BACKWARD_SHARE, TILES=max(1, tiles))
    return _token_gradients_kernel, constexprs, warps


# ---------------------------------------------------------------------------- backward pass 2
@triton.jit(do_not_specialize=_SIZES)
def _input_gradient_kernel(x_ptr, g_ptr, m_first_ptr, m_second_ptr, centre_ptr, ratios_ptr,
                           weight_ptr, t_first_ptr, t_second_ptr, dx_ptr, H, W, C, d, m_sb,
                           m_srow, m_scol, m_shead, t_sb, t_srow, t_scol, t_shead, eps, n_var,
                           SECOND: tl.constexpr, POOL: tl.constexpr,
                           CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """dx of the tokens of CELLS cells of cell row ci of image b: D1 + beta (x - mu_ln) - tok1 / C
    (the gradient through Eq. 2, see :func:`..function.ln_gradient`) + (dL/dT_0 + 2 (x - centre)
    dL/dT_1) / n, n the cell's tokens; without ``SECOND`` no dL/dT_1."""
    b, ci, start, Wp = _program_tile(H, W, POOL, CELLS)
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, m_sb, m_srow, m_scol, m_shead, CELLS,
                                    C_BLOCK)
    first_cells, var_it_cells, first, var_it = _inter_token(
        m_first_ptr, m_second_ptr, offsets, cell_mask, CELLS, S_BLOCK, C_BLOCK)
    centre = _channel_row(centre_ptr + b * C, C, C_BLOCK)
    mean_it = first + centre
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr, C, C, C_BLOCK)
    weight = _channel_row(weight_ptr, C, C_BLOCK)
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, t_sb, t_srow, t_scol, t_shead, CELLS,
                                    C_BLOCK)
    n = _cell_counts(ci, start, H, W, POOL, CELLS)[:, None]
    dt_first = _per_token(tl.load(t_first_ptr + offsets, mask=cell_mask, other=0.0) / n, CELLS,
                          S_BLOCK, C_BLOCK)
    if SECOND:
        dt_second = _per_token(tl.load(t_second_ptr + offsets, mask=cell_mask, other=0.0) / n,
                               CELLS, S_BLOCK, C_BLOCK)
    cols = tl.arange(0, C_BLOCK)
    x_image, g_image = _image(x_ptr, b, H * W * C), _image(g_ptr, b, H * W * C)
    dx_image = _image(dx_ptr, b, H * W * C)
    j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
    for r in tl.static_range(POOL):
        tokens = (ci * POOL + r) * W + j
        valid = real & (ci * POOL + r < H)
        x, mask = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
        g, _ = _load_tokens(g_image, tokens, valid, C, C_BLOCK)
        mean_ln, var_ln, rstd, xhat = _normalised(x, mask, C, n_var, mean_it, var_it, lam_m,
                                                  kap_m, lam_v, kap_v, eps)
        d1 = g * weight * rstd
        tok1 = tl.sum(d1 * lam_m, axis=1)
        tok2 = tl.sum(d1 * xhat * rstd * lam_v, axis=1)
        dx = d1 + (-tok2 / n_var)[:, None] * (x - mean_ln[:, None]) - (tok1 / C)[:, None]
        dx += dt_first
        if SECOND:
            dx += 2.0 * (x - centre) * dt_second
        tl.store(dx_image + tokens[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)


def input_gradient(g, x, centre, m_first, m_second, ratios, weight, eps, n_var, t_first,
                   t_second, grid):
    """dx (x's shape and dtype) from g, x, the centre, the products m (as in :func:`output`) and
    dL/dT, each moment a (B, Hp, Wp, heads, d) view (t_second may be None)."""
    B, _, C = x.shape
    dx = torch.empty_like(x)
    spec = _input_gradient_spec(C, grid.pool, t_second is not None)
    programs = (B * grid.Hp, cdiv(grid.Wp, spec[1]['CELLS']))
    launch('triton.input_gradient', spec, programs,
           [g, x, m_first, m_second, centre, ratios, weight, t_first, t_second], [dx], x, g,
           m_first, m_second, centre.contiguous(), ratios, weight, t_first,
           t_first if t_second is None else t_second, dx, grid.H, grid.W, C, grid.d,
           *_layout(m_first), *_layout(t_first), float(eps), float(n_var))
    return dx


@functools.lru_cache(maxsize=None)
def _input_gradient_spec(C, pool, second):
    """Two warps for tiles of 32 channels: with four, sm_80 spills 16 bytes for 16-bit tokens."""
    constexprs, warps = _tiling(C, pool, BACKWARD_SHARE, SECOND=second)
    return _input_gradient_kernel, constexprs, 2 if constexprs['C_BLOCK'] <= 32 else warps


def specializations(C, pool, heads, square_of_pooled=False, fused=None, arch=None, keep=None):
    """The compiled kernels one DTN layer of C channels in ``heads`` heads and pooling ``pool``
    launches, forward and backward, as (kernel, constexprs, num_warps): what a GPU of compute
    capability ``arch`` compiles for it (the tokens' dtype aside), at any image size: the fused
    passes both with their heads split among programs (small grids) and not. With ``fused``
    (default: the settings, :data:`.triton_fused.ENABLED` and :data:`.triton_cells.ENABLED`) the
    products are formed on chip where the heads allow: without pooling in the fused passes
    (:mod:`.triton_fused`, whose tiles depend on ``arch``; with ``keep``, default
    :data:`.triton_fused.KEEP_PRODUCTS`, keeping their products between the passes), with pooling on
    the cell grid (:mod:`.triton_cells`); otherwise the band products
    (:func:`.triton_band.specializations`) run between these passes."""
    from . import triton_cells, triton_fused  # which import this module's pieces of Eqs. 4-5
    d = C // heads
    if fused is None:
        fused, cells = triton_fused.fuses(pool, d), triton_cells.forms_products(pool, d)
    else:
        fused, cells = (fused and triton_fused.can_fuse(pool, d),
                        fused and triton_cells.can_form_products(pool, d))
    if fused:
        keep = triton_fused.KEEP_PRODUCTS if keep is None else keep
        return [*triton_fused.specializations(d, arch, keep), _parameter_gradients_spec(),
                *triton_fused.specializations(d, arch, keep, split=True)[:2]]  # output, tokens'
    passes = [_output_spec(C, pool), _token_gradients_spec(C, pool), _parameter_gradients_spec(),
              _input_gradient_spec(C, pool, pool == 1 or not square_of_pooled)]
    if pool > 1:  # T of the tokens: no moments pass without pooling
        passes.insert(0, _moments_spec(C, pool, square_of_pooled))
    if cells:
        passes += triton_cells.specializations(d)
    return passes
