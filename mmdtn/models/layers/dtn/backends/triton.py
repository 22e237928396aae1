"""The GPU backend: DTN's full-resolution passes in Triton kernels (:mod:`.triton_kernels`).

Supports CUDA tensors in float16, bfloat16 and float32 (read as they are; statistics in float32,
the output in x's dtype), any H x W, any channel count and pooling, both statistics conventions;
``auto`` takes it for CUDA tensors with pooling of at least :attr:`TritonBackend.AUTO_MIN_POOL`
(below, the eager ``torch`` backend was measured faster). Not float64: the kernels compute in
float32, and float64 runs on the ``torch`` backend. Needs ``triton``, which comes with PyTorch's
CUDA builds; with ``TRITON_INTERPRET=1`` the kernels also run, slowly, on CPU tensors (for
tests). The positional products are fused into the kernels over the nonzero bands of P_y and
P_x, of the tokens or, with pooling, of the cells (see :mod:`.triton_kernels`).

The kernels run inside the ``torch.library`` custom ops ``mmdtn::dtn_triton_forward`` and
``mmdtn::dtn_triton_backward``, which ``torch.compile`` and ``torch.export`` record as single
operations; the positional factors P_y and P_x are formed from the coefficients a^h in
``mmdtn::dtn_triton_axis_factors`` (:mod:`.triton_factors`), one launch forward and one backward.
"""
import os

import torch

from ..function import Saved, TokenStatistics, define_custom_ops, ln_statistics
from .base import Backend, DenseFactor

try:
    from . import triton_factors as factors
    from . import triton_kernels as kernels
    _MISSING = None
except ImportError as error:  # pragma: no cover - PyTorch builds without triton
    factors, kernels, _MISSING = None, None, f'triton cannot be imported ({error})'

__all__ = ['TritonBackend', 'interpreting']


def interpreting():
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get('TRITON_INTERPRET') == '1'


class TritonBackend(Backend):
    """DTN in Triton kernels on CUDA GPUs (see the module docstring)."""

    name = 'triton'
    devices = ('cuda', )
    input_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    keeps_token_statistics = False

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

    #: The smallest pooling at which ``auto`` takes this backend. Measured on an H200 (README,
    #: "DTN on GPUs"; forward + backward, float16 tokens, PVT-Tiny's and Swin-T's stages at
    #: 800 x 1344): with pooling 4 the kernels take 0.6-0.8x the time of the eager 'torch'
    #: backend, with pooling 2 1.7x, without pooling 4-8x (the fused band products of Eq. 6 read
    #: the band of every token, where the 'torch' backend multiplies by P_y and P_x in turn).
    AUTO_MIN_POOL = 4

    def auto_passes_over(self, x, grid):
        return grid.pool < self.AUTO_MIN_POOL

    def axis_factors(self, pos_coef, rows, cols):
        return factors.axis_factors(pos_coef, rows, cols)

    def factor(self, p):
        return DenseFactor(p)

    def statistics(self, x, grid, convention):  # for analysis: the passes never store Eq. 2
        mean_ln, var_ln = ln_statistics(x.float(), convention.ln_divisor(grid.C))
        cells, centre = kernels.statistics(x, grid)
        if not grid.pooled:
            return TokenStatistics(mean_ln, var_ln, centre, grid.cell_means(x), None)  # a view
        cell_mean, cell_var = cells
        cell_second = None
        if not convention.square_of_pooled:  # the mean of (x - centre)^2 over the cell
            cell_second = cell_var + (cell_mean - centre).square()
        return TokenStatistics(mean_ln, var_ln, centre, cell_mean, cell_second)

    def fuses_products(self, x, grid, p_x):
        return not grid.pooled

    def fuses_cell_products(self, x, grid):
        return True

    def fused_forward(self, x, p_y, p_x, ratios, weight, bias, eps, grid, convention):
        return self._forward(x, p_y, p_x, ratios, weight, bias, eps, grid, convention)

    def fused_cell_forward(self, x, p_y, p_x, ratios, weight, bias, eps, grid, convention):
        return self._forward(x, p_y, p_x, ratios, weight, bias, eps, grid, convention)

    def fused_backward(self, g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid):
        return self._backward(g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid)

    def fused_cell_backward(self, g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid,
                            convention):
        return self._backward(g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid,
                              convention.square_of_pooled)

    @staticmethod
    def _forward(x, p_y, p_x, ratios, weight, bias, eps, grid, convention):
        cells, centre = kernels.statistics(x, grid)
        y = kernels.output(x, centre, p_y.detach().contiguous(), p_x.detach().contiguous(),
                           ratios.contiguous(), weight.contiguous(), bias.contiguous(), eps,
                           convention.ln_divisor(grid.C), grid, cells,
                           convention.square_of_pooled)
        return y, Saved(None, None, centre, cells)

    @staticmethod
    def _backward(g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid,
                  square_of_pooled=False):
        return kernels.fused_backward(g, x, saved.centre.contiguous(), p_y.detach().contiguous(),
                                      p_x.detach().contiguous(), ratios.contiguous(),
                                      weight.contiguous(), eps, n_var, grid, saved.moments,
                                      square_of_pooled)
