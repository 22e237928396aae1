"""DynamicTokenNorm's Triton backend without a GPU: its kernels in Triton's interpreter on CPU
tensors against the dense reference, and the choice of the backend for CUDA tensors (their
compilation for sm_90 and the tile-tuning tools: ``test_gpu_tools.py``).

On a machine with a CUDA GPU, ``TRITON_INTERPRET=0 python -m pytest tests/test_dtn_triton.py``
runs the same tests on the GPU, with the kernels compiled (the dense reference stays on the CPU,
in float64)."""
import os
import random
import sys
import warnings

import pytest
import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import FakeTensorMode
from test_dynamic_token_norm import dense_dtn, randomize, tokens

from mmdtn import DynamicTokenNorm, set_dtn_backend
from mmdtn.models.layers.dtn.backends import select_backend
from mmdtn.models.layers.dtn.backends import triton as triton_backend
from mmdtn.models.layers.dtn.backends import (
    triton_band, triton_cells, triton_fused, triton_kernels, triton_parameters)
from mmdtn.models.layers.dtn.backends.base import Backend, recording_launches
from mmdtn.models.layers.dtn.backends.triton_launch import LaunchOptions
from mmdtn.models.layers.dtn.function import TokenMoments
from mmdtn.models.layers.dtn.gates import channel_ratios
from mmdtn.models.layers.dtn.grid import TokenGrid
from mmdtn.models.layers.dtn.positional import (axis_factors, paper_coefficients,
                                                relative_offsets)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Where the kernels run: CPU tensors in the interpreter, CUDA tensors compiled.
DEVICE = 'cpu' if triton_backend.interpreting() else 'cuda'
pytestmark = pytest.mark.skipif(
    DEVICE == 'cuda' and not torch.cuda.is_available(),
    reason='the kernels run in the interpreter (TRITON_INTERPRET=1, which conftest sets) or on a '
    'CUDA GPU')


@pytest.fixture
def triton_dtn(backend_setting):
    set_dtn_backend('triton')


#: The two ways the positional products run: fused (the default; formed on chip, both factors at
#: once: without pooling inside the passes over the tokens, with pooling on the cell grid) and
#: staged (one factor at a time, between the passes).
WAYS = ['fused', 'staged']


def run_passes(monkeypatch, way):
    """Makes the products run the ``way`` of :data:`WAYS` within a test."""
    monkeypatch.setattr(triton_fused, 'ENABLED', way == 'fused')
    monkeypatch.setattr(triton_cells, 'ENABLED', True)


@pytest.fixture
def fused_passes(monkeypatch):
    """Forms the products fused (the default; not ``MMDTN_TRITON_FUSED=0``) within a test,
    whatever the setting."""
    run_passes(monkeypatch, 'fused')


def loss_weights(y, scale=1.0):
    """dL/dy for the output y: ``scale`` * seeded standard-normal values, drawn on the CPU so that
    every device gets the same. Not a ramp over the elements: with one, the bias gradient (dL/dy
    summed over the tokens) is about 1 from terms of hundreds in total magnitude, and float32 sums
    of it in some orders are off by more than 1e-5 of it (a plain running sum: 1.9e-5)."""
    values = torch.randn(y.shape, generator=torch.Generator().manual_seed(0))
    return (scale * values).to(y.device)


def relative_errors(norm, x, hw, loss_scale=1.0):
    """Largest errors of the output and of every gradient against the dense reference in float64,
    relative to the largest reference value, for dL/dy = :func:`loss_weights`; x may have any
    dtype."""
    x = x.detach().requires_grad_()
    y = norm(x, hw)
    g = loss_weights(y, loss_scale)
    grads = torch.autograd.grad((y.float() * g).sum(), [x, *norm.parameters()])
    reference = DynamicTokenNorm(norm.num_features, norm.num_heads, norm.pool_size, norm.eps,
                                 reference_compat=norm.reference_compat).double()
    reference.load_state_dict(norm.state_dict())
    xd = x.detach().cpu().double().requires_grad_()
    ref = dense_dtn(xd, hw, reference)[0]
    ref_grads = torch.autograd.grad((ref * g.cpu().double()).sum(),
                                    [xd, *reference.parameters()])
    errors = [((y.cpu().double() - ref).abs().max() / ref.abs().max()).item()]
    errors += [((a.cpu().double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
               for a, b in zip(grads, ref_grads)]
    assert y.dtype == x.dtype and grads[0].dtype == x.dtype
    return errors


SHAPES = [((5, 7), 1, 3, 12, 3), ((6, 9), 2, 4, 16, 1), ((9, 6), 4, 5, 20, 3), ((1, 1), 1, 1, 8, 1),
          ((1, 9), 2, 3, 12, 1), ((7, 8), 4, 1, 4, 1), ((4, 4), 1, 4, 96, 1)]


@pytest.mark.parametrize('hw,pool,heads,C,B,way', [
    (*shape, way) for way in WAYS for shape in SHAPES
    if way == 'fused' or shape[1] > 1])
@pytest.mark.parametrize('reference_compat', [False, True])
def test_equals_dense_reference_float32(triton_dtn, monkeypatch, hw, pool, heads, C, B, way,
                                        reference_compat):
    """Odd, non-square, 1 x 1 and 1 x N grids, pooling 1, 2, 4 with partial border cells, heads
    1, 3, 4, 5, a channel count that is not a power of two (96), batch 1 and 3; with pooling both
    ways (the products on the cell grid or one factor at a time); forward and every gradient to
    float32 rounding."""
    run_passes(monkeypatch, way)
    norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool, eps=1e-5,
                                      reference_compat=reference_compat)).float().to(DEVICE)
    x = tokens(B, *hw, C, torch.float32).to(DEVICE)
    assert max(relative_errors(norm, x, hw)) < 1e-5


@pytest.mark.parametrize('C,heads,hw,enabled,fused', [
    (8, 2, (3, 41), True, True), (8, 2, (3, 41), False, False), (72, 1, (3, 5), True, False)])
def test_without_pooling_fused_or_staged(triton_dtn, monkeypatch, C, heads, hw, enabled, fused):
    """Without pooling the passes are fused kernels for heads of up to 64 channels (here on token
    rows of several programs): one forward, two backward, and no band products; the staged passes
    for wider heads (72 channels) or with MMDTN_TRITON_FUSED=0. Each equals the dense reference,
    forward and every gradient, to float32 rounding."""
    monkeypatch.setattr(triton_fused, 'ENABLED', enabled)
    norm = randomize(DynamicTokenNorm(C, heads, eps=1e-5)).float().to(DEVICE)
    x = tokens(2, *hw, C, torch.float32).to(DEVICE)
    with recording_launches() as launches:
        outputs_and_gradients(norm, x, hw)
    names = [k.name for k in launches]
    fused_names = ['triton.fused_output', 'triton.fused_token_gradients',
                   'triton.fused_input_gradient']
    assert [n for n in names if n.startswith('triton.fused')] == (fused_names if fused else [])
    assert ('triton.band_matmul' in names) == (not fused), names
    assert max(relative_errors(norm, x, hw)) < 1e-5


