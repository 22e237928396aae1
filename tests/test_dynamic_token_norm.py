"""DynamicTokenNorm (Shao et al., ICLR 2022, Eqs. 4-7) against dense formulas, limits, bad input."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from mmdtn import DynamicTokenNorm
from mmdtn.models.layers.dynamic_token_norm import neighbourhood_offsets

# every test runs with the fused CPU kernels and with the PyTorch implementation
pytestmark = pytest.mark.usefixtures('dtn_implementation')


# ----------------------------------------------------------------------------- dense reference
def dense_positional_matrix(pos_coef, Hp, Wp):
    """P^h = softmax_j(a^h . R_ij), R_ij = [dx^2 + dy^2, dx, dy] as a T x T x 3 tensor (Eq. 6)."""
    ys, xs = torch.meshgrid(torch.arange(Hp), torch.arange(Wp), indexing='ij')
    ys, xs = ys.flatten().to(pos_coef.dtype), xs.flatten().to(pos_coef.dtype)
    dx = xs[None, :] - xs[:, None]  # source column minus output column
    dy = ys[None, :] - ys[:, None]
    R = torch.stack([dx**2 + dy**2, dx, dy], dim=-1)
    return torch.softmax(torch.einsum('ijk,hk->hij', R, pos_coef), dim=-1)


def pooling_matrix(H, W, s, dtype):
    """(Hp*Wp, H*W) matrix averaging the real tokens of every s x s cell of the ceil grid."""
    Hp, Wp = math.ceil(H / s), math.ceil(W / s)
    M = torch.zeros(Hp * Wp, H * W, dtype=dtype)
    for n in range(H * W):
        r, c = divmod(n, W)
        M[(r // s) * Wp + c // s, n] = 1.0
    return M / M.sum(1, keepdim=True), M.t().bool()


def dense_dtn(x, hw, norm, P=None):
    """Eqs. 2, 4, 5 with a dense T x T positional matrix; returns (y, statistics dict)."""
    B, N, C = x.shape
    H, W = hw
    s, nh = norm.pool_size, norm.num_heads
    d = C // nh
    Hp, Wp = math.ceil(H / s), math.ceil(W / s)
    if P is None:
        P = dense_positional_matrix(norm.pos_coef.to(x.dtype), Hp, Wp)
    M, member = pooling_matrix(H, W, s, x.dtype)
    xp = torch.einsum('tn,bnc->btc', M, x).view(B, -1, nh, d)
    qp = torch.einsum('tn,bnc->btc', M, x * x).view(B, -1, nh, d)
    mean_it = torch.einsum('hij,bjhd->bihd', P, xp)
    var_it = (torch.einsum('hij,bjhd->bihd', P, qp) - mean_it**2).clamp_min(0)
    cell = member.float().argmax(1)  # cell of every token
    mean_it = mean_it.reshape(B, -1, C)[:, cell]
    var_it = var_it.reshape(B, -1, C)[:, cell]
    var_ln, mean_ln = torch.var_mean(x, -1, keepdim=True, correction=0)
    lm = torch.sigmoid(norm.mean_gate.to(x.dtype)).repeat_interleave(d)
    lv = torch.sigmoid(norm.var_gate.to(x.dtype)).repeat_interleave(d)
    mean = lm * mean_ln + (1 - lm) * mean_it
    var = lv * var_ln + (1 - lv) * var_it
    y = norm.weight.to(x.dtype) * (x - mean) / torch.sqrt(var + norm.eps) + norm.bias.to(x.dtype)
    stats = dict(mean_ln=mean_ln, var_ln=var_ln, mean_it=mean_it, var_it=var_it, mean=mean, var=var)
    return y, stats


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
        for B, heads, C in [(1, 2, 8), (3, 3, 12)]:
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
    # the paper's initialisation, logits -(k - D)^2: 11 weights per row in float32, 15 in float64
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
    """Gates -> -inf and P^h a normalised banded matrix: a local IN (paper Fig. 5).

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


# ----------------------------------------------------------------------------- initialisation
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
    """init='layernorm': a fresh DTN is nn.LayerNorm. In float64 the only difference left is the
    (1 - lambda) share of the inter-token statistics, tested on tokens whose scales span 6 orders of
    magnitude with large offsets; in float32 on ordinary features (there, badly conditioned tokens
    make any two LayerNorm implementations differ by more than 1e-5)."""
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
            assert (norm(x, (H, W)) - ln(x)).abs().max() < 1e-5, (dtype, pool)
    # the gates still learn
    x.requires_grad_()
    norm(x, (H, W)).square().sum().backward()
    assert norm.mean_gate.grad.abs().sum() > 0 and norm.var_gate.grad.abs().sum() > 0


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


