"""Triton's interpreter (``TRITON_INTERPRET=1``) with its language patched once per kernel run,
and without the overflow checks whose asserts it never runs.

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

The interpreter also redoes every add, subtract and multiply of int32 values in int64 and compares
the result with int32's range (its ``sanitize_overflow`` option), then hands the comparison to a
device assert that does nothing unless its ``debug`` option is on, which the interpreter never
sets. :func:`drop_dead_overflow_checks` turns that computation off where ``debug`` is off: every
result and error is the same, and the slowest tests took about 40% less time.
"""
import dataclasses
import functools

__all__ = ['patch_once_per_run', 'drop_dead_overflow_checks']

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


def drop_dead_overflow_checks():
    """Turns off the interpreter's int32 overflow checks where its asserts are off (``debug``; see
    the module docstring). Idempotent; returns whether the interpreter now runs without them."""
    try:
        from triton.runtime.interpreter import interpreter_builder as builder
        options = builder.options
        if not options.debug:
            builder.options = dataclasses.replace(options, sanitize_overflow=False)
        return not builder.options.sanitize_overflow
    except (ImportError, AttributeError, TypeError):  # another interpreter: left as it is
        return False