@pytest.mark.parametrize('dtype', [torch.float32, torch.float16])
@pytest.mark.parametrize('C,heads,hw,B', [(12, 3, (5, 7), 3), (8, 2, (3, 41), 2)])
def test_fused_passes_keeping_their_products(triton_dtn, fused_passes, monkeypatch, dtype, C,
                                             heads, hw, B):
    """With ``MMDTN_TRITON_KEEP_PRODUCTS=1`` the fused output also writes m_0 and var_it (2, B,
    N, C) in float32, and the token gradients and the input gradient read them instead of forming
    them again in a walk over the band (the input gradient walks it for the shares of the gradient
    of a^h alone): the same launches, and y and every gradient exactly those of the passes that
    form them again (the same float32 values), eagerly and compiled (the custom op's fake tensors
    keep them too)."""
    norm = randomize(DynamicTokenNorm(C, heads, eps=1e-5)).float().to(DEVICE)
    x = tokens(B, *hw, C, torch.float32).to(DEVICE, dtype)
    results, fused = {}, {}
    for keep in (False, True):
        monkeypatch.setattr(triton_fused, 'KEEP_PRODUCTS', keep)
        with recording_launches() as launches:
            results[keep] = outputs_and_gradients(norm, x, hw)
        fused[keep] = {k.name: k for k in launches if k.name.startswith('triton.fused')}
        assert list(fused[keep]) == ['triton.fused_output', 'triton.fused_token_gradients',
                                     'triton.fused_input_gradient']
    products = 2 * B * hw[0] * hw[1] * C * 4
    assert (fused[True]['triton.fused_output'].written
            == fused[False]['triton.fused_output'].written + products)
    for name in ('triton.fused_token_gradients', 'triton.fused_input_gradient'):
        assert fused[True][name].read == fused[False][name].read + products
    for k, (a, b) in enumerate(zip(results[False], results[True])):
        assert torch.equal(a, b), k
    torch._dynamo.reset()
    compiled = torch.compile(norm, fullgraph=True, backend='aot_eager')
    for a, b in zip(outputs_and_gradients(compiled, x, hw), results[True]):
        assert torch.allclose(a, b, atol=1e-6)  # P traced and eager: equal to float32 rounding


