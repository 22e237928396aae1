"""Triton kernels of DynamicTokenNorm's passes over the tokens (Shao et al., ICLR 2022, Eqs. 2, 4,
5), each followed by the function that launches it.

Tokens x are (B, N, C) in float16, bfloat16 or float32, read as they are; everything is computed
and accumulated in float32, and the outputs have x's dtype. A program holds whole tokens (all C
channels, ``C_BLOCK`` = the next power of two), so Eq. 2 never leaves its registers and is never
stored: every pass that reads a token forms its mean and variance again. H, W and the layout of
the cell planes are runtime arguments: a new resolution launches the same compiled kernels.

Every pass takes a tile of cells of one cell row (without pooling a cell is a token) and walks the
``POOL`` token rows of its cells:

    moments          T = (mean of x - centre, mean of (x - centre)^2) per cell: x read once
    output           y from x and the products m = P^h T (Eqs. 4-5): x read, y written
    token gradients  backward pass 1, from g and x: dL/dm of every cell (sums of D1 and D2 over
                     its tokens) and the sums for the parameters per program (added up
                     afterwards in a fixed order: no float atomics)
    input gradient   backward pass 2: dx from g, x, m and dL/dT

The cell values (T, m and their gradients) are float32 planes laid out for the positional
products (:mod:`.products`): the strides of a plane come as (image, cell row, cell column, head,
channel, moment). The centre about which T is taken is the mean of a sample of the tokens
(:func:`centre_stride`; rows of P sum to 1, so the statistics do not depend on it; one near the
tokens' values keeps the second moment about it free of cancellation). The passes form the
inter-token variance from m's raw second moment, var_it = m_1 - m_0^2 (Eq. 5).
"""
import torch
import triton
import triton.language as tl

from .launch import cdiv, launch

__all__ = ['sample_centre', 'moments', 'output', 'token_gradients', 'input_gradient', 'Tiles',
           'specs', 'TOKEN_POINTERS']

#: Elements of a token tile (tokens x C_BLOCK channels) per thread of a program: a pass holds
#: several such tiles (x, dL/dy, the cell statistics, ...) in registers.
ELEMENTS_PER_THREAD = 8
#: Tokens the token-gradients pass covers per program at least: its sums for the parameters
#: (4 C float32) are written once per program and read again, an eighth of 16-bit g and x.
TOKENS_PER_PROGRAM = 32
#: The centre is the mean of one token in CENTRE_STRIDE where that takes at least CENTRE_SAMPLE
#: tokens, else of every token: a prime stride walks across the columns of every token grid whose
#: width it does not divide, rather than down a few of them. The further the centre lies from
#: the tokens' mean, the more of the gradient of a^h cancels in float32 (the softmax's gradient
#: takes away the centre's share exactly, rounding and all).
CENTRE_STRIDE, CENTRE_SAMPLE = 17, 64

#: Pointer arguments of the kernels to tensors of the tokens' dtype; all others are float32.
TOKEN_POINTERS = ('x_ptr', 'g_ptr', 'y_ptr', 'dx_ptr')
#: Runtime integers that change with the resolution: never specialized (no recompilation). The
#: channel count C and head width d are specialized (a multiple of 16 lets a program read 16
#: bytes of tokens at a time), once per layer.
_SIZES = ['H', 'W', 's_b', 's_row', 's_col', 's_head', 's_chan', 's_moment']


