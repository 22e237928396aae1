"""The GPU backend: DTN's passes over the tokens in Triton kernels, its positional products as
float32 matrix products on cuBLAS.

Supports CUDA tensors in float16, bfloat16 and float32 (read as they are; statistics in float32,
the output in x's dtype), any H x W, any channel count and head width, any pooling, both
statistics conventions (the reference code's group-RMS prenormalization runs before, in float32,
and its result comes in float32); ``auto`` takes it for CUDA tensors. Not float64: the kernels
compute in float32, and float64 runs on the ``torch`` backend. Needs ``triton``, which comes with
PyTorch's CUDA builds; with ``TRITON_INTERPRET=1`` the kernels also run, slowly, on CPU tensors
(for tests).

Four kernels read and write the tokens (:mod:`.kernels`): the moments T of the cells (x read once),
the output (x read, y written), and backward the token gradients (g and x read, dL/dm of the cells
written) and the input gradient (g and x read, dx written). Between them the positional products
run as batched float32 matrix products (:mod:`.products`), and one kernel each way forms P_y, P_x
and the gates' ratios from the layer's parameters and their gradients (:mod:`.parameters`). A
layer is one autograd node in eager calls and one ``torch.library`` custom op each way under
tracing (:mod:`.layer`).
"""
import os

import torch

from ..base import Backend

try:
    from . import layer
    _MISSING = None
except ImportError as error:  # pragma: no cover - PyTorch builds without triton
    layer = None
    _MISSING = f'triton cannot be imported ({error})'

__all__ = ['TritonBackend', 'interpreting']


def interpreting():
    """Whether Triton runs its kernels in its interpreter (TRITON_INTERPRET=1), on CPU tensors."""
    return os.environ.get('TRITON_INTERPRET') == '1'


class TritonBackend(Backend):
    """DTN in Triton kernels and cuBLAS products on CUDA GPUs (see the module docstring)."""

    name = 'triton'
    devices = ('cuda', )
    input_dtypes = (torch.float16, torch.bfloat16, torch.float32)
    runs_passes = False

    def supports(self, x, grid, dtype):
        if _MISSING:
            return _MISSING
        if dtype == torch.float64:
            return "the Triton kernels compute in float32; float64 runs on the 'torch' backend"
        kind = x.device.type
        if kind == 'cuda' or kind == 'meta':
            return None
        if kind == 'cpu':
            return None if interpreting() else (
                'x is on the CPU; the Triton kernels run on CUDA GPUs (and, with '
                'TRITON_INTERPRET=1, in Triton\'s interpreter)')
        return f'x is on {x.device}; the Triton kernels run on CUDA GPUs'

    def apply(self, x, pos_coef, gates, weight, bias, grid, eps, convention, layernorm):
        return layer.normalize(x, pos_coef, *gates, weight, bias, grid, eps, convention,
                               layernorm)