@pytest.mark.parametrize('rows', [7, 3])
def test_fused_input_gradient_programs_of_several_token_rows(triton_dtn, fused_passes, monkeypatch,
                                                             rows):
    """Where a program per token row would make more than PROGRAMS input-gradient programs, each
    takes several token rows and writes the parameter sums and its share of the gradient of a^h
    once for all of them: here the programs of a row (7 rows of 20 tokens, batch 2, 2 heads)
    become programs of all 7 rows, or of 3, 3 and 1. Forward and every gradient equal the dense
    reference to float32 rounding."""
    blocks = -(-20 // triton_fused.specializations(4)[2][1]['TOKENS'])
    row_programs = 2 * 7 * blocks * 2
    monkeypatch.setattr(triton_fused, 'PROGRAMS', row_programs // rows)
    assert triton_fused.rows_per_program(row_programs, 7) == rows
    norm = randomize(DynamicTokenNorm(8, 2, eps=1e-5)).float().to(DEVICE)
    x = tokens(2, 7, 20, 8, torch.float32).to(DEVICE)
    with recording_launches() as launches:
        assert max(relative_errors(norm, x, (7, 20))) < 1e-5
    sums = [k.written for k in launches if k.name == 'triton.fused_input_gradient']
    programs = 2 * -(-7 // rows) * blocks
    assert sums and set(sums) == {2 * 7 * 20 * 8 * 4 + programs * (4 * 8 + 2 * 3) * 4}  # dx, sums


@pytest.mark.parametrize('C,heads,hw,B,groups,split', [
    (8, 2, (3, 41), 2, 1, True), (12, 3, (5, 7), 3, 1, True), (12, 3, (5, 7), 3, 2, True),
    (12, 3, (5, 7), 3, 3, True), (12, 3, (5, 7), 3, 3, False)])
def test_fused_heads_split_among_programs(triton_dtn, fused_passes, monkeypatch, C, heads, hw, B,
                                          groups, split):
    """Where a program per tile of tokens would make fewer than PROGRAMS output and
    token-gradients programs, the heads are split among programs of the same tokens (here, as
    PROGRAMS sets it: 3 heads in one program, in groups of 2 and 1, or one each; small grids like
    these have one each by default), each forming Eq. 2 over all channels, and the token gradients
    write a share of the gradient of Eq. 2 per group (float32 (groups, B N, 4)), added up before
    the input gradient reads it; with MMDTN_TRITON_SPLIT_HEADS=0 every head stays in one program.
    Forward and every gradient equal the dense reference to float32 rounding."""
    tiles = -(-hw[1] // triton_fused.specializations(C // heads)[0][1]['TOKENS'])
    programs = B * hw[0] * tiles
    monkeypatch.setattr(triton_fused, 'PROGRAMS', programs * groups)
    monkeypatch.setattr(triton_fused, 'SPLIT_HEADS', split)
    groups = groups if split else 1
    assert -(-heads // triton_fused.heads_per_program(programs, heads)) == groups
    norm = randomize(DynamicTokenNorm(C, heads, eps=1e-5)).float().to(DEVICE)
    x = tokens(B, *hw, C, torch.float32).to(DEVICE)
    with recording_launches() as launches:
        assert max(relative_errors(norm, x, hw)) < 1e-5
    written = [k.written for k in launches if k.name == 'triton.fused_token_gradients']
    tokens_bytes = B * hw[0] * hw[1] * 4  # per float32 value of a token
    assert written and set(written) == {2 * tokens_bytes * C + 4 * groups * tokens_bytes}


def test_fused_passes_take_the_tiles_of_the_gpus_architecture(
        triton_dtn, fused_passes, monkeypatch):
    """A GPU's compute capability selects the fused kernels' tiles: where ARCH_TILES has its own
    for a kernel and head width (here, as tune_fused_tiles.py would write them, 2 warps for the
    token gradients of heads of 32 channels on sm_80, and for the output 8 warps of at most 128
    registers a thread), that GPU takes them, and other GPUs and the interpreter TILES'; a
    register cap reaches the launch. With sm_80's tiles the layer equals the dense reference,
    forward and every gradient."""
    assert triton_fused.architecture(torch.device('cpu')) is None
    monkeypatch.setattr(triton_fused, 'ARCH_TILES', {80: {'token_gradients': {32: (16, 2)},
                                                          'output': {32: (16, 8, 128)}}})
    triton_fused.specializations.cache_clear()
    try:
        assert triton_fused.tiles('token_gradients', 32, 80) == (16, 2)
        for arch in (None, 86, 90):
            assert triton_fused.tiles('token_gradients', 32, arch) == (16, 4)
            assert triton_fused.tiles('token_gradients', 64, arch) == triton_fused.tiles(
                'token_gradients', 64, 80)
        warps = {}
        launch = triton_fused.launch

        def noted(name, spec, *args):
            warps[name] = spec[2]
            launch(name, spec, *args)

        monkeypatch.setattr(triton_fused, 'launch', noted)
        monkeypatch.setattr(triton_fused, 'architecture', lambda device: 80)
        norm = randomize(DynamicTokenNorm(64, 2, eps=1e-5)).float().to(DEVICE)  # heads of 32
        x = tokens(1, 5, 18, 64, torch.float32).to(DEVICE)
        assert max(relative_errors(norm, x, (5, 18))) < 1e-5
        assert warps['triton.fused_token_gradients'] == LaunchOptions(2), warps
        assert warps['triton.fused_output'] == LaunchOptions(8, 128), warps
    finally:
        triton_fused.specializations.cache_clear()


def outputs_and_gradients(norm, x, hw):
    """y and the gradients of x and of every parameter for dL/dy = :func:`loss_weights` (the loss
    summed in float32, for 16-bit tokens too)."""
    x = x.detach().requires_grad_()
    y = norm(x, hw)
    return [y, *torch.autograd.grad((y.float() * loss_weights(y)).sum(), [x, *norm.parameters()])]


@pytest.mark.parametrize('hw,pool,heads,B', [
    ((3, 16), 1, 5, 1), ((17, 2), 1, 3, 3), ((2, 15), 1, 1, 1), ((3, 33), 2, 5, 1),
    ((41, 2), 4, 3, 2), ((9, 30), 2, 4, 1), ((5, 38), 4, 1, 1)])
@pytest.mark.parametrize('reference_compat', [False, True])
def test_banded_positional_factors(triton_dtn, hw, pool, heads, B, reference_compat):
    """P_y and P_x with exact zeros outside a band narrower than the axes, heads of different
    band widths, wide grids in tiles of several programs, partial border cells: equal to the
    dense reference and to the 'torch' backend, forward and every gradient."""
    C = 4 * heads
    norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool, eps=1e-5,
                                      reference_compat=reference_compat)).float()
    with torch.no_grad():
        norm.pos_coef[:, 0] = -torch.linspace(1.0, 4.0, heads)
    norm.to(DEVICE)
    p_y, p_x = norm.axis_matrices(hw)
    assert (p_x[:, 0] == 0).any() or (p_y[:, 0] == 0).any()  # a real band
    x = tokens(B, *hw, C, torch.float32).to(DEVICE)
    assert max(relative_errors(norm, x, hw)) < 1e-5
    triton_results = outputs_and_gradients(norm, x, hw)
    set_dtn_backend('torch')
    for a, b in zip(triton_results, outputs_and_gradients(norm, x, hw)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def traffic_on_meta(C, hw, pool, heads):
    """benchmark_norm's fused bound and the traffic counters (forward, backward) of the Triton
    backend on float16 meta tensors of batch 2 (kernels recorded, not run), and those tokens."""
    sys.path.insert(0, os.path.join(ROOT, 'tools', 'analysis'))
    from benchmark_norm import fused_bound, traffic
    set_dtn_backend('triton')
    norm = DynamicTokenNorm(C, heads, pool_size=pool).to('meta')
    x = torch.empty(2, hw[0] * hw[1], C, device='meta', dtype=torch.float16, requires_grad=True)
    return fused_bound(C, pool, x.dtype), traffic(norm, x, hw, torch.empty_like(x)), x


#: The launches of a layer with pooling, forward and backward (parameters aside), by way of
#: :data:`WAYS`, and the bytes of its products beyond the passes over the tokens, in tensors of the
#: moments T: fused, T read and m written forward, dL/dm and T read and dL/dT written backward;
#: staged, P_x T and P_y u, each reading one and writing one, forward, and backward P_x T again
#: (not kept), the two transposed products and the two outer products (which read two each and
#: store nothing: the gradients of the factors are contracted into shares of that of a^h as they
#: are formed).
#: The parameters' kernels, which every layer launches: left out of :func:`pass_launches`.
PARAMETER_KERNELS = {'triton.parameters', 'triton.parameter_gradients',
                     'triton.parameters_backward'}


def pass_launches(norm, x, hw):
    """The Triton kernels a layer on meta tensors records, forward then backward, but
    :data:`PARAMETER_KERNELS`."""
    sys.path.insert(0, os.path.join(ROOT, 'tools', 'analysis'))
    from benchmark_norm import TrafficCounter  # looks inside the custom ops on meta tensors
    with TrafficCounter().counting(), recording_launches() as recorded:
        torch.autograd.grad(norm(x, hw).sum(), x)
    return [k.name for k in recorded if k.name not in PARAMETER_KERNELS]


POOLED_LAUNCHES = {
    'fused': ((['triton.moments', 'triton.cell_products', 'triton.output'], 2),
              (['triton.token_gradients', 'triton.cell_products_backward',
                'triton.input_gradient'], 3)),
    'staged': ((['triton.moments', 'triton.band_matmul', 'triton.band_matmul', 'triton.output'],
                4),
               (['triton.token_gradients', 'triton.band_matmul', 'triton.band_outer',
                 'triton.band_matmul', 'triton.band_outer', 'triton.band_matmul',
                 'triton.input_gradient'], 10)),
}


@pytest.mark.parametrize('C,hw,pool,heads', [(64, (200, 336), 4, 4), (192, (100, 168), 2, 6)])
@pytest.mark.parametrize('way', WAYS)
def test_traffic_with_pooling(backend_setting, monkeypatch, C, hw, pool, heads, way):
    """With pooling (float16 tokens, PVT-Tiny's stage-1 and Swin-T's stage-2 shapes at 800 x 1344,
    counted on meta tensors: recorded, not run) the passes over the tokens move, forward and
    backward, within 3% of what a DTN fused as far as the math allows must move (the rest: their
    sums for the parameters, per program); the products on the cell grid between them add the
    bytes of :data:`POOLED_LAUNCHES`' tensors of the moments (and, forward, those of the positional
    factors, the centre and the ratios: at most half a tensor more), which shrink with pool^2."""
    run_passes(monkeypatch, way)
    bounds, counts, x = traffic_on_meta(C, hw, pool, heads)
    tokens = x.shape[:2].numel()
    moments = 2 * C * 4 / pool**2  # T per token: two float32 values per cell and channel
    for count, bound, (launches, products) in zip(counts, bounds, POOLED_LAUNCHES[way]):
        names = [launches[0], launches[-1]]  # the passes over the tokens
        assert set(launches) == set(count.by_kernel) - PARAMETER_KERNELS - {'torch'}
        over_tokens = sum(count.by_kernel[k] for k in names) / tokens
        assert bound <= over_tokens <= 1.03 * bound, (count.by_kernel, bound)
        beyond = count.bytes / tokens - over_tokens
        assert products * moments < beyond <= (products + 0.5) * moments, count.by_kernel
    norm = DynamicTokenNorm(C, heads, pool_size=pool).to('meta')
    forward, backward = POOLED_LAUNCHES[way]
    assert pass_launches(norm, x, hw) == forward[0] + backward[0]


def test_cell_products_have_a_switch_of_their_own(triton_dtn, fused_passes, monkeypatch):
    """``MMDTN_TRITON_CELL_PRODUCTS=0`` (triton_cells.ENABLED) runs the products of the layers
    with pooling one factor at a time and leaves the passes without pooling fused; the compile
    report's kernels follow it."""
    monkeypatch.setattr(triton_cells, 'ENABLED', False)
    for pool, launches in ((2, POOLED_LAUNCHES['staged']), (1, None)):
        norm = DynamicTokenNorm(16, 2, pool_size=pool).to('meta')
        x = torch.empty(2, 36, 16, device='meta', requires_grad=True)
        names = pass_launches(norm, x, (6, 6))
        if launches:
            assert names == launches[0][0] + launches[1][0]
        else:
            assert names == ['triton.fused_output', 'triton.fused_token_gradients',
                             'triton.fused_input_gradient']
    kernels = {spec[0] for spec in triton_kernels.specializations(64, 2, 4)}
    assert triton_cells.specializations(16)[0][0] not in kernels


def test_traffic_without_pooling(backend_setting, fused_passes):
    """Without pooling (PVT-Tiny's stage-3 shape, float16 tokens, on meta tensors), the passes
    fused. Forward: x read once and y written once, as LayerNorm, plus the positional factors and
    the per-channel parameters. Backward, two passes over the tokens: g and x read and dL/dm
    written (two float16 values per channel and a byte, the exponent of a scale, per head and
    moment), then g, x and dL/dm read, dx written and the sums for the parameters and the shares
    of the gradient of a^h (per program of several token rows); besides them only per-token values
    and the factors."""
    C, H, W, heads = 320, 50, 84, 5
    _, counts, x = traffic_on_meta(C, (H, W), 1, heads)
    tokens, token_bytes, dm_bytes = x.shape[:2].numel(), C * 2, 2 * C * 2 + 2 * heads
    forward, backward = counts
    assert set(forward.by_kernel) <= {'triton.parameters', 'triton.fused_output', 'torch'}
    assert forward.by_kernel['triton.fused_output'] / tokens <= 1.02 * 2 * token_bytes
    assert forward.bytes / tokens <= 1.1 * 2 * token_bytes, forward.by_kernel  # + the centre
    from mmdtn.models.layers.dtn.backends.triton_fused import rows_per_program, specializations
    blocks = -(-W // specializations(C // heads)[2][1]['TOKENS'])
    rows = rows_per_program(2 * H * blocks * heads, H)
    assert rows == 5  # PVT-Tiny's stage 3 at batch 2: 3000 programs of a token row
    programs = 2 * -(-H // rows) * blocks
    sums = programs * 4 * C * 4 / tokens  # per program, for the weight, bias and gates
    passes = backward.by_kernel['triton.fused_token_gradients'] / tokens
    assert 2 * token_bytes + dm_bytes < passes <= 1.03 * (2 * token_bytes + dm_bytes)
    passes = backward.by_kernel['triton.fused_input_gradient'] / tokens
    assert 3 * token_bytes + dm_bytes + sums < passes <= 1.03 * (3 * token_bytes + dm_bytes + sums)
    assert backward.bytes / tokens <= 1.03 * (5 * token_bytes + 2 * dm_bytes + 2 * sums)
    from benchmark_norm import TrafficCounter  # looks inside the custom ops on meta tensors
    norm = DynamicTokenNorm(C, 5).to('meta')
    with TrafficCounter().counting(), recording_launches() as launches:
        y = norm(x, (H, W))
        assert [k.name for k in launches] == ['triton.parameters', 'triton.fused_output']
        torch.autograd.grad(y.sum(), x)
    assert [k.name for k in launches[2:]] == [
        'triton.fused_token_gradients', 'triton.fused_input_gradient',
        'triton.parameter_gradients', 'triton.parameters_backward']


def test_kernel_loads_counts_what_the_interpreted_kernels_load(backend_setting, fused_passes,
                                                               monkeypatch):
    """tools/analysis/kernel_loads.py adds up the bytes every load of the interpreted kernels asks
    for: the moments pass with pooling loads every token once (and the centre once per program);
    the fused forward pass without pooling, its programs each of every head (PROGRAMS), loads the
    tokens of a token row three times (Eq. 2 in two passes, then the output) and every token row
    of the band once per token row: where the band covers the grid, H + 3 times x. It counts their
    float operations: the fused forward's tl.dot, P_x's weights of a program's tokens times the
    band's sums of a head, is 2 TOKENS BAND D_BLOCK FLOPs per moment, band step, head and program,
    whatever its masks leave."""
    if not triton_backend.interpreting():
        pytest.skip('the loads are counted in Triton\'s interpreter (TRITON_INTERPRET=1)')
    sys.path.insert(0, os.path.join(ROOT, 'tools', 'analysis'))
    from kernel_loads import count
    monkeypatch.setattr(triton_fused, 'PROGRAMS', 1)
    H, W, C = 6, 9, 8
    x_bytes = H * W * C * 4
    moments = count(C, 2, 2, H, W, torch.float32)['forward']['triton.moments']
    programs = 3  # one per cell row: a tile of 32 cells of 2 x 2 tokens covers its 5 cells
    assert moments.loaded == x_bytes + programs * C * 4 and moments.operands > x_bytes  # + T
    assert moments.dot_flops == 0 < moments.flops
    fused = count(C, 2, 1, H, W, torch.float32)['forward']['triton.fused_output']
    assert (H + 3) * x_bytes <= fused.loaded < (H + 3) * x_bytes + H * 2 * 1024  # + P, centre...
    # x read, y written; the factors, the centre, the ratios, the weight and the bias read
    assert fused.operands == 2 * x_bytes + 4 * (2 * (H * H + W * W) + C + 4 * C + 2 * C)
    constexprs = triton_fused.specializations(C // 2)[0][1]  # one band step: W <= BAND
    assert fused.dot_flops == (H * 2 * 2 * 2 * constexprs['TOKENS'] * constexprs['BAND']
                               * constexprs['D_BLOCK'])  # programs, heads, moments
    assert fused.flops > fused.dot_flops


@pytest.mark.parametrize('heads,rows,cols', [(3, 5, 70), (1, 1, 1), (4, 17, 2)])
def test_factors_in_one_launch_equal_the_pytorch_formulation(heads, rows, cols):
    """P_y and P_x from the parameters' kernel (rows in blocks of 16, entries in steps of 64, here
    more than one) equal positional.axis_factors to float32 rounding, with the same exact zeros;
    the gradient of the coefficients, from the outer products' shares of it (gradients dP of the
    factors as the products A X^T with X the identity) added up by the backward kernel, equals
    that of the float64 formulation to float32 rounding of its sums, also when one factor takes
    no part in the loss (its gradient zeros)."""
    torch.manual_seed(0)
    coef = (paper_coefficients(heads) + 0.2 * torch.randn(heads, 3)).to(DEVICE).requires_grad_()
    gates = torch.zeros(2, heads, device=DEVICE)
    with recording_launches() as launches:
        *factors, ratios = triton_parameters.run_parameters(coef.detach(), *gates, rows, cols, 1,
                                                            False)
    assert [k.name for k in launches] == ['triton.parameters']
    pytorch = axis_factors(coef, rows, cols)
    for p, q in zip(factors, pytorch):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7) and torch.equal(p == 0, q == 0)
    coef64 = coef.detach().double().requires_grad_()
    expected = axis_factors(coef64, rows, cols)

    def output_gradients(used):
        return [torch.linspace(-1.0, 2.0, p.numel(), dtype=p.dtype, device=p.device).view_as(p)
                if i in used else torch.zeros_like(p) for i, p in enumerate(factors)]

    def gradient(ps, wrt, used):
        loss = sum((p * g.to(p)).sum() for p, g in zip(ps, output_gradients(used)))
        return torch.autograd.grad(loss, wrt, retain_graph=True)[0].double()

    def shares(used):
        return [triton_band.band_outer(p, dp, torch.eye(p.shape[-1], device=DEVICE)
                                       .expand_as(p).contiguous(), 1, linear)
                for p, dp, linear in zip(factors, output_gradients(used), (2, 1))]

    for used in ((0, 1), (1, )):
        want, given = gradient(expected, coef64, used), shares(used)
        with recording_launches() as launches:
            kernel, *_ = triton_parameters.run_parameters_backward(
                given, *gates, ratios.new_zeros(2, ratios.shape[1]), 1, False)
        assert [k.name for k in launches] == ['triton.parameters_backward']
        error = (kernel.double() - want).abs().max()
        pytorch_error = (gradient(pytorch, coef, used) - want).abs().max()
        assert error <= max(4 * pytorch_error, 1e-6 * want.abs().max()), (error, pytorch_error)


@pytest.mark.parametrize('layernorm', [False, True])
@pytest.mark.parametrize('heads,d', [(3, 5), (2, 300), (1, 1)])
def test_channel_ratios_in_one_launch_equal_the_pytorch_formulation(layernorm, heads, d):
    """The ratios (4, C) from the gates, in the parameters' kernel forward and backward, equal
    gates.channel_ratios to float32 rounding, and so do the gates' gradients (summed over more
    channels than one step covers for d = 300; from the ratios' gradient with 1 - lambda tied to
    lambda), for logits and for distances from LayerNorm: at 0 (LayerNorm exactly), below and
    above tanh's series threshold, and negative."""
    torch.manual_seed(d)
    gates = [3 * torch.randn(heads), torch.randn(heads)]
    gates[0][0], gates[1][-1] = 0.0, -0.05
    gates = [g.to(DEVICE).requires_grad_() for g in gates]
    coef = paper_coefficients(heads).float().to(DEVICE)
    p_y, p_x, ratios = triton_parameters.run_parameters(coef, *(g.detach() for g in gates), 2, 3,
                                                        d, layernorm)
    grad = torch.linspace(-1.0, 2.0, ratios.numel(), device=DEVICE).view_as(ratios)
    tied = grad[[0, 2]] - grad[[1, 3]]  # of lambda, less that of 1 - lambda
    _, *kernel_grads = triton_parameters.run_parameters_backward(
        [torch.zeros(1, heads, 3, device=DEVICE)], *(g.detach() for g in gates), tied, d,
        layernorm)
    expected = channel_ratios(*gates, d, layernorm, torch.float32)
    assert torch.allclose(ratios, expected, rtol=3e-7, atol=1e-7)
    assert ratios.dtype == torch.float32 and ratios.shape == (4, heads * d)
    if layernorm:
        assert ratios[1, :d].eq(0).all() and ratios[0, :d].eq(1).all()  # LayerNorm exactly
    for a, b in zip(kernel_grads, torch.autograd.grad((expected * grad).sum(), gates)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())


def test_parameters_backward_takes_one_or_two_tensors_of_shares():
    """The shares of the gradient of a^h come from the fused passes or the cell products (one
    tensor) or the two factors' outer products; any other count is refused before a launch,
    naming it."""
    shares = [torch.zeros(1, 2, 3, device=DEVICE)] * 3
    gate = torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match='one or two tensors of shares, got 3'):
        triton_parameters.run_parameters_backward(shares, gate, gate, torch.zeros(4, 2), 1, False)


@pytest.mark.parametrize('L,N,group', [(40, 300, 2), (9, 600, 1)])
def test_band_products_equal_dense_products(L, N, group):
    """band_matmul (P X and P^T X) and band_outer (G = A X^T where P is nonzero, contracted with
    Eq. 6's softmax: sum_ij P_ij G_ij (R_ij - Rbar_i) per head, for R = d^2 and d = j - i, in
    shares that add up to it) against dense products, for P with bands of different widths, a
    zero row, more rows than a program's block, and X with more columns (and summed values) than
    a program's block."""
    torch.manual_seed(L)
    offsets = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    P = torch.rand(3, L, L)
    for h, (lo, hi) in enumerate([(2, 5), (7, 0), (0, 3)]):
        P[h] *= ((offsets >= -lo) & (offsets <= hi)).float()
    P[1, L // 2] = 0
    X, A = torch.randn(2, 3 * group, L, N).unbind(0)
    dense = P.repeat_interleave(group, 0)
    P, X, A = P.to(DEVICE), X.to(DEVICE), A.to(DEVICE)
    for transpose in (False, True):
        out = triton_band.band_matmul(P, X, group, transpose).cpu()
        ref = torch.bmm(dense.transpose(1, 2) if transpose else dense, X.cpu())
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    G = torch.bmm(A.cpu(), X.cpu().transpose(1, 2)).view(3, group, L, L).sum(1)
    for linear in (1, 2):
        shares = triton_band.band_outer(P, A, X, group, linear).cpu()
        assert shares.shape[1:] == (3, 3)
        expected = contracted(P.cpu(), G, linear)
        assert torch.allclose(shares.sum(0), expected, rtol=1e-5, atol=1e-4 * expected.abs().max())


def contracted(P, G, linear):
    """sum_ij P_ij G_ij (R_ij - Rbar_i), Rbar_i = sum_j P_ij R_ij, per head (heads, 3): R = d^2 in
    slot 0, R = d in slot ``linear``, d = j - i; in float64."""
    P, G = P.double(), G.double()
    d = relative_offsets(P.shape[-1], P.device, torch.float64)
    out = torch.zeros(P.shape[0], 3, dtype=torch.float64)
    for slot, R in ((0, d * d), (linear, d)):
        out[:, slot] = (P * G * (R - (P * R).sum(-1, keepdim=True))).sum((1, 2))
    return out.float()


@pytest.mark.parametrize('B,H,W,pool,heads,d', [
    (2, 10, 38, 2, 3, 8), (1, 4, 4, 4, 1, 5), (3, 27, 9, 4, 2, 16)])
def test_cell_products_equal_dense_products(B, H, W, pool, heads, d):
    """With pooling, the cell products (both factors in one kernel each way) against dense
    float64 products with P^h = P_y^h (x) P_x^h: m = P^h T, dL/dT = P^hT dL/dm, and the shares of
    the gradient of a^h, which add up to the contraction of the gradients of P_y^h and P_x^h with
    Eq. 6's softmax (R = d^2 on both axes, dx and dy); on a grid of one cell, on cell rows of more
    than one program's cells, and with partial border cells."""
    torch.manual_seed(H)
    grid = TokenGrid(B, H, W, heads * d, heads, pool)
    coef = paper_coefficients(heads) + 0.2 * torch.randn(heads, 3)
    p_y, p_x = (p.to(DEVICE) for p in axis_factors(coef, grid.Hp, grid.Wp))
    T, dm = torch.randn(grid.column_major), torch.randn(grid.head_major)
    m = triton_cells.cell_products(T.to(DEVICE), p_y, p_x, grid).cpu()
    dT, shares = triton_cells.cell_products_backward(dm.to(DEVICE), T.to(DEVICE), p_y, p_x, grid)
    P_y, P_x, T64, dm64 = (t.cpu().double() for t in (p_y, p_x, T, dm))
    cells = T64.permute(0, 2, 3, 4, 1, 5)  # head-major (heads, 2, B, Hp, Wp, d)
    u = torch.einsum('hws,hkbisc->hkbiwc', P_x, cells)
    assert torch.allclose(m.double(), torch.einsum('hir,hkbrwc->hkbiwc', P_y, u), atol=1e-5)
    du = torch.einsum('hir,hkbiwc->hkbrwc', P_y, dm64)
    expected = torch.einsum('hws,hkbrwc->hkbrsc', P_x, du).permute(0, 4, 1, 2, 3, 5)
    assert torch.allclose(dT.cpu().double(), expected, atol=1e-5)
    grad_y = torch.einsum('hkbiwc,hkbrwc->hir', dm64, u)
    grad_x = torch.einsum('hkbrwc,hkbrsc->hws', du, cells)
    want = contracted(P_y, grad_y, 2) + contracted(P_x, grad_x, 1)
    assert shares.shape[1:] == (heads, 3)
    assert torch.allclose(shares.sum(0).cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize('B,H,W,C,heads', [(2, 5, 19, 12, 3), (1, 1, 1, 4, 1), (3, 7, 4, 10, 5)])
def test_band_products_form_the_token_moments_where_they_read_them(B, H, W, C, heads):
    """Without pooling T is not stored (TokenMoments): P_x T and the gradient of P_x formed from
    float16 tokens, read directly, equal the same band products over T stored in float32."""
    torch.manual_seed(W)
    grid = TokenGrid(B, H, W, C, heads, 1)
    x = torch.randn(B, H * W, C).half()
    centre = x.float().mean(1).view(B, 1, 1, C) + 0.1
    T = Backend().token_moments(x.float(), centre, grid).view(heads, W, -1)
    p_x = axis_factors(paper_coefficients(heads), H, W)[1]
    A = torch.randn(T.shape)
    lazy = TokenMoments(x.to(DEVICE), centre.to(DEVICE), grid)
    p_x, A, T = p_x.to(DEVICE), A.to(DEVICE), T.to(DEVICE)
    assert torch.allclose(triton_band.band_matmul(p_x, lazy, 1),
                          triton_band.band_matmul(p_x, T, 1), rtol=1e-6, atol=1e-6)
    # the shares of the gradient of a^h, as many as each operand's tiles make programs, summed
    assert torch.allclose(triton_band.band_outer(p_x, A, lazy, 1, 1).sum(0),
                          triton_band.band_outer(p_x, A, T, 1, 1).sum(0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize('dtype,tol', [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize('pool,way', [(1, 'fused'), (1, 'staged'), (2, 'fused'), (2, 'staged')])
def test_half_precision_tokens_are_read_directly(triton_dtn, monkeypatch, dtype, tol, pool,
                                                 way):
    """float16 and bfloat16 tokens go to the kernels as they are (statistics in float32); the
    output and dx have the tokens' dtype and the accuracy of their resolution."""
    run_passes(monkeypatch, way)
    norm = randomize(DynamicTokenNorm(32, 4, pool_size=pool)).float().to(DEVICE)
    x = tokens(2, 6, 7, 32, torch.float32).to(DEVICE, dtype)
    assert max(relative_errors(norm, x, (6, 7))) < tol


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('C,heads,pool', [(16, 1, 1), (32, 4, 2)])
def test_reference_compat_prenormalises_half_precision_tokens_in_float32(triton_dtn, dtype, C,
                                                                         heads, pool):
    """With ``reference_compat`` the group-RMS prenormalisation, part of the statistics, runs in
    float32 on 16-bit tokens too, before the kernels: the output and dx equal the 'torch'
    backend's to a unit of their dtype, every parameter gradient to float32 rounding. (Run in the
    tokens' dtype, its rounding moved the gradients of the gates and of a^h by up to 0.6% of
    their largest value for float16 tokens and 1.7% for bfloat16 here.)"""
    norm = randomize(DynamicTokenNorm(C, heads, pool, reference_compat=True)).float().to(DEVICE)
    x = tokens(2, 6, 7, C, torch.float32).to(DEVICE, dtype)
    results = []
    for backend in ('triton', 'torch'):
        set_dtn_backend(backend)
        results.append(outputs_and_gradients(norm, x, (6, 7)))
    for k, (a, b) in enumerate(zip(*results)):
        tol = torch.finfo(dtype).eps if k < 2 else 1e-4
        assert (a.float() - b.float()).abs().max() <= tol * b.float().abs().max(), k


#: Errors of :func:`relative_errors` that :func:`test_random_layers` lets pass whatever the
#: 'torch' backend's, by dtype of the tokens.
ERROR_FLOORS = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}


def random_layer(seed):
    """A layer and its tokens drawn at random, seeded, over the options the tests above take a few
    at a time: (C, heads, pool, reference_compat, B, H, W, dtype, way, PROGRAMS)."""
    rng = random.Random(seed)
    heads, d = rng.choice([1, 2, 3, 5]), rng.choice([3, 8, 16, 20, 32])
    return (heads * d, heads, rng.choice([1, 1, 2, 3, 4]), rng.random() < 0.4, rng.choice([1, 2]),
            rng.randint(1, 9), rng.randint(1, 24),
            rng.choice([torch.float32, torch.float16, torch.bfloat16]), rng.choice(WAYS),
            rng.choice([triton_fused.PROGRAMS, 1]))


@pytest.mark.parametrize('seed', range(8))
def test_random_layers(triton_dtn, monkeypatch, seed):
    """Layers drawn at random (:func:`random_layer`) are as close to the dense reference on the
    Triton backend as on the 'torch' backend: output and every gradient within three times its
    error, or :data:`ERROR_FLOORS`. (A wider search of this kind, about 750 layers, found the
    reference convention's prenormalisation running in 16 bits: the test above.)"""
    C, heads, pool, compat, B, H, W, dtype, way, programs = random_layer(seed)
    run_passes(monkeypatch, way)
    monkeypatch.setattr(triton_fused, 'PROGRAMS', programs)
    errors = {}
    for backend in ('triton', 'torch'):
        set_dtn_backend(backend)
        norm = randomize(DynamicTokenNorm(C, heads, pool, reference_compat=compat), seed=seed)
        x = tokens(B, H, W, C, seed=seed).to(DEVICE, dtype)
        errors[backend] = relative_errors(norm.float().to(DEVICE), x, (H, W))
    for k, (error, torch_error) in enumerate(zip(errors['triton'], errors['torch'])):
        assert error <= 3 * max(torch_error, ERROR_FLOORS[dtype]), (k, errors)


@pytest.mark.parametrize('pool,way', [(1, 'fused'), (1, 'staged'), (2, 'fused')])
def test_half_precision_gradients_between_the_passes_keep_their_range(triton_dtn, monkeypatch,
                                                                      pool, way):
    """Without pooling, for 16-bit tokens, dL/dm passes between the fused backward kernels in
    float16, each token's values of a head and moment divided by the power of two above their
    largest (with pooling and in the staged passes it passes in float32): with tokens of standard
    deviation 1e-2 and dL/dy up to 100, dL/dvar reaches about 1e6, beyond float16's range
    (unscaled, dx is nan), while dx stays within it; dx keeps float16's accuracy."""
    run_passes(monkeypatch, way)
    norm = randomize(DynamicTokenNorm(32, 4, pool_size=pool)).float().to(DEVICE)
    x = (1e-2 * tokens(2, 6, 7, 32, torch.float32)).to(DEVICE, torch.float16)
    assert max(relative_errors(norm, x, (6, 7), loss_scale=100.0)) < 2e-3


@triton.jit
def _scaled_round_trip_kernel(dm_ptr, stored_ptr, exponent_ptr, out_ptr, D: tl.constexpr,
                              TOKENS: tl.constexpr):
    tokens = tl.arange(0, TOKENS)
    offsets = tokens[:, None] * D + tl.arange(0, D)[None, :]
    mask = offsets < TOKENS * D
    triton_fused._store_scaled(stored_ptr, exponent_ptr, tokens, tokens < TOKENS, offsets, mask,
                               tl.load(dm_ptr + offsets))
    tl.debug_barrier()
    tl.store(out_ptr + offsets, triton_fused._load_scaled(stored_ptr, exponent_ptr, tokens,
                                                          tokens < TOKENS, offsets, mask))


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float32])
def test_gradients_between_the_fused_passes_scaled_per_token(dtype):
    """dL/dm as the fused token-gradients kernel stores it and the input-gradient kernel reads it
    back: for 16-bit tokens in float16, each token's values divided by the power of two above
    their largest (at most twice it; its biased exponent stored in a byte), so a token of values
    near 1e6 or 1e-6, beyond float16's range, keeps 11 bits of its largest value; tokens of zeros
    and of subnormal values get 2^-126, inf stays inf. For float32 tokens in float32, unscaled:
    exact."""
    largest = torch.tensor([0.0, 1e-40, 1e-6, 1.0, 3.0, 2.0**100, 1e6, float('inf')])
    values = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    dm = values / values.abs().amax(1, keepdim=True) * largest[:, None]
    stored = torch.empty(8, 16, dtype=triton_fused.gradient_dtype(dtype))
    exponents = torch.full((8,), 255, dtype=torch.uint8)
    out = torch.empty_like(dm)
    dm, stored, exponents, out = (t.to(DEVICE) for t in (dm, stored, exponents, out))
    _scaled_round_trip_kernel[(1,)](dm, stored, exponents, out, D=16, TOKENS=8)
    dm, exponents, out = dm.cpu(), exponents.cpu(), out.cpu()
    if dtype == torch.float32:
        assert stored.dtype == torch.float32 and (exponents == 255).all()  # no scales
        assert torch.equal(out, dm)
        return
    assert stored.dtype == torch.float16
    scales = 2.0 ** (exponents.double() - 127)
    assert torch.equal(scales[:2], torch.full((2,), 2.0**-126, dtype=torch.float64))
    expected = 2.0 ** torch.floor(torch.log2(largest[2:7].double()) + 1)
    assert torch.equal(scales[2:7], expected)  # powers of two above the largest
    assert exponents[7] == 253
    error = (out[:7] - dm[:7]).abs().amax(1)
    assert (error <= 2.0**-11 * largest[:7]).all(), error / largest[:7]
    assert torch.isinf(out[7]).any() and not torch.isnan(out[7]).any()


@pytest.mark.parametrize('pool', [1, 2])
def test_constant_and_large_tokens_stay_finite(triton_dtn, pool):
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=pool)).float().to(DEVICE)
    x = torch.full((2, 24, 16), 3.0, device=DEVICE, requires_grad=True)
    y = norm(x, (4, 6))
    assert torch.allclose(y, norm.bias.expand_as(y), atol=1e-3)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    x = (1e4 * tokens(2, 4, 6, 16, torch.float64) + 3e4).to(DEVICE)
    y32 = norm(x.float(), (4, 6))
    set_dtn_backend('torch')
    y64 = norm.double()(x, (4, 6))
    assert torch.isfinite(y32).all() and torch.allclose(y32.double(), y64, atol=1e-3)


@pytest.mark.parametrize('pool', [1, 2])
def test_centre_from_a_sample_of_the_tokens(triton_dtn, pool):
    """The moments are taken about the mean of every 17th token: rows of P sum to 1, so the
    statistics do not depend on it. With those tokens 50 standard deviations from all others (the
    centre far from most tokens) the float32 kernels still give the float64 result, forward and
    every gradient, to 1e-4."""
    assert triton_kernels.CENTRE_STRIDE == 17
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=pool, eps=1e-5)).float().to(DEVICE)
    x = tokens(2, 6, 9, 16, torch.float64)
    x[:, ::17] += 50.0
    assert max(relative_errors(norm, x.float().to(DEVICE), (6, 9))) < 1e-4


@pytest.mark.parametrize('pool', [1, 2])
def test_statistics_for_analysis_equal_the_pytorch_backend(triton_dtn, pool):
    """DynamicTokenNorm.statistics (Eqs. 2 and 5, for the analysis tools) on the Triton backend,
    whose passes never store Eq. 2, equals the 'torch' backend's to float32 rounding."""
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=pool)).float().to(DEVICE)
    x = tokens(2, 6, 7, 16, torch.float32).to(DEVICE)
    stats = norm.statistics(x, (6, 7))
    set_dtn_backend('torch')
    for name, value in norm.statistics(x, (6, 7)).items():
        assert torch.allclose(stats[name], value, atol=1e-5 * value.abs().max().item()), name


@pytest.mark.parametrize('pool,init', [(2, 'paper'), (1, 'layernorm')])
def test_compiles_with_torch_compile(triton_dtn, pool, init):
    """One graph (the layer's custom ops, the factors and the ratios formed inside), equal to
    eager."""
    torch._dynamo.reset()
    norm = randomize(DynamicTokenNorm(16, 2, pool_size=pool, init=init)).float().to(DEVICE)
    compiled = torch.compile(norm, fullgraph=True, backend='aot_eager')
    x = tokens(1, 5, 6, 16, torch.float32).to(DEVICE).requires_grad_()
    y, ref = compiled(x, (5, 6)), norm(x, (5, 6))
    assert torch.allclose(y, ref, atol=1e-6)  # P traced and eager: equal to float32 rounding
    grads = torch.autograd.grad(y.sum(), [x, *norm.parameters()])
    ref_grads = torch.autograd.grad(ref.sum(), [x, *norm.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))


def test_inductor_compiles_around_the_layer_op(triton_dtn):
    """torch.compile with inductor (mmengine's ``compile=True``) keeps the layer's op as one call
    between the code it generates for the rest, forward and backward, equal to eager."""
    torch._dynamo.reset()
    norm = randomize(DynamicTokenNorm(16, 2, pool_size=2)).float().to(DEVICE)
    linear = torch.nn.Linear(16, 16).to(DEVICE)

    def block(x):
        return linear(norm(x, (5, 6))).relu()

    x = tokens(2, 5, 6, 16, torch.float32).to(DEVICE).requires_grad_()
    y, ref = torch.compile(block, fullgraph=True)(x), block(x)
    assert torch.allclose(y, ref, atol=1e-6)
    wrt = [x, *norm.parameters(), *linear.parameters()]
    grads = torch.autograd.grad((y * loss_weights(y)).sum(), wrt)
    ref_grads = torch.autograd.grad((ref * loss_weights(ref)).sum(), wrt)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))