@pytest.mark.parametrize('chunk', [150, 250, 1000])
@pytest.mark.parametrize('pool,hw', [(1, (7, 9)), (2, (8, 10)), (2, (7, 9)), (4, (12, 8))])
def test_chunked_passes_equal_dense_reference(monkeypatch, pool, hw, chunk):
    """Inputs split into chunks of one or more cell rows (the last one partial, chunks spanning
    two images)."""
    import mmdtn.models.layers.dynamic_token_norm as dtn_module
    monkeypatch.setitem(dtn_module._CHUNK_ELEMENTS, 'cpu', chunk)
    H, W = hw
    norm = randomize(DynamicTokenNorm(12, 3, pool_size=pool)).double()
    x = tokens(3, H, W, 12).requires_grad_()
    g = torch.randn(3, H * W, 12, dtype=torch.float64)
    assert_equals_dense_reference(norm, x, hw, g)


@pytest.mark.parametrize('pool,hw', [(1, (12, 60)), (1, (60, 12)), (2, (21, 117)), (1, (56, 9))])
@pytest.mark.parametrize('a1', [-1.0, -2.5, -0.1])
@pytest.mark.parametrize('C,heads', [(8, 4), (32, 2)])
def test_banded_positional_products_equal_dense_reference(dtn_implementation, pool, hw, a1, C,
                                                          heads):
    """With the CPU kernels the positional products skip the exact zeros of P_x and P_y on long
    axes (blocks of rows, the last one partial, bands wider on one side than the other) and,
    without pooling and with whole vectors per head (16 channels), apply P_x on the tokens
    themselves; values and gradients still equal the dense formulation. a1 = -0.1 spreads P too
    widely for a band on these grids and keeps the dense products, as does the PyTorch
    implementation."""
    from mmdtn.models.layers.dynamic_token_norm import _Band, _Grid, _on_tokens
    torch.manual_seed(0)
    norm = randomize(DynamicTokenNorm(C, heads, pool_size=pool)).double()
    with torch.no_grad():  # Eq. 7 peaks at distinct neighbours, other widths, random gates
        offsets = torch.tensor(neighbourhood_offsets(heads), dtype=torch.float64)
        norm.pos_coef[:, 0] = a1
        norm.pos_coef[:, 1:] = -2 * a1 * offsets
    p_y, p_x = norm.axis_matrices(hw)
    long_axis = p_x if p_x.shape[-1] >= p_y.shape[-1] else p_y
    native = dtn_implementation == 'cpu_kernels'
    assert _Band(long_axis, native=native).banded == (native and a1 != -0.1)
    H, W = hw
    x = tokens(2, H, W, C).requires_grad_()
    grid = _Grid(x, H, W, pool, heads)
    on_tokens = native and pool == 1 and C == 32 and a1 != -0.1 and W > H
    assert _on_tokens(x, grid, _Band(p_x, native=native)) == on_tokens
    g = torch.randn(2, H * W, C, dtype=torch.float64)
    assert_equals_dense_reference(norm, x, hw, g)


@pytest.mark.parametrize('Dy', [(9, -9), (0, 20), (-3, 1)])
@pytest.mark.parametrize('threads', [1, 3])
def test_fused_passes_with_peaks_off_the_diagonal_equal_dense_reference(dtn_implementation, Dy,
                                                                        threads):
    """Without pooling and with P_x banded, the CPU kernels fuse the positional products with the
    passes over the tokens, walking the token rows of every head in order and keeping only the
    rows of u = P_x T that P_y still needs. With P_y's peaks far from its diagonal (whose weights
    are then exact zeros: row i's sources lie 9 or 20 rows away, and the rows' gradients arrive
    before or after row i itself), values and gradients still equal the dense formulation. With 3
    threads the 4 (image, head) tasks are too few, and every head's channels are split into two
    groups of tasks of their own."""
    from mmdtn.models.layers.dynamic_token_norm import _Band, _Grid, _on_tokens
    torch.manual_seed(0)
    H, W = 30, 40
    norm = randomize(DynamicTokenNorm(32, 2)).double()
    with torch.no_grad():
        norm.pos_coef[:, 0] = -1.0
        norm.pos_coef[:, 1] = torch.tensor([2.0, -2.0])
        norm.pos_coef[:, 2] = 2 * torch.tensor(Dy, dtype=torch.float64)
    p_y, p_x = norm.axis_matrices((H, W))
    x = tokens(2, H, W, 32).requires_grad_()
    native = dtn_implementation == 'cpu_kernels'
    assert _on_tokens(x, _Grid(x, H, W, 1, 2), _Band(p_x, native=native)) == native
    if max(abs(v) for v in Dy) >= 9:
        assert (p_y.diagonal(dim1=1, dim2=2) == 0).any()
    g = torch.randn(2, H * W, 32, dtype=torch.float64)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_equals_dense_reference(norm, x, hw=(H, W), g=g)
    finally:
        torch.set_num_threads(saved)


