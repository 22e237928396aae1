"""The portable backend: DTN's passes as PyTorch operations, on any device and dtype.

Supports every input. Each pass is a handful of element-wise operations and reductions written
functionally (no ``out=`` into views), so that ``torch.compile`` traces forward and backward in one
graph and, on GPUs, fuses them into generated kernels; ``torch.export`` and ``torch.jit.trace`` see
plain aten operations. The positional products are dense batched matrix products. In eager mode this
is the slowest backend: about a dozen kernels per pass, each a trip through memory.
"""
import torch

from ..function import TokenStatistics, define_traced_function, ln_gradient, ln_statistics
from .base import Backend

__all__ = ['PyTorchBackend']


class PyTorchBackend(Backend):
    """DTN in PyTorch operations (see the module docstring)."""

    name = 'torch'

    def __init__(self):
        self.normalize = define_traced_function(self)

    def supports(self, x, grid, dtype):
        if not x.dtype.is_floating_point:
            return f'x must be a floating-point tensor, got {x.dtype}'
        return None

    def statistics(self, x, grid, convention):
        B, N, C = x.shape
        mean_ln, var_ln = ln_statistics(x, convention.ln_divisor(C))  # Eq. 2
        cell_mean = grid.cell_means(x)
        # rows of P sum to 1: moments about any per-channel constant are exact
        centre = cell_mean.mean(dim=(1, 2), keepdim=True)
        cell_second = None
        if grid.pooled and not convention.square_of_pooled:
            cell_second = grid.cell_means((x - centre.view(B, 1, C)).square())
        return TokenStatistics(mean_ln, var_ln, centre, cell_mean, cell_second)

    @staticmethod
    def _inter_token(centre, m, grid):
        """mu_it and var_it per token, (B, N, C), and the first moment per cell."""
        first, second = (grid.cells_of(grid.from_head_major(t)) for t in m.unbind(1))
        var_it = second if grid.pooled else (second - first * first).clamp_min(0)
        return grid.to_tokens(first + centre), grid.to_tokens(var_it), first

    def output(self, x, stats, m, ratios, weight, bias, eps, n_var, grid):
        mean_it, var_it, _ = self._inter_token(stats.centre, m, grid)
        lam_m, kap_m, lam_v, kap_v = ratios.unbind(0)
        mean = lam_m * stats.mean_ln + kap_m * mean_it  # Eq. 5
        var = lam_v * stats.var_ln + kap_v * var_it  # Eq. 5
        return (x - mean) * torch.rsqrt(var + eps) * weight + bias  # Eq. 4

    def token_gradients(self, g, x, saved, m, ratios, weight, eps, n_var, grid):
        C = grid.C
        mean_it, var_it, first = self._inter_token(saved.centre, m, grid)
        lam_m, kap_m, lam_v, kap_v = ratios.unbind(0)
        rstd = torch.rsqrt(lam_v * saved.var_ln + kap_v * var_it + eps)
        xhat = (x - lam_m * saved.mean_ln - kap_m * mean_it) * rstd
        d1 = g * weight * rstd  # -dL/dmu
        d2 = d1 * xhat * rstd  # -2 dL/dvar
        tok1 = (d1 * lam_m).sum(-1, keepdim=True)
        tok2 = (d2 * lam_v).sum(-1, keepdim=True)
        sums = torch.stack([t.reshape(-1, C).sum(0) for t in (
            xhat * g, g, saved.mean_ln * d1, saved.var_ln * d2, mean_it * d1, var_it * d2)])
        # dL/dm per cell, with respect to the raw moments (m_second = P T_1):
        # dL/dm_second = dL/dvar_it [var_it > 0], dL/dm_first = dL/dmu_it - 2 m_first dL/dm_second
        var_it_cells = grid.cells_of(grid.from_head_major(m[:, 1]))
        if not grid.pooled:
            var_it_cells = var_it_cells - first * first
        dm_second = -0.5 * kap_v * grid.cell_sums(d2) * (var_it_cells > 0)
        dm_first = -kap_m * grid.cell_sums(d1) - 2 * first * dm_second
        dm = torch.stack([grid.to_head_major(dm_first), grid.to_head_major(dm_second)], dim=1)
        return (d1, tok1, tok2), sums, dm.contiguous()

    def input_gradient(self, tokens, g, x, saved, m, ratios, weight, eps, n_var, d_first,
                       d_second, grid):
        d1, tok1, tok2 = tokens
        beta, alpha = ln_gradient(tok1, tok2, saved.mean_ln, grid.C, n_var)
        counts = grid.cell_counts(x.device, x.dtype)

        def per_token(d):  # column-major dL/dT -> (B, N, C), divided by the cell's tokens
            return grid.to_tokens(grid.cells_of(grid.from_column_major(d)) / counts)

        dx = d1 + x * beta + alpha + per_token(d_first)
        if d_second is not None:
            dx = dx + 2 * (x - saved.centre.view(grid.B, 1, grid.C)) * per_token(d_second)
        return dx
