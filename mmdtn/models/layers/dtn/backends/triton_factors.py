"""The positional factors P_y^h and P_x^h of DynamicTokenNorm (Eq. 6) in Triton, and the gradient
of their coefficients: the parts of :mod:`.triton_parameters`' kernels that handle them.

Written in PyTorch (:func:`..positional.axis_factors`), the factors take about 20 element-wise
operations forward and 14 backward, each a launch that reads and writes heads x L x L values:
on a GPU that is more launches than the rest of the layer and, without pooling, about a quarter
of its bytes. Here a program forms ROWS rows of a factor from the coefficients a^h alone,

    P[h, i, j] = softmax_j(a1 d^2 + a_lin d),   d = j - i,   a_lin = a2 for P_x, a3 for P_y,

truncated as :func:`..positional.truncated_softmax` (weights below eps(float32) 2^-26 of the row
maximum are exact zeros), in chunks of ``BLOCK`` entries, so that any L runs with one compiled
kernel: the logits are recomputed for the row maximum, the row sum and the store instead of being
read (:func:`_factor_rows`). Backward needs no gradients of the factors: with dl = P (dP - sum_j
P dP) the gradient of the logits, da1 = sum d^2 dl over both factors, da2 = sum d dl over P_x and
da3 over P_y, linear in dP, and the programs that form dP (the fused passes, :mod:`.triton_fused`,
and the outer products, :mod:`.triton_band`) contract their shares of it as they go. A program per
head adds those shares up in a fixed order (:func:`_coefficient_shares`; deterministic, no
atomics).
"""
import torch
import triton
import triton.language as tl

from ..positional import truncation_cutoff
from .triton_launch import cdiv

__all__ = ['ROWS', 'BLOCK', 'CUTOFF', 'row_blocks']

#: Rows of a factor a program forms, and entries of those rows one step covers.
ROWS, BLOCK = 16, 64
#: Logits below the row maximum by more than this are exact zeros (positional.truncated_softmax).
CUTOFF = truncation_cutoff(torch.float32)


@triton.jit
def _rows(b, rows, cols, ROWS: tl.constexpr):
    """Block b of ROWS rows among those of P_y^h followed by those of P_x^h: (whether they are
    P_x's, their indices i (ROWS,), the length L of the factor's rows)."""
    blocks_y = tl.cdiv(rows, ROWS)
    in_x = b >= blocks_y
    i = tl.where(in_x, b - blocks_y, b) * ROWS + tl.arange(0, ROWS)
    return in_x, i, tl.where(in_x, cols, rows)


@triton.jit
def _entries(i, start, length, BLOCK: tl.constexpr):
    """Columns k = start .. start + BLOCK of rows i: (k, d = k - i as float32 (ROWS, BLOCK),
    which entries lie in the factor)."""
    k = start + tl.arange(0, BLOCK)
    d = (k[None, :] - i[:, None]).to(tl.float32)
    return k, d, (i[:, None] < length) & (k[None, :] < length)


@triton.jit
def _logits(a1, a_lin, d, k, length):
    """Eq. 6's logits a1 d^2 + a_lin d, -inf past the row's end."""
    return tl.where(k[None, :] < length, a1 * (d * d) + a_lin * d, float('-inf'))


@triton.jit
def _factor_rows(coef_ptr, p_y_ptr, p_x_ptr, h, b, rows, cols, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, CUTOFF: tl.constexpr):
    """Block b of ROWS rows of P_y^h or of P_x^h (:func:`_rows`), the truncated softmax of
    Eq. 6."""
    in_x, i, length = _rows(b, rows, cols, ROWS)
    a1 = tl.load(coef_ptr + 3 * h)
    a_lin = tl.load(coef_ptr + 3 * h + tl.where(in_x, 1, 2))
    peak = tl.full((ROWS, ), float('-inf'), tl.float32)
    for start in range(0, length, BLOCK):
        k, d, _ = _entries(i, start, length, BLOCK)
        peak = tl.maximum(peak, tl.max(_logits(a1, a_lin, d, k, length), axis=1))
    total = tl.zeros((ROWS, ), tl.float32)
    for start in range(0, length, BLOCK):
        k, d, _ = _entries(i, start, length, BLOCK)
        shifted = _logits(a1, a_lin, d, k, length) - peak[:, None]
        total += tl.sum(tl.where(shifted < CUTOFF, 0.0, tl.exp(shifted)), axis=1)
    out = tl.where(in_x, p_x_ptr + h * cols * cols, p_y_ptr + h * rows * rows)
    for start in range(0, length, BLOCK):
        k, d, inside = _entries(i, start, length, BLOCK)
        shifted = _logits(a1, a_lin, d, k, length) - peak[:, None]
        p = tl.where(shifted < CUTOFF, 0.0, tl.exp(shifted)) / total[:, None]
        tl.store(out + i[:, None] * length + k[None, :], p, mask=inside)


@triton.jit
def _coefficient_shares(shares_ptr, h, programs, BLOCK: tl.constexpr):
    """The sum of the programs' shares (programs, heads, 3) of the gradient of a^h, added up over
    the programs in a fixed order, BLOCK at a time: (4,), the last 0."""
    heads = tl.num_programs(0)
    k = tl.arange(0, 4)
    total = tl.zeros([BLOCK, 4], tl.float32)
    for start in range(0, programs, BLOCK):
        p = start + tl.arange(0, BLOCK)
        at = ((p * heads + h) * 3)[:, None] + k[None, :]
        total += tl.load(shares_ptr + at, mask=(p < programs)[:, None] & (k < 3)[None, :],
                         other=0.0)
    return tl.sum(total, axis=0)


def row_blocks(rows, cols):
    """Blocks of ROWS rows of P_y^h and P_x^h together: the programs per head of the factors."""
    return cdiv(rows, ROWS) + cdiv(cols, ROWS)
