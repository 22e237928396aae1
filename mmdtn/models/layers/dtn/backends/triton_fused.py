"""DynamicTokenNorm without pooling in three Triton kernels, the positional products of Eq. 5 formed
on chip: the forward pass (Eq. 2, the products and Eq. 4; x read once, y written once) and the
backward pass in two, with nothing of the products stored but dL/dm (Shao et al., ICLR 2022).

Without pooling the staged passes (:mod:`..function`) write and read u = P_x T and m = P_y u
forward and u, m, dL/du and dL/dT again backward, float32 tensors of two moments per channel and
token (with 16-bit tokens four times x's bytes each): 9.5x LayerNorm's bytes forward and 21.2x
backward (``benchmark_norm.py --tables traffic``). Here a program holds TOKENS tokens w of one token
row i of one image (:data:`TILES`) and forms, head by head, over the nonzero band of both factors
(:func:`.triton_band._band`, found from P on the device), BAND token columns s at a time
(:func:`_products`):

    v_s   = sum_r P_y^h[i, r] S_rs                     (P_y's row i; per token column s)
    m_w   = sum_s P_x^h[w, s] v_s                      (P_x's rows of the tokens; tl.dot)

with S = T = (x - centre, (x - centre)^2) of the tokens; P^h = P_y^h (x) P_x^h, so m is the staged
m = P_y u in another order, equal to float32 rounding. The three kernels:

    output           y = gamma (x - mu) / sqrt(sigma2 + eps) + beta (Eqs. 4-5, var_it = m_1 - m_0^2)
    token gradients  with D1 = g gamma rstd and D2 = D1 xhat rstd: dL/dm (stored) and the
                     per-token gradient of Eq. 2; g and x read, dL/dm written
    input gradient   dL/dT = P^T dL/dm by the same products with the factors transposed (S =
                     dL/dm); dx = D1 + x beta + alpha + dL/dT_0 + 2 (x - centre) dL/dT_1 (m formed
                     again for rstd), the sums for the weight, the bias and the ratios, and the
                     gradient of a^h (below) in the walk that forms m again; g, x and dL/dm read,
                     dx written; a program per head, of several token rows where there are many
                     programs (:data:`PROGRAMS`): the sums, float32 per program and channel, are
                     written once for all of them

The output and the token gradients form Eq. 2 over all channels and the products head by head;
where a program per token tile would make fewer than :data:`PROGRAMS` programs (PVT-Tiny's and
Swin-T's stage 4 at 800 x 1344, batch 2: 150), the heads are split among several programs of the
same tokens (:func:`heads_per_program`), each forming Eq. 2 again from the cache; the token
gradients' per-token gradient of Eq. 2 is then a share per group of heads, added up (one PyTorch
sum) before the input gradient reads it.

With :data:`KEEP_PRODUCTS` the output also writes m_0 and var_it (float32), and the backward kernels
read them instead of forming them again: more bytes, one walk fewer (off by default).

dL/dm passes between the backward kernels in float32 for float32 tokens and in float16 for 16-bit
tokens (:func:`gradient_dtype`). There each token's values of a head and moment are divided by the
power of two above their largest (:func:`_store_scaled`; its exponent is stored, a byte), so that
float16's range never binds (dL/dvar exceeds it where variances are small) and its 11 significant
bits hold every value within 2^14 of its token's largest. That halves the bytes of the largest
operand of the backward pass.

The gradients of P_y and P_x are never formed: P = softmax(a . R) by rows (Eq. 6), so the gradient
of a is linear in them, da = sum_ij dP_ij P_ij (R_ij - Rbar_i) with Rbar_i = sum_j P_ij R_ij, and
each input-gradient program contracts its share of dP_y (row i: sum_s e_s T_rs with e = P_x^T dL/dm
of its tokens) and of dP_x (rows w: sum_i dL/dm_iw v_is) with it at once: three numbers per head and
program, added up in a fixed order afterwards (:mod:`.triton_parameters`; no float atomics). It does
so in the walk over x's band that forms m again for rstd, from the same sums v, and from dL/dm of
its tokens as the token gradients stored it: so the backward pass walks the band three times per
head and token, not four (the token gradients once, the input gradient twice).

The rows of the band are read again by the programs of neighbouring token rows: from the GPU's
cache (``kernel_loads.py`` counts those reads). Heads wider than MAX_HEAD_CHANNELS channels run the
staged passes (:func:`fuses`).

H and W are runtime arguments (no recompilation per resolution). The input gradient is specialised
on the channel count C and the head width d (multiples of 16 in every layer without pooling of the
models here), so that Triton reads and writes its tokens 8 or 16 bytes at a time; the output and the
token gradients are not, since with their tiles they spill so. The tiles, the walks and every
figure behind them (registers, spills, times on an H200) are in docs/gpu.md.
"""
import functools
import os

import torch
import triton
import triton.language as tl

from .triton_band import SPAN_BLOCK, _band, _weights
from .triton_kernels import SUM_ROWS, _channel_row, _ratio_rows, _standardised
from .triton_launch import LaunchOptions, cdiv, launch

__all__ = ['can_fuse', 'fuses', 'keeps_products', 'fused_output', 'fused_backward',
           'specializations', 'architecture', 'tiles', 'tiles_table', 'gradient_dtype',
           'MAX_HEAD_CHANNELS', 'KEEP_PRODUCTS', 'GRADIENT_POINTERS', 'EXPONENT_POINTERS',
           'PROGRAMS', 'SPLIT_HEADS', 'rows_per_program', 'heads_per_program']

#: Token columns of the band per step: the inner dimension of the products with P_x (tl.dot's
#: least, 16).
BAND = 16

#: Pointer arguments of the fused kernels to dL/dm, of :func:`gradient_dtype`, and to the
#: exponents of its scales (uint8).
GRADIENT_POINTERS = ('scaled_dm_ptr',)
EXPONENT_POINTERS = ('exponent_ptr',)


