"""The backends of DynamicTokenNorm: one module each, the same math, different hardware.

============  ===============================  ==============================================
name          runs                             why not elsewhere
============  ===============================  ==============================================
``cpu``       float32/float64 on CPUs          C++ kernels (built by ``pip install``)
``triton``    float16/bfloat16/float32, CUDA   Triton kernels; float64 and other devices: no
``torch``     anything                         portable PyTorch operations, slower eagerly
============  ===============================  ==============================================

``auto`` (the default) takes, for every call, the first backend made for the input's device that
supports the input, else ``torch``; when a backend made for the device cannot run an input, it
says why, once. ``set_dtn_backend(name)`` or the environment variable
``MMDTN_DTN_BACKEND`` choose one backend for every call; a call it cannot run is an error, not a
silent fallback. During ``torch.onnx.export`` every call runs on ``torch``, whatever the setting:
ONNX has no counterpart of the compiled backends' custom ops, and the portable backend's aten
operations translate one for one (docs/deployment.md). Every backend equals the dense reference
(:mod:`..reference`) to rounding, forward and backward.
"""
import os
import warnings

import torch

from ..grid import TokenGrid
from .base import Backend
from .cpu import CpuBackend
from .pytorch import PyTorchBackend
from .triton import TritonBackend

__all__ = ['Backend', 'BACKENDS', 'ENVIRONMENT_VARIABLE', 'set_dtn_backend', 'get_dtn_backend',
           'available_backends', 'select_backend']

#: The backends by name, in the order ``auto`` tries them.
BACKENDS = {backend.name: backend
            for backend in (CpuBackend(), TritonBackend(), PyTorchBackend())}
PORTABLE = 'torch'
ENVIRONMENT_VARIABLE = 'MMDTN_DTN_BACKEND'

_choice = {'name': os.environ.get(ENVIRONMENT_VARIABLE, 'auto') or 'auto'}
_warned = set()


def _checked(name):
    if name != 'auto' and name not in BACKENDS:
        raise ValueError(f"unknown DynamicTokenNorm backend {name!r}: choose 'auto' or one of "
                         f'{sorted(BACKENDS)} (set_dtn_backend or ${ENVIRONMENT_VARIABLE})')
    return name


def set_dtn_backend(name):
    """Run every DynamicTokenNorm call on the backend ``name`` ('auto', 'torch', 'cpu', ...)."""
    _choice['name'] = _checked(name)


def get_dtn_backend():
    """The backend setting: 'auto' or the name of the backend every call runs on."""
    return _checked(_choice['name'])


def available_backends(device='cpu'):
    """Names of the backends that can run float32 tokens on ``device`` here."""
    x = torch.zeros(1, 1, 1, device=device)
    return [name for name, backend in BACKENDS.items()
            if backend.supports(x, TokenGrid(1, 1, 1, 1, 1, 1), torch.float32) is None]


def select_backend(x, grid, dtype):
    """The backend that runs tokens ``x`` on ``grid``, with statistics in ``dtype``, under the
    current setting; the portable one during ONNX export."""
    if torch.onnx.is_in_onnx_export():
        return BACKENDS[PORTABLE]
    name = get_dtn_backend()
    if name != 'auto':
        backend = BACKENDS[name]
        reason = backend.supports(x, grid, dtype)
        if reason is not None:
            raise RuntimeError(
                f'the DynamicTokenNorm backend {name!r} (set by set_dtn_backend or '
                f'${ENVIRONMENT_VARIABLE}) cannot run tokens of shape {tuple(x.shape)}, '
                f'{x.dtype}, on {x.device}: {reason}')
        return backend
    for backend in BACKENDS.values():
        if x.device.type not in backend.devices:
            continue
        reason = backend.supports(x, grid, dtype)
        if reason is None:
            return backend
        if (backend.name, reason) not in _warned:
            _warned.add((backend.name, reason))
            warnings.warn(f'DynamicTokenNorm: the {backend.name!r} backend cannot run this input '
                          f'({reason}); using the {PORTABLE!r} backend')
    return BACKENDS[PORTABLE]
