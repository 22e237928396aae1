"""DynamicTokenNorm (Shao et al., ICLR 2022, Eqs. 4-7) against dense formulas, limits, bad input,
on every backend of the CPU."""
import math

import pytest
import torch
import torch.nn.functional as F

from mmdtn import DynamicTokenNorm, neighbourhood_offsets
from mmdtn.models.layers.dtn.reference import dense_dtn as dense_dtn_of
from mmdtn.models.layers.dtn.reference import dense_positional_matrix

# every test runs on every DynamicTokenNorm backend of the CPU
pytestmark = pytest.mark.usefixtures('dtn_backend')


def dense_dtn(x, hw, norm):
    """The dense reference (explicit T x T P^h) with the parameters of ``norm``: (y, stats)."""
    return dense_dtn_of(x, hw, norm.weight, norm.bias, norm.mean_gate, norm.var_gate,
                        norm.pos_coef, norm.pool_size, norm.eps, norm.convention)


def assert_equals_dense_reference(norm, x, hw, g):
    """Float64 output and gradients of (y * g).sum() for x and all parameters equal
    :func:`dense_dtn`'s."""
    y = norm(x, hw)
    ref = dense_dtn(x, hw, norm)[0]
    assert torch.allclose(y, ref, atol=1e-10)
    grads = torch.autograd.grad((y * g).sum(), [x, *norm.parameters()])
    ref_grads = torch.autograd.grad((ref * g).sum(), [x, *norm.parameters()])
    for a, b in zip(grads, ref_grads):
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-9)


def randomize(norm, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
        norm.pos_coef[:, 0] = -0.3 * norm.pos_coef[:, 0].abs() + 0.05
    return norm


def tokens(B, H, W, C, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H * W, C, generator=g, dtype=torch.float64) * 2 + 0.5
    x = x + torch.randn(B, H * W, 1, generator=g, dtype=torch.float64)  # token offsets
    return x.to(dtype)


SHAPES = [(1, 1), (1, 9), (7, 1), (4, 4), (5, 7), (6, 9), (9, 6), (8, 12), (13, 11)]


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize('pool', [1, 2, 4])
def test_equals_dense_reference(dtype, tol, pool):
    for i, (H, W) in enumerate(SHAPES):
        for B, heads, C in [(1, 1, 4), (3, 3, 12), (1, 4, 8), (3, 5, 10)]:
            norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool), seed=i).to(dtype)
            x = tokens(B, H, W, C, dtype, seed=i)
            ref, ref_stats = dense_dtn(x.double(), (H, W), norm.double())
            norm.to(dtype)
            y = norm(x, (H, W))
            assert y.dtype == dtype and y.shape == x.shape
            assert torch.allclose(y.double(), ref, atol=tol, rtol=0), (H, W, B, C, pool)
            stats = norm.statistics(x, (H, W))
            for key, value in ref_stats.items():
                assert torch.allclose(stats[key].double(), value, atol=tol * 10, rtol=0), key


def test_positional_matrix_is_dense_softmax_and_stochastic():
    norm = randomize(DynamicTokenNorm(12, 3, pool_size=2)).double()
    for H, W in [(5, 7), (8, 8), (1, 6)]:
        P = norm.positional_matrix((H, W))
        Hp, Wp = norm.pooled_shape((H, W))
        assert (Hp, Wp) == (math.ceil(H / 2), math.ceil(W / 2))
        assert P.shape == (3, Hp * Wp, Hp * Wp)
        assert torch.allclose(P, dense_positional_matrix(norm.pos_coef, Hp, Wp), atol=1e-12)
        assert torch.allclose(P.sum(-1), torch.ones(3, Hp * Wp, dtype=P.dtype), atol=1e-12)


