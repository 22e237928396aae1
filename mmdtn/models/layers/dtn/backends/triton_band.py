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
                 product (``tl.dot`` in float32); Y written as it is or with its blocks of d
                 columns moved ahead of the rows (the layout the next product reads)
    band_outer   G = A X^T where P is nonzero, the gradient of P: a program per matrix, block
                 of rows and chunk of BLOCK_K of the summed dimension, one column of the band at
                 a time, contracting its part of G with Eq. 6's softmax as it goes (below)

G is never stored. The layer forms P = softmax(a . R) by rows from a^h (Eq. 6), so the gradient of
a^h is linear in G, sum_ij G_ij P_ij (R_ij - Rbar_i) with Rbar_i = sum_j P_ij R_ij and R = (d^2, d),
d = j - i: every program gives its share of it, three numbers, which the parameters' backward
kernel adds up in a fixed order (:mod:`.triton_parameters`; no float atomics). Stored, G took L x L
values per chunk and matrix, written and then summed by PyTorch.

Measured on an H200 (docs/gpu.md, "Measured on an H200"): ``tl.dot`` took band_matmul to 0.68-0.72x
the time of a column-at-a-time loop, but band_outer to 1.25-1.65x, so band_outer keeps the loop.

Matrix k of X, A and the results uses P[k // group]. Everything is float32, except that without
pooling X = T (x - centre and its square, four times the bytes of 16-bit tokens) is not stored:
with TOKENS the kernels form its entries from the tokens where they read them
(:class:`..function.TokenMoments`). Without pooling these products run only for heads too wide
for the fused passes (:mod:`.triton_fused`), which form the products on chip.
"""
import torch
import triton
import triton.language as tl

from ..function import TokenMoments
from .base import DenseFactor
from .triton_launch import cdiv, launch

__all__ = ['BandFactor', 'band_matmul', 'band_outer', 'specializations']

#: Tiles of the band products, chosen on an H200 by ``tools/analysis/tune_band_tiles.py`` (README,
#: "DTN on GPUs"; on another GPU, run it and put its tables here), by kernel and operand:
#: ``matrices`` (X float32, P X), ``transposed`` (P^T X) and ``tokens`` (X the T of the tokens,
#: formed in registers from a pointer each). ROWS: rows of P per program; BAND: columns of P per
#: step over the band; BLOCK_N: columns of X per program; STAGES: steps over the band in flight;
#: BLOCK_K (band_outer): values of the summed dimension per program.
MATMUL_TILES = {
    'matrices': dict(ROWS=16, BAND=16, BLOCK_N=128, STAGES=1, warps=4),
    'transposed': dict(ROWS=8, BAND=16, BLOCK_N=256, STAGES=2, warps=4),
    'tokens': dict(ROWS=16, BAND=16, BLOCK_N=64, STAGES=1, warps=4),
}
OUTER_TILES = {
    'matrices': dict(ROWS=8, BLOCK_K=512, warps=4),
    'tokens': dict(ROWS=4, BLOCK_K=512, warps=4),
}
#: Entries of P one step of the search for the band reads.
SPAN_BLOCK = 64


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


@triton.jit
def _token_indices(x_ptr, centre_ptr, head, n, mask, B, H, W, C, d):
    """Where the entries of T = (x - centre, (x - centre)^2) (:class:`..function.TokenMoments`;
    no pooling, a cell is a token) of head ``head`` at the indices ``n`` (1-D) of (slot, image,
    row, channel of the head) come from, given the tokens x (B, H W, C) and the centre (B, C): the
    pointers to their tokens in column 0, their centre and whether they are the second slot."""
    channel = head * d + n % d
    image_row = n // d
    b = (image_row // H) % B
    first_token = (b * H + image_row % H).to(tl.int64) * W * C + channel
    centre = tl.load(centre_ptr + b * C + channel, mask=mask, other=0.0)
    return x_ptr + first_token, centre, image_row >= B * H


@triton.jit
def _token_moments(tokens, centre, second, col, C, mask):
    """Entries of T in token column(s) ``col`` from :func:`_token_indices` (broadcast); 0 where
    not ``mask``."""
    diff = tl.load(tokens + col * C, mask=mask, other=0.0).to(tl.float32) - centre
    return tl.where(mask, tl.where(second, diff * diff, diff), 0.0)


@triton.jit(do_not_specialize=['L', 'N', 'group', 'inner', 'B', 'H', 'C', 'd'])
def _band_matmul_kernel(p_ptr, in_ptr, x_ptr, centre_ptr, out_ptr, L, N, group, inner, B, H, C,
                        d, TRANSPOSE: tl.constexpr, TOKENS: tl.constexpr, ROWS: tl.constexpr,
                        BAND: tl.constexpr, BLOCK_N: tl.constexpr, SPAN_BLOCK: tl.constexpr,
                        STAGES: tl.constexpr):
    """Rows of block ``rb`` and columns of block ``nb`` of Y[k] = P[h] X[k] (P[h]^T X[k]): the
    band in blocks of BAND columns of P, each a matrix product (float32 multiply-adds). Y is
    stored as (heads, N / inner, group, L, inner): as (heads * group, L, N) for inner = N. With
    TOKENS, X is the T of the tokens x (group 1)."""
    k, rb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p_head = p_ptr + (k // group).to(tl.int64) * L * L
    rows = rb * ROWS + tl.arange(0, ROWS)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    lo, hi = _band(p_head, rows, L, TRANSPOSE, ROWS, SPAN_BLOCK)
    if TOKENS:
        tokens, centre, second = _token_indices(x_ptr, centre_ptr, k, n, n < N, B, H, L, C, d)
    else:
        x_mat = in_ptr + k.to(tl.int64) * L * N
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for start in tl.range(lo, hi, BAND, num_stages=STAGES):
        cols = start + tl.arange(0, BAND)
        weights = _weights(p_head, rows, cols, L, hi, TRANSPOSE)
        mask = (cols[:, None] < hi) & (n[None, :] < N)
        if TOKENS:
            x_rows = _token_moments(tokens[None, :], centre[None, :], second[None, :],
                                    cols[:, None], C, mask)
        else:
            x_rows = tl.load(x_mat + cols[:, None] * N + n[None, :], mask=mask, other=0.0)
        acc += tl.dot(weights, x_rows, input_precision='ieee')
    h, matrix = k // group, k % group
    block = (h.to(tl.int64) * group * N + (n // inner) * group * inner) * L
    out = out_ptr + block[None, :] + (matrix * L + rows[:, None]) * inner + (n % inner)[None, :]
    tl.store(out, acc, mask=(rows[:, None] < L) & (n[None, :] < N))


def _operand(x):
    """A product's right operand x: float32 (matrices, L, N) contiguous, or the T of a
    TokenMoments. Returns its shape, whether it is T formed from tokens, the tensors it reads, and
    the kernels' arguments for it: in_ptr, x_ptr, centre_ptr and the sizes B, H, C, d. The
    pointer a kernel does not read is another operand of its type: a kernel of the tokens is
    compiled once per dtype of the tokens, one of matrices once."""
    if isinstance(x, TokenMoments):
        grid = x.grid
        shape = (grid.heads, grid.W, 2 * grid.B * grid.H * grid.d)
        centre = x.centre.contiguous()
        return shape, True, [x.x, centre], (centre, x.x, centre), (grid.B, grid.H, grid.C, grid.d)
    x = x.contiguous()
    return x.shape, False, [x], (x, x, x), (1, 1, 1, 1)


def band_matmul(p, x, group, transpose=False, inner=None):
    """P X, or P^T X with ``transpose``, for x (heads * group, L, N) float32 or a TokenMoments
    (group 1); with ``inner`` as :meth:`.base.DenseFactor.matmul`, (heads, N / inner, group, L,
    inner)."""
    (n, L, N), tokens, reads, pointers, sizes = _operand(x)
    shape = (n, L, N) if inner is None else (n // group, N // inner, group, L, inner)
    y = torch.empty(shape, dtype=torch.float32, device=p.device)
    spec = _matmul_spec(transpose, tokens)
    tiles = spec[1]
    launch('triton.band_matmul', spec, (n, cdiv(L, tiles['ROWS']), cdiv(N, tiles['BLOCK_N'])),
           [p, *reads], [y], p, *pointers, y, L, N, group, inner or N, *sizes)
    return y


@triton.jit(do_not_specialize=['L', 'K', 'group', 'heads', 'linear', 'B', 'H', 'C', 'd'])
def _band_outer_kernel(p_ptr, a_ptr, in_ptr, x_ptr, centre_ptr, shares_ptr, L, K, group, heads,
                       linear, B, H, C, d, TOKENS: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPAN_BLOCK: tl.constexpr):
    """Program (k, rb, s): chunk ``s`` of G[k, i, j] = sum_c A[k, i, c] X[k, j, c] for the rows
    i of block ``rb`` and the columns j where P[h, i, j] != 0, one column of the band at a time,
    contracted with the softmax of Eq. 6 as it goes: its share of the gradient of a^h (3,),
    d^2 in slot 0 and d in slot ``linear`` (d = j - i), the other slot 0. With TOKENS, X is the T
    of the tokens x (group 1)."""
    k, rb, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    h = k // group
    p_head = p_ptr + h.to(tl.int64) * L * L
    rows = rb * ROWS + tl.arange(0, ROWS)
    c = s * BLOCK_K + tl.arange(0, BLOCK_K)
    lo, hi = _band(p_head, rows, L, False, ROWS, SPAN_BLOCK)
    mat = k.to(tl.int64) * L * K
    a = tl.load(a_ptr + mat + rows[:, None] * K + c[None, :],
                mask=(rows[:, None] < L) & (c[None, :] < K), other=0.0)
    if TOKENS:
        tokens, centre, second = _token_indices(x_ptr, centre_ptr, k, c, c < K, B, H, L, C, d)
    # per row i, over its band: sum_j P G (1, d, d^2) and sum_j P (d, d^2), the Rbar_i of Eq. 6
    weighted = tl.zeros([ROWS], tl.float32)
    weighted_d = tl.zeros([ROWS], tl.float32)
    weighted_square = tl.zeros([ROWS], tl.float32)
    mean_d = tl.zeros([ROWS], tl.float32)
    mean_square = tl.zeros([ROWS], tl.float32)
    for j in range(lo, hi):
        if TOKENS:
            x_row = _token_moments(tokens, centre, second, j, C, c < K)
        else:
            x_row = tl.load(in_ptr + mat + j * K + c, mask=c < K, other=0.0)
        weights = tl.load(p_head + rows * L + j, mask=rows < L, other=0.0)
        offset = (j - rows).to(tl.float32)
        pg = weights * tl.sum(a * x_row[None, :], axis=1)
        weighted += pg
        weighted_d += pg * offset
        weighted_square += pg * offset * offset
        mean_d += weights * offset
        mean_square += weights * offset * offset
    # dl_ij = P_ij (G_ij - sum_j' P_ij' G_ij') is the gradient of row i's logits, and
    # sum_j dl_ij R_ij = sum_j P_ij G_ij (R_ij - Rbar_i): linear in G, so chunks and matrices add
    share_square = tl.sum(weighted_square - mean_square * weighted, axis=0)
    share_d = tl.sum(weighted_d - mean_d * weighted, axis=0)
    program = ((k % group) * tl.num_programs(1) + rb) * tl.num_programs(2) + s
    out = shares_ptr + (program * heads + h) * 3
    tl.store(out, share_square)
    tl.store(out + 1, tl.where(linear == 1, share_d, 0.0))
    tl.store(out + 2, tl.where(linear == 2, share_d, 0.0))


def band_outer(p, a, x, group, linear):
    """The gradient of P for u = P X and dL/du = A, G = A X^T where P is nonzero, contracted with
    the softmax of Eq. 6 into shares (programs, heads, 3) of the gradient of a^h, which add up to
    it: d^2 in slot 0, d in slot ``linear`` (1 for P_x, 2 for P_y). a (heads * group, L, K)
    contiguous float32, x as a (float32, or a TokenMoments with group 1)."""
    (n, L, K), tokens, reads, pointers, sizes = _operand(x)
    spec = _outer_spec(tokens)
    grid = (n, cdiv(L, spec[1]['ROWS']), cdiv(K, spec[1]['BLOCK_K']))
    heads = n // group
    shares = torch.empty(group * grid[1] * grid[2], heads, 3, dtype=torch.float32,
                         device=p.device)
    launch('triton.band_outer', spec, grid, [p, a, *reads], [shares], p, a, *pointers, shares, L,
           K, group, heads, linear, *sizes)
    return shares


class BandFactor(DenseFactor):
    """:class:`.base.DenseFactor` with the products over the nonzero band of P (float32), P_y's
    (``axis`` 'y') or P_x's ('x'); :meth:`outer` gives the gradient of P contracted: shares of
    the gradient of a^h (:func:`band_outer`)."""

    contracts = True

    def __init__(self, p, axis):
        super().__init__(p, axis)
        self.linear = 2 if axis == 'y' else 1

    def matmul(self, x, transpose=False, inner=None):
        return band_matmul(self.p.contiguous(), x, self._group(x), transpose, inner)

    def outer(self, a, x):
        return band_outer(self.p.contiguous(), a.contiguous(), x, self._group(x), self.linear)

    def _group(self, x):
        return 1 if isinstance(x, TokenMoments) else x.shape[0] // self.p.shape[0]


def _matmul_spec(transpose, tokens=False):
    tiles = dict(MATMUL_TILES['tokens' if tokens else 'transposed' if transpose else 'matrices'])
    warps = tiles.pop('warps')
    return _band_matmul_kernel, dict(TRANSPOSE=transpose, TOKENS=tokens, **tiles,
                                     SPAN_BLOCK=SPAN_BLOCK), warps


def _outer_spec(tokens=False):
    tiles = dict(OUTER_TILES['tokens' if tokens else 'matrices'])
    warps = tiles.pop('warps')
    return _band_outer_kernel, dict(TOKENS=tokens, **tiles, SPAN_BLOCK=SPAN_BLOCK), warps


def specializations():
    """(kernel, constexprs, num_warps) of the band products: the same for every shape; with
    TOKENS (no pooling) P_x T and the gradient of P_x read T's tokens."""
    return [_matmul_spec(False), _matmul_spec(True), _matmul_spec(False, True), _outer_spec(),
            _outer_spec(True)]
