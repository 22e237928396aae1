"""DynamicTokenNorm's backends: the switch between them, what each one takes, and their agreement
with each other and with the dense reference where their paths differ (banded and fused products,
the two builds of the CPU kernels)."""
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from conftest import CPU_BACKENDS
from test_dynamic_token_norm import assert_equals_dense_reference, randomize, tokens

from mmdtn import (DynamicTokenNorm, available_backends, get_dtn_backend, neighbourhood_offsets,
                   set_dtn_backend)
from mmdtn.models.layers.dtn.backends import BACKENDS
from mmdtn.models.layers.dtn.backends import cpu as cpu_backend
from mmdtn.models.layers.dtn.backends.cpu import BandedFactor
from mmdtn.models.layers.dtn.grid import TokenGrid


def uses_fused_products(norm, x, hw):
    """Whether the CPU backend fuses the positional products with the passes over the tokens."""
    grid = TokenGrid.of(x, hw, norm.num_heads, norm.pool_size)
    return BACKENDS['cpu'].fuses_products(x, grid, norm.axis_matrices(hw, x.dtype)[1])


# ----------------------------------------------------------------------------- the switch
def test_switch_by_function_and_environment_variable(backend_setting):
    assert set(available_backends('cpu')) == {'cpu', 'torch', 'triton'}  # triton: interpreted
    x = torch.randn(2, 20, 8, dtype=torch.float64)
    norm = randomize(DynamicTokenNorm(8, 2, pool_size=2)).double()
    outputs = {}
    for name in ('auto', 'cpu', 'torch'):
        set_dtn_backend(name)
        assert get_dtn_backend() == name
        outputs[name] = norm(x, (4, 5))
    assert torch.allclose(outputs['cpu'], outputs['torch'], atol=1e-12)
    assert torch.equal(outputs['auto'], outputs['cpu'])  # auto takes the CPU kernels on CPUs
    with pytest.raises(ValueError, match="unknown DynamicTokenNorm backend 'cuda'.*'cpu'"):
        set_dtn_backend('cuda')
    script = ('import torch\n'
              'from mmdtn import DynamicTokenNorm, get_dtn_backend\n'
              'print(get_dtn_backend())\n'
              'DynamicTokenNorm(8, 2)(torch.randn(1, 4, 8), (2, 2))\n')
    env = dict(os.environ, MMDTN_DTN_BACKEND='torch')
    out = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == 'torch', out.stderr
    env['MMDTN_DTN_BACKEND'] = 'gpu'
    out = subprocess.run([sys.executable, '-c', script], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "unknown DynamicTokenNorm backend 'gpu'" in out.stderr


def test_inputs_of_other_dtypes_are_converted_for_the_backend(backend_setting):
    """The CPU kernels take float32 and float64: float16 tokens are computed in float32, and the
    output has the input's dtype."""
    norm = randomize(DynamicTokenNorm(8, 2))
    x = torch.randn(1, 6, 8).half()
    set_dtn_backend('cpu')
    y = norm(x, (2, 3))
    assert y.dtype == torch.float16
    assert torch.equal(y, norm(x.float(), (2, 3)).half())


def test_missing_cpu_kernels_warn_once_and_fall_back_or_stop(monkeypatch, backend_setting):
    """Without its kernels the CPU backend cannot run: 'auto' says so once and takes the portable
    backend; the 'cpu' backend asked for by name is an error that says why."""
    norm = randomize(DynamicTokenNorm(8, 2, pool_size=2)).double()
    x = tokens(1, 6, 6, 8)
    expected = norm(x, (6, 6))
    monkeypatch.setattr(cpu_backend, 'kernels', None)
    assert 'cpu' not in available_backends('cpu')
    set_dtn_backend('auto')
    with pytest.warns(UserWarning, match="'cpu' backend cannot run.*without its CPU kernels"):
        y = norm(x, (6, 6))
    assert torch.allclose(y, expected, atol=1e-12)
    set_dtn_backend('cpu')
    with pytest.raises(RuntimeError, match=r"backend 'cpu'.*\(1, 36, 8\).*without its CPU kernels"):
        norm(x, (6, 6))


# ----------------------------------------------------------------------------- banded and fused
@pytest.mark.parametrize('pool,hw', [(1, (12, 60)), (1, (60, 12)), (2, (21, 117)), (1, (56, 9))])
@pytest.mark.parametrize('a1', [-1.0, -2.5, -0.1])
@pytest.mark.parametrize('C,heads', [(8, 4), (32, 2)])
def test_banded_positional_products_equal_dense_reference(dtn_backend, pool, hw, a1, C, heads):
    """The CPU backend's positional products skip the exact zeros of P_x and P_y on long axes
    (blocks of rows, the last one partial, bands wider on one side than the other) and, without
    pooling and with whole vectors per head (16 channels), are fused with the passes over the
    tokens; values and gradients still equal the dense formulation. a1 = -0.1 spreads P too widely
    for a band on these grids and keeps the dense products."""
    torch.manual_seed(0)
    norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool)).double()
    with torch.no_grad():  # Eq. 7 peaks at distinct neighbours, other widths, random gates
        offsets = torch.tensor(neighbourhood_offsets(heads), dtype=torch.float64)
        norm.pos_coef[:, 0] = a1
        norm.pos_coef[:, 1:] = -2 * a1 * offsets
    p_y, p_x = norm.axis_matrices(hw)
    long_axis = p_x if p_x.shape[-1] >= p_y.shape[-1] else p_y
    assert BandedFactor.is_banded(long_axis) == (a1 != -0.1)
    H, W = hw
    x = tokens(2, H, W, C).requires_grad_()
    fused = pool == 1 and C == 32 and a1 != -0.1 and W > H
    assert uses_fused_products(norm, x, hw) == fused
    g = torch.randn(2, H * W, C, dtype=torch.float64)
    assert_equals_dense_reference(norm, x, hw, g)