def test_negligible_positional_weights_are_exact_zeros():
    """Weights below eps * 2^-26 of their row's maximum (eps of the dtype) become exact zeros
    instead of subnormal floats (which would slow matrix products down); the matrix stays a softmax
    to the dtype's precision."""
    norm = DynamicTokenNorm(8, 4).double()
    with torch.no_grad():
        norm.pos_coef.copy_(torch.tensor([[-1.0, 2.0, 0.0], [-3.0, 0.0, -2.0],
                                          [-0.5, 8.0, 8.0], [-1e-3, 0.0, 0.0]]))
    P = norm.positional_matrix((40, 60))
    assert torch.allclose(P, dense_positional_matrix(norm.pos_coef, 40, 60), atol=1e-15, rtol=0)
    assert torch.allclose(P.sum(-1), torch.ones_like(P[..., 0]), atol=1e-12)
    assert (P == 0).any() and (P[3] > 0).all()  # the near-uniform head keeps every weight
    for dtype, smallest in [(torch.float64, 2.0**-78), (torch.float32, 2.0**-49)]:
        for p in norm.to(dtype).axis_matrices((40, 60)):
            row_max = p.amax(-1, keepdim=True)
            assert torch.all((p == 0) | (p >= smallest * 0.999 * row_max))
            assert not torch.any((p != 0) & (p < torch.finfo(dtype).tiny))
    # float32: the kept weights are the softmax's to float32 rounding, the dropped ones negligible
    P32 = norm.float().positional_matrix((40, 60)).double()
    ref = dense_positional_matrix(norm.double().pos_coef, 40, 60).detach()
    kept = P32 != 0
    assert torch.allclose(P32[kept], ref[kept], rtol=1e-6, atol=0)
    limit = (2.0**-49 * 1.01) * ref.amax(-1, keepdim=True).expand_as(ref)
    assert (ref[~kept] <= limit[~kept]).all()
    # the paper's initialization, logits -(k - D)^2: 11 weights per row in float32, 15 in float64
    fresh = DynamicTokenNorm(8, 4)
    for dtype, kept in [(torch.float32, 11), (torch.float64, 15)]:
        p_y, p_x = fresh.to(dtype).axis_matrices((40, 60))
        assert ((p_x[:, 20:40] != 0).sum(-1) == kept).all(), dtype
        assert ((p_y[:, 15:25] != 0).sum(-1) == kept).all(), dtype


