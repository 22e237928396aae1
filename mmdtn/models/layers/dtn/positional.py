"""The position-aware matrix P^h of Dynamic Token Normalization (Shao et al., ICLR 2022, Eqs. 6-7).

    P^h_ij = softmax_j(a^h . R_ij),   R_ij = [dx^2 + dy^2, dx, dy]                          (Eq. 6)
    a^h    = [-1, 2 Dx^h, 2 Dy^h] at initialization, (Dx^h, Dy^h) a neighbour offset     (Eq. 7)

with (dx, dy) the column and row of source token j minus those of output token i. The logits
separate over the two axes, (a1 dx^2 + a2 dx) + (a1 dy^2 + a3 dy), so on a rectangular grid the
softmax factorizes exactly: P^h = P_y^h (kron) P_x^h, with P_x^h (W x W) and P_y^h (H x H) the
softmax of each axis's logits. DTN applies P^h as these two factors and never builds the T x T
matrix; :func:`positional_matrix` builds it for inspection.

Far from its peak a factor's weights underflow: :func:`truncated_softmax` makes them exact zeros,
so that the factors are band matrices whose zeros the kernels may skip.
"""
import math

import numpy as np
import torch

__all__ = ['neighbourhood_offsets', 'paper_coefficients', 'relative_offsets', 'truncated_softmax',
           'truncation_cutoff', 'axis_factors', 'positional_matrix', 'CUTOFF_MARGIN_BITS']

#: Positional weights below eps(dtype) * 2^-CUTOFF_MARGIN_BITS of their row's maximum are exact
#: zeros (see truncated_softmax): 2^-49 = 1.8e-15 in float32, 2^-78 = 3.3e-24 in float64.
CUTOFF_MARGIN_BITS = 26


def neighbourhood_offsets(num_heads):
    """Distinct (Dx, Dy) cell offsets of the smallest k x k neighbourhood with k^2 >= num_heads
    (Eq. 7's "neighbourhood of size sqrt(H) x sqrt(H)").

    The neighbourhood spans offsets -floor((k-1)/2) .. ceil((k-1)/2) on both axes and contains the
    token itself (offset (0, 0)). Cells are handed out nearest first (then row-major), so that e.g.
    5 heads take the token and its four direct neighbours.

    Returns:
        list[tuple[int, int]]: ``num_heads`` distinct (Dx, Dy) offsets.
    """
    k = math.ceil(math.sqrt(num_heads))
    lo = -((k - 1) // 2)
    cells = [(dx, dy) for dy in range(lo, lo + k) for dx in range(lo, lo + k)]
    cells.sort(key=lambda c: (c[0]**2 + c[1]**2, c[1], c[0]))
    return cells[:num_heads]


def paper_coefficients(num_heads, dtype=torch.float32):
    """a^h = [-1, 2 Dx^h, 2 Dy^h] of Eq. 7 for every head, (num_heads, 3): P^h peaks at the
    head's neighbour offset (Dx^h, Dy^h), since -(dx^2 + dy^2) + 2 Dx dx + 2 Dy dy =
    -(dx - Dx)^2 - (dy - Dy)^2 + const."""
    offsets = torch.tensor(neighbourhood_offsets(num_heads), dtype=dtype).view(num_heads, 2)
    return torch.cat([torch.full((num_heads, 1), -1.0, dtype=dtype), 2 * offsets], dim=1)


def relative_offsets(length, device, dtype):
    """d[i, j] = j - i (source minus output) along one grid axis, (length, length).

    Made afresh on every call (a few hundred elements): cached tensors would outlive tracing by
    ``torch.compile`` or ``torch.export`` as fake tensors."""
    pos = torch.arange(length, device=device, dtype=dtype)
    return pos[None, :] - pos[:, None]


def truncated_softmax(logits):
    """Row softmax whose weights below eps * 2^-26 of the row maximum are exact zeros, with eps the
    resolution of the logits' dtype (2^-23 for float32, 2^-52 for float64).

    A dropped weight w < eps 2^-26 w_max changes a weighted sum by w v, below the resolution
    eps w_max v_max of its peak term unless the feature v is 2^26 (6.7e7) times larger than v_max,
    the feature at the peak. Kept, such weights times small features give subnormal floats, which
    slow matrix products on CPUs down by 2x and more; zeros cost nothing, and banded kernels skip
    them. With the paper's initialization (logits -(k - D)^2 at distance k) this keeps 11 weights
    per row in float32 and 15 in float64, on any grid."""
    return _truncated_softmax(logits, serial=False)


def truncation_cutoff(dtype):
    """The logit, relative to its row's maximum, below which truncated_softmax gives an exact
    zero: log(eps(dtype) 2^-CUTOFF_MARGIN_BITS)."""
    return math.log(torch.finfo(dtype).eps) - CUTOFF_MARGIN_BITS * math.log(2.0)


def _truncated_softmax(logits, serial):
    """truncated_softmax; with ``serial`` by :class:`_SerialSoftmax`."""
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    kept = shifted.masked_fill(shifted < truncation_cutoff(logits.dtype), -math.inf)
    return _SerialSoftmax.apply(kept) if serial else torch.softmax(kept, dim=-1)


class _SerialSoftmax(torch.autograd.Function):
    """Row softmax of small CPU logits whose row maximum is 0, on the calling thread: PyTorch's
    softmax and exp split even a few thousand elements over threads, NumPy's exp does not, and
    the row sums and the backward pass are element-wise operations and reductions that PyTorch
    runs on one thread below :data:`SERIAL_ELEMENTS`."""

    @staticmethod
    def forward(ctx, logits):
        weights = torch.from_numpy(np.exp(logits.detach().numpy()))
        p = weights / weights.sum(-1, keepdim=True)
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad):
        p, = ctx.saved_tensors
        return p * (grad - (p * grad).sum(-1, keepdim=True))