#: Whether the positional products are formed on chip, both factors at once: without pooling in
#: the fused passes here, with pooling on the cell grid (:mod:`.triton_cells`); by default.
#: ``MMDTN_TRITON_FUSED=0`` runs the staged passes, the products one factor at a time (read at
#: import): less GPU time where the GPU is kept busy, more host time and three times the memory
#: (docs/gpu.md, "How a layer runs").
ENABLED = os.environ.get('MMDTN_TRITON_FUSED', '1') != '0'
#: Whether the fused forward pass keeps its products for the backward pass: m_0 and var_it, two
#: float32 values per channel and token, which the backward kernels then read instead of forming
#: them again (``MMDTN_TRITON_KEEP_PRODUCTS=1``, read at import; off by default). The token
#: gradients then walk no band, and the input gradient's first walk forms the shares of the
#: gradient of a^h alone: two walks per head and token backward instead of three, for more bytes
#: and four times the tokens' bytes more kept between the passes (docs/gpu.md, "How a layer
#: runs"). Not yet timed on a GPU.
KEEP_PRODUCTS = os.environ.get('MMDTN_TRITON_KEEP_PRODUCTS', '0') == '1'
#: The widest heads the fused passes take: for heads of 128 channels the token gradients spilled
#: with every tile tried. Wider heads run the staged passes.
MAX_HEAD_CHANNELS = 64
#: (tokens of a token row per program, warps[, registers a thread]) by kernel and head width
#: (channels, padded to 32 or 64): the tiles that took the least time on an H200 among those
#: that spill on neither sm_80 nor sm_90 (``compile_kernels.py``), or where not yet timed the
#: compiler's choice among those; a third number caps the registers ptxas gives a thread
#: (:class:`.triton_launch.LaunchOptions`; none has one yet). The tokens are the rows of P_x in
#: one tl.dot (at least 16). On another GPU, run ``tools/analysis/tune_fused_tiles.py`` and put
#: its tables here and in :data:`WALKS`. Why each is what it is: docs/gpu.md.
TILES = {
    'output': {32: (16, 8), 64: (16, 8)},
    'token_gradients': {32: (16, 4), 64: (16, 4)},
    'kept_token_gradients': {32: (8, 4), 64: (8, 4)},
    'input_gradient': {32: (16, 8), 64: (16, 8)},
}

#: Tiles of :data:`TILES` replaced on one architecture, by compute capability (10 major + minor),
#: where its compiler spills registers with them or another GPU times them faster
#: (``tools/analysis/tune_fused_tiles.py`` writes its candidates here for the GPU at hand). None at
#: present.
ARCH_TILES = {}

#: The walk over P_y^h's band (its rows r in :func:`_products`), by kernel and head width as
#: :data:`TILES`: (rows unrolled per step, loads in flight), Triton's ``loop_unroll_factor`` and
#: ``num_stages`` of the loop. A step reads a tile of BAND token columns of one band row and adds
#: it in with P_y's weight; (1, 1) walks the rows one after the other. Two rows a step took the
#: backward kernels' time down on an H200 and the output's up, loads in flight every kernel's; four
#: rows a step, and two in the token gradients for heads of 32 channels, spill on sm_90
#: (docs/gpu.md). The token gradients that read the kept products walk nothing.
WALKS = {
    'output': {32: (1, 1), 64: (1, 1)},
    'token_gradients': {32: (1, 1), 64: (2, 1)},
    'kept_token_gradients': {32: (1, 1), 64: (1, 1)},
    'input_gradient': {32: (2, 1), 64: (2, 1)},
}

#: The programs a launch of the fused kernels keeps at least where it can: about 4 per SM of an
#: H100's or H200's 132. The input gradient: where a program per token row and head makes more,
#: each program takes several rows (:func:`rows_per_program`) and writes the parameter sums (4
#: float32 values per channel) once for all of them (on an H200, 256 to 2048 took about the same
#: time at PVT-Tiny's stage 3, 132 more: docs/gpu.md). The output and the token gradients: where a
#: program per tile of tokens makes fewer (PVT-Tiny's and Swin-T's stage 4 at 800 x 1344, batch 2:
#: 150 programs, each walking 8 or 24 heads), the heads are split among programs
#: (:func:`heads_per_program`): 4 groups, 600 programs. Not yet timed on a GPU.
PROGRAMS = 512
#: Whether the output and the token gradients split the heads among programs where there are
#: fewer than :data:`PROGRAMS` (:func:`heads_per_program`); ``MMDTN_TRITON_SPLIT_HEADS=0`` keeps
#: every head in one program, as before the split, to compare on a GPU (read at import).
SPLIT_HEADS = os.environ.get('MMDTN_TRITON_SPLIT_HEADS', '1') != '0'


def can_fuse(pool, d):
    """Whether the fused passes take a layer with pooling ``pool`` and heads of d channels: no
    pooling, heads of at most MAX_HEAD_CHANNELS channels."""
    return pool == 1 and d <= MAX_HEAD_CHANNELS


def fuses(pool, d):
    """Whether such a layer runs fused here: where it can, with :data:`ENABLED`."""
    return ENABLED and can_fuse(pool, d)


def keeps_products(pool, d):
    """Whether such a layer's fused forward pass keeps its products for the backward pass:
    where it runs fused (:func:`fuses`), with :data:`KEEP_PRODUCTS`."""
    return KEEP_PRODUCTS and fuses(pool, d)


# ---------------------------------------------------------------------------- shared pieces
@triton.jit
def _head_offsets(i, w, head, W, C, d, D_BLOCK: tl.constexpr):
    """The mask and the offsets within an image of tokens w (TOKENS,) of token row i, the d
    channels of ``head``: [TOKENS, D_BLOCK] each."""
    c = tl.arange(0, D_BLOCK)
    return (w < W)[:, None] & (c < d)[None, :], (i * W + w)[:, None] * C + (head * d + c)[None, :]


@triton.jit
def _head_tokens(image, i, w, head, W, C, d, D_BLOCK: tl.constexpr):
    """Tokens w (TOKENS,) of token row i, the d channels of ``head``, from ``image`` (a tensor of
    tokens): float32 [TOKENS, D_BLOCK] (zeros outside), the mask and the offsets within the
    image."""
    mask, offsets = _head_offsets(i, w, head, W, C, d, D_BLOCK)
    return tl.load(image + offsets, mask=mask, other=0.0).to(tl.float32), mask, offsets


