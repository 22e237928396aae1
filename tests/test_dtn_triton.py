"""DynamicTokenNorm's Triton backend without a GPU: its kernels in Triton's interpreter on CPU
tensors, its products on the CPU, against the dense reference; the precision of the products;
the choice of the backend for CUDA tensors (the kernels' compilation for sm_80 and sm_90:
``test_gpu_tools.py``).

On a machine with a CUDA GPU, ``TRITON_INTERPRET=0 python -m pytest tests/test_dtn_triton.py``
runs the same tests on the GPU, with the kernels compiled (the dense reference stays on the CPU,
in float64)."""
import random
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from test_dynamic_token_norm import randomize, tokens

from mmdtn import DynamicTokenNorm, set_dtn_backend
from mmdtn.models.layers.dtn.backends import select_backend
from mmdtn.models.layers.dtn.backends import triton as triton_backend
from mmdtn.models.layers.dtn.backends.base import recording_launches
from mmdtn.models.layers.dtn.backends.triton import kernels, layer, parameters, products
from mmdtn.models.layers.dtn.gates import channel_ratios
from mmdtn.models.layers.dtn.grid import TokenGrid
from mmdtn.models.layers.dtn.positional import axis_factors, paper_coefficients
from mmdtn.models.layers.dtn.reference import DenseDynamicTokenNorm

#: Where the kernels run: CPU tensors in the interpreter, CUDA tensors compiled.
DEVICE = 'cpu' if triton_backend.interpreting() else 'cuda'
pytestmark = pytest.mark.skipif(
    DEVICE == 'cuda' and not torch.cuda.is_available(),
    reason='the kernels run in the interpreter (TRITON_INTERPRET=1, which conftest sets) or on a '
    'CUDA GPU')


@pytest.fixture
def triton_dtn(backend_setting):
    set_dtn_backend('triton')


def loss_weights(y, scale=1.0):
    """dL/dy for the output y: ``scale`` * seeded standard-normal values, drawn on the CPU so that
    every device gets the same. Not a ramp over the elements: with one, the bias gradient (dL/dy
    summed over the tokens) is about 1 from terms of hundreds in total magnitude, and float32 sums
    of it in some orders are off by more than 1e-5 of it."""
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
                                 init=norm.init, reference_compat=norm.reference_compat).double()
    reference.load_state_dict(norm.state_dict())
    xd = x.detach().cpu().double().requires_grad_()
    ref = DenseDynamicTokenNorm(reference)(xd, hw)
    ref_grads = torch.autograd.grad((ref * g.cpu().double()).sum(),
                                    [xd, *reference.parameters()])
    errors = [((y.cpu().double() - ref).abs().max() / ref.abs().max()).item()]
    errors += [((a.cpu().double() - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
               for a, b in zip(grads, ref_grads)]
    assert y.dtype == x.dtype and grads[0].dtype == x.dtype
    return errors


def outputs_and_gradients(norm, x, hw):
    """y and the gradients of x and of every parameter for dL/dy = :func:`loss_weights` (the loss
    summed in float32, for 16-bit tokens too)."""
    x = x.detach().requires_grad_()
    y = norm(x, hw)
    return [y, *torch.autograd.grad((y.float() * loss_weights(y)).sum(), [x, *norm.parameters()])]


#: (hw, pool, heads, C, B): odd, non-square, 1 x 1 and 1 x N grids, pooling 1, 2, 4 with partial
#: border cells, heads 1, 3, 4, 5, channel counts that are not powers of two (20, 96), heads of
#: 96 and 80 channels (wider than 64), batch 1 and 3.
SHAPES = [((5, 7), 1, 3, 12, 3), ((6, 9), 2, 4, 16, 1), ((9, 6), 4, 5, 20, 3), ((1, 1), 1, 1, 8, 1),
          ((1, 9), 2, 3, 12, 1), ((7, 8), 4, 1, 4, 1), ((4, 4), 1, 1, 96, 1),
          ((3, 5), 2, 2, 160, 2)]


@pytest.mark.parametrize('hw,pool,heads,C,B', SHAPES)
@pytest.mark.parametrize('reference_compat', [False, True])
def test_equals_dense_reference_float32(triton_dtn, hw, pool, heads, C, B, reference_compat):
    """Forward and every gradient equal the dense reference to float32 rounding, on every shape
    of :data:`SHAPES`, in both statistics conventions."""
    norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool, eps=1e-5,
                                      reference_compat=reference_compat)).float().to(DEVICE)
    x = tokens(B, *hw, C, torch.float32).to(DEVICE)
    assert max(relative_errors(norm, x, hw)) < 1e-5