def axis_factors(pos_coef, rows, cols):
    """The factors (P_y, P_x) of P^h = P_y^h (kron) P_x^h on a ``rows`` x ``cols`` grid (Eq. 6).

    Args:
        pos_coef: a^h, (heads, 3), coefficients of [dx^2 + dy^2, dx, dy], in the dtype wanted.

    Returns:
        tuple[Tensor, Tensor]: P_y (heads, rows, rows) and P_x (heads, cols, cols), rows sum to 1;
        P_x[h, i, j] = softmax_j(a1 (j - i)^2 + a2 (j - i)), P_y likewise with a3.
    """
    a1, a2, a3 = (c[:, None, None] for c in pos_coef.unbind(1))
    dx = relative_offsets(cols, pos_coef.device, pos_coef.dtype)
    dy = relative_offsets(rows, pos_coef.device, pos_coef.dtype)
    return _axis_factor(a1, a3, dy), _axis_factor(a1, a2, dx)


#: Elements up to which PyTorch's CPU operations run on one thread (at::internal::GRAIN_SIZE).
SERIAL_ELEMENTS = 32768


def _axis_factor(square, linear, offsets):
    """truncated_softmax(square d^2 + linear d) for the per-head coefficients (heads, 1, 1) and the
    offsets d (L, L). Eager on CPUs a few heads at a time, every operation small enough to run on
    one thread: a factor is a few thousand elements per head, and a parallel region per operation
    would cost more than the operation, the more so on a busy machine."""
    heads, L = square.shape[0], offsets.shape[-1]
    if (square.device.type != 'cpu' or L * L > SERIAL_ELEMENTS or torch.compiler.is_compiling()
            or torch.jit.is_tracing()):
        return truncated_softmax(square * offsets.square() + linear * offsets)
    step, d2 = SERIAL_ELEMENTS // (L * L), offsets.square()
    factors = [_truncated_softmax(square[h:h + step] * d2 + linear[h:h + step] * offsets, True)
               for h in range(0, heads, step)]
    return factors[0] if len(factors) == 1 else torch.cat(factors)


def positional_matrix(p_y, p_x):
    """The dense P^h = P_y^h (kron) P_x^h, (heads, T, T) with T = rows * cols in row-major order."""
    heads, rows, cols = p_y.shape[0], p_y.shape[-1], p_x.shape[-1]
    T = rows * cols
    return torch.einsum('hac,hbd->habcd', p_y, p_x).reshape(heads, T, T)