def _forward_backward(norms, x, hw, g):
    """Output of the stacked ``norms`` and the gradients of (y * g).sum() for x and parameters."""
    y = x
    for norm in norms:
        y = norm(y, hw)
    params = [p for norm in norms for p in norm.parameters()]
    return [y.detach(), *torch.autograd.grad((y * g).sum(), [x, *params])]


def assert_implementations_agree(monkeypatch, norms, x, hw, g):
    """The CPU kernels and the PyTorch implementation give the same outputs and gradients of the
    stacked ``norms`` to float32 rounding."""
    import mmdtn.models.layers.dynamic_token_norm as dtn_module
    results = {}
    for use in (True, False):
        monkeypatch.setattr(dtn_module, 'USE_CPU_KERNELS', use)
        results[use] = _forward_backward(norms, x, hw, g)
    for a, b in zip(results[True], results[False]):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize('pool,hw,B', [(1, (9, 13), 2), (2, (10, 14), 1), (2, (9, 13), 2),
                                       (4, (17, 22), 2), (3, (7, 8), 1)])
def test_cpu_kernels_equal_pytorch_implementation(monkeypatch, dtn_implementation, pool, hw, B):
    """Float32, two stacked layers (the second reuses the first's scratch memory while the first
    keeps its saved tensors): both implementations agree to float32 rounding."""
    torch.manual_seed(0)
    norms = [randomize(DynamicTokenNorm(24, 4, pool_size=pool), seed=i) for i in range(2)]
    x = (torch.randn(B, hw[0] * hw[1], 24) * 3 + 1).requires_grad_()
    g = torch.randn(B, hw[0] * hw[1], 24)
    assert_implementations_agree(monkeypatch, norms, x, hw, g)


def test_products_on_the_tokens_equal_pytorch_implementation(monkeypatch):
    """Float32, paper initialisation, 16 channels per head, no pooling, two stacked layers: the
    kernels that apply P_x on the tokens agree with the PyTorch implementation."""
    import mmdtn.models.layers.dynamic_token_norm as dtn_module
    from mmdtn.models.layers.dynamic_token_norm import _Band, _Grid, _on_tokens
    torch.manual_seed(0)
    hw = (10, 40)
    norms = [DynamicTokenNorm(64, 4) for _ in range(2)]
    for norm in norms:
        with torch.no_grad():
            norm.mean_gate.uniform_(-2, 2)
            norm.var_gate.uniform_(-2, 2)
    x = (torch.randn(2, 400, 64) * 3 + 1).requires_grad_()
    g = torch.randn(2, 400, 64)
    p_x = norms[0].axis_matrices(hw)[1]
    monkeypatch.setattr(dtn_module, 'USE_CPU_KERNELS', True)
    assert _on_tokens(x, _Grid(x, *hw, 1, 4), _Band(p_x, native=True))
    assert_implementations_agree(monkeypatch, norms, x, hw, g)


def test_backward_twice_with_retained_graph_gives_same_gradients():
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=1))
    x = torch.randn(2, 30, 16, requires_grad=True)
    y = norm(x, (5, 6))
    first = torch.autograd.grad(y.square().sum(), [x, *norm.parameters()], retain_graph=True)
    norm(torch.randn(2, 30, 16), (5, 6)).sum().backward()  # another call in between
    second = torch.autograd.grad(y.square().sum(), [x, *norm.parameters()])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_cpu_kernels_baseline_and_avx512_builds_agree(tmp_path):
    """ATEN_CPU_CAPABILITY=default selects the baseline build of the kernels (on CPUs with AVX-512
    the other run uses the AVX-512 build); float64 results agree to rounding. The 12 x 60 grid
    uses the banded positional products along W, on the tokens."""
    import subprocess
    import sys
    script = (
        'import torch, sys\n'
        'from mmdtn import DynamicTokenNorm\n'
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


def test_missing_cpu_kernels_warn_once_and_fall_back(monkeypatch):
    import mmdtn.models.layers.dynamic_token_norm as dtn_module
    norm = randomize(DynamicTokenNorm(8, 2, pool_size=2)).double()
    x = tokens(1, 6, 6, 8)
    expected = norm(x, (6, 6))
    monkeypatch.setattr(dtn_module, 'USE_CPU_KERNELS', True)
    monkeypatch.setattr(dtn_module, '_native_ops', None)
    dtn_module._warn_no_kernels.cache_clear()
    with pytest.warns(UserWarning, match='without its CPU kernels'):
        y = norm(x, (6, 6))
    assert torch.allclose(y, expected, atol=1e-12)