@pytest.mark.parametrize('pool', [1, 3])
def test_starting_from_layernorm(triton_dtn, pool):
    """init='layernorm' (gates as distances from LayerNorm), moved away from LayerNorm: forward
    and every gradient equal the dense reference; at its start, the layer is LayerNorm."""
    norm = randomize(DynamicTokenNorm(12, 3, pool_size=pool, eps=1e-5,
                                      init='layernorm')).float().to(DEVICE)
    x = tokens(2, 5, 7, 12, torch.float32).to(DEVICE)
    assert max(relative_errors(norm, x, (5, 7))) < 1e-5
    fresh = DynamicTokenNorm(12, 3, pool_size=pool, eps=1e-5, init='layernorm').to(DEVICE)
    expected = torch.nn.functional.layer_norm(x, (12, ), fresh.weight, fresh.bias, 1e-5)
    torch.testing.assert_close(fresh(x, (5, 7)), expected, rtol=1e-5, atol=1e-5)


def test_launches_of_a_call(triton_dtn, monkeypatch):
    """Forward: the parameters, the moments, two products and the output (and the centre, one
    PyTorch reduction); backward without pooling: the moments and two products again, the token
    gradients, four products, the input gradient and the parameters' two kernels (and the
    reduction of the token gradients' shares); with pooling the same without the three formed
    again."""
    bmm, products_run = torch.bmm, []

    def counted_bmm(*args, **kwargs):
        products_run.append(1)
        return bmm(*args, **kwargs)

    monkeypatch.setattr(products.torch, 'bmm', counted_bmm)
    for pool in (1, 2):
        norm = randomize(DynamicTokenNorm(12, 3, pool_size=pool)).float().to(DEVICE)
        x = tokens(2, 5, 7, 12, torch.float32).to(DEVICE).requires_grad_()
        with recording_launches() as forward:
            y = norm(x, (5, 7))
        assert len(products_run) == 2
        with recording_launches() as backward:
            y.backward(loss_weights(y))
        assert len(products_run) == (8 if pool == 1 else 6)
        products_run.clear()
        assert [k.name for k in forward] == ['triton.parameters', 'triton.moments',
                                             'triton.output']
        assert [k.name for k in backward] == ['triton.moments'] * (pool == 1) + [
            'triton.token_gradients', 'triton.input_gradient', 'triton.factor_gradients',
            'triton.parameters_backward']