@pytest.mark.parametrize('Dy', [(9, -9), (0, 20), (-3, 1)])
@pytest.mark.parametrize('threads', [1, 3])
def test_fused_passes_with_peaks_off_the_diagonal_equal_dense_reference(dtn_backend, Dy, threads):
    """Without pooling and with P_x banded, the CPU kernels fuse the positional products with the
    passes over the tokens, walking the token rows of every head in order and keeping only the
    rows of u = P_x T that P_y still needs. With P_y's peaks far from its diagonal (whose weights
    are then exact zeros: row i's sources lie 9 or 20 rows away, and the rows' gradients arrive
    before or after row i itself), values and gradients still equal the dense formulation. With 3
    threads the 4 (image, head) tasks are too few, and every head's channels are split into two
    groups of tasks of their own."""
    torch.manual_seed(0)
    H, W = 30, 40
    norm = randomize(DynamicTokenNorm(32, 2)).double()
    with torch.no_grad():
        norm.pos_coef[:, 0] = -1.0
        norm.pos_coef[:, 1] = torch.tensor([2.0, -2.0])
        norm.pos_coef[:, 2] = 2 * torch.tensor(Dy, dtype=torch.float64)
    p_y = norm.axis_matrices((H, W))[0]
    x = tokens(2, H, W, 32).requires_grad_()
    assert uses_fused_products(norm, x, (H, W))
    if max(abs(v) for v in Dy) >= 9:
        assert (p_y.diagonal(dim1=1, dim2=2) == 0).any()
    g = torch.randn(2, H * W, 32, dtype=torch.float64)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_equals_dense_reference(norm, x, hw=(H, W), g=g)
    finally:
        torch.set_num_threads(saved)


# ----------------------------------------------------------------------------- agreement
def forward_backward(norms, x, hw, g):
    """Output of the stacked ``norms`` and the gradients of (y * g).sum() for x and parameters."""
    y = x
    for norm in norms:
        y = norm(y, hw)
    params = [p for norm in norms for p in norm.parameters()]
    return [y.detach(), *torch.autograd.grad((y * g).sum(), [x, *params])]


def assert_backends_agree(norms, x, hw, g):
    """Every CPU backend gives the outputs and gradients of the stacked ``norms`` of the first, to
    float32 rounding."""
    results = []
    for name in CPU_BACKENDS:
        set_dtn_backend(name)
        results.append(forward_backward(norms, x, hw, g))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize('pool,hw,B', [(1, (9, 13), 2), (2, (10, 14), 1), (2, (9, 13), 2),
                                       (4, (17, 22), 2), (3, (7, 8), 1)])
def test_backends_agree_in_float32(backend_setting, pool, hw, B):
    """Float32, two stacked layers: all backends agree to float32 rounding."""
    torch.manual_seed(0)
    norms = [randomize(DynamicTokenNorm(24, 4, pool_size=pool), seed=i) for i in range(2)]
    x = (torch.randn(B, hw[0] * hw[1], 24) * 3 + 1).requires_grad_()
    g = torch.randn(B, hw[0] * hw[1], 24)
    assert_backends_agree(norms, x, hw, g)