def test_eager_calls_and_custom_ops_agree(triton_dtn):
    """Eager calls run the Python of the layer's custom ops in one autograd Function, without
    their dispatch; under a dispatch mode a layer is one custom op each way, the factors and the
    ratios formed inside. Both give the same output and gradients."""
    from test_dtn_tracing import RecordingOps
    norm = randomize(DynamicTokenNorm(12, 3, pool_size=2, init='layernorm')).to(DEVICE)
    x = tokens(2, 5, 6, 12, torch.float32).to(DEVICE)

    def forward_backward():
        xg = x.detach().requires_grad_()
        y = norm(xg, (5, 6))
        return [y, *torch.autograd.grad((y * y).sum(), [xg, *norm.parameters()])]

    with torch.profiler.profile() as profiler:
        eager = forward_backward()
    names = {event.name for event in profiler.events()}
    assert not any(name.startswith('mmdtn::') for name in names), sorted(names)
    nodes = {event.name for event in profiler.events() if 'Backward' in event.name
             and 'autograd::engine' in event.name}
    assert [name for name in nodes if 'DynamicTokenNorm' in name or 'Eager' in name] == [
        'autograd::engine::evaluate_function: TracedDynamicTokenNormBackward'], sorted(nodes)
    with RecordingOps() as recording:
        custom = forward_backward()
    assert {op for op in recording.ops if op.startswith('mmdtn::')} == {
        'mmdtn::dtn_triton_forward', 'mmdtn::dtn_triton_backward'}
    for a, b in zip(eager, custom):
        assert torch.equal(a, b)


