"""Launching the Triton backend's kernels with little host time.

At batch 2 a DynamicTokenNorm layer on a GPU waits for the host (docs/gpu.md, "Measured on an
H200"), and a launch through ``kernel[grid](...)`` spends much of its host time in Triton's argument
binding: the type and specialisation of every argument, the cache key, the compiled kernel's lookup
(on an H200 node 16 us a launch of a 6-argument kernel against 9-10 us through its compiled kernel;
the backend's kernels take up to 30 arguments). A launch here does that once for each
:func:`launch_key` and then calls the compiled kernel itself (``CompiledKernel[grid]``), which takes
the current device's stream and Triton's launch hooks as the binding path does.

The key holds more than Triton specialises a kernel on, never less: for every tensor its dtype
and whether its address is a multiple of 16 bytes (Triton's alignment specialisation), every
other argument by value (integers are specialised on being 1 or a multiple of 16, and typed by
their range), the constexprs, the launch options (warps, register cap) and the current device
(a compiled kernel is loaded once per device). Any argument that differs from a cached launch's
is a new key, which binds through Triton again, so a cached kernel never runs arguments it was
not compiled for.

In Triton's interpreter (``TRITON_INTERPRET=1``) every launch binds: there are no compiled
kernels. With meta tensors a launch is only recorded (:func:`.base.record_launch`), with its
arguments, which gives the traffic of any shape without a GPU and what Triton would compile for
it (``compile_kernels.py`` checks its own specialisations against those).

A kernel is launched as a spec (kernel, constexprs, warps): ``warps`` is the number of warps of a
program or :class:`LaunchOptions`, which also caps the registers of a thread.
"""
import contextlib
from typing import NamedTuple, Optional

import torch

from .base import record_launch, recording, tensor_bytes

__all__ = ['launch', 'launch_key', 'CompiledLaunches', 'LaunchOptions', 'launch_options', 'cdiv',
           'labelled_launches']


class LaunchOptions(NamedTuple):
    """What Triton compiles a kernel with besides its arguments: the warps of a program and the
    registers a thread may take (Triton's ``maxnreg``; None: ptxas's choice, up to 255). ptxas
    takes what it is allowed: a cap it can keep to without spilling lets an SM hold more
    programs at once (``compile_kernels.py`` reports both)."""
    num_warps: int
    maxnreg: Optional[int] = None

    def kwargs(self):
        """The options as keyword arguments of a Triton launch or ``triton.compile``."""
        return dict(num_warps=self.num_warps,
                    **({} if self.maxnreg is None else dict(maxnreg=self.maxnreg)))


def launch_options(warps):
    """The :class:`LaunchOptions` of a spec's ``warps``: a number of warps, or the options."""
    return warps if isinstance(warps, LaunchOptions) else LaunchOptions(warps)


def cdiv(a, b):
    """ceil(a / b) for ints, for the programs of a grid (``triton.cdiv`` is a JIT function:
    slower to call from the host)."""
    return -(-a // b)


def launch_key(kernel, constexprs, warps, device, args):
    """What selects the compiled kernel of a launch (see the module docstring)."""
    return (kernel, launch_options(warps), device, *constexprs.items(),
            *[(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a
              for a in args])


class CompiledLaunches:
    """The compiled kernels of past launches by :func:`launch_key`, each with the values of its
    constexprs in the kernel's argument order (a compiled kernel takes every argument
    positionally). A kernel whose constexprs are not all after the arguments passed, or whose
    launch returns no compiled kernel (the interpreter), always binds through Triton. Holds no
    tensors: kernels and numbers only; at ``limit`` keys (many resolutions) it starts again."""

    def __init__(self, limit=8192):
        self.compiled, self.limit = {}, limit

    def __call__(self, kernel, constexprs, warps, grid, args, device):
        key = launch_key(kernel, constexprs, warps, device, args)
        cached = self.compiled.get(key)
        if cached is not None:
            compiled, constants = cached
            compiled[(*grid, 1, 1)[:3]](*args, *constants)
            return
        compiled = kernel[grid](*args, **constexprs, **launch_options(warps).kwargs())
        if len(self.compiled) >= self.limit:
            self.compiled.clear()
        after = list(getattr(kernel, 'arg_names', ()))[len(args):]
        if hasattr(compiled, '__getitem__') and sorted(after) == sorted(constexprs):
            self.compiled[key] = compiled, tuple(constexprs[name] for name in after)


_compiled_launches = CompiledLaunches()
_labels = []  # non-empty inside labelled_launches


@contextlib.contextmanager
def labelled_launches():
    """Every launch inside is an entry of its own in ``torch.profiler``, ``launch <name>``, whose
    own CPU time is the host's to launch it (the launch key and Triton's launcher; in the
    interpreter, running the kernel), apart from the Python around it (``benchmark_norm.py
    --tables host``). Outside, launches carry no label, which would cost host time itself."""
    _labels.append(True)
    try:
        yield
    finally:
        _labels.pop()


def launch(name, spec, grid, reads, writes, *args):
    """Records the launch of ``spec`` = (kernel, constexprs, warps) on ``grid`` (1 to 3
    program counts) with ``args`` and, unless the tensors are meta tensors (traffic counts only),
    launches it: on CUDA tensors through :class:`CompiledLaunches`, on the tensors' device (the
    current device is switched where it differs: Triton launches on the current one), elsewhere
    (the interpreter) through Triton's binding; inside :func:`labelled_launches`, labelled."""
    if _labels:
        with torch.profiler.record_function(f'launch {name}'):
            return _launch(name, spec, grid, reads, writes, *args)
    return _launch(name, spec, grid, reads, writes, *args)


def _launch(name, spec, grid, reads, writes, *args):
    kernel, constexprs, warps = spec
    device = reads[0].device
    if recording():
        record_launch(name, tensor_bytes(reads), tensor_bytes(writes),
                      (*spec, args) if device.type == 'meta' else None)
    if device.type == 'cuda':
        if device.index == torch.cuda.current_device():
            _compiled_launches(kernel, constexprs, warps, grid, args, device.index)
        else:  # Triton launches on the current device: make it the tensors'
            with torch.cuda.device(device):
                _compiled_launches(kernel, constexprs, warps, grid, args, device.index)
    elif device.type != 'meta':
        kernel[grid](*args, **constexprs, **launch_options(warps).kwargs())