def test_layernorm_limit():
    """Gates -> +inf: lambda = 1, DTN degrades into LN (Sec. 3.2, 'Representation capacity')."""
    for pool, (H, W) in [(1, (5, 7)), (2, (6, 6)), (4, (9, 10))]:
        for dtype in (torch.float32, torch.float64):
            norm = randomize(DynamicTokenNorm(16, 4, pool_size=pool, eps=1e-5)).to(dtype)
            with torch.no_grad():
                norm.mean_gate.fill_(60.0)
                norm.var_gate.fill_(60.0)
            x = tokens(2, H, W, 16, dtype)
            ref = F.layer_norm(x, (16, ), norm.weight, norm.bias, eps=1e-5)
            assert torch.allclose(norm(x, (H, W)), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize('pool,hw', [(1, (5, 7)), (2, (6, 8))])
def test_instance_norm_limit(pool, hw):
    """Gates -> -inf and P = 1/T (a^h = 0): IN over all tokens per channel (Eq. 3)."""
    H, W = hw
    norm = randomize(DynamicTokenNorm(12, 3, pool_size=pool, eps=1e-5)).double()
    with torch.no_grad():
        norm.mean_gate.fill_(-60.0)
        norm.var_gate.fill_(-60.0)
        norm.pos_coef.zero_()
    x = tokens(3, H, W, 12)
    ref = F.instance_norm(x.transpose(1, 2), weight=norm.weight, bias=norm.bias, eps=1e-5)
    assert torch.allclose(norm(x, (H, W)), ref.transpose(1, 2), atol=1e-10)


def local_instance_norm(x, hw, window, weight, bias, eps):
    """Mean and variance of every token over the tokens (r + i, c + j), i, j < window (clipped)."""
    B, N, C = x.shape
    H, W = hw
    img = x.view(B, H, W, C)
    out = torch.empty_like(img)
    for r in range(H):
        for c in range(W):
            patch = img[:, r:r + window[0], c:c + window[1]].reshape(B, -1, C)
            var, mean = torch.var_mean(patch, dim=1, correction=0)
            out[:, r, c] = (img[:, r, c] - mean) / torch.sqrt(var + eps) * weight + bias
    return out.view(B, N, C)


@pytest.mark.parametrize('hw,window', [((1, 11), (1, 2)), ((6, 7), (2, 2))])
def test_local_instance_norm_with_banded_P(hw, window):
    """Gates -> -inf and P^h a normalized banded matrix: a local IN (paper Fig. 5).

    a^h = [-L, L, L] gives logits -L (dx^2 - dx) - L (dy^2 - dy), which are 0 for dx, dy in {0, 1}
    and <= -2L elsewhere: for large L, P^h averages the token and its right/lower neighbours."""
    H, W = hw
    L = 60.0
    norm = randomize(DynamicTokenNorm(8, 2, eps=1e-5)).double()
    with torch.no_grad():
        norm.mean_gate.fill_(-60.0)
        norm.var_gate.fill_(-60.0)
        norm.pos_coef.copy_(torch.tensor([[-L, L, L]] * 2))
    P = norm.positional_matrix(hw)[0]
    band = torch.zeros(H * W, H * W, dtype=torch.float64)
    for n in range(H * W):
        r, c = divmod(n, W)
        for m in range(H * W):
            rr, cc = divmod(m, W)
            band[n, m] = float(0 <= rr - r < window[0] and 0 <= cc - c < window[1])
    assert torch.allclose(P, band / band.sum(1, keepdim=True), atol=1e-20)
    x = tokens(2, H, W, 8)
    ref = local_instance_norm(x, hw, window, norm.weight, norm.bias, 1e-5)
    assert torch.allclose(norm(x, hw), ref, atol=1e-10)


def test_gradcheck_input_and_all_parameters():
    torch.manual_seed(0)
    for (H, W), pool, heads, C in [((3, 4), 1, 2, 4), ((4, 6), 2, 2, 4), ((5, 3), 2, 3, 6)]:
        norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool)).double()
        names = [n for n, _ in norm.named_parameters()]
        params = tuple(p.detach().clone().requires_grad_() for p in norm.parameters())
        x = tokens(2, H, W, C).requires_grad_()

        def fn(x, *ps):
            return torch.func.functional_call(norm, dict(zip(names, ps)), (x, (H, W)))

        assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-6, fast_mode=True)


def test_backward_matches_autograd_of_dense_reference():
    norm = randomize(DynamicTokenNorm(12, 3, pool_size=2)).double()
    x = tokens(2, 5, 7, 12).requires_grad_()
    g = torch.randn(2, 35, 12, dtype=torch.float64)
    grads = torch.autograd.grad((norm(x, (5, 7)) * g).sum(), [x, *norm.parameters()])
    ref = torch.autograd.grad((dense_dtn(x, (5, 7), norm)[0] * g).sum(), [x, *norm.parameters()])
    for a, b in zip(grads, ref):
        assert torch.allclose(a, b, atol=1e-9)


# ----------------------------------------------------------------------------- initialization
@pytest.mark.parametrize('heads', [1, 2, 3, 4, 5, 8, 9, 16])
def test_paper_init_peaks_at_distinct_neighbours(heads):
    norm = DynamicTokenNorm(heads * 2, heads)
    assert torch.equal(norm.mean_gate, torch.zeros(heads))
    assert torch.equal(norm.var_gate, torch.zeros(heads))
    offsets = neighbourhood_offsets(heads)
    k = math.ceil(math.sqrt(heads))
    assert len(set(offsets)) == heads and (0, 0) in offsets
    assert max(max(abs(a), abs(b)) for a, b in offsets) <= k // 2
    H = W = 9
    P = norm.positional_matrix((H, W))
    centre = 4 * W + 4  # an interior token
    peaks = set()
    for h in range(heads):
        dx, dy = offsets[h]
        assert norm.pos_coef[h].tolist() == [-1.0, 2.0 * dx, 2.0 * dy]  # Eq. 7
        row = P[h, centre]
        top = int(row.argmax())
        assert divmod(top, W) == (4 + dy, 4 + dx)
        assert row[top] > 1.5 * torch.topk(row, 2).values[1]  # a clear, unique peak
        peaks.add(top)
    assert len(peaks) == heads