@pytest.mark.parametrize('pool', [1, 2])
def test_backward_keeps_nothing_but_saved_tensors(triton_dtn, pool):
    """Everything the layer's backward reads (P_y, P_x and the ratios formed inside the op, the
    cell tensors with pooling) goes through save_for_backward: no other tensor outlives the
    forward pass, and the gradients through the saved tensors equal a fresh call's."""
    from test_dtn_tracing import new_tensors_after
    norm = randomize(DynamicTokenNorm(24, 2, pool_size=pool)).to(DEVICE)
    x = tokens(2, 6, 8, 24, torch.float32).to(DEVICE).requires_grad_()
    y, hidden = new_tensors_after(lambda: norm(x, (6, 8)))
    assert not hidden, [tuple(t.shape) for t in hidden]
    g = loss_weights(y)
    grads = torch.autograd.grad((y * g).sum(), [x, *norm.parameters()])
    expected = torch.autograd.grad((norm(x, (6, 8)) * g).sum(), [x, *norm.parameters()])
    for a, b in zip(grads, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize('pool', [1, 2])
def test_repeated_and_misaligned_calls_equal_the_first(triton_dtn, pool):
    """On a GPU a repeated launch calls the compiled kernel of the first (:mod:`.triton_launch`),
    and tokens at an address that is not a multiple of 16 bytes (a view one element into a
    buffer) take a kernel compiled for them. Repeated calls equal the first exactly, misaligned
    tokens equal it to float32 rounding."""
    from mmdtn.models.layers.dtn.backends import triton_launch
    norm = randomize(DynamicTokenNorm(24, 3, pool_size=pool)).to(DEVICE)
    x = tokens(2, 6, 7, 24, torch.float32).to(DEVICE)
    buffer = torch.empty(x.numel() + 1, device=DEVICE)
    shifted = buffer[1:].view(x.shape).copy_(x)
    assert shifted.data_ptr() % 16 != 0

    def forward_backward(tokens_in):
        xg = tokens_in.detach().requires_grad_()
        y = norm(xg, (6, 7))
        return [y, *torch.autograd.grad((y * loss_weights(y)).sum(), [xg, *norm.parameters()])]

    first = forward_backward(x)
    for _ in range(2):
        for a, b in zip(forward_backward(x), first):
            assert torch.equal(a, b)
    for a, b in zip(forward_backward(shifted), first):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if DEVICE == 'cuda':
        keys = triton_launch._compiled_launches.compiled
        assert any((torch.float32, False) in key for key in keys)


def test_auto_takes_triton_for_cuda_tensors_and_says_once_why_not(monkeypatch, backend_setting):
    """auto takes the Triton kernels for CUDA tensors of every pooling; where they cannot run it
    takes the 'torch' backend and says why, once."""
    set_dtn_backend('auto')
    grid = TokenGrid(2, 8, 8, 8, 2, 4)
    with FakeTensorMode():  # CUDA tensors without a GPU
        x = torch.empty(2, 64, 8, device='cuda')
    for pool in (1, 2, 4):
        assert select_backend(x, TokenGrid(2, 8, 8, 8, 2, pool), torch.float32).name == 'triton'
    assert select_backend(x, grid, torch.float64).name == 'torch'  # float64: not the kernels'
    monkeypatch.setattr(triton_backend, '_MISSING', 'triton cannot be imported (test)')
    with pytest.warns(UserWarning, match="'triton' backend cannot run.*cannot be imported"):
        assert select_backend(x, grid, torch.float32).name == 'torch'
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # once
        assert select_backend(x, grid, torch.float32).name == 'torch'


def test_host_table_labels_every_launch(backend_setting, fused_passes, capsys):
    """benchmark_norm.py --tables host: every launch of a Triton kernel is an entry of its own
    (``launch <kernel>``, its own CPU time: the host's to launch it), counted in the layer's
    line, and the backend launches unlabelled again afterwards."""
    sys.path.insert(0, os.path.join(ROOT, 'tools', 'analysis'))
    import argparse
    from unittest import mock
    from benchmark_norm import kernels_table
    args = argparse.Namespace(stages=[('tiny', 3, 32, 2, 16, 1, 2)], batch=1, dtype='float32',
                              warmup=1)
    kernels_table(args, torch.device(DEVICE), ['triton'], progress=mock.Mock(), host=True)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if 'DTN triton:' in line)
    assert '; 6 Triton launches, ' in line  # parameters both ways, output, 2 backward, sums
    assert 'launch triton.fused_output' in out and 'launch triton.fused_input_gradient' in out
    set_dtn_backend('triton')
    norm = DynamicTokenNorm(32, 2).to(DEVICE)
    x = torch.randn(1, 32, 32, device=DEVICE)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        norm(x, (2, 16))
    assert not any(e.key.startswith('launch ') for e in prof.key_averages())
