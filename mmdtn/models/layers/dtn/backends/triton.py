"""The GPU backend: DTN's full-resolution passes in Triton kernels (:mod:`.triton_kernels`).

Supports CUDA tensors in float16, bfloat16 and float32 (read as they are; statistics in float32,
the output in x's dtype), any H x W, any channel count and pooling, both statistics conventions;
``auto`` takes it for CUDA tensors. Not float64: the kernels compute in float32, and float64 runs
on the ``torch`` backend. Needs ``triton``, which comes with PyTorch's CUDA builds; with
``TRITON_INTERPRET=1`` the kernels also run, slowly, on CPU tensors (for tests). With pooling
the positional products of the cells run as batched matrix products (PyTorch) between the
kernels; without pooling, where the cells are the tokens, they are fused into the kernels over
the nonzero bands of P_y and P_x (see :mod:`.triton_kernels`).

The kernels run inside the ``torch.library`` custom ops ``mmdtn::dtn_triton_forward`` and
``mmdtn::dtn_triton_backward``, which ``torch.compile`` and ``torch.export`` record as single
operations.
"""
import os

import torch

from ..function import TokenStatistics, define_custom_ops
from .base import Backend, DenseFactor

try:
    from . import triton_kernels as kernels
    _MISSING = None
except ImportError as error:  # pragma: no cover - PyTorch builds without triton
    kernels, _MISSING = None, f'triton cannot be imported ({error})'

__all__ = ['TritonBackend', 'interpreting']


def interpreting():
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get('TRITON_INTERPRET') == '1'


class TritonBackend(Backend):
    """DTN in Triton kernels on CUDA GPUs (see the module docstring)."""

    name = 'triton'
    devices = ('cuda', )
    input_dtypes = (torch.float16, torch.bfloat16, torch.float32)

    def __init__(self):
        self.apply = define_custom_ops(self, 'triton')

    def supports(self, x, grid, dtype):
        if _MISSING:
            return _MISSING
        if dtype == torch.float64:
            return "the Triton kernels compute in float32; float64 runs on the 'torch' backend"
        if x.device.type == 'cpu' and not interpreting():
            return ('x is on the CPU; the Triton kernels run on CUDA GPUs (and, with '
                    'TRITON_INTERPRET=1, in Triton\'s interpreter)')
        if x.device.type not in ('cuda', 'cpu', 'meta'):
            return f'x is on {x.device}; the Triton kernels run on CUDA GPUs'
        return None

    def factor(self, p):
        return DenseFactor(p)

    def statistics(self, x, grid, convention):
        n_var = grid.C - 1 if convention.unbiased_ln_var else grid.C
        mean_ln, var_ln, cells = kernels.statistics(x, grid, n_var)
        if not grid.pooled:  # cells: per-image channel sums of the programs
            centre = (cells.sum(1) / grid.N).view(grid.B, 1, 1, grid.C)
            return TokenStatistics(mean_ln, var_ln, centre, grid.cell_means(x), None)  # a view
        cell_mean, cell_m2 = cells
        centre = cell_mean.mean(dim=(1, 2), keepdim=True)
        cell_second = None
        if not convention.square_of_pooled:  # the mean of (x - centre)^2 over the cell
            counts = grid.cell_counts(x.device, cell_m2.dtype)
            cell_second = cell_m2 / counts + (cell_mean - centre).square()
        return TokenStatistics(mean_ln, var_ln, centre, cell_mean, cell_second)

    @staticmethod
    def _cells(m, grid):
        return [grid.from_head_major(t) for t in m.unbind(1)]

    def output(self, x, stats, m, ratios, weight, bias, eps, grid):
        first, second = self._cells(m, grid)
        return kernels.output(x, stats.mean_ln, stats.var_ln, first, second,
                              stats.centre.contiguous(), ratios.contiguous(),
                              weight.contiguous(), bias.contiguous(), eps, grid)

    def token_gradients(self, g, x, saved, m, ratios, weight, eps, grid):
        dm = torch.empty_like(m)
        first, second = self._cells(m, grid)
        sums = kernels.token_gradients(g, x, saved.mean_ln, saved.var_ln, first, second,
                                       saved.centre, ratios.contiguous(), weight.contiguous(), eps,
                                       dm, grid)
        return None, sums, dm  # pass 2 recomputes the per-token terms

    def input_gradient(self, tokens, g, x, saved, m, ratios, weight, eps, n_var, d_first,
                       d_second, grid):
        first, second = self._cells(m, grid)
        return kernels.input_gradient(
            g, x, saved.mean_ln, saved.var_ln, first, second, saved.centre, ratios.contiguous(),
            weight.contiguous(), eps, n_var, grid.from_column_major(d_first),
            None if d_second is None else grid.from_column_major(d_second), grid)

    def fuses_products(self, x, grid, p_x):
        return not grid.pooled

    def fused_output(self, x, stats, p_y, p_x, ratios, weight, bias, eps, grid):
        return kernels.fused_output(x, stats.mean_ln, stats.var_ln, stats.centre.contiguous(),
                                    p_y.detach().contiguous(), p_x.detach().contiguous(),
                                    ratios.contiguous(), weight.contiguous(), bias.contiguous(),
                                    eps, grid)

    def fused_backward(self, g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid):
        return kernels.fused_backward(g, x, saved.mean_ln, saved.var_ln, saved.centre.contiguous(),
                                      p_y.detach().contiguous(), p_x.detach().contiguous(),
                                      ratios.contiguous(), weight.contiguous(), eps, n_var, grid)