def test_layernorm_init_equals_layernorm_even_for_strongly_varying_tokens():
    """init='layernorm': a fresh DTN is nn.LayerNorm (computed in float64, so that float32 results
    are measured against the exact LayerNorm rather than against another rounding of it). In
    float64 the only difference left is the (1 - lambda) share of the inter-token statistics,
    tested on tokens whose scales span 6 orders of magnitude with large offsets; in float32 on
    ordinary features (there, badly conditioned tokens put float32 LayerNorm itself more than 1e-5
    from the exact one)."""
    g = torch.Generator().manual_seed(0)
    for dtype, log_scale, offset in [(torch.float64, 3.0, 100.0), (torch.float32, 1.0, 5.0)]:
        for pool, (H, W) in [(1, (14, 14)), (2, (10, 12)), (4, (17, 9))]:
            C = 32
            norm = DynamicTokenNorm(C, 4, pool_size=pool, eps=1e-6, init='layernorm').to(dtype)
            ln = torch.nn.LayerNorm(C, eps=1e-6).to(dtype)
            with torch.no_grad():
                w = torch.randn(C, generator=g, dtype=dtype)
                b = torch.randn(C, generator=g, dtype=dtype)
                norm.weight.copy_(w), ln.weight.copy_(w)
                norm.bias.copy_(b), ln.bias.copy_(b)
            scale = torch.exp(log_scale * torch.randn(2, H * W, 1, generator=g, dtype=dtype))
            x = torch.randn(2, H * W, C, generator=g, dtype=dtype) * scale.clamp(1e-3, 1e3)
            x = x + offset * torch.randn(2, H * W, 1, generator=g, dtype=dtype)
            x = x + 0.1 * offset * torch.randn(C, generator=g, dtype=dtype)
            exact = ln.double()(x.double()).detach()  # LayerNorm without float32 rounding
            ln.to(dtype)
            assert (norm(x, (H, W)).double() - exact).abs().max() < 1e-5, (dtype, pool)
    # the gates still learn
    x.requires_grad_()
    norm(x, (H, W)).square().sum().backward()
    assert all(gate.grad.abs().sum() > 0 for gate in norm.gates)
    assert [n for n, _ in norm.named_parameters()] == [
        'weight', 'bias', 'mean_gate_distance', 'var_gate_distance', 'pos_coef'
    ]


# ----------------------------------------------------------------------------- numerics
def test_autocast_statistics_in_float32_output_in_input_dtype():
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=2))
    x = tokens(2, 6, 8, 16, torch.float32)
    ref = norm(x, (6, 8))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y32 = norm(x, (6, 8))
        y16 = norm(x.bfloat16(), (6, 8))
    assert y32.dtype == torch.float32 and torch.allclose(y32, ref, atol=1e-6)
    assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()
    assert torch.allclose(y16.float(), norm(x.bfloat16().float(), (6, 8)), atol=0.1)
    xb = x.bfloat16().requires_grad_()
    with torch.autocast('cpu', dtype=torch.bfloat16):
        norm(xb, (6, 8)).float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and torch.isfinite(xb.grad).all()