def test_fused_products_agree_with_other_backends(backend_setting):
    """Float32, paper initialization, 16 channels per head, no pooling, two stacked layers: the
    CPU kernels that fuse the products with the passes over the tokens agree with the others."""
    torch.manual_seed(0)
    hw = (10, 40)
    norms = [DynamicTokenNorm(64, 4) for _ in range(2)]
    for norm in norms:
        with torch.no_grad():
            norm.mean_gate.uniform_(-2, 2)
            norm.var_gate.uniform_(-2, 2)
    x = (torch.randn(2, 400, 64) * 3 + 1).requires_grad_()
    g = torch.randn(2, 400, 64)
    assert uses_fused_products(norms[0], x, hw)
    assert_backends_agree(norms, x, hw, g)


def test_cpu_kernels_baseline_and_avx512_builds_agree(tmp_path):
    """ATEN_CPU_CAPABILITY=default selects the baseline build of the kernels (on CPUs with AVX-512
    the other run uses the AVX-512 build); float64 results agree to rounding. The 12 x 60 grid
    uses the banded positional products along W, on the tokens."""
    script = (
        'import torch, sys\n'
        'from mmdtn import DynamicTokenNorm, set_dtn_backend\n'
        'set_dtn_backend("cpu")\n'
        'out = {}\n'
        'for pool, hw in [(1, (9, 13)), (4, (17, 22)), (1, (12, 60))]:\n'
        '    torch.manual_seed(0)\n'
        '    norm = DynamicTokenNorm(64, 4, pool_size=pool).double()\n'
        '    with torch.no_grad():\n'
        '        norm.mean_gate.uniform_(-2, 2); norm.var_gate.uniform_(-2, 2)\n'
        '    x = torch.randn(2, hw[0] * hw[1], 64, dtype=torch.float64, requires_grad=True)\n'
        '    y = norm(x, hw)\n'
        '    grads = torch.autograd.grad(y.square().sum(), [x, *norm.parameters()])\n'
        '    out[(pool, hw)] = [y.detach(), *grads]\n'
        'torch.save(out, sys.argv[1])\n')
    results = []
    for capability in (None, 'default'):
        env = dict(os.environ)
        env.pop('ATEN_CPU_CAPABILITY', None)
        if capability:
            env['ATEN_CPU_CAPABILITY'] = capability
        path = tmp_path / f'{capability}.pt'
        subprocess.run([sys.executable, '-c', script, str(path)], env=env, check=True)
        results.append(torch.load(path))
    assert len(results[0]) == 3
    for pool in results[0]:
        for a, b in zip(results[0][pool], results[1][pool]):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_traffic_counts_of_the_layer_benchmark():
    """tools/dev/benchmark_norm.py counts LayerNorm as one launch reading x and writing y
    (and its statistics), DTN's compiled kernels inside its custom ops, and the Triton backend on
    meta tensors, where its kernels are recorded without running."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools',
                                    'dev'))
    from benchmark_norm import inputs, layers, traffic
    C, H, W = 16, 8, 12
    x_bytes = 2 * H * W * C * 4
    counts = {}
    for name, (module, backend, where) in layers(
            C, 2, 2, torch.device('cpu'),
            [('cpu', torch.device('cpu')), ('triton', torch.device('meta'))], False).items():
        x, grad = inputs(C, H, W, 2, where, torch.float32)
        set_dtn_backend(backend)
        counts[name] = traffic(module, x, (H, W), grad)
    set_dtn_backend('auto')
    forward, backward = counts['LN']
    assert forward.launches == 1 and 2 * x_bytes <= forward.bytes < 2.2 * x_bytes
    assert backward.launches == 1 and 3 * x_bytes <= backward.bytes < 3.3 * x_bytes
    forward, backward = counts['DTN cpu']
    assert {'cpu.statistics', 'cpu.output'} <= set(forward.by_kernel)
    assert {'cpu.token_gradients', 'cpu.input_gradient'} <= set(backward.by_kernel)
    forward, backward = counts['DTN triton']
    assert forward.by_kernel['triton.output'] >= 2 * x_bytes
    assert backward.by_kernel['triton.input_gradient'] >= 3 * x_bytes
    # 16-bit tokens: LayerNorm's parameters in the tokens' dtype (CUDA's LayerNorm refuses float32
    # parameters with them), DTN's float32
    half = layers(C, 2, 2, torch.device('cpu'), [('torch', torch.device('cpu'))], False,
                  torch.float16)
    assert half['LN'][0].weight.dtype == torch.float16
    assert half['DTN torch'][0].weight.dtype == torch.float32


def permuted(x: torch.Tensor) -> torch.Tensor:
    """x (a, b, c) as (b, a, c): one ``contiguous`` that returns x itself, one that copies."""
    return x.contiguous().permute(1, 0, 2).contiguous()


permuted_copy = torch.library.custom_op('mmdtn_tests::permuted_copy', mutates_args=())(permuted)


def test_traffic_counter_counts_copies_inside_custom_ops(monkeypatch):
    """Inside the custom ops it looks into, ``contiguous`` reaches benchmark_norm's counter as an
    aliasing operation of its own: a copy (a storage of its own) counts as a launch that reads and
    writes the tensor, a ``contiguous`` that returns its input does not."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools',
                                    'dev'))
    import benchmark_norm
    monkeypatch.setitem(benchmark_norm.CUSTOM_OP_IMPLEMENTATIONS, 'mmdtn_tests::permuted_copy',
                        permuted)
    x = torch.empty(8, 6, 4, device='meta')
    counter = benchmark_norm.TrafficCounter()
    with counter.counting():
        permuted_copy(x)
    assert counter.launches == 1 and counter.bytes == 2 * x.numel() * x.element_size()