@triton.jit
def _ln_statistics(x_image, i, w, W, C, d, heads, n_var, D_BLOCK: tl.constexpr):
    """Eq. 2 of tokens w of token row i over all C channels, a head's channels at a time: the mean
    as a sum / C, then the variance about it / n_var (the second reading of the tokens comes from
    the cache); each [TOKENS, 1]."""
    total = tl.zeros([w.shape[0]], tl.float32)
    for head in range(heads):
        x, _, _ = _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK)
        total += tl.sum(x, axis=1)
    mean_ln = total / C
    squares = tl.zeros_like(total)
    for head in range(heads):
        x, mask, _ = _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK)
        diff = tl.where(mask, x - mean_ln[:, None], 0.0)
        squares += tl.sum(diff * diff, axis=1)
    return mean_ln[:, None], (squares / n_var)[:, None]


@triton.jit
def _exponent_above(largest):
    """The biased exponent (of float32, 1 ... 253) of the least power of two above each of
    ``largest`` (>= 0, float32), from its exponent bits: 2^-126 ... 2^126 (inf and nan give 2^126
    and stay what they are when scaled)."""
    exponent = (largest.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return tl.minimum(tl.maximum(exponent + 1, 1), 253)


@triton.jit
def _power_of_two(biased):
    """2^(biased - 127) for biased exponents 1 ... 254, exact, from the exponent bits."""
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def _store_scaled(dm_image, exponents, tokens, valid, offsets, mask, dm):
    """One moment of dL/dm [TOKENS, D_BLOCK] of ``tokens`` (one head's channels) stored in
    dm_image's dtype: float32 as it is; float16 as dm / s, with s per token the power of two above
    its largest |dL/dm| (its biased exponent, one byte, at ``exponents`` + tokens), so that each
    token's largest value keeps 11 significant bits at any magnitude. Scaling by 1 / s = 2^(127 -
    biased) is exact and needs no division."""
    if dm_image.dtype.element_ty == tl.float32:
        tl.store(dm_image + offsets, dm, mask=mask)
    else:
        biased = _exponent_above(tl.max(tl.where(mask, tl.abs(dm), 0.0), axis=1))
        tl.store(dm_image + offsets,
                 (dm * _power_of_two(254 - biased)[:, None]).to(dm_image.dtype.element_ty),
                 mask=mask)
        tl.store(exponents + tokens, biased.to(tl.uint8), mask=valid)


@triton.jit
def _load_scaled(dm_image, exponents, tokens, valid, offsets, mask):
    """One moment of dL/dm at ``offsets`` of ``tokens`` as :func:`_store_scaled` stored it, in
    float32 (zeros outside ``mask``)."""
    dm = tl.load(dm_image + offsets, mask=mask, other=0.0).to(tl.float32)
    if dm_image.dtype.element_ty != tl.float32:
        biased = tl.load(exponents + tokens, mask=valid, other=127).to(tl.int32)
        dm = dm * _power_of_two(biased)[:, None]
    return dm


@triton.jit
def _source(src_image, plane, exponents, exponent_plane, tokens, valid, offsets, mask, centre,
            FROM_TOKENS: tl.constexpr):
    """The two moments of S at ``offsets`` (of ``tokens``, which are ``valid``): T = (x - centre,
    (x - centre)^2) from the tokens, or dL/dm from two planes ``plane`` apart and their exponents
    ``exponent_plane`` apart (:func:`_load_scaled`); zeros outside ``mask``."""
    if FROM_TOKENS:
        t = tl.load(src_image + offsets, mask=mask, other=0.0).to(tl.float32)
        t = tl.where(mask, t - centre, 0.0)
        return t, t * t
    else:
        return (_load_scaled(src_image, exponents, tokens, valid, offsets, mask),
                _load_scaled(src_image + plane, exponents + exponent_plane, tokens, valid,
                             offsets, mask))


@triton.jit
def _bands(p_y, p_x, i, w, H, W, TRANSPOSE: tl.constexpr, SPAN_BLOCK: tl.constexpr):
    """The nonzero band of P_y^h's row i and of P_x^h's rows w (with TRANSPOSE: of their
    columns), searched once per head and program: (lo_y, hi_y, lo_x, hi_x)."""
    lo_y, hi_y = _band(p_y, i + tl.arange(0, 1), H, TRANSPOSE, 1, SPAN_BLOCK)
    lo_x, hi_x = _band(p_x, w, W, TRANSPOSE, w.shape[0], SPAN_BLOCK)
    return lo_y, hi_y, lo_x, hi_x


@triton.jit
def _products(src_image, plane, exponents, exponent_plane, centre, p_y, p_x, bands, i, w, H, W,
              s_row, s_col, channel, real, dm_first, dm_second, FROM_TOKENS: tl.constexpr,
              TRANSPOSE: tl.constexpr, PRODUCTS: tl.constexpr, COEFFICIENTS: tl.constexpr,
              BAND: tl.constexpr, D_BLOCK: tl.constexpr, UNROLL: tl.constexpr,
              STAGES: tl.constexpr):
    """One walk over the ``bands`` (:func:`_bands`) of P_y^h's row i and P_x^h's rows w (with
    TRANSPOSE: of their columns), for the channels ``channel`` of one head (``real``: the head's
    own), of the source S (:func:`_source`; its entry of row r and column s at r s_row + s s_col +
    channel: tokens W C and C, :mod:`.triton_cells` the strides of a cell tensor). Returns (first,
    second, da1, da2, da3):

    - with PRODUCTS, (P_y^h (x) P_x^h) S at tokens w of token row i, or with TRANSPOSE the
      transposed factors' (the module docstring), the two moments, float32 [TOKENS, D_BLOCK];
    - with COEFFICIENTS (not TRANSPOSE), the share of the gradient of a^h of tokens w with dL/dm
      ``dm_first``, ``dm_second`` [TOKENS, D_BLOCK] (zeros outside) through these products and
      the softmax of Eq. 6 (module docstring), R = (d^2, d) with d = source - output on each
      axis; from the same sums v of the band's rows as the products, where both are formed.

    What is not asked for is zeros (never formed)."""
    lo_y, hi_y, lo_x, hi_x = bands
    first = tl.zeros([w.shape[0], D_BLOCK], tl.float32)
    second = tl.zeros([w.shape[0], D_BLOCK], tl.float32)
    # the gradient of a^h. P_y's row i: Rbar = sum_r P R and sum_r P dP (1, R); P_x's rows w: the
    # same, per row
    zero = tl.sum(tl.zeros([w.shape[0]], tl.float32), axis=0)
    mean_sq_y, mean_lin_y, dp_y, dp_sq_y, dp_lin_y = zero, zero, zero, zero, zero
    mean_sq_x = tl.zeros([w.shape[0]], tl.float32)
    mean_lin_x = tl.zeros([w.shape[0]], tl.float32)
    dp_x = tl.zeros([w.shape[0]], tl.float32)
    dp_sq_x = tl.zeros([w.shape[0]], tl.float32)
    dp_lin_x = tl.zeros([w.shape[0]], tl.float32)
    for start in range(lo_x, hi_x, BAND):
        cols = start + tl.arange(0, BAND)
        valid = cols < hi_x
        mask = valid[:, None] & real[None, :]
        if COEFFICIENTS:
            weights_x = _weights(p_x, w, cols, W, hi_x, TRANSPOSE)  # P_x[w, s]
            e_first = tl.dot(tl.trans(weights_x), dm_first, input_precision='ieee')  # P_x^T dm
            e_second = tl.dot(tl.trans(weights_x), dm_second, input_precision='ieee')
        v_first = tl.zeros([BAND, D_BLOCK], tl.float32)
        v_second = tl.zeros([BAND, D_BLOCK], tl.float32)
        if COEFFICIENTS:
            lin = tl.zeros([BAND, D_BLOCK], tl.float32)  # sum_r P_y[i, r] dy e S_r, per entry
            sq = tl.zeros([BAND, D_BLOCK], tl.float32)  # sum_r P_y[i, r] dy^2 e S_r
        for r in tl.range(lo_y, hi_y, num_stages=STAGES,
                          loop_unroll_factor=UNROLL):  # v = sum_r P_y[i, r] S_r
            if TRANSPOSE:
                weight_y = tl.load(p_y + r * H + i)
            else:
                weight_y = tl.load(p_y + i * H + r)
            s_first, s_second = _source(src_image, plane, exponents, exponent_plane,
                                        r * W + cols, valid,
                                        (r * s_row + cols * s_col)[:, None] + channel[None, :],
                                        mask, centre, FROM_TOKENS)
            v_first += weight_y * s_first
            v_second += weight_y * s_second
            if COEFFICIENTS:
                dy = tl.cast(r - i, tl.float32)
                weighted = (weight_y * dy) * (e_first * s_first + e_second * s_second)
                lin += weighted
                sq += weighted * dy
        if not COEFFICIENTS:  # formed after the walk: not held across it
            weights_x = _weights(p_x, w, cols, W, hi_x, TRANSPOSE)  # P_x[w, s] (or transposed)
        if PRODUCTS:  # m = P_x v
            first += tl.dot(weights_x, v_first, input_precision='ieee')
            second += tl.dot(weights_x, v_second, input_precision='ieee')
        if COEFFICIENTS:
            # P dP_y[i, r] with dP_y[i, r] = sum_s e_s S_rs (these tokens' share), summed over r
            # with (1, dy, dy^2): e . v and the sums above, reduced once per step
            dp_y += tl.sum(tl.sum(e_first * v_first + e_second * v_second, axis=1), axis=0)
            dp_lin_y += tl.sum(tl.sum(lin, axis=1), axis=0)
            dp_sq_y += tl.sum(tl.sum(sq, axis=1), axis=0)
            # P dP_x[w, s], dP_x[w, s] = sum_c dm_w v_s
            outer = (tl.dot(dm_first, tl.trans(v_first), input_precision='ieee')
                     + tl.dot(dm_second, tl.trans(v_second), input_precision='ieee'))
            dx = (cols[None, :] - w[:, None]).to(tl.float32)
            dp = weights_x * outer
            dp_x += tl.sum(dp, axis=1)
            dp_sq_x += tl.sum(dp * dx * dx, axis=1)
            dp_lin_x += tl.sum(dp * dx, axis=1)
            mean_sq_x += tl.sum(weights_x * dx * dx, axis=1)
            mean_lin_x += tl.sum(weights_x * dx, axis=1)
    if COEFFICIENTS:
        for r in range(lo_y, hi_y):
            weight_y = tl.load(p_y + i * H + r)
            dy = tl.cast(r - i, tl.float32)
            mean_sq_y += weight_y * dy * dy
            mean_lin_y += weight_y * dy
    da1 = tl.sum(dp_sq_x - mean_sq_x * dp_x, axis=0) + dp_sq_y - mean_sq_y * dp_y
    return (first, second, da1, tl.sum(dp_lin_x - mean_lin_x * dp_x, axis=0),
            dp_lin_y - mean_lin_y * dp_y)


@triton.jit
def _head(ptr, b, head, C, d, D_BLOCK: tl.constexpr):
    """The channels of ``head``, whether they are the head's own, and its centre [1, D_BLOCK]."""
    c = tl.arange(0, D_BLOCK)
    return head * d + c, c < d, _channel_row(ptr + b * C + head * d, d, D_BLOCK)


@triton.jit
def _factors(p_y_ptr, p_x_ptr, head, H, W):
    """Head ``head``'s P_y^h (H, H) and P_x^h (W, W) (factors: far below 2^31 entries)."""
    return p_y_ptr + head * H * H, p_x_ptr + head * W * W


@triton.jit
def _head_standardised(x_image, products_image, plane, centre_ptr, p_y_ptr, p_x_ptr, ratios_ptr, b,
                       i, w, head, H, W, C, d, mean_ln, var_ln, eps, dm_first, dm_second,
                       COEFFICIENTS: tl.constexpr, KEPT: tl.constexpr, BAND: tl.constexpr,
                       D_BLOCK: tl.constexpr, SPAN_BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                       STAGES: tl.constexpr):
    """Eq. 5 by the products on chip inside Eq. 4 without the affine, for the channels of
    ``head`` of tokens w of token row i of image b, given Eq. 2 ([TOKENS, 1] each). Returns the
    tokens x [TOKENS, D_BLOCK], their mask and offsets, the head's channels, which are real, its
    centre, P_y^h and P_x^h, the first moment about the centre m_0 = mu_it - centre, var_it, the
    four ratio rows, rstd and xhat; and with COEFFICIENTS the tokens' share of the gradient of a^h
    from their dL/dm ``dm_first``, ``dm_second`` (:func:`_products`; zeros without). With KEPT,
    m_0 and var_it come as the forward pass kept them, two planes ``plane`` apart at
    ``products_image`` (:data:`KEEP_PRODUCTS`), and the band is walked for the share alone."""
    channel, real, centre = _head(centre_ptr, b, head, C, d, D_BLOCK)
    p_y, p_x = _factors(p_y_ptr, p_x_ptr, head, H, W)
    if KEPT:
        mask, offsets = _head_offsets(i, w, head, W, C, d, D_BLOCK)
        first = tl.load(products_image + offsets, mask=mask, other=0.0)
        var_it = tl.load(products_image + plane + offsets, mask=mask, other=0.0)
        da1, da2, da3 = 0.0, 0.0, 0.0
        if COEFFICIENTS:
            bands = _bands(p_y, p_x, i, w, H, W, False, SPAN_BLOCK)
            _, _, da1, da2, da3 = _products(x_image, 0, x_image, 0, centre, p_y, p_x, bands, i, w,
                                            H, W, W * C, C, channel, real, dm_first, dm_second,
                                            True, False, False, True, BAND, D_BLOCK, UNROLL,
                                            STAGES)
    else:
        bands = _bands(p_y, p_x, i, w, H, W, False, SPAN_BLOCK)
        first, second, da1, da2, da3 = _products(x_image, 0, x_image, 0, centre, p_y, p_x, bands,
                                                 i, w, H, W, W * C, C, channel, real, dm_first,
                                                 dm_second, True, False, True, COEFFICIENTS, BAND,
                                                 D_BLOCK, UNROLL, STAGES)
        var_it = tl.maximum(second - first * first, 0.0)
    lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr + head * d, C, d, D_BLOCK)
    x, mask, offsets = _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK)  # after the walk
    rstd, xhat = _standardised(x, mean_ln, var_ln, first + centre, var_it, lam_m, kap_m, lam_v,
                               kap_v, eps)
    return (x, mask, offsets, channel, real, centre, p_y, p_x, first, var_it, lam_m, kap_m, lam_v,
            kap_v, rstd, xhat, da1, da2, da3)


