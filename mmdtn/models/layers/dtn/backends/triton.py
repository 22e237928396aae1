"""The GPU backend: DTN's full-resolution passes in Triton kernels (:mod:`.triton_kernels`).

Supports CUDA tensors in float16, bfloat16 and float32 (read as they are; statistics in float32,
the output in x's dtype), any H x W, any channel count and pooling, both statistics conventions
(the reference code's group-RMS prenormalisation runs before, in float32, and its result comes
in float32); ``auto`` takes it for CUDA tensors. Not float64: the kernels compute in float32, and
float64 runs on the ``torch`` backend. Needs ``triton``, which comes with PyTorch's CUDA builds;
with ``TRITON_INTERPRET=1`` the kernels also run, slowly, on CPU tensors (for tests).

Four kernels read and write the tokens: the moments T of the cells (x read once), the output (x
read, y written), and backward the token gradients (g and x read, dL/dm of the cells written) and
the input gradient (g and x read, dx written). Between them the positional products run on the cell
grid in float32, both factors in one kernel each way (:mod:`.triton_cells`: T read and m written;
backward dL/dT and the shares of the gradient of a^h); for heads wider than 64 channels, or with
``MMDTN_TRITON_FUSED=0`` or ``MMDTN_TRITON_CELL_PRODUCTS=0``, one axis at a time (:mod:`..function`)
over the nonzero band of each factor (:mod:`.triton_band`). Without pooling the passes are fused
instead, the products formed on chip (:mod:`.triton_fused`; heads of up to 64 channels): forward one
kernel (x read once, y written once), backward two (dL/dm, then dx), whose programs contract their
shares of the gradients of P_y and P_x with Eq. 6's softmax into the gradient of a^h. Where the
staged passes run without pooling, backward never stores T (x - centre and its square, four times
the bytes of 16-bit tokens): the products with P_x form it from the tokens where they read it
(:class:`..function.TokenMoments`).

A layer is one ``torch.library`` custom op each way, ``mmdtn::dtn_triton_forward`` and
``mmdtn::dtn_triton_backward``, which ``torch.compile`` and ``torch.export`` record as single
operations, and in eager calls one autograd node. It takes the layer's own parameters
(:class:`.triton_parameters.KernelParameters`): forward forms the positional factors P_y and P_x
from the coefficients a^h and the per-channel ratios from the gates in one launch, and backward
turns their gradients into those of a^h and the gates in one launch. On a GPU at batch 2 a layer
waits for the host to launch its kernels (docs/gpu.md, "Measured on an H200"): every launch and
autograd node costs host time.
"""
import os

import torch

from ..function import (FormedParameters, Gradients, Saved, TokenMoments, TokenStatistics,
                        define_custom_ops)
from .base import Backend
from .triton_interpreter import drop_dead_overflow_checks, patch_once_per_run

try:
    from .triton_band import BandFactor
    from . import triton_kernels as kernels
    from . import triton_fused as fused
    from . import triton_cells as cells
    from .triton_parameters import KernelParameters
    _MISSING = None
except ImportError as error:  # pragma: no cover - PyTorch builds without triton
    kernels, BandFactor, fused, cells = None, None, None, None
    KernelParameters = FormedParameters  # the op is defined, never run: supports() says why
    _MISSING = f'triton cannot be imported ({error})'

__all__ = ['TritonBackend', 'interpreting']


def interpreting():
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get('TRITON_INTERPRET') == '1'


if interpreting():  # tests, kernel_loads.py: the interpreter, faster (see triton_interpreter.py)
    patch_once_per_run()
    drop_dead_overflow_checks()


class TritonBackend(Backend):
    """DTN in Triton kernels on CUDA GPUs (see the module docstring)."""

    name = 'triton'
    devices = ('cuda', )
    input_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    keeps_token_statistics = False
    raw_second_moment = True
    keeps_row_products = False

    def __init__(self):
        self.normalize = define_custom_ops(self, 'triton', KernelParameters())

    def apply(self, x, pos_coef, gates, weight, bias, grid, eps, convention, layernorm):
        return self.normalize(x, pos_coef, *gates, weight, bias, grid, eps, convention, layernorm)

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

    def factor(self, p, axis):
        return BandFactor(p, axis)

    def forms_products(self, grid):
        return cells.forms_products(grid.pool, grid.d)

    def products(self, T, p_y, p_x, grid):
        return cells.cell_products(T, p_y, p_x, grid)

    def products_backward(self, dm, T, p_y, p_x, grid):
        return cells.cell_products_backward(dm, T, p_y, p_x, grid)

    def token_moments(self, x, centre, grid):
        return TokenMoments(x, centre, grid)  # formed by the band products where they read it

    def statistics(self, x, grid, convention):
        centre = kernels.sample_centre(x)
        T = (kernels.moments(x, centre, grid, convention.square_of_pooled) if grid.pooled
             else self.token_moments(x, centre, grid))
        return TokenStatistics(None, None, centre, None, None, T)

    def fuses_products(self, x, grid, p_x):
        return fused.fuses(grid.pool, grid.d)

    def keeps_fused_products(self, grid):
        return fused.keeps_products(grid.pool, grid.d)

    def fused_forward(self, x, p_y, p_x, ratios, weight, bias, eps, grid, convention):
        centre = kernels.sample_centre(x)
        y, products = fused.fused_output(x, centre, p_y, p_x, ratios, weight, bias, eps,
                                         convention.ln_divisor(grid.C), grid,
                                         self.keeps_fused_products(grid))
        return y, Saved(None, None, centre, products=products)

    def fused_backward(self, g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid):
        dx, sums, shares = fused.fused_backward(g, x, saved.centre, p_y, p_x, ratios, weight, eps,
                                                n_var, grid, saved.products)
        return Gradients(dx, None, None, *self.parameter_gradients(sums), coefficients=[shares])

    @staticmethod
    def _products(m, grid):
        """The two moments of the head-major products m as (B, Hp, Wp, heads, d) views."""
        return [grid.from_head_major(t) for t in m.unbind(1)]

    def output(self, x, stats, m, ratios, weight, bias, eps, n_var, grid):
        return kernels.output(x, stats.centre, *self._products(m, grid), ratios.contiguous(),
                              weight.contiguous(), bias.contiguous(), eps, n_var, grid)

    def token_gradients(self, g, x, saved, m, ratios, weight, eps, n_var, grid):
        dm, sums = kernels.token_gradients(g, x, saved.centre, *self._products(m, grid),
                                           ratios.contiguous(), weight.contiguous(), eps, n_var,
                                           grid)
        return None, sums, dm  # pass 2 forms D1 again; sums per program

    def parameter_gradients(self, sums):
        return kernels.parameter_gradients(sums)

    def input_gradient(self, tokens, g, x, saved, m, ratios, weight, eps, n_var, d_first,
                       d_second, grid):
        d_second = None if d_second is None else grid.from_column_major(d_second)
        return kernels.input_gradient(g, x, saved.centre, *self._products(m, grid),
                                      ratios.contiguous(), weight.contiguous(), eps, n_var,
                                      grid.from_column_major(d_first), d_second, grid)
