"""The forward pass of DynamicTokenNorm without pooling in one Triton kernel: Eq. 2, the positional
products of Eq. 5 and Eq. 4, with x read once and y written once (Shao et al., ICLR 2022).

Without pooling the staged forward (:mod:`..function`) writes and reads u = P_x T and m = P_y u,
four float32 tensors of two moments per channel and token: with 16-bit tokens 9.5x LayerNorm's
bytes, against 1x here (``benchmark_norm.py --tables traffic``). A program holds TOKENS tokens of
one token row i of one image (:func:`_tiles`), all their channels, and for every head h forms

    T_r   = (x - centre, (x - centre)^2) in the rows r of the band of P_y^h's row i
    v     = sum_r P_y^h[i, r] T_r                        (Eq. 5, P_y's row i; per token column)
    m     = P_x^h v                                      (Eq. 5, P_x's rows of the tokens; tl.dot)
    y     = gamma (x - mu) / sqrt(sigma2 + eps) + beta  (Eqs. 4-5, var_it = m_1 - m_0^2)

over the nonzero band of both factors (:func:`.triton_band._band`, found from P on the device),
BAND token columns at a time. P^h = P_y^h (x) P_x^h, so v and m are m = P_y u of the staged passes
in another order: equal to float32 rounding. The rows of the band are read again by the programs
of the neighbouring token rows: from the GPU's cache (``kernel_loads.py`` counts those reads).
Backward stays staged (:mod:`.triton_kernels`, :mod:`.triton_band`), and so does the forward pass
of heads wider than MAX_HEAD_CHANNELS channels (:func:`fuses`).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from .triton_band import SPAN_BLOCK, _band, _weights
from .triton_kernels import _channel_row, _ratio_rows, _standardised
from .triton_launch import launch

__all__ = ['fuses', 'fused_output', 'specializations', 'MAX_HEAD_CHANNELS']

#: Token columns of the band per step: the inner dimension of the products with P_x (tl.dot's
#: least, 16).
BAND = 16


#: Whether the fused forward runs at all: ``MMDTN_TRITON_FUSED_FORWARD=0`` runs the staged forward
#: instead (read at import), to compare the two on a GPU.
ENABLED = os.environ.get('MMDTN_TRITON_FUSED_FORWARD', '1') != '0'
#: The widest heads the fused forward takes: up to 128 channels it compiles without spills on
#: sm_80 and sm_90; for heads of 256 channels sm_80 spills 256-304 bytes, and wider heads run the
#: staged forward.
MAX_HEAD_CHANNELS = 128


def fuses(pool, d):
    """Whether the forward pass of a layer with pooling ``pool`` and heads of d channels runs
    fused here (no pooling, heads of at most MAX_HEAD_CHANNELS channels; unless not ENABLED)."""
    return ENABLED and pool == 1 and d <= MAX_HEAD_CHANNELS


def _tiles(d_block):
    """Tokens of a token row per program (the rows of P_x in one tl.dot, at least 16) and warps,
    for heads of d_block channels (padded): without spills on sm_80 and sm_90 in every dtype, at
    96-128 registers a thread for 32 channels and 128-228 for 64 and 128 (with 32 tokens and 8
    warps, 32 channels spilled 40 bytes on sm_90 in float32). Not yet timed on a GPU."""
    return (16, 4) if d_block <= 32 else (32, 8)


@triton.jit
def _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK: tl.constexpr):
    """Tokens w (TOKENS,) of token row i, the d channels of ``head``: float32 [TOKENS, D_BLOCK]
    (zeros outside), the mask and the offsets within the image."""
    c = tl.arange(0, D_BLOCK)
    mask = (w < W)[:, None] & (c < d)[None, :]
    offsets = (i * W + w)[:, None] * C + (head * d + c)[None, :]
    return tl.load(x_image + offsets, mask=mask, other=0.0).to(tl.float32), mask, offsets


@triton.jit(do_not_specialize=['H', 'W', 'C', 'd', 'heads'])
def _fused_output_kernel(x_ptr, centre_ptr, p_y_ptr, p_x_ptr, ratios_ptr, weight_ptr, bias_ptr,
                         y_ptr, H, W, C, d, heads, eps, n_var, TOKENS: tl.constexpr,
                         BAND: tl.constexpr, D_BLOCK: tl.constexpr, SPAN_BLOCK: tl.constexpr):
    """y of tokens w = block * TOKENS ... of token row i of image b (program (b H + i, block))."""
    row, block = tl.program_id(0), tl.program_id(1)
    b, i = row // H, row % H
    w = block * TOKENS + tl.arange(0, TOKENS)
    c = tl.arange(0, D_BLOCK)
    image = b.to(tl.int64) * H * W * C
    x_image, y_image = x_ptr + image, y_ptr + image

    # Eq. 2 over all C channels, a head's channels at a time: the mean as a sum / C, then the
    # variance about it / n_var (the second reading of the tokens comes from the cache)
    total = tl.zeros([TOKENS], tl.float32)
    for head in range(heads):
        x, _, _ = _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK)
        total += tl.sum(x, axis=1)
    mean_ln = total / C
    squares = tl.zeros([TOKENS], tl.float32)
    for head in range(heads):
        x, mask, _ = _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK)
        diff = tl.where(mask, x - mean_ln[:, None], 0.0)
        squares += tl.sum(diff * diff, axis=1)
    var_ln = (squares / n_var)[:, None]
    mean_ln = mean_ln[:, None]

    for head in range(heads):
        channel = head * d + c
        real = c < d
        centre = _channel_row(centre_ptr + b * C + head * d, d, D_BLOCK)
        p_y = p_y_ptr + head * H * H  # factors: far below 2^31 entries
        p_x = p_x_ptr + head * W * W
        lo_y, hi_y = _band(p_y, i + tl.arange(0, 1), H, False, 1, SPAN_BLOCK)
        lo_x, hi_x = _band(p_x, w, W, False, TOKENS, SPAN_BLOCK)
        first = tl.zeros([TOKENS, D_BLOCK], tl.float32)  # P T_0 = mu_it - centre
        second = tl.zeros([TOKENS, D_BLOCK], tl.float32)  # P T_1, raw
        for start in range(lo_x, hi_x, BAND):
            cols = start + tl.arange(0, BAND)
            mask = (cols < hi_x)[:, None] & real[None, :]
            v_first = tl.zeros([BAND, D_BLOCK], tl.float32)
            v_second = tl.zeros([BAND, D_BLOCK], tl.float32)
            for r in range(lo_y, hi_y):  # v = sum_r P_y[i, r] T_r
                weight_y = tl.load(p_y + i * H + r)
                t = tl.load(x_image + (r * W + cols)[:, None] * C + channel[None, :], mask=mask,
                            other=0.0).to(tl.float32)
                t = tl.where(mask, t - centre, 0.0)
                v_first += weight_y * t
                v_second += weight_y * (t * t)
            weights_x = _weights(p_x, w, cols, W, hi_x, False)  # m = P_x v
            first += tl.dot(weights_x, v_first, input_precision='ieee')
            second += tl.dot(weights_x, v_second, input_precision='ieee')

        # Eq. 5 inside Eq. 4
        lam_m, kap_m, lam_v, kap_v = _ratio_rows(ratios_ptr + head * d, C, d, D_BLOCK)
        gamma = _channel_row(weight_ptr + head * d, d, D_BLOCK)
        beta = _channel_row(bias_ptr + head * d, d, D_BLOCK)
        var_it = tl.maximum(second - first * first, 0.0)
        x, mask, offsets = _head_tokens(x_image, i, w, head, W, C, d, D_BLOCK)
        _, xhat = _standardised(x, mean_ln, var_ln, first + centre, var_it, lam_m, kap_m, lam_v,
                                kap_v, eps)
        tl.store(y_image + offsets, (xhat * gamma + beta).to(y_ptr.dtype.element_ty), mask=mask)


def fused_output(x, centre, p_y, p_x, ratios, weight, bias, eps, n_var, grid):
    """y (x's shape and dtype) without pooling from x (B, N, C) contiguous, the centre (B, 1, 1, C)
    float32, the factors P_y (heads, H, H), P_x (heads, W, W) and the ratios (4, C): one launch."""
    y = torch.empty_like(x)
    operands = [x, centre.contiguous(), p_y.contiguous(), p_x.contiguous(), ratios.contiguous(),
                weight.contiguous(), bias.contiguous()]
    spec = _spec(grid.d)
    launch('triton.fused_output', spec, (grid.B * grid.H, -(-grid.W // spec[1]['TOKENS'])),
           operands, [y], *operands, y, grid.H, grid.W, grid.C, grid.d, grid.heads, float(eps),
           float(n_var))
    return y


@functools.lru_cache(maxsize=None)
def _spec(d):
    d_block = max(16, triton.next_power_of_2(d))
    tokens, warps = _tiles(d_block)
    return _fused_output_kernel, dict(TOKENS=tokens, BAND=BAND, D_BLOCK=d_block,
                                      SPAN_BLOCK=SPAN_BLOCK), warps


def specializations(d):
    """(kernel, constexprs, num_warps) of the fused forward for heads of d channels."""
    return [_spec(d)]