@triton.jit
def _group_heads(heads, group_heads, SPLIT: tl.constexpr):
    """The heads a program of the output or the token gradients takes, first and end: with SPLIT
    group ``program_id(2)`` of ``group_heads`` heads (the last may have fewer), else all."""
    if SPLIT:
        first_head = tl.program_id(2) * group_heads
        return first_head, tl.minimum(heads, first_head + group_heads)
    else:
        return 0, heads


# ---------------------------------------------------------------------------- forward
# not specialised on C and d: with them its tiles spilled on sm_86 to sm_120 (docs/gpu.md)
@triton.jit(do_not_specialize=['H', 'W', 'C', 'd', 'heads', 'group_heads'])
def _fused_output_kernel(x_ptr, centre_ptr, p_y_ptr, p_x_ptr, ratios_ptr, weight_ptr, bias_ptr,
                         y_ptr, products_ptr, H, W, C, d, heads, group_heads, eps, n_var,
                         TOKENS: tl.constexpr, BAND: tl.constexpr, D_BLOCK: tl.constexpr,
                         SPAN_BLOCK: tl.constexpr, UNROLL: tl.constexpr, STAGES: tl.constexpr,
                         KEEP: tl.constexpr, SPLIT: tl.constexpr):
    """y of tokens w = block * TOKENS ... of token row i of image b (program (b H + i, block));
    with SPLIT the channels of heads ``group_heads`` group ... only (program (b H + i, block,
    group); Eq. 2 over all channels). With KEEP also m_0 and var_it, two planes (2, B, N, C)
    float32 at ``products_ptr``."""
    row, block = tl.program_id(0), tl.program_id(1)
    b, i = row // H, row % H
    w = block * TOKENS + tl.arange(0, TOKENS)
    image = b.to(tl.int64) * H * W * C
    plane = (tl.num_programs(0) // H).to(tl.int64) * H * W * C  # B N C
    x_image, y_image = x_ptr + image, y_ptr + image
    mean_ln, var_ln = _ln_statistics(x_image, i, w, W, C, d, heads, n_var, D_BLOCK)
    first_head, end = _group_heads(heads, group_heads, SPLIT)
    for head in range(first_head, end):
        (x, mask, offsets, _, _, _, _, _, first, var_it, _, _, _, _, _, xhat, _, _,
         _) = _head_standardised(x_image, products_ptr, plane, centre_ptr, p_y_ptr, p_x_ptr,
                                 ratios_ptr, b, i, w, head, H, W, C, d, mean_ln, var_ln, eps, 0.0,
                                 0.0, False, False, BAND, D_BLOCK, SPAN_BLOCK, UNROLL, STAGES)
        gamma = _channel_row(weight_ptr + head * d, d, D_BLOCK)
        beta = _channel_row(bias_ptr + head * d, d, D_BLOCK)
        tl.store(y_image + offsets, (xhat * gamma + beta).to(y_ptr.dtype.element_ty), mask=mask)
        if KEEP:
            tl.store(products_ptr + image + offsets, first, mask=mask)
            tl.store(products_ptr + plane + image + offsets, var_it, mask=mask)


def fused_output(x, centre, p_y, p_x, ratios, weight, bias, eps, n_var, grid, keep=False):
    """y (x's shape and dtype) without pooling from x (B, N, C) contiguous, the centre (B, 1, 1, C)
    float32, the factors P_y (heads, H, H), P_x (heads, W, W) and the ratios (4, C): one launch.
    Returns y and, with ``keep``, the products for the backward pass (:data:`KEEP_PRODUCTS`: m_0
    and var_it, (2, B, N, C) float32), else None."""
    y = torch.empty_like(x)
    operands = [x, centre.contiguous(), p_y.contiguous(), p_x.contiguous(), ratios.contiguous(),
                weight.contiguous(), bias.contiguous()]
    products = x.new_empty(2, *x.shape, dtype=torch.float32) if keep else None
    specs, programs, group_heads = head_programs(grid, architecture(x.device), keep, 0)
    # without keep the kernel stores nothing at products_ptr: the centre (float32) stands in
    launch('triton.fused_output', specs[0], programs, operands, [y, products] if keep else [y],
           *operands, y, products if keep else operands[1], grid.H, grid.W, grid.C, grid.d,
           grid.heads, group_heads, float(eps), float(n_var))
    return y, products


# ---------------------------------------------------------------------------- backward
# not specialised on C and d: with them its tiles spill on sm_86 and sm_90 (docs/gpu.md)
@triton.jit(do_not_specialize=['H', 'W', 'C', 'd', 'heads', 'group_heads'])
def _fused_token_gradients_kernel(x_ptr, g_ptr, centre_ptr, p_y_ptr, p_x_ptr, ratios_ptr,
                                  weight_ptr, products_ptr, scaled_dm_ptr, exponent_ptr, token_ptr,
                                  H, W, C, d, heads, group_heads, eps, n_var, TOKENS: tl.constexpr,
                                  BAND: tl.constexpr, D_BLOCK: tl.constexpr,
                                  SPAN_BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                                  STAGES: tl.constexpr, KEEP: tl.constexpr, SPLIT: tl.constexpr):
    """For tokens w of token row i of image b (program (b H + i, block)): dL/dm (two planes (2,
    B, N, C) as :func:`_store_scaled` stores them; for 16-bit tokens the exponents (2, B, heads,
    N)) and per token mean_ln, var_ln and the gradient of Eq. 2 as dx = ... + x beta + alpha
    (``token_ptr``, (B N, 4)). With SPLIT for the channels of heads ``group_heads`` group ...
    only (program (b H + i, block, group)), into plane ``group`` of (groups, B N, 4): the group's
    share of beta and alpha, and mean_ln and var_ln in group 0's plane (the others' are zeros as
    allocated), so that the planes add up to the token values (the gradient of Eq. 2 is linear in
    the heads' sums). With KEEP the products come from the forward pass
    (``products_ptr``, :func:`_fused_output_kernel`'s), without it from a walk over the band."""
    row, block = tl.program_id(0), tl.program_id(1)
    b, i = row // H, row % H
    w = block * TOKENS + tl.arange(0, TOKENS)
    image = b.to(tl.int64) * H * W * C
    plane = (tl.num_programs(0) // H).to(tl.int64) * H * W * C  # B N C
    exponent_plane = (tl.num_programs(0) // H) * heads * H * W  # B heads N
    x_image, g_image, dm_image = x_ptr + image, g_ptr + image, scaled_dm_ptr + image
    mean_ln, var_ln = _ln_statistics(x_image, i, w, W, C, d, heads, n_var, D_BLOCK)
    tok1 = tl.zeros([TOKENS], tl.float32)  # sum_c D1 lambda_m
    tok2 = tl.zeros([TOKENS], tl.float32)  # sum_c D2 lambda_v
    first_head, end = _group_heads(heads, group_heads, SPLIT)
    for head in range(first_head, end):
        (x, mask, offsets, _, _, _, _, _, first, var_it, lam_m, kap_m, lam_v, kap_v, rstd, xhat,
         _, _, _) = _head_standardised(x_image, products_ptr + image, plane, centre_ptr, p_y_ptr,
                                       p_x_ptr, ratios_ptr, b, i, w, head, H, W, C, d, mean_ln,
                                       var_ln, eps, 0.0, 0.0, False, KEEP, BAND, D_BLOCK,
                                       SPAN_BLOCK, UNROLL, STAGES)
        gamma = _channel_row(weight_ptr + head * d, d, D_BLOCK)
        g, _, _ = _head_tokens(g_image, i, w, head, W, C, d, D_BLOCK)
        d1 = g * gamma * rstd
        d2 = d1 * xhat * rstd
        tok1 += tl.sum(d1 * lam_m, axis=1)
        tok2 += tl.sum(d2 * lam_v, axis=1)
        # dL/dm_second = dL/dvar_it [var_it > 0], dL/dm_first = dL/dmu_it - 2 m_first dL/dm_second
        dm_second = tl.where(var_it > 0, -0.5 * kap_v * d2, 0.0)
        dm_first = -kap_m * d1 - 2.0 * first * dm_second
        exponents = exponent_ptr + (b * heads + head) * H * W
        _store_scaled(dm_image, exponents, i * W + w, w < W, offsets, mask, dm_first)
        _store_scaled(dm_image + plane, exponents + exponent_plane, i * W + w, w < W, offsets,
                      mask, dm_second)
    # the gradient through Eq. 2 (function.ln_gradient): dx = ... + x beta + alpha (with SPLIT
    # this group's share)
    beta = -tok2 / n_var
    alpha = -tok1 / C - beta * tl.reshape(mean_ln, [TOKENS])
    token = token_ptr + (b.to(tl.int64) * H * W + i * W + w) * 4
    first = w < W
    if SPLIT:  # group k's plane; mean_ln and var_ln in group 0's (the others' hold zeros)
        group = tl.program_id(2)
        token += group.to(tl.int64) * (tl.num_programs(0) // H) * H * W * 4
        first = first & (group == 0)
    tl.store(token, tl.reshape(mean_ln, [TOKENS]), mask=first)
    tl.store(token + 1, tl.reshape(var_ln, [TOKENS]), mask=first)
    tl.store(token + 2, beta, mask=w < W)
    tl.store(token + 3, alpha, mask=w < W)


# specialised on C and d: 16-byte token loads, without spills (docs/gpu.md)
@triton.jit(do_not_specialize=['H', 'W', 'rows'])
def _fused_input_gradient_kernel(x_ptr, g_ptr, centre_ptr, p_y_ptr, p_x_ptr, ratios_ptr,
                                 weight_ptr, products_ptr, scaled_dm_ptr, exponent_ptr, token_ptr,
                                 dx_ptr, partial_ptr, coef_ptr, H, W, C, d, rows, eps,
                                 TOKENS: tl.constexpr, BAND: tl.constexpr, D_BLOCK: tl.constexpr,
                                 SPAN_BLOCK: tl.constexpr, UNROLL: tl.constexpr,
                                 STAGES: tl.constexpr, KEEP: tl.constexpr):
    """dx of head ``program_id(2)``'s channels of tokens w of up to ``rows`` token rows i of image
    b (program (b R + k, block, head) takes rows k rows ... k rows + rows - 1, R = ceil(H /
    rows)): D1 + x beta + alpha + dL/dT_0 + 2 (x - centre) dL/dT_1; the sums of xhat g, g,
    (mu_ln - mu_it) D1 and (var_ln - var_it) D2 over all its tokens
    (:data:`.triton_kernels.TIED_SUMS`), for the head's channels of the sums (4, C) of program (b R
    + k, block); and the program's share of the gradient of a^h, of (programs, heads, 3), formed
    in the walk that forms m again (with KEEP m comes from the forward pass, ``products_ptr``, and
    the walk forms the share alone)."""
    row_block, block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row_blocks = tl.cdiv(H, rows)
    b, first_row = row_block // row_blocks, (row_block % row_blocks) * rows
    w = block * TOKENS + tl.arange(0, TOKENS)
    image = b.to(tl.int64) * H * W * C
    batch, heads = tl.num_programs(0) // row_blocks, tl.num_programs(2)
    plane = batch.to(tl.int64) * H * W * C  # B N C
    exponent_plane = batch * heads * H * W  # B heads N
    x_image, g_image, dm_image = x_ptr + image, g_ptr + image, scaled_dm_ptr + image
    exponents = exponent_ptr + (b * heads + head) * H * W
    gamma = _channel_row(weight_ptr + head * d, d, D_BLOCK)
    xhat_g = tl.zeros([D_BLOCK], tl.float32)
    g_sum = tl.zeros([D_BLOCK], tl.float32)
    mean_d1 = tl.zeros([D_BLOCK], tl.float32)  # (mu_ln - mu_it) D1
    var_d2 = tl.zeros([D_BLOCK], tl.float32)  # (var_ln - var_it) D2
    share1 = tl.sum(tl.zeros([TOKENS], tl.float32), axis=0)  # of the gradient of a^h
    share2, share3 = share1, share1
    for i in range(first_row, tl.minimum(first_row + rows, H)):
        token = token_ptr + (b.to(tl.int64) * H * W + i * W + w) * 4
        mean_ln = tl.load(token, mask=w < W, other=0.0)[:, None]
        var_ln = tl.load(token + 1, mask=w < W, other=0.0)[:, None]
        beta = tl.load(token + 2, mask=w < W, other=0.0)[:, None]
        alpha = tl.load(token + 3, mask=w < W, other=0.0)[:, None]
        mask, offsets = _head_offsets(i, w, head, W, C, d, D_BLOCK)
        dm_first, dm_second = _source(dm_image, plane, exponents, exponent_plane, i * W + w,
                                      w < W, offsets, mask, 0.0, False)
        (x, mask, offsets, channel, real, centre, p_y, p_x, first, var_it, _, _, _, _, rstd, xhat,
         da1, da2, da3) = _head_standardised(x_image, products_ptr + image, plane, centre_ptr,
                                             p_y_ptr, p_x_ptr, ratios_ptr, b, i, w, head, H, W, C,
                                             d, mean_ln, var_ln, eps, dm_first, dm_second, True,
                                             KEEP, BAND, D_BLOCK, SPAN_BLOCK, UNROLL, STAGES)
        share1 += da1
        share2 += da2
        share3 += da3
        g, _, _ = _head_tokens(g_image, i, w, head, W, C, d, D_BLOCK)
        d1 = g * gamma * rstd
        d2 = d1 * xhat * rstd
        xhat_g += tl.sum(xhat * g, axis=0)
        g_sum += tl.sum(g, axis=0)
        mean_d1 += tl.sum((mean_ln - first - centre) * d1, axis=0)
        var_d2 += tl.sum((var_ln - var_it) * d2, axis=0)
        bands = _bands(p_y, p_x, i, w, H, W, True, SPAN_BLOCK)  # of the transposed factors
        dt_first, dt_second, _, _, _ = _products(dm_image, plane, exponents, exponent_plane,
                                                 centre, p_y, p_x, bands, i, w, H, W, W * C, C,
                                                 channel, real, 0.0, 0.0, False, True, True,
                                                 False, BAND, D_BLOCK, UNROLL, STAGES)
        dx = d1 + x * beta + alpha + dt_first + 2.0 * (x - centre) * dt_second
        tl.store(dx_ptr + image + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    c = tl.arange(0, D_BLOCK)
    program = (row_block * tl.num_programs(1) + block).to(tl.int64)
    sums = partial_ptr + program * SUM_ROWS * C + head * d + c
    tl.store(sums, xhat_g, mask=c < d)
    tl.store(sums + C, g_sum, mask=c < d)
    tl.store(sums + 2 * C, mean_d1, mask=c < d)
    tl.store(sums + 3 * C, var_d2, mask=c < d)
    coef = coef_ptr + (program * heads + head) * 3
    tl.store(coef, share1)
    tl.store(coef + 1, share2)
    tl.store(coef + 2, share3)


def gradient_dtype(dtype):
    """The dtype dL/dm passes between the backward kernels in for tokens of ``dtype``: float32
    for float32 tokens (unscaled); for 16-bit tokens float16, scaled per token, head and moment
    (:func:`_store_scaled`): 11 significant bits of every value within 2^14 of its token's
    largest (more than bfloat16 tokens have), in half float32's bytes."""
    return torch.float32 if dtype == torch.float32 else torch.float16


def rows_per_program(programs, H):
    """Token rows per input-gradient program, where one a row would make ``programs``: as many
    as keep at least :data:`PROGRAMS` programs (one where there are fewer), at most H, spread
    evenly over the image's rows."""
    rows = max(1, min(H, programs // PROGRAMS))
    return cdiv(H, cdiv(H, rows))


def heads_per_program(programs, heads):
    """Heads per output and token-gradients program, where a program with every head would make
    ``programs``: all where those are at least :data:`PROGRAMS` or without :data:`SPLIT_HEADS`,
    else the heads split evenly into up to PROGRAMS / programs groups (rounded up; at most a group
    a head)."""
    if not SPLIT_HEADS:
        return heads
    groups = min(heads, max(1, cdiv(PROGRAMS, programs)))
    return cdiv(heads, groups)


def head_programs(grid, arch, keep, kernel):
    """The fused passes' :func:`specializations` on ``grid``, split or not as the programs of
    ``kernel`` (0: the output, 1: the token gradients) need, those programs, (B H, blocks of a
    token row, groups of heads), and the heads of a group (:func:`heads_per_program`). The tile
    is the same split or not."""
    tokens = specializations(grid.d, arch, keep)[kernel][1]['TOKENS']
    programs = grid.B * grid.H * cdiv(grid.W, tokens)
    group_heads = heads_per_program(programs, grid.heads)
    groups = cdiv(grid.heads, group_heads)
    return (specializations(grid.d, arch, keep, groups > 1),
            (grid.B * grid.H, cdiv(grid.W, tokens), groups), group_heads)


def fused_backward(g, x, centre, p_y, p_x, ratios, weight, eps, n_var, grid, products=None):
    """dx (x's shape and dtype), the input-gradient programs' sums (programs, 4, C) for the weight,
    the bias and the ratios (as :func:`.triton_kernels.token_gradients`') and their shares
    (programs, heads, 3) of the gradient of a^h, from g and x (B, N, C) contiguous and the
    forward pass's operands (``products``: what :func:`fused_output` kept, if it did): two
    launches."""
    B, N, C = x.shape
    keep = products is not None
    operands = [x, g, centre.contiguous(), p_y.contiguous(), p_x.contiguous(),
                ratios.contiguous(), weight.contiguous()]
    # without kept products the kernels read nothing at products_ptr: the centre stands in
    read = [*operands, products] if keep else operands
    operands = [*operands, products if keep else operands[2]]
    specs, programs, group_heads = head_programs(grid, architecture(x.device), keep, 1)
    groups = programs[2]
    dm = x.new_empty(2, B, N, C, dtype=gradient_dtype(x.dtype))
    exponents = x.new_empty(2, B, grid.heads, N if dm.dtype != torch.float32 else 0,
                            dtype=torch.uint8)
    # split, the groups' planes but group 0's keep zeros for mean_ln and var_ln
    token = (torch.zeros if groups > 1 else torch.empty)(groups, B * N, 4, dtype=torch.float32,
                                                         device=x.device)
    launch('triton.fused_token_gradients', specs[1], programs, read, [dm, exponents, token],
           *operands, dm, exponents, token, grid.H, grid.W, C, grid.d, grid.heads, group_heads,
           float(eps), float(n_var))
    token = token.sum(0) if groups > 1 else token[0]  # the groups' shares, in a fixed order
    dx = torch.empty_like(x)
    spec = specs[2]
    blocks = cdiv(grid.W, spec[1]['TOKENS'])
    rows = rows_per_program(B * grid.H * blocks * grid.heads, grid.H)
    programs = (B * cdiv(grid.H, rows), blocks, grid.heads)
    partial = x.new_empty(programs[0] * programs[1], SUM_ROWS.value, C, dtype=torch.float32)
    shares = x.new_empty(programs[0] * programs[1], grid.heads, 3, dtype=torch.float32)
    launch('triton.fused_input_gradient', spec, programs, [*read, dm, exponents, token],
           [dx, partial, shares], *operands, dm, exponents, token, dx, partial, shares, grid.H,
           grid.W, C, grid.d, rows, float(eps))
    return dx, partial, shares


# ---------------------------------------------------------------------------- specialisations
def head_block(d):
    """The width :data:`TILES` and :data:`WALKS` are keyed by for heads of d channels: d padded to
    32 or the power of two above it."""
    return max(32, triton.next_power_of_2(d))


@functools.lru_cache(maxsize=None)
def _capability(index):
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def architecture(device):
    """The compute capability (10 major + minor) of a CUDA ``device``, which selects its tiles
    (:func:`tiles`); None elsewhere (the interpreter, meta tensors: :data:`TILES`)."""
    if device.type != 'cuda':
        return None
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


def tiles_table(name, d_block, arch=None):
    """The table by head width that kernel ``name`` takes its tiles for heads of ``d_block``
    channels from on compute capability ``arch``: :data:`ARCH_TILES`' where it has them, else
    :data:`TILES`'."""
    own = ARCH_TILES.get(arch, {}).get(name, {})
    return own if d_block in own else TILES[name]


def tiles(name, d_block, arch=None):
    """(tokens, warps[, registers a thread]) of kernel ``name`` for heads of ``d_block`` channels
    on compute capability ``arch`` (:func:`tiles_table`)."""
    return tiles_table(name, d_block, arch)[d_block]


def _spec(kernel, name, d, arch, **constexprs):
    """(kernel, constexprs, launch options) of one fused kernel for heads of d channels on
    ``arch``, with ``constexprs`` of its own."""
    d_block = head_block(d)
    tokens, *options = tiles(name, d_block, arch)
    unroll, stages = WALKS[name][d_block]
    return kernel, dict(TOKENS=tokens, BAND=BAND, D_BLOCK=d_block, SPAN_BLOCK=SPAN_BLOCK,
                        UNROLL=unroll, STAGES=stages, **constexprs), LaunchOptions(*options)


@functools.lru_cache(maxsize=None)
def specializations(d, arch=None, keep=False, split=False):
    """(kernel, constexprs, launch options) of the fused passes for heads of d channels on compute
    capability ``arch`` (:func:`tiles`): the output, the token gradients and the input gradient;
    with ``keep`` the output keeps the products and the token gradients read them
    (:data:`KEEP_PRODUCTS`), and the input gradient too, walking the band for the shares of the
    gradient of a^h alone; with ``split`` the output and the token gradients take a group of heads
    a program (:func:`heads_per_program`)."""
    return (_spec(_fused_output_kernel, 'output', d, arch, KEEP=keep, SPLIT=split),
            _spec(_fused_token_gradients_kernel,
                  'kept_token_gradients' if keep else 'token_gradients', d, arch, KEEP=keep,
                  SPLIT=split),
            _spec(_fused_input_gradient_kernel, 'input_gradient', d, arch, KEEP=keep))