@pytest.mark.parametrize('dtype,tol', [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize('pool', [1, 2])
def test_half_precision_tokens_are_read_directly(triton_dtn, dtype, tol, pool):
    """float16 and bfloat16 tokens go to the kernels as they are (statistics in float32); the
    output and dx have the tokens' dtype and the accuracy of their resolution."""
    norm = randomize(DynamicTokenNorm(32, 4, pool_size=pool)).float().to(DEVICE)
    x = tokens(2, 6, 7, 32, torch.float32).to(DEVICE, dtype)
    assert max(relative_errors(norm, x, (6, 7))) < tol


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16])
@pytest.mark.parametrize('C,heads,pool', [(16, 1, 1), (32, 4, 2)])
def test_reference_compat_prenormalizes_half_precision_tokens_in_float32(triton_dtn, dtype, C,
                                                                         heads, pool):
    """With ``reference_compat`` the group-RMS prenormalization, part of the statistics, runs in
    float32 on 16-bit tokens too, before the kernels: the output and dx equal the 'torch'
    backend's to a unit of their dtype, every parameter gradient to float32 rounding."""
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
    at a time: (C, heads, pool, reference_compat, B, H, W, dtype)."""
    rng = random.Random(seed)
    heads, d = rng.choice([1, 2, 3, 5]), rng.choice([3, 8, 16, 20, 32, 72])
    return (heads * d, heads, rng.choice([1, 1, 2, 3, 4]), rng.random() < 0.4, rng.choice([1, 2]),
            rng.randint(1, 9), rng.randint(1, 24),
            rng.choice([torch.float32, torch.float16, torch.bfloat16]))


@pytest.mark.parametrize('seed', range(6))
def test_random_layers(triton_dtn, seed):
    """Layers drawn at random (:func:`random_layer`) are as close to the dense reference on the
    Triton backend as on the 'torch' backend: output and every gradient within three times its
    error, or :data:`ERROR_FLOORS`."""
    C, heads, pool, compat, B, H, W, dtype = random_layer(seed)
    errors = {}
    for backend in ('triton', 'torch'):
        set_dtn_backend(backend)
        norm = randomize(DynamicTokenNorm(C, heads, pool, reference_compat=compat), seed=seed)
        x = tokens(B, H, W, C, seed=seed).to(DEVICE, dtype)
        errors[backend] = relative_errors(norm.float().to(DEVICE), x, (H, W))
    for k, (error, torch_error) in enumerate(zip(errors['triton'], errors['torch'])):
        assert error <= 3 * max(torch_error, ERROR_FLOORS[dtype]), (k, errors)


@pytest.mark.parametrize('setting', ['allow_tf32', 'medium', 'per_backend'])
def test_products_run_in_full_float32_whatever_the_global_setting(triton_dtn, monkeypatch,
                                                                  setting):
    """Every matrix product of the layer runs with float32 matrix products in full precision,
    however the user set TF32 or bfloat16 products: ``torch.backends.cuda.matmul.allow_tf32``,
    ``torch.set_float32_matmul_precision('medium')`` or the per-backend ``fp32_precision``; the
    setting is as it was afterwards. (TF32 inputs ruin the second moment where a channel's mean
    varies over the image.)"""
    seen = []
    bmm = torch.bmm

    def watched_bmm(*args, **kwargs):
        cuda = torch.backends.cuda.matmul.fp32_precision
        seen.append((cuda, torch.backends.mkldnn.matmul.fp32_precision))
        return bmm(*args, **kwargs)

    monkeypatch.setattr(products.torch, 'bmm', watched_bmm)
    before = {}
    try:
        if setting == 'allow_tf32':
            torch.backends.cuda.matmul.allow_tf32 = True
        elif setting == 'medium':
            torch.set_float32_matmul_precision('medium')
        else:
            torch.backends.cuda.matmul.fp32_precision = 'tf32'
            torch.backends.mkldnn.matmul.fp32_precision = 'bf16'
        before = (torch.backends.cuda.matmul.fp32_precision,
                  torch.backends.mkldnn.matmul.fp32_precision)
        norm = randomize(DynamicTokenNorm(12, 3)).float().to(DEVICE)
        outputs_and_gradients(norm, tokens(2, 4, 5, 12, torch.float32).to(DEVICE), (4, 5))
        after = (torch.backends.cuda.matmul.fp32_precision,
                 torch.backends.mkldnn.matmul.fp32_precision)
    finally:
        torch.backends.cuda.matmul.fp32_precision = 'none'
        torch.backends.mkldnn.matmul.fp32_precision = 'none'
        torch.set_float32_matmul_precision('highest')
    assert len(seen) == 8 and {cuda for cuda, _ in seen} == {'ieee'}, seen
    assert {cpu for _, cpu in seen} <= {'ieee', 'none'}, seen  # 'none': full precision
    assert after == before and before[0] == 'tf32'


@pytest.mark.parametrize('heads,rows,cols', [(3, 5, 70), (1, 1, 1), (4, 17, 2)])
@pytest.mark.parametrize('layernorm', [False, True])
def test_parameters_equal_the_pytorch_formulation(heads, rows, cols, layernorm):
    """P_y and P_x from the parameters' kernel (rows in blocks of 16, entries in steps of 64, here
    more than one) equal positional.axis_factors to float32 rounding, with the same exact zeros,
    and the ratios equal gates.channel_ratios; backward, the gradient of a^h from dense gradients
    of the factors (contracted with Eq. 6's softmax) and those of the gates equal autograd of the
    float64 formulation to float32 rounding, also when one factor takes no part in the loss."""
    torch.manual_seed(rows)
    d = 5
    coef = (paper_coefficients(heads) + 0.2 * torch.randn(heads, 3)).to(DEVICE)
    gates = [3 * torch.randn(heads, device=DEVICE), torch.randn(heads, device=DEVICE)]
    gates[0][0] = 0.0
    plan = layer.plan_of(1, rows, cols, heads * d, heads, 1, 1e-6, False, False, layernorm)
    formed = torch.empty(plan.formed, device=DEVICE)
    with recording_launches() as launches:
        p_y, p_x, ratios = parameters.parameters(coef, *gates, formed, plan)
    assert [k.name for k in launches] == ['triton.parameters']
    coef64 = coef.double().requires_grad_()
    gates64 = [g.double().requires_grad_() for g in gates]
    expected = [*axis_factors(coef64, rows, cols),
                channel_ratios(*gates64, d, layernorm, torch.float64)]
    for p, q in zip((p_y, p_x, ratios), expected):
        assert torch.allclose(p.double(), q, rtol=1e-6, atol=1e-7)
    zeros = [p == 0 for p in axis_factors(coef, rows, cols)]  # float32's cutoff
    assert torch.equal(p_y == 0, zeros[0]) and torch.equal(p_x == 0, zeros[1])
    for used in ((0, 1), (1, )):
        grads = [torch.linspace(-1.0, 2.0, p.numel(), device=DEVICE).view_as(p) if i in used
                 else torch.zeros_like(p) for i, p in enumerate((p_y, p_x))]
        grad_ratios = torch.linspace(-2.0, 1.0, ratios.numel(), device=DEVICE).view_as(ratios)
        tied = (grad_ratios[[0, 2]] - grad_ratios[[1, 3]]).contiguous()
        coef_grad, *gate_grads = parameters.parameters_backward(p_y, p_x, *grads, *gates, tied,
                                                                plan)
        loss = sum((q * g.double()).sum() for q, g in zip(expected, (*grads, grad_ratios)))
        want = torch.autograd.grad(loss, [coef64, *gates64], retain_graph=True)
        coef32 = coef.clone().requires_grad_()  # the float32 formulation's error, for scale
        loss32 = sum((q * g).sum() for q, g in zip(axis_factors(coef32, rows, cols), grads))
        pytorch_error = (torch.autograd.grad(loss32, coef32)[0].double() - want[0]).abs().max()
        error = (coef_grad.double() - want[0]).abs().max()
        assert error <= max(4 * pytorch_error, 1e-6 * want[0].abs().max()), (error, pytorch_error)
        for got, w in zip(gate_grads, want[1:]):
            assert torch.allclose(got.double(), w, rtol=1e-5, atol=1e-6 * w.abs().max().item())


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
def test_centre_from_a_sample_of_the_tokens(triton_dtn, monkeypatch, pool):
    """The moments are taken about the mean of every 17th token (here every token of a small
    grid: every 17th of one of 1088 tokens and more): rows of P sum to 1, so the statistics do not
    depend on it. With those tokens 50 standard deviations from all others (the centre far from
    most tokens) the float32 kernels still give the float64 result, forward and every gradient,
    to 1e-4."""
    assert kernels.centre_stride(17 * 64) == 17 and kernels.centre_stride(17 * 64 - 1) == 1
    monkeypatch.setattr(kernels, 'CENTRE_SAMPLE', 1)
    layer._plans.clear()
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=pool, eps=1e-5)).float().to(DEVICE)
    x = tokens(2, 6, 9, 16, torch.float64)
    x[:, ::17] += 50.0
    assert max(relative_errors(norm, x.float().to(DEVICE), (6, 9))) < 1e-4
    layer._plans.clear()


@pytest.mark.parametrize('pool', [1, 2])
def test_statistics_for_analysis_equal_the_pytorch_backend(triton_dtn, pool):
    """DynamicTokenNorm.statistics (Eqs. 2 and 5, for the analysis tools) with the Triton
    backend chosen runs on the 'torch' backend's passes, and equals its result."""
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
    assert torch.equal(y, ref)
    grads = torch.autograd.grad(y.sum(), [x, *norm.parameters()])
    ref_grads = torch.autograd.grad(ref.sum(), [x, *norm.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_inductor_compiles_around_the_layer_op(triton_dtn):
    """torch.compile with inductor (mmengine's ``compile=True``) keeps the layer's op as one call
    between the code it generates for the rest, forward and backward, equal to eager; a new
    resolution under dynamic shapes runs the same graph."""
    torch._dynamo.reset()
    norm = randomize(DynamicTokenNorm(16, 2, pool_size=2)).float().to(DEVICE)
    linear = torch.nn.Linear(16, 16).to(DEVICE)

    def block(x, hw):
        return linear(norm(x, hw)).relu()

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for hw in ((5, 6), (3, 7)):
        x = tokens(2, *hw, 16, torch.float32).to(DEVICE).requires_grad_()
        y, ref = compiled(x, hw), block(x, hw)
        assert torch.allclose(y, ref, atol=1e-6)
        wrt = [x, *norm.parameters(), *linear.parameters()]
        grads = torch.autograd.grad((y * loss_weights(y)).sum(), wrt)
        ref_grads = torch.autograd.grad((ref * loss_weights(ref)).sum(), wrt)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))


def test_eager_calls_and_custom_ops_agree(triton_dtn):
    """Eager calls run the layer's passes in one autograd Function, without the custom ops'
    dispatch; under a dispatch mode a layer is one custom op each way, the factors and the ratios
    formed inside. Both give the same output and gradients."""
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
    assert [name for name in nodes if 'DynamicTokenNorm' in name] == [
        'autograd::engine::evaluate_function: TritonDynamicTokenNormBackward'], sorted(nodes)
    with RecordingOps() as recording:
        custom = forward_backward()
    assert {op for op in recording.ops if op.startswith('mmdtn::')} == {
        'mmdtn::dtn_triton_forward', 'mmdtn::dtn_triton_backward'}
    for a, b in zip(eager, custom):
        assert torch.equal(a, b)


@pytest.mark.parametrize('pool', [1, 2])
def test_backward_keeps_nothing_but_saved_tensors(triton_dtn, pool):
    """Everything the layer's backward reads (P_y, P_x and the ratios formed inside the op, the
    planes with pooling) goes through save_for_backward: no other tensor outlives the forward
    pass, and the gradients through the saved tensors equal a fresh call's, also a second time
    (retain_graph: backward writes into no saved tensor)."""
    from test_dtn_tracing import new_tensors_after
    norm = randomize(DynamicTokenNorm(24, 2, pool_size=pool)).to(DEVICE)
    x = tokens(2, 6, 8, 24, torch.float32).to(DEVICE).requires_grad_()
    y, hidden = new_tensors_after(lambda: norm(x, (6, 8)))
    assert not hidden, [tuple(t.shape) for t in hidden]
    g = loss_weights(y)
    loss = (y * g).sum()
    grads = torch.autograd.grad(loss, [x, *norm.parameters()], retain_graph=True)
    again = torch.autograd.grad(loss, [x, *norm.parameters()])
    expected = torch.autograd.grad((norm(x, (6, 8)) * g).sum(), [x, *norm.parameters()])
    for a, b, c in zip(grads, again, expected):
        assert torch.equal(a, c) and torch.equal(b, c)


@pytest.mark.parametrize('pool', [1, 2])
def test_repeated_and_misaligned_calls_equal_the_first(triton_dtn, pool):
    """On a GPU a repeated launch calls the compiled kernel of the first (:mod:`.launch`), and
    tokens at an address that is not a multiple of 16 bytes (a view one element into a buffer)
    take a kernel compiled for them. Repeated calls equal the first exactly, misaligned tokens
    equal it to float32 rounding; a layer's plan is made once."""
    from mmdtn.models.layers.dtn.backends.triton import launch
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
    plans = dict(layer._plans)
    for _ in range(2):
        for a, b in zip(forward_backward(x), first):
            assert torch.equal(a, b)
    assert layer._plans == plans
    for a, b in zip(forward_backward(shifted), first):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    if DEVICE == 'cuda':
        keys = launch._compiled_launches.compiled
        assert any((torch.float32, False) in key for key in keys)


def test_plans_hold_numbers_only():
    """A plan holds no tensor (nothing outlives tracing or a call) and is made per shapes and
    settings."""
    plan = layer.plan_of(2, 7, 9, 24, 3, 2, 1e-6, True, True, False)
    assert plan is layer.plan_of(2, 7, 9, 24, 3, 2, 1e-6, True, True, False)
    assert plan is not layer.plan_of(2, 7, 10, 24, 3, 2, 1e-6, True, True, False)

    def numbers(value):
        if isinstance(value, (tuple, list)):
            return all(numbers(v) for v in value)
        if isinstance(value, dict):
            return all(numbers(v) for v in value.values())
        return not isinstance(value, torch.Tensor)

    assert numbers(list(vars(plan).values()))
    assert (plan.Hp, plan.Wp, plan.n_var) == (4, 5, 23.0)


def test_auto_takes_triton_for_cuda_tensors_and_says_once_why_not(monkeypatch, backend_setting):
    """auto takes the Triton backend for CUDA tensors of every pooling and head width; where it
    cannot run it takes the 'torch' backend and says why, once."""
    set_dtn_backend('auto')
    grid = TokenGrid(2, 8, 8, 8, 2, 4)
    with FakeTensorMode():  # CUDA tensors without a GPU
        x = torch.empty(2, 64, 8, device='cuda')
        wide = torch.empty(2, 64, 256, device='cuda')
    for pool in (1, 2, 4):
        assert select_backend(x, TokenGrid(2, 8, 8, 8, 2, pool), torch.float32).name == 'triton'
    assert select_backend(wide, TokenGrid(2, 8, 8, 256, 2, 1), torch.float32).name == 'triton'
    assert select_backend(x, grid, torch.float64).name == 'torch'  # float64: not the kernels'
    monkeypatch.setattr(triton_backend, '_MISSING', 'triton cannot be imported (test)')
    with pytest.warns(UserWarning, match="'triton' backend cannot run.*cannot be imported"):
        assert select_backend(x, grid, torch.float32).name == 'torch'
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # once
        assert select_backend(x, grid, torch.float32).name == 'torch'


def test_fake_tensors_give_the_shapes_of_the_real_call(triton_dtn):
    """The custom ops' fake implementations give what the real passes give, shape and dtype, with
    and without pooling: what torch.compile and torch.export plan memory with."""
    for pool in (1, 3):
        plan = layer.plan_of(2, 5, 7, 12, 3, pool, 1e-6, False, False, False)
        x = tokens(2, 5, 7, 12, torch.float32).to(DEVICE, torch.float16)
        norm = DynamicTokenNorm(12, 3, pool_size=pool).to(DEVICE)
        args = (x, norm.pos_coef.detach(), norm.mean_gate.detach(), norm.var_gate.detach(),
                norm.weight.detach(), norm.bias.detach())
        real = layer.layer_forward(*args, plan)
        with FakeTensorMode() as mode:
            fake = torch.ops.mmdtn.dtn_triton_forward(
                *(mode.from_tensor(a) for a in args), 5, 7, pool, 3, 1e-6, False, False, False)
        assert [(t.shape, t.dtype) for t in real] == [(t.shape, t.dtype) for t in fake]
