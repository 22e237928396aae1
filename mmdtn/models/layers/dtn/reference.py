"""The dense reference of Dynamic Token Normalization, written line by line against the paper
(Shao et al., "Dynamic Token Normalization Improves Vision Transformers", ICLR 2022, Sec. 3.2,
Eqs. 2 and 4-7, Algorithm 1; App. B.1 for the pooling).

It builds the T x T positional matrix P^h of every head and applies it with plain matrix products,
exactly as the equations read, in O(B C T^2) time and O(H T^2) memory. It is the one oracle of the
tests and benchmarks: every backend of :class:`~mmdtn.models.layers.dtn.DynamicTokenNorm` must
equal it, forward and backward (autograd of this code), to rounding. Nothing here is fast.
"""

import torch

from ..reference_compat import PAPER_CONVENTION, group_rms_normalize
from .grid import pooled_size

__all__ = ['relative_positions', 'dense_positional_matrix', 'pooling_matrix', 'dense_dtn',
           'DenseDynamicTokenNorm']


def relative_positions(Hp, Wp, dtype=torch.float64, device=None):
    """R of Eq. 6, (T, T, 3) with T = Hp * Wp cells in row-major order:
    R_ij = [dx^2 + dy^2, dx, dy], (dx, dy) = column and row of source j minus those of output i."""
    ys, xs = torch.meshgrid(torch.arange(Hp, dtype=dtype, device=device),
                            torch.arange(Wp, dtype=dtype, device=device), indexing='ij')
    ys, xs = ys.flatten(), xs.flatten()
    dx = xs[None, :] - xs[:, None]
    dy = ys[None, :] - ys[:, None]
    return torch.stack([dx**2 + dy**2, dx, dy], dim=-1)


def dense_positional_matrix(pos_coef, Hp, Wp):
    """P^h = softmax_j(R_ij . a^h) (Eq. 6) for every head: (heads, T, T), rows sum to 1."""
    R = relative_positions(Hp, Wp, pos_coef.dtype, pos_coef.device)
    return torch.softmax(torch.einsum('ijk,hk->hij', R, pos_coef), dim=-1)


def pooling_matrix(H, W, pool_size, dtype=torch.float64, device=None):
    """The average pooling of App. B.1 as a (Hp * Wp, H * W) matrix: row t averages the real
    tokens of cell t of the ceil(H / s) x ceil(W / s) grid. Also returns the cell of every token
    (H * W,), for broadcasting the cell statistics back to the tokens."""
    s = pool_size
    Hp, Wp = pooled_size((H, W), s)
    rows = torch.arange(H, device=device)[:, None] // s
    cols = torch.arange(W, device=device)[None, :] // s
    cell = (rows * Wp + cols).flatten()
    M = torch.zeros(Hp * Wp, H * W, dtype=dtype, device=device)
    M[cell, torch.arange(H * W, device=device)] = 1.0
    return M / M.sum(1, keepdim=True), cell


def dense_dtn(x, hw_shape, weight, bias, mean_gate, var_gate, pos_coef, pool_size=1, eps=1e-6,
              convention=PAPER_CONVENTION):
    """DTN of tokens x (B, N, C), N = H * W row-major, with dense P^h; differentiable by autograd.

    Args:
        weight, bias: gamma and beta of Eq. 4, (C,).
        mean_gate, var_gate: logits of the weight ratios lambda^h of Eq. 5, (heads,).
        pos_coef: a^h of Eq. 6, (heads, 3), coefficients of [dx^2 + dy^2, dx, dy].
        pool_size: s, inter-token statistics on s x s cells (App. B.1).
        convention: the paper's statistics or the authors' code's
            (:mod:`~mmdtn.models.layers.reference_compat`).

    Returns:
        tuple: y (B, N, C), and a dict of the normalization constants (B, N, C) or (B, N, 1):
        'mean_ln', 'var_ln' (Eq. 2), 'mean_it', 'var_it' (the inter-token terms of Eq. 5),
        'mean', 'var' (Eq. 5).
    """
    B, N, C = x.shape
    H, W = hw_shape
    heads = pos_coef.shape[0]
    d = C // heads
    if convention.group_rms_prenorm:
        x = group_rms_normalize(x, heads, eps)

    # Eq. 2: intra-token (LN) statistics over the C channels of every token
    n_var = convention.ln_divisor(C)
    mean_ln = x.mean(-1, keepdim=True)
    var_ln = (x - mean_ln).square().sum(-1, keepdim=True) / n_var

    # App. B.1: the inter-token statistics are computed on average-pooled cells
    M, cell = pooling_matrix(H, W, pool_size, x.dtype, x.device)
    Hp, Wp = pooled_size((H, W), pool_size)
    x_cells = torch.einsum('tn,bnc->btc', M, x).view(B, -1, heads, d)  # x^h per head
    if convention.square_of_pooled:
        x2_cells = x_cells * x_cells
    else:
        x2_cells = torch.einsum('tn,bnc->btc', M, x * x).view(B, -1, heads, d)

    # Eq. 6: P^h = softmax(R a^h)
    P = dense_positional_matrix(pos_coef.to(x.dtype), Hp, Wp)

    # Eq. 5: inter-token mean P^h x^h and variance P^h (x^h . x^h) - (P^h x^h)^2
    mean_it = torch.einsum('hij,bjhd->bihd', P, x_cells)
    var_it = (torch.einsum('hij,bjhd->bihd', P, x2_cells) - mean_it**2).clamp_min(0)
    mean_it = mean_it.reshape(B, -1, C)[:, cell]  # every token takes its cell's statistics
    var_it = var_it.reshape(B, -1, C)[:, cell]

    # Eq. 5: mu^h = lam^h mu_ln + (1 - lam^h) P^h x^h, sigma2^h likewise; lam^h = sigmoid(gate)
    lam_mean = torch.sigmoid(mean_gate.to(x.dtype)).repeat_interleave(d)
    lam_var = torch.sigmoid(var_gate.to(x.dtype)).repeat_interleave(d)
    mean = lam_mean * mean_ln + (1 - lam_mean) * mean_it
    var = lam_var * var_ln + (1 - lam_var) * var_it

    # Eq. 4: y = gamma (x - mu) / sqrt(sigma2 + eps) + beta
    y = weight.to(x.dtype) * (x - mean) / torch.sqrt(var + eps) + bias.to(x.dtype)
    stats = dict(mean_ln=mean_ln, var_ln=var_ln, mean_it=mean_it, var_it=var_it, mean=mean,
                 var=var)
    return y, stats


class DenseDynamicTokenNorm(torch.nn.Module):
    """:func:`dense_dtn` with the parameters of a :class:`DynamicTokenNorm` (shared, not copied),
    called like it: ``forward(x, hw_shape)``. For tests, benchmarks and documentation."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, hw_shape):
        n = self.norm
        return dense_dtn(x, hw_shape, n.weight, n.bias, *n.gate_logits(), n.pos_coef,
                         n.pool_size, n.eps, n.convention)[0]
