"""Products with one positional factor P (heads, L, L) of DynamicTokenNorm over its nonzero band,
in Triton: the Triton backend's :class:`BandFactor`, with the interface of
:class:`.base.DenseFactor`.

Far from its peak a row of P is exact zeros (:func:`..positional.truncated_softmax`: about 11
nonzero weights in float32 at the paper's initialisation), so P X takes about 11 multiply-adds per
value instead of L, and the gradient of P is needed only where P is nonzero: elsewhere the
truncated softmax passes no gradient, and it is 0 here. As dense batched matrix products
(``torch.bmm``) on an H200 the products took most of the layer's time without pooling, the
gradient of P (L x L from sums over 10^4 values) the most: cuBLAS runs few, long programs for it.

Both kernels find the nonzero columns of a block of ROWS rows of P (or of P^T) on the device,
from those rows alone (no host synchronisation, no spans stored):

    band_matmul  Y = P X (or P^T X): a program per matrix, block of rows and block of BLOCK_N
                 columns of X; the block's band in steps of BAND columns, each a small matrix
                 product (``tl.dot`` in float32)
    band_outer   G = A X^T where P is nonzero: a program per matrix, block of rows and chunk of
                 OUTER_BLOCK_K of the summed dimension, one column of the band at a time; the
                 chunks' sums are added up afterwards in a fixed order (no float atomics)

Measured on an H200 (README, "DTN on GPUs"): ``tl.dot`` took band_matmul to 0.68-0.72x the time of a
column-at-a-time loop, but band_outer to 1.25-1.65x, so band_outer keeps the loop.

Matrix k of X, A and the results uses P[k // group]. Everything is float32.
"""
import torch
import triton
import triton.language as tl

from .base import DenseFactor
from .triton_kernels import _launch

__all__ = ['BandFactor', 'band_matmul', 'band_outer', 'specializations']

#: Rows of P per program, columns of P per step over the band and columns of X per program of
#: band_matmul, values of the summed dimension per program of band_outer, and entries of P one step
#: of the search for the band reads.
ROWS, BAND, BLOCK_N, OUTER_BLOCK_K, SPAN_BLOCK = 16, 32, 128, 256, 64


@triton.jit
def _band(p_head, rows, L, TRANSPOSE: tl.constexpr, ROWS: tl.constexpr,
          SPAN_BLOCK: tl.constexpr):
    """The first and one past the last column j with P[i, j] != 0 (P[j, i] with TRANSPOSE) over
    rows i of the block; (0, 0) where all are zero."""
    lo, hi = L + 0, L * 0  # runtime integers: loop-carried
    for start in range(0, L, SPAN_BLOCK):
        cols = start + tl.arange(0, SPAN_BLOCK)
        mask = (rows[:, None] < L) & (cols[None, :] < L)
        if TRANSPOSE:
            entries = tl.load(p_head + cols[None, :] * L + rows[:, None], mask=mask, other=0.0)
        else:
            entries = tl.load(p_head + rows[:, None] * L + cols[None, :], mask=mask, other=0.0)
        nonzero = entries != 0
        lo = tl.minimum(lo, tl.min(tl.where(nonzero, cols[None, :], L)))
        hi = tl.maximum(hi, tl.max(tl.where(nonzero, cols[None, :] + 1, 0)))
    return lo, tl.maximum(hi, lo)


@triton.jit
def _weights(p_head, rows, cols, L, hi, TRANSPOSE: tl.constexpr):
    """P[i, j] (P[j, i] with TRANSPOSE) for rows i and columns j below hi, [ROWS, BAND]."""
    mask = (rows[:, None] < L) & (cols[None, :] < hi)
    if TRANSPOSE:
        return tl.load(p_head + cols[None, :] * L + rows[:, None], mask=mask, other=0.0)
    else:
        return tl.load(p_head + rows[:, None] * L + cols[None, :], mask=mask, other=0.0)


