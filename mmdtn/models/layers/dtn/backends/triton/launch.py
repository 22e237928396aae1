"""Launching the Triton backend's kernels with little host time.

A launch through ``kernel[grid](...)`` spends much of its host time in Triton's argument binding:
the type and specialization of every argument, the cache key, the compiled kernel's lookup. A
launch here does that once for each :func:`launch_key` and then calls the compiled kernel itself
(``CompiledKernel[grid]``), which takes the current device's stream and Triton's launch hooks as
the binding path does.

The key holds more than Triton specializes a kernel on, never less: for every tensor its dtype
and whether its address is a multiple of 16 bytes (Triton's alignment specialization), every
other argument by value, the constexprs, the warps and the current device (a compiled kernel is
loaded once per device). Any argument that differs from a cached launch's is a new key, which
binds through Triton again, so a cached kernel never runs arguments it was not compiled for.

In Triton's interpreter (``TRITON_INTERPRET=1``) every launch binds: there are no compiled
kernels. With meta tensors a launch is only recorded (:func:`..base.record_launch`), with its
arguments: the traffic of any shape without a GPU, and what Triton would compile for it.

A kernel is launched as a spec: (kernel, constexprs, number of warps).
"""
import torch

from ..base import record_launch, recording, tensor_bytes

__all__ = ['launch', 'launch_key', 'CompiledLaunches', 'cdiv']


def cdiv(a, b):
    """ceil(a / b) for ints, for the programs of a grid (``triton.cdiv`` is a JIT function:
    slower to call from the host)."""
    return -(-a // b)


def launch_key(kernel, constexprs, warps, device, args):
    """What selects the compiled kernel of a launch (see the module docstring)."""
    return (kernel, warps, device, *constexprs.items(),
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
        compiled = kernel[grid](*args, **constexprs, num_warps=warps)
        if len(self.compiled) >= self.limit:
            self.compiled.clear()
        after = list(getattr(kernel, 'arg_names', ()))[len(args):]
        if hasattr(compiled, '__getitem__') and sorted(after) == sorted(constexprs):
            self.compiled[key] = compiled, tuple(constexprs[name] for name in after)


_compiled_launches = CompiledLaunches()


def launch(name, spec, grid, reads, writes, *args):
    """Records the launch of ``spec`` = (kernel, constexprs, warps) on ``grid`` (1 to 3 program
    counts) with ``args``, the tensors ``reads`` and ``writes`` counted as read and written and,
    unless they are meta tensors (traffic counts only), launches it: on CUDA tensors through
    :class:`CompiledLaunches`, on the tensors' device (Triton launches on the current one, which
    is switched where it differs), elsewhere (the interpreter) through Triton's binding."""
    kernel, constexprs, warps = spec
    device = reads[0].device
    if recording():
        record_launch(name, tensor_bytes(reads), tensor_bytes(writes),
                      (*spec, args) if device.type == 'meta' else None)
    if device.type == 'cuda':
        if device.index == torch.cuda.current_device():
            _compiled_launches(kernel, constexprs, warps, grid, args, device.index)
        else:
            with torch.cuda.device(device):
                _compiled_launches(kernel, constexprs, warps, grid, args, device.index)
    elif device.type != 'meta':
        kernel[grid](*args, **constexprs, num_warps=warps)
