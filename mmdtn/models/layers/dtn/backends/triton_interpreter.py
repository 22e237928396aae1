"""Triton's interpreter (``TRITON_INTERPRET=1``) with its language patched once per kernel run.

The interpreter runs a kernel as Python over NumPy arrays, with ``triton.language`` replaced by
interpreted versions for the run (``triton.runtime.interpreter._patch_lang``). Triton 3.8 does
that replacement again at every call of a ``@triton.jit`` function inside the kernel: a scan of
every member of ``triton.language`` and of its tensor type (``inspect.getmembers``), which
changes nothing after the first call. The backend's kernels call their helpers in their inner
loops, thousands of times a launch, and in the tests that scan took about 30% of the
interpreter's time (``cProfile``). Here each function is patched at its first call within a
kernel run, as Triton patches it, and not again in that run; everything patched during the run
is restored when it ends, however it ends. Results are the same; only the repeated scans go.

Only the interpreter is touched, and only where it has the two internals this relies on
(``_patch_lang`` and ``GridExecutor.__call__``): elsewhere :func:`patch_once_per_run` does nothing,
and the interpreter runs as Triton ships it.
"""
import functools

__all__ = ['patch_once_per_run']

#: The scopes of the functions patched in the kernel run now under way, by function; None
#: outside a run.
_run_scopes = None
#: Triton's own patching, once :func:`patch_once_per_run` has replaced it.
_triton_patch_lang = None


class _Kept:
    """What the patching returns within a run: its scope is kept for the end of the run."""

    def restore(self):
        pass


_KEPT = _Kept()


def _patch_within_run(fn):
    if _run_scopes is None:  # outside a kernel run: as Triton does
        return _triton_patch_lang(fn)
    if fn not in _run_scopes:
        _run_scopes[fn] = _triton_patch_lang(fn)
    return _KEPT


def _one_run(call):

    @functools.wraps(call)
    def run(self, *args, **kwargs):
        global _run_scopes
        if _run_scopes is not None:  # a kernel launched within a run: nothing of ours to undo
            return call(self, *args, **kwargs)
        _run_scopes = {}
        try:
            return call(self, *args, **kwargs)
        finally:
            scopes, _run_scopes = _run_scopes, None
            for scope in reversed(scopes.values()):
                scope.restore()

    return run


def patch_once_per_run():
    """Makes Triton's interpreter patch its language once per function and kernel run (see the
    module docstring). Idempotent; returns whether the interpreter runs that way."""
    global _triton_patch_lang
    try:
        from triton.runtime import interpreter
        executor, patch_lang = interpreter.GridExecutor, interpreter._patch_lang
    except (ImportError, AttributeError):
        return False
    if patch_lang is not _patch_within_run:
        _triton_patch_lang = patch_lang
        interpreter._patch_lang = _patch_within_run
        executor.__call__ = _one_run(executor.__call__)
    return True