@pytest.mark.parametrize('pool', [1, 2])
def test_constant_large_and_empty_inputs(pool):
    norm = DynamicTokenNorm(16, 4, pool_size=pool)
    # constant tokens: zero variance everywhere, the output is the bias (up to the rounding of
    # (1 - lambda) * mu, amplified by 1 / sqrt(eps), for arbitrary gates)
    x = torch.full((2, 24, 16), 3.0, requires_grad=True)
    assert torch.equal(norm(x, (4, 6)), norm.bias.expand(2, 24, 16))
    randomize(norm)
    y = norm(x, (4, 6))
    assert torch.allclose(y, norm.bias.expand_as(y), atol=1e-3)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in norm.parameters())
    # constant within each token only / within each channel only
    for x in (torch.randn(2, 24, 1).expand(2, 24, 16), torch.randn(1, 1, 16).expand(2, 24, 16)):
        assert torch.isfinite(norm(x.contiguous(), (4, 6))).all()
    # magnitudes of 1e4 with a large common offset: finite and accurate in float32
    x = 1e4 * tokens(2, 4, 6, 16, torch.float64) + 3e4
    y32 = norm(x.float(), (4, 6))
    y64 = norm.double()(x, (4, 6))
    norm.float()
    assert torch.isfinite(y32).all()
    assert torch.allclose(y32.double(), y64, atol=1e-3)
    # empty batch
    x = torch.zeros(0, 24, 16, requires_grad=True)
    y = norm(x, (4, 6))
    assert y.shape == (0, 24, 16)
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_bad_input_raises_value_error_naming_shapes():
    with pytest.raises(ValueError, match='num_features=10.*num_heads=4'):
        DynamicTokenNorm(10, 4)
    with pytest.raises(ValueError, match='pool_size'):
        DynamicTokenNorm(8, 2, pool_size=0)
    with pytest.raises(ValueError, match='init'):
        DynamicTokenNorm(8, 2, init='xavier')
    norm = DynamicTokenNorm(8, 2)
    with pytest.raises(ValueError, match=r'\(2, 12, 8\).*hw_shape=\(3, 5\)'):
        norm(torch.randn(2, 12, 8), (3, 5))
    with pytest.raises(ValueError, match=r'\(12, 8\)'):
        norm(torch.randn(12, 8), (3, 4))
    with pytest.raises(ValueError, match=r'\(2, 12, 6\).*num_features=8'):
        norm(torch.randn(2, 12, 6), (3, 4))
    with pytest.raises(ValueError, match='hw_shape'):
        norm(torch.randn(2, 12, 8), 12)


# ----------------------------------------------------------------------------- plumbing
def test_any_resolution_caching_and_inference_mode():
    norm = randomize(DynamicTokenNorm(8, 2, pool_size=2))
    with torch.inference_mode():  # tables first created here must still serve training
        norm(torch.randn(1, 35, 8), (5, 7))
    x = torch.randn(1, 35, 8, requires_grad=True)
    norm(x, (5, 7)).sum().backward()
    assert x.grad is not None
    for H, W in [(3, 3), (2, 11), (16, 5)]:
        y = norm(torch.randn(2, H * W, 8), (H, W))
        assert y.shape == (2, H * W, 8)


def test_build_norm_layer_and_registries():
    from mmcv.cnn import build_norm_layer
    from mmdet.registry import MODELS as MMDET_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS

    name, layer = build_norm_layer(dict(type='DTN', num_heads=4, pool_size=4), 64)
    assert name == 'dtn' and isinstance(layer, DynamicTokenNorm)
    assert (layer.num_features, layer.num_heads, layer.pool_size) == (64, 4, 4)
    assert layer.eps == 1e-5  # build_norm_layer's default
    y = layer(torch.randn(2, 64, 64), (8, 8))
    assert y.shape == (2, 64, 64)
    _, frozen = build_norm_layer(dict(type='DTN', num_heads=2, requires_grad=False), 8)
    assert not any(p.requires_grad for p in frozen.parameters())
    for registry in (MMDET_MODELS, MMSEG_MODELS):
        for type_name in ('DTN', 'DynamicTokenNorm'):
            built = registry.build(dict(type=type_name, num_features=16, num_heads=2))
            assert isinstance(built, DynamicTokenNorm)
    assert [n for n, _ in layer.named_parameters()] == [
        'weight', 'bias', 'mean_gate', 'var_gate', 'pos_coef'
    ]


def test_backward_twice_with_retained_graph_gives_same_gradients():
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=1))
    x = torch.randn(2, 30, 16, requires_grad=True)
    y = norm(x, (5, 6))
    first = torch.autograd.grad(y.square().sum(), [x, *norm.parameters()], retain_graph=True)
    norm(torch.randn(2, 30, 16), (5, 6)).sum().backward()  # another call in between
    second = torch.autograd.grad(y.square().sum(), [x, *norm.parameters()])
    for a, b in zip(first, second):
        assert torch.equal(a, b)