@triton.jit(do_not_specialize=['L', 'N', 'group'])
def _band_matmul_kernel(p_ptr, in_ptr, out_ptr, L, N, group, TRANSPOSE: tl.constexpr,
                        ROWS: tl.constexpr, BAND: tl.constexpr, BLOCK_N: tl.constexpr,
                        SPAN_BLOCK: tl.constexpr):
    """Rows of block ``rb`` and columns of block ``nb`` of Y[k] = P[h] X[k] (P[h]^T X[k]): the
    band in blocks of BAND columns of P, each a matrix product (float32 multiply-adds)."""
    k, rb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_head = p_ptr + (k // group).to(tl.int64) * L * L
    rows = rb * ROWS + tl.arange(0, ROWS)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    lo, hi = _band(p_head, rows, L, TRANSPOSE, ROWS, SPAN_BLOCK)
    x_mat = in_ptr + k.to(tl.int64) * L * N
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for start in range(lo, hi, BAND):
        cols = start + tl.arange(0, BAND)
        weights = _weights(p_head, rows, cols, L, hi, TRANSPOSE)
        x_rows = tl.load(x_mat + cols[:, None] * N + n[None, :],
                         mask=(cols[:, None] < hi) & (n[None, :] < N), other=0.0)
        acc += tl.dot(weights, x_rows, input_precision='ieee')
    tl.store(out_ptr + k.to(tl.int64) * L * N + rows[:, None] * N + n[None, :], acc,
             mask=(rows[:, None] < L) & (n[None, :] < N))


def band_matmul(p, x, group, transpose=False):
    """P X, or P^T X with ``transpose``, for x (heads * group, L, N) contiguous float32."""
    n, L, N = x.shape
    y = torch.empty_like(x)
    spec = _matmul_spec(transpose)
    _launch('triton.band_matmul', spec, (n, -(-L // ROWS), -(-N // BLOCK_N)),
            [p, x], [y], p, x, y, L, N, group)
    return y


@triton.jit(do_not_specialize=['L', 'K', 'group', 'matrices'])
def _band_outer_kernel(p_ptr, a_ptr, b_ptr, out_ptr, L, K, group, matrices, ROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPAN_BLOCK: tl.constexpr):
    """Chunk ``s`` of the sums G[k, i, j] = sum_c A[k, i, c] X[k, j, c] for rows i of block
    ``rb`` and the columns j where P[h, i, j] != 0, one column of the band at a time; 0 in the
    other columns of the rows (every entry written)."""
    k, rb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_head = p_ptr + (k // group).to(tl.int64) * L * L
    rows = rb * ROWS + tl.arange(0, ROWS)
    c = s * BLOCK_K + tl.arange(0, BLOCK_K)
    lo, hi = _band(p_head, rows, L, False, ROWS, SPAN_BLOCK)
    mat = k.to(tl.int64) * L * K
    a = tl.load(a_ptr + mat + rows[:, None] * K + c[None, :],
                mask=(rows[:, None] < L) & (c[None, :] < K), other=0.0)
    out = out_ptr + (s * matrices + k).to(tl.int64) * L * L + rows * L
    for j in range(lo, hi):
        x_row = tl.load(b_ptr + mat + j * K + c, mask=c < K, other=0.0)
        weights = tl.load(p_head + rows * L + j, mask=rows < L, other=0.0)
        dots = tl.sum(a * x_row[None, :], axis=1)
        tl.store(out + j, tl.where(weights != 0, dots, 0.0), mask=rows < L)
    for start in range(0, L, SPAN_BLOCK):
        cols = start + tl.arange(0, SPAN_BLOCK)
        outside = (rows[:, None] < L) & (cols[None, :] < L) & ((cols < lo) | (cols >= hi))[None, :]
        tl.store(out[:, None] + cols[None, :], tl.zeros([ROWS, SPAN_BLOCK], tl.float32),
                 mask=outside)


def band_outer(p, a, x, group):
    """A X^T where P is nonzero, 0 elsewhere, summed over the matrices of each head (heads, L, L),
    for a and x (heads * group, L, K) contiguous float32."""
    n, L, K = x.shape
    chunks = -(-K // OUTER_BLOCK_K)
    partial = torch.empty(chunks, n, L, L, dtype=torch.float32, device=x.device)
    spec = _outer_spec()
    _launch('triton.band_outer', spec, (n, -(-L // ROWS), chunks), [p, a, x], [partial],
            p, a, x, partial, L, K, group, n)
    return partial.view(chunks, -1, group, L, L).sum((0, 2))


class BandFactor(DenseFactor):
    """:class:`.base.DenseFactor` with the products over the nonzero band of P (float32)."""

    def _product(self, x, transpose):
        return band_matmul(self.p.contiguous(), x.contiguous(), x.shape[0] // self.p.shape[0],
                           transpose)

    def outer(self, a, x):
        return band_outer(self.p.contiguous(), a.contiguous(), x.contiguous(),
                          x.shape[0] // self.p.shape[0])


def _matmul_spec(transpose):
    return _band_matmul_kernel, dict(TRANSPOSE=transpose, ROWS=ROWS, BAND=BAND, BLOCK_N=BLOCK_N,
                                     SPAN_BLOCK=SPAN_BLOCK), 4


def _outer_spec():
    return _band_outer_kernel, dict(ROWS=ROWS, BLOCK_K=OUTER_BLOCK_K, SPAN_BLOCK=SPAN_BLOCK), 4


def specializations():
    """(kernel, constexprs, num_warps) of the band products: the same for every shape."""
    return [_matmul_spec(False), _matmul_spec(True), _outer_spec()]