class Tiles:
    """The tile rule of the passes for C channels and pooling ``pool``: ``warps`` per program
    (4, or 8 past 256 channels), ``tokens`` per tile (ELEMENTS_PER_THREAD elements of it per
    thread, at most 64; the backward passes hold more tiles and take half), and the ``constexprs``
    of each pass. Plain numbers: one per layer, cached with the layer's plan."""

    def __init__(self, C, pool):
        self.c_block = triton.next_power_of_2(C)
        self.s_block = triton.next_power_of_2(pool)
        self.warps = 4 if self.c_block <= 256 else 8
        tokens = max(1, min(64, ELEMENTS_PER_THREAD * 32 * self.warps // self.c_block))
        self.cells = max(1, tokens // self.s_block)
        self.backward_cells = max(1, tokens // 2 // self.s_block)
        self.tiles = max(1, TOKENS_PER_PROGRAM // (self.backward_cells * self.s_block * pool))
        self.forward = dict(POOL=pool, CELLS=self.cells, S_BLOCK=self.s_block,
                            C_BLOCK=self.c_block)
        self.backward = dict(self.forward, CELLS=self.backward_cells)

    def programs(self, B, Hp, Wp, cells):
        """The grid of a pass over tiles of ``cells`` cells: (image and cell row, tile)."""
        return B * Hp, cdiv(Wp, cells)


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
def _cell_tile(b, ci, start, Wp, C, d, s_b, s_row, s_col, s_head, s_chan, CELLS: tl.constexpr,
               C_BLOCK: tl.constexpr):
    """Offsets (int64) [CELLS, C_BLOCK] of cells start ... start + CELLS - 1 of cell row ci of
    image b in a cell plane of the given strides, and the mask of the real ones."""
    cols = tl.arange(0, C_BLOCK)
    cjs = start + tl.arange(0, CELLS)
    channel = (cols // d).to(tl.int64) * s_head + (cols % d).to(tl.int64) * s_chan
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
def _channel_row(ptr, C, C_BLOCK: tl.constexpr):
    """C float32 values from ``ptr`` as [1, C_BLOCK], zeros past C."""
    cols = tl.arange(0, C_BLOCK)
    return tl.load(ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _program_tile(H, W, POOL: tl.constexpr, CELLS: tl.constexpr):
    """The image b, cell row ci and first cell of a program (row b Hp + ci, block of CELLS
    cells), and the cells per row Wp."""
    row, block = tl.program_id(0), tl.program_id(1)
    Hp, Wp = (H + POOL - 1) // POOL, (W + POOL - 1) // POOL
    return row // Hp, row % Hp, block * CELLS, Wp


@triton.jit
def _ratio_rows(ratios_ptr, C, C_BLOCK: tl.constexpr):
    """lambda_mean, 1 - lambda_mean, lambda_var, 1 - lambda_var of the channels, from the ratios
    (4, C), each [1, C_BLOCK]."""
    return (_channel_row(ratios_ptr, C, C_BLOCK), _channel_row(ratios_ptr + C, C, C_BLOCK),
            _channel_row(ratios_ptr + 2 * C, C, C_BLOCK),
            _channel_row(ratios_ptr + 3 * C, C, C_BLOCK))


@triton.jit
def _inter_token(m_ptr, offsets, cell_mask, s_moment, CELLS: tl.constexpr, S_BLOCK: tl.constexpr,
                 C_BLOCK: tl.constexpr):
    """The products m of a tile's cells: the first moment about the centre and the inter-token
    variance var_it = m_1 - m_0^2 (Eq. 5, clamped at 0; m_1 = P T_1 is the raw second moment),
    per cell [CELLS, C_BLOCK], and the first moment and var_it per token."""
    first = tl.load(m_ptr + offsets, mask=cell_mask, other=0.0)
    second = tl.load(m_ptr + s_moment + offsets, mask=cell_mask, other=0.0)
    var_it = tl.maximum(second - first * first, 0.0)
    return (first, second - first * first, _per_token(first, CELLS, S_BLOCK, C_BLOCK),
            _per_token(var_it, CELLS, S_BLOCK, C_BLOCK))


@triton.jit
def _normalized(x, mask, C, n_var, mean_it, var_it, lam_m, kap_m, lam_v, kap_v, eps):
    """Eq. 2 per token (the mean as a sum / C, the variance about it / n_var), then Eq. 5 inside
    Eq. 4 without the affine: mean_ln, var_ln (TILE,), rstd and xhat [TILE, C_BLOCK]."""
    mean_ln = tl.sum(x, axis=1) / C
    diff = tl.where(mask, x - mean_ln[:, None], 0.0)
    var_ln = tl.sum(diff * diff, axis=1) / n_var
    rstd = tl.rsqrt(lam_v * var_ln[:, None] + kap_v * var_it + eps)  # Eq. 5 in Eq. 4
    xhat = (x - lam_m * mean_ln[:, None] - kap_m * mean_it) * rstd
    return mean_ln, var_ln, rstd, xhat


# ---------------------------------------------------------------------------- moments
@triton.jit(do_not_specialize=_SIZES)
def _moments_kernel(x_ptr, centre_ptr, t_ptr, H, W, C, d, s_b, s_row, s_col, s_head, s_chan,
                    s_moment, SQUARE: tl.constexpr, POOL: tl.constexpr, CELLS: tl.constexpr,
                    S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """T of CELLS cells of cell row ci of image b: the mean of x - centre over each cell's real
    tokens and the mean of its square, or with ``SQUARE`` (the reference code's convention with
    pooling) the square of the first."""
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
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, s_b, s_row, s_col, s_head, s_chan,
                                    CELLS, C_BLOCK)
    tl.store(t_ptr + offsets, first, mask=cell_mask)
    tl.store(t_ptr + s_moment + offsets, second, mask=cell_mask)


def centre_stride(N):
    """The stride of the tokens whose mean is the centre, on a grid of N tokens."""
    return CENTRE_STRIDE if N >= CENTRE_STRIDE * CENTRE_SAMPLE else 1


def sample_centre(x, stride):
    """The centre of the moments, (B, C) float32: the mean of every ``stride``-th token."""
    return x[:, ::stride].mean(1, dtype=torch.float32)


def moments(x, centre, T, plan):
    """Writes T, the cell moments about the centre (B, C), into the plane ``T`` (float32)."""
    launch('triton.moments', plan.moments, plan.forward_programs, [x, centre], [T], x, centre, T,
           plan.H, plan.W, plan.C, plan.d, *plan.strides)


# ---------------------------------------------------------------------------- output
@triton.jit(do_not_specialize=_SIZES)
def _output_kernel(x_ptr, m_ptr, centre_ptr, ratios_ptr, weight_ptr, bias_ptr, y_ptr, H, W, C, d,
                   s_b, s_row, s_col, s_head, s_chan, s_moment, eps, n_var, POOL: tl.constexpr,
                   CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """y of the tokens of CELLS cells of cell row ci of image b (Eqs. 2, 4, 5)."""
    b, ci, start, Wp = _program_tile(H, W, POOL, CELLS)
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, s_b, s_row, s_col, s_head, s_chan,
                                    CELLS, C_BLOCK)
    _, _, first, var_it = _inter_token(m_ptr, offsets, cell_mask, s_moment, CELLS, S_BLOCK,
                                       C_BLOCK)
    mean_it = first + _channel_row(centre_ptr + b * C, C, C_BLOCK)
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr, C, C_BLOCK)
    weight, bias = _channel_row(weight_ptr, C, C_BLOCK), _channel_row(bias_ptr, C, C_BLOCK)
    cols = tl.arange(0, C_BLOCK)
    x_image, y_image = _image(x_ptr, b, H * W * C), _image(y_ptr, b, H * W * C)
    j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
    for r in tl.static_range(POOL):
        tokens = (ci * POOL + r) * W + j
        x, mask = _load_tokens(x_image, tokens, real & (ci * POOL + r < H), C, C_BLOCK)
        _, _, _, xhat = _normalized(x, mask, C, n_var, mean_it, var_it, lam_m, kap_m, lam_v,
                                    kap_v, eps)
        y = xhat * weight + bias  # Eq. 4
        tl.store(y_image + tokens[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mask)


def output(x, m, centre, ratios, weight, bias, plan):
    """y (x's shape and dtype) from x, the products m (a plane), the centre and the parameters."""
    y = torch.empty_like(x)
    launch('triton.output', plan.output, plan.forward_programs,
           [x, m, centre, ratios, weight, bias], [y], x, m, centre, ratios, weight, bias, y,
           plan.H, plan.W, plan.C, plan.d, *plan.strides, plan.eps, plan.n_var)
    return y


# ---------------------------------------------------------------------------- backward pass 1
@triton.jit(do_not_specialize=_SIZES)
def _token_gradients_kernel(x_ptr, g_ptr, m_ptr, centre_ptr, ratios_ptr, weight_ptr, dm_ptr,
                            partial_ptr, H, W, C, d, s_b, s_row, s_col, s_head, s_chan, s_moment,
                            eps, n_var, POOL: tl.constexpr, CELLS: tl.constexpr,
                            TILES: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """For TILES tiles of CELLS cells of cell row ci of image b: with D1 = g w rstd (= -dL/dmu)
    and D2 = D1 xhat rstd (= -2 dL/dvar), dL/dm of every cell with respect to the raw moments and
    the program's shares (4, C) of the gradients of the weight (sum xhat g), the bias (sum g),
    and lambda_mean and lambda_var with 1 - lambda tied to lambda (Eq. 5's mixtures, whose two
    ratios a gate sets together: -sum (mu_ln - mu_it) D1 and -sum (var_ln - var_it) D2 / 2)."""
    b, ci, first_cell, Wp = _program_tile(H, W, POOL, CELLS * TILES)
    cols = tl.arange(0, C_BLOCK)
    centre = _channel_row(centre_ptr + b * C, C, C_BLOCK)
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr, C, C_BLOCK)
    weight = _channel_row(weight_ptr, C, C_BLOCK)
    x_image, g_image = _image(x_ptr, b, H * W * C), _image(g_ptr, b, H * W * C)
    xhat_g = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    g_sum = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    mean_d1 = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    var_d2 = tl.zeros([CELLS * S_BLOCK, C_BLOCK], tl.float32)
    for tile in range(TILES):
        start = first_cell + tile * CELLS
        offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, s_b, s_row, s_col, s_head,
                                        s_chan, CELLS, C_BLOCK)
        first, var_raw, first_t, var_it_t = _inter_token(m_ptr, offsets, cell_mask, s_moment,
                                                         CELLS, S_BLOCK, C_BLOCK)
        mean_it = first_t + centre
        j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
        d1_cells = tl.zeros([CELLS, C_BLOCK], tl.float32)
        d2_cells = tl.zeros([CELLS, C_BLOCK], tl.float32)
        for r in tl.static_range(POOL):
            tokens = (ci * POOL + r) * W + j
            valid = real & (ci * POOL + r < H)
            x, mask = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
            g, _ = _load_tokens(g_image, tokens, valid, C, C_BLOCK)
            mean_ln, var_ln, rstd, xhat = _normalized(x, mask, C, n_var, mean_it, var_it_t,
                                                      lam_m, kap_m, lam_v, kap_v, eps)
            d1 = g * weight * rstd
            d2 = d1 * xhat * rstd
            d1_cells += _cell_sums(d1, CELLS, S_BLOCK, C_BLOCK)
            d2_cells += _cell_sums(d2, CELLS, S_BLOCK, C_BLOCK)
            xhat_g += xhat * g
            g_sum += g
            mean_d1 += (mean_ln[:, None] - mean_it) * d1
            var_d2 += (var_ln[:, None] - var_it_t) * d2
        # dL/dm_1 = dL/dvar_it [var_it > 0], dL/dm_0 = dL/dmu_it - 2 m_0 dL/dm_1 (Eq. 5)
        dm_second = tl.where(var_raw > 0, -0.5 * kap_v * d2_cells, 0.0)
        dm_first = -kap_m * d1_cells - 2.0 * first * dm_second
        tl.store(dm_ptr + offsets, dm_first, mask=cell_mask)
        tl.store(dm_ptr + s_moment + offsets, dm_second, mask=cell_mask)
    program = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    partial = partial_ptr + program.to(tl.int64) * 4 * C + cols
    tl.store(partial, tl.sum(xhat_g, axis=0), mask=cols < C)
    tl.store(partial + C, tl.sum(g_sum, axis=0), mask=cols < C)
    tl.store(partial + 2 * C, -tl.sum(mean_d1, axis=0), mask=cols < C)
    tl.store(partial + 3 * C, -0.5 * tl.sum(var_d2, axis=0), mask=cols < C)


def token_gradients(g, x, m, centre, ratios, weight, dm, plan):
    """Writes dL/dm (a plane, float32) into ``dm`` and returns the gradients (4, C) float32 of
    the weight, the bias and the ratios with 1 - lambda tied to lambda (mean, variance), from g,
    x, the products m and the centre; the programs' shares are added up by one reduction in a
    fixed order (deterministic)."""
    partial = torch.empty(plan.gradient_programs[0] * plan.gradient_programs[1], 4, plan.C,
                          dtype=torch.float32, device=x.device)
    launch('triton.token_gradients', plan.token_gradients, plan.gradient_programs,
           [g, x, m, centre, ratios, weight], [dm, partial], x, g, m, centre, ratios, weight, dm,
           partial, plan.H, plan.W, plan.C, plan.d, *plan.strides, plan.eps, plan.n_var)
    return partial.sum(0)


# ---------------------------------------------------------------------------- backward pass 2
@triton.jit(do_not_specialize=_SIZES)
def _input_gradient_kernel(x_ptr, g_ptr, m_ptr, centre_ptr, ratios_ptr, weight_ptr, dt_ptr,
                           t_ptr, dx_ptr, H, W, C, d, s_b, s_row, s_col, s_head, s_chan, s_moment,
                           eps, n_var, SQUARE: tl.constexpr, POOL: tl.constexpr,
                           CELLS: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr):
    """dx of the tokens of CELLS cells of cell row ci of image b: D1 + beta (x - mu_ln) - tok1 / C
    (the gradient through Eq. 2, see :func:`...function.ln_gradient`) + (dL/dT_0 + 2 (x - centre)
    dL/dT_1) / n, n the cell's tokens; with ``SQUARE`` (T_1 = T_0^2) dL/dT_0 + 2 T_0 dL/dT_1 / n
    instead."""
    b, ci, start, Wp = _program_tile(H, W, POOL, CELLS)
    offsets, cell_mask = _cell_tile(b, ci, start, Wp, C, d, s_b, s_row, s_col, s_head, s_chan,
                                    CELLS, C_BLOCK)
    _, _, first, var_it = _inter_token(m_ptr, offsets, cell_mask, s_moment, CELLS, S_BLOCK,
                                       C_BLOCK)
    centre = _channel_row(centre_ptr + b * C, C, C_BLOCK)
    mean_it = first + centre
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr, C, C_BLOCK)
    weight = _channel_row(weight_ptr, C, C_BLOCK)
    n = _cell_counts(ci, start, H, W, POOL, CELLS)[:, None]
    dt_first = tl.load(dt_ptr + offsets, mask=cell_mask, other=0.0)
    dt_second = tl.load(dt_ptr + s_moment + offsets, mask=cell_mask, other=0.0)
    if SQUARE:
        dt_first += 2.0 * tl.load(t_ptr + offsets, mask=cell_mask, other=0.0) * dt_second
    dt_first = _per_token(dt_first / n, CELLS, S_BLOCK, C_BLOCK)
    if not SQUARE:
        dt_second = _per_token(dt_second / n, CELLS, S_BLOCK, C_BLOCK)
    cols = tl.arange(0, C_BLOCK)
    x_image, g_image = _image(x_ptr, b, H * W * C), _image(g_ptr, b, H * W * C)
    dx_image = _image(dx_ptr, b, H * W * C)
    j, real = _cell_columns(start, POOL, W, Wp, CELLS, S_BLOCK)
    for r in tl.static_range(POOL):
        tokens = (ci * POOL + r) * W + j
        valid = real & (ci * POOL + r < H)
        x, mask = _load_tokens(x_image, tokens, valid, C, C_BLOCK)
        g, _ = _load_tokens(g_image, tokens, valid, C, C_BLOCK)
        mean_ln, var_ln, rstd, xhat = _normalized(x, mask, C, n_var, mean_it, var_it, lam_m,
                                                  kap_m, lam_v, kap_v, eps)
        d1 = g * weight * rstd
        tok1 = tl.sum(d1 * lam_m, axis=1)
        tok2 = tl.sum(d1 * xhat * rstd * lam_v, axis=1)
        dx = d1 + (-tok2 / n_var)[:, None] * (x - mean_ln[:, None]) - (tok1 / C)[:, None]
        dx += dt_first
        if not SQUARE:
            dx += 2.0 * (x - centre) * dt_second
        tl.store(dx_image + tokens[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=mask)


def input_gradient(g, x, m, centre, ratios, weight, dT, T, plan):
    """dx (x's shape and dtype) from g, x, the products m, the centre and dL/dT (planes); T is
    read only in the reference code's convention with pooling (T_1 = T_0^2)."""
    dx = torch.empty_like(x)
    launch('triton.input_gradient', plan.input_gradient, plan.backward_programs,
           [g, x, m, centre, ratios, weight, dT], [dx], x, g, m, centre, ratios, weight, dT, T,
           dx, plan.H, plan.W, plan.C, plan.d, *plan.strides, plan.eps, plan.n_var)
    return dx


# ---------------------------------------------------------------------------- specializations
def specs(C, pool, square_of_pooled):
    """The (kernel, constexprs, num_warps) of the four passes of a layer of C channels and
    pooling ``pool``: moments, output, token gradients, input gradient. The same at any image
    size and in any tokens' dtype (Triton compiles each dtype apart)."""
    tiles = Tiles(C, pool)
    square = bool(square_of_pooled and pool > 1)
    return ((_moments_kernel, dict(tiles.forward, SQUARE=square), tiles.warps),
            (_output_kernel, tiles.forward, tiles.warps),
            (_token_gradients_kernel, dict(tiles.backward, TILES=tiles.tiles), tiles.warps),
            (_input_gradient_kernel, dict(tiles.backward, SQUARE=square), tiles.warps))
