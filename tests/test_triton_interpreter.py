"""Triton's interpreter as the tests run it (``tools/dev/triton_interpreter.py``): the language
is patched once per function and kernel run, with the results of Triton's own way, and is as it was
after every run, also after one that fails; its int32 overflow checks, whose asserts run only with
``debug`` on, are off while ``debug`` is off."""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError

import triton_interpreter  # tools/dev, on the path where conftest patches the interpreter
from mmdtn.models.layers.dtn.backends.triton import interpreting

pytestmark = pytest.mark.skipif(
    not interpreting(), reason="the kernels here run in Triton's interpreter (TRITON_INTERPRET=1, "
    'which conftest sets)')


@triton.jit
def _scaled_row(x_ptr, row, scale, BLOCK: tl.constexpr):
    """A helper called in a loop, with one of triton.language's own jit functions (tl.max)."""
    values = tl.load(x_ptr + row * BLOCK + tl.arange(0, BLOCK))
    return values * scale + tl.max(values, axis=0)


@triton.jit
def _rows_kernel(x_ptr, y_ptr, rows, scale, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], tl.float32)
    for row in range(rows):
        total += _scaled_row(x_ptr, row, scale, BLOCK)
    tl.store(y_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), total)


def expected(x, scale):
    return (x * scale + x.amax(dim=1, keepdim=True)).sum(0)


def run(x, scale=2.0):
    y = torch.empty(3, x.shape[1])
    _rows_kernel[(3,)](x, y, x.shape[0], scale, BLOCK=x.shape[1])
    return y


def test_each_function_is_patched_once_per_run_and_the_language_restored(monkeypatch):
    assert triton_interpreter.patch_once_per_run()  # conftest did it already
    patched, patch_lang = [], triton_interpreter._triton_patch_lang  # Triton's own
    monkeypatch.setattr(triton_interpreter, '_triton_patch_lang',
                        lambda fn: patched.append(fn.__name__) or patch_lang(fn))
    load, reduce = tl.load, tl.core.reduce  # builtins of triton.language and of its core
    x = torch.randn(7, 16)
    y = run(x)
    assert torch.allclose(y, expected(x, 2.0).expand(3, -1), rtol=1e-6, atol=1e-5)
    # 3 programs x 7 rows of calls, each patched once a run: the kernel, the helper, tl.max
    assert patched.count('_rows_kernel') == 1 and patched.count('_scaled_row') == 1
    assert patched.count('max') == 1
    assert tl.load is load and tl.core.reduce is reduce and not hasattr(tl.tensor, '__index__')
    assert triton_interpreter._run_scopes is None


def test_a_failing_run_restores_the_language_and_the_next_run_patches_again():
    load = tl.load
    with pytest.raises(InterpreterError, match='power of 2'):  # raised within the run
        run(torch.randn(7, 12))
    assert tl.load is load and triton_interpreter._run_scopes is None
    x = torch.randn(5, 8)
    assert torch.allclose(run(x, 0.5), expected(x, 0.5).expand(3, -1), rtol=1e-6, atol=1e-5)


@triton.jit
def _offset_kernel(out_ptr, base):
    tl.store(out_ptr + tl.program_id(0), base + tl.program_id(0) * 2)  # int32 arithmetic


def test_overflow_checks_are_dropped_where_their_asserts_never_run(monkeypatch):
    """The backend's import turned the interpreter's int32 overflow checks off (its ``debug`` is
    off). With them on and ``debug`` off, an int32 sum beyond 2^31 - 1 wraps as without them: the
    checks were computed for nothing. With ``debug`` on, they stop the run, and are kept."""
    from triton.runtime.interpreter import interpreter_builder as builder

    options = builder.options
    assert not options.debug and not options.sanitize_overflow
    out = torch.zeros(2, dtype=torch.int32)
    for sanitize in (False, True):
        monkeypatch.setattr(builder, 'options', dataclasses.replace(
            options, sanitize_overflow=sanitize))
        _offset_kernel[(2,)](out, 2**31 - 2)
        assert out.tolist() == [2**31 - 2, -2**31]
    monkeypatch.setattr(builder, 'options', dataclasses.replace(
        options, sanitize_overflow=True, debug=True))
    assert not triton_interpreter.drop_dead_overflow_checks()  # kept: debug is on
    _offset_kernel[(2,)](out, 2**31 - 3)  # 2^31 - 3 and 2^31 - 1: no overflow
    assert out.tolist() == [2**31 - 3, 2**31 - 1]
    with pytest.raises(InterpreterError, match='overflow'):
        _offset_kernel[(2,)](out, 2**31 - 2)
