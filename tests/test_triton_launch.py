"""The Triton backend's launches (:mod:`mmdtn.models.layers.dtn.backends.triton.launch`): a
repeated launch calls the compiled kernel of the first, and only for arguments that Triton would
have compiled the same kernel for. Fake kernels record what is called: no GPU, no Triton."""
import contextlib

import torch

from mmdtn.models.layers.dtn.backends.triton import launch as triton_launch
from mmdtn.models.layers.dtn.backends.triton.launch import CompiledLaunches


class FakeCompiled:
    def __init__(self, calls):
        self.calls = calls

    def __getitem__(self, grid):
        return lambda *args: self.calls.append(('compiled', grid, args))


class FakeKernel:
    """``kernel[grid](*args, **constexprs, num_warps=...)`` as Triton's JIT function: records the
    binding call and returns a compiled kernel."""

    def __init__(self, arg_names):
        self.arg_names, self.calls = arg_names, []

    def __getitem__(self, grid):
        def bind(*args, num_warps, **constexprs):
            self.calls.append(('bind', grid, args, constexprs, num_warps))
            return FakeCompiled(self.calls)
        return bind


def kinds(kernel):
    return [call[0] for call in kernel.calls]


def test_a_repeated_launch_calls_the_compiled_kernel_with_every_argument_in_order():
    kernel = FakeKernel(['x_ptr', 'y_ptr', 'n', 'eps', 'BLOCK', 'EVEN'])
    launches = CompiledLaunches()
    x, y = torch.zeros(64), torch.zeros(64)
    for _ in range(3):
        launches(kernel, {'EVEN': True, 'BLOCK': 32}, 4, (5, ), (x, y, 64, 1e-5), 0)
    assert kinds(kernel) == ['bind', 'compiled', 'compiled']
    assert kernel.calls[0][1:] == ((5, ), (x, y, 64, 1e-5), {'EVEN': True, 'BLOCK': 32}, 4)
    grid, args = kernel.calls[1][1:]
    assert grid == (5, 1, 1) and args[:4] == (x, y, 64, 1e-5) and args[4:] == (32, True)


def test_arguments_triton_would_compile_differently_for_bind_again():
    """Another dtype, an address not a multiple of 16 bytes, another integer or float value,
    another constexpr, number of warps or device: each binds through Triton, and the first
    launch's compiled kernel is called again only for the first launch's arguments."""
    kernel = FakeKernel(['x_ptr', 'n', 'eps', 'BLOCK'])
    launches = CompiledLaunches()
    x = torch.zeros(64)
    first = (kernel, {'BLOCK': 32}, 4, (1, ), (x, 64, 0.5), 0)
    others = [
        (kernel, {'BLOCK': 32}, 4, (1, ), (x.half(), 64, 0.5), 0),
        (kernel, {'BLOCK': 32}, 4, (1, ), (x[1:], 64, 0.5), 0),  # 4 bytes off alignment
        (kernel, {'BLOCK': 32}, 4, (1, ), (x, 1, 0.5), 0),
        (kernel, {'BLOCK': 32}, 4, (1, ), (x, 64, 0.25), 0),
        (kernel, {'BLOCK': 64}, 4, (1, ), (x, 64, 0.5), 0),
        (kernel, {'BLOCK': 32}, 8, (1, ), (x, 64, 0.5), 0),
        (kernel, {'BLOCK': 32}, 4, (1, ), (x, 64, 0.5), 1),
    ]
    launches(*first)
    for other in others:
        launches(*other)
    assert kinds(kernel) == ['bind'] * 8
    launches(*first)
    launches(*others[1])
    assert kinds(kernel)[8:] == ['compiled', 'compiled']
    assert x[4:].data_ptr() % 16 == 0
    launches(kernel, {'BLOCK': 32}, 4, (7, ), (x[4:], 64, 0.5), 0)  # aligned: the same kernel
    assert kinds(kernel)[10:] == ['compiled']


def test_the_cache_holds_no_tensors_and_starts_again_at_its_limit():
    kernel = FakeKernel(['x_ptr', 'n', 'BLOCK'])
    launches = CompiledLaunches(limit=3)
    x = torch.zeros(8)
    for n in range(3):
        launches(kernel, {'BLOCK': 8}, 1, (1, ), (x, n), 0)
    assert len(launches.compiled) == 3
    for key, (compiled, constants) in launches.compiled.items():
        assert not any(isinstance(part, torch.Tensor) for part in (*key, *constants))
    launches(kernel, {'BLOCK': 8}, 1, (1, ), (x, 3), 0)
    assert len(launches.compiled) == 1


def test_a_kernel_whose_constexprs_are_not_its_last_arguments_always_binds():
    """The compiled kernel takes every argument positionally: without the constexprs after the
    arguments passed, their order is not known, and the launch binds every time."""
    kernel = FakeKernel(['x_ptr', 'BLOCK', 'n'])
    launches = CompiledLaunches()
    x = torch.zeros(8)
    for _ in range(2):
        launches(kernel, {'BLOCK': 8}, 1, (1, ), (x, 8), 0)
    assert kinds(kernel) == ['bind', 'bind'] and not launches.compiled


def test_a_launch_runs_on_the_device_of_its_tensors(monkeypatch):
    """Triton launches on the current device: tensors on another CUDA device make theirs current
    for the launch, and the compiled kernel is kept for their device."""
    class Tokens:
        device = torch.device('cuda', 1)

    entered = []

    @contextlib.contextmanager
    def current(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'device', current)
    monkeypatch.setattr(triton_launch, '_compiled_launches', CompiledLaunches())
    kernel = FakeKernel(['x_ptr', 'BLOCK'])
    triton_launch.launch('fake', (kernel, {'BLOCK': 8}, 1), (1, ), [Tokens()], [], 5)
    assert entered == [torch.device('cuda', 1)] and kinds(kernel) == ['bind']
    assert [key[2] for key in triton_launch._compiled_launches.compiled] == [1]


def test_a_launch_that_returns_no_compiled_kernel_always_binds():
    """Triton's interpreter returns nothing from a launch: such a kernel binds every time."""
    class InterpretedKernel(FakeKernel):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.calls.append(('bind', ))

    kernel = InterpretedKernel(['x_ptr', 'BLOCK'])
    launches = CompiledLaunches()
    for _ in range(2):
        launches(kernel, {'BLOCK': 8}, 1, (1, ), (torch.zeros(8), ), 0)
    assert kinds(kernel) == ['bind', 'bind'] and not launches.compiled