def test_cost_model_of_the_layer_benchmark():
    """The H200 cost model of benchmark_norm.py: a launch that moves bytes takes them at the
    passes' share of the bandwidth, a matrix product the longer of its bytes at the products'
    share and its FLOPs at the float32 rate's share, and each launch a gap."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools',
                                    'dev'))
    from benchmark_norm import H200, expected_seconds
    bandwidth, gap = H200['bandwidth'], H200['gap']
    moved = 10**9
    assert expected_seconds([('triton.output', moved, 0)]) == pytest.approx(
        moved / (H200['passes'] * bandwidth) + gap)
    assert expected_seconds([('torch.bmm', moved, 1)]) == pytest.approx(
        moved / (H200['products'] * bandwidth) + gap)
    flops = 10**13
    assert expected_seconds([('torch.bmm', 1, flops)]) == pytest.approx(
        flops / (H200['rate'] * H200['fp32']) + gap)


def test_layer_benchmark_checks_every_backend_against_the_torch_backend(backend_setting):
    """tools/dev/benchmark_norm.py's error column: y and dx of a backend against those of the
    'torch' backend on the tokens in float32, relative to the largest reference value; float32
    rounding for the CPU kernels, float16's for float16 tokens, and a wrong dx shows."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools',
                                    'dev'))
    from benchmark_norm import inputs, outputs, relative_error
    C, H, W = 16, 8, 12
    norm = DynamicTokenNorm(C, 2, pool_size=2)
    x, grad = inputs(C, H, W, 2, torch.device('cpu'), torch.float32)
    reference = outputs(norm, 'torch', x, (H, W), grad)
    backends = [name for name in ('cpu', 'torch') if name in available_backends('cpu')]
    for backend in backends:
        assert relative_error(outputs(norm, backend, x, (H, W), grad), reference) < 1e-5
    half = outputs(norm, backends[0], x.half(), (H, W), grad.half())
    assert 1e-5 < relative_error(half, reference) < 2e-3
    y, dx = reference
    assert abs(relative_error((y, 1.01 * dx), reference) - 0.01) < 1e-6


def test_kernels_table_of_the_layer_benchmark(backend_setting, capsys):
    """tools/dev/benchmark_norm.py --tables kernels: per layer, the kernels or operations that
    take most of one forward + backward, from torch.profiler (on CPU their own CPU time), with
    their share and launches per call; --stages picks rows of the stage table by name."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), 'tools',
                                    'dev'))
    import argparse
    from benchmark_norm import STAGES, kernels_table, selected_stages
    parser = argparse.ArgumentParser()
    assert selected_stages(parser, ['swin_t:3', 'pvt_tiny:1']) == [STAGES[0], STAGES[6]]
    with pytest.raises(SystemExit):
        selected_stages(parser, ['pvt_tiny:9'])
    # without pooling on 32 x 48 tokens the products with dense factors take about 15% of the
    # layer's CPU time, first of its operations (on 8 x 12 with pooling 2, about 2.5%: ranked
    # among the shown ones or not by the noise of a shared CPU)
    args = argparse.Namespace(stages=[('tiny', 1, 16, 32, 48, 1, 2)], batch=2, dtype='float32',
                              warmup=1)
    kernels_table(args, torch.device('cpu'), ['torch'], progress=mock.Mock())
    out = capsys.readouterr().out
    assert 'tiny s1 32x48x16 p1, LN:' in out and 'tiny s1 32x48x16 p1, DTN torch:' in out
    assert 'aten::native_layer_norm' in out and 'aten::bmm' in out and '%  x' in out
