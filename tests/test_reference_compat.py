"""Weights of the authors' reference DTN code convert and reproduce its outputs."""
import pytest
import torch

from mmdtn import DynamicTokenNorm, convert_reference_state_dict
from mmdtn import neighbourhood_offsets
from mmdtn.models.layers.reference_compat import REFERENCE_ONLY_VAR_MEAN_GATE

# every test runs on every DynamicTokenNorm backend of the CPU
pytestmark = pytest.mark.usefixtures('dtn_backend')


def reference_forward(x, sd, heads, side, pool, eps):
    """The reference code's forward as described: square side x side grid, pooling by ``pool``.

    Group-RMS pre-normalization, unbiased LN variance, inter-token second moment from the square of
    the pooled x, positional logits pos_proj([dx, dy, dx^2 + dy^2]) with dx, dy = output - source
    and a softmax over source cells."""
    B, T, C = x.shape
    g = x.view(B, T, heads, C // heads)
    x = (g / torch.sqrt((g * g).mean(-1, keepdim=True) + eps)).view(B, T, C)
    cells = side // pool
    n = cells * cells
    rows = torch.arange(n) // cells
    cols = torch.arange(n) % cells
    dx = (cols[:, None] - cols[None, :]).to(x.dtype)  # [out, src]: output minus source
    dy = (rows[:, None] - rows[None, :]).to(x.dtype)
    feats = torch.stack([dx, dy, dx * dx + dy * dy], -1)  # (out, src, 3)
    logits = feats @ sd['pos_proj.weight'].t() + sd['pos_proj.bias']  # (out, src, heads)
    P = torch.softmax(logits, dim=1).permute(2, 0, 1)  # P[h, out, src]
    mean_ln = x.mean(-1, keepdim=True)
    var_ln = x.var(-1, keepdim=True)  # unbiased
    img = x.view(B, side, side, C)
    pooled = img.view(B, cells, pool, cells, pool, C).mean((2, 4)).reshape(B, n, heads, -1)
    mean_it = torch.einsum('hos,bshd->bohd', P, pooled)
    var_it = torch.einsum('hos,bshd->bohd', P, pooled * pooled) - mean_it**2

    def up(t):  # nearest: every token takes its cell's value
        t = t.reshape(B, cells, 1, cells, 1, C).expand(B, cells, pool, cells, pool, C)
        return t.reshape(B, T, C)

    d = C // heads
    lm = torch.sigmoid(sd['mean_norm_weight']).repeat_interleave(d) if 'mean_norm_weight' in sd \
        else torch.ones(C, dtype=x.dtype)
    lv = torch.sigmoid(sd['var_norm_weight']).repeat_interleave(d)
    mean = lm * mean_ln + (1 - lm) * up(mean_it)
    var = lv * var_ln + (1 - lv) * up(var_it)
    return (x - mean) / torch.sqrt(var + eps) * sd['weight'] + sd['bias']


def reference_state_dict(heads, C, seed, only_var=False):
    g = torch.Generator().manual_seed(seed)
    sd = {
        'weight': 1 + 0.3 * torch.randn(C, generator=g, dtype=torch.float64),
        'bias': 0.3 * torch.randn(C, generator=g, dtype=torch.float64),
        'var_norm_weight': torch.randn(heads, generator=g, dtype=torch.float64),
        'pos_proj.weight': torch.randn(heads, 3, generator=g, dtype=torch.float64) * 0.5,
        'pos_proj.bias': torch.randn(heads, generator=g, dtype=torch.float64),
    }
    sd['pos_proj.weight'][:, 2] = -sd['pos_proj.weight'][:, 2].abs() - 0.1
    if not only_var:
        sd['mean_norm_weight'] = torch.randn(heads, generator=g, dtype=torch.float64)
    return sd


@pytest.mark.parametrize('heads,C,side,pool,only_var', [
    (4, 16, 6, 1, False),
    (6, 24, 8, 2, False),
    (9, 18, 8, 4, False),
    (4, 16, 4, 2, True),
])
def test_converted_weights_reproduce_reference_forward(heads, C, side, pool, only_var):
    eps = 1e-5
    sd = reference_state_dict(heads, C, seed=heads, only_var=only_var)
    norm = DynamicTokenNorm(C, heads, pool_size=pool, eps=eps, reference_compat=True).double()
    converted = convert_reference_state_dict(sd)
    norm.load_state_dict(converted)  # strict: exactly our keys
    x = torch.randn(3, side * side, C, dtype=torch.float64) * 2 + torch.randn(3, side * side, 1)
    ref = reference_forward(x, sd, heads, side, pool, eps)
    assert torch.allclose(norm(x, (side, side)), ref, atol=1e-10)
    # float32 too
    assert torch.allclose(norm.float()(x.float(), (side, side)).double(), ref, atol=1e-4)


def test_paper_semantics_differ_from_reference():
    sd = reference_state_dict(4, 16, seed=0)
    x = torch.randn(2, 64, 16, dtype=torch.float64) * 3
    paper = DynamicTokenNorm(16, 4, pool_size=2, eps=1e-5).double()
    paper.load_state_dict(convert_reference_state_dict(sd))
    assert not torch.allclose(paper(x, (8, 8)), reference_forward(x, sd, 4, 8, 2, 1e-5), atol=1e-3)


def test_model_state_dict_with_prefixes_is_converted_and_other_keys_kept():
    sd = {}
    for i in range(2):
        for k, v in reference_state_dict(4, 8, seed=i).items():
            sd[f'blocks.{i}.norm1.{k}'] = v
    sd['blocks.0.attn.qkv.weight'] = torch.randn(24, 8)
    sd['head.weight'] = torch.randn(10, 8)
    out = convert_reference_state_dict(sd)
    for i in range(2):
        p = f'blocks.{i}.norm1.'
        assert torch.equal(out[p + 'mean_gate'], sd[p + 'mean_norm_weight'])
        assert torch.equal(out[p + 'var_gate'], sd[p + 'var_norm_weight'])
        w = sd[p + 'pos_proj.weight']
        assert torch.equal(out[p + 'pos_coef'], torch.stack([w[:, 2], -w[:, 0], -w[:, 1]], 1))
        assert torch.equal(out[p + 'weight'], sd[p + 'weight'])
        for old in ('mean_norm_weight', 'var_norm_weight', 'pos_proj.weight', 'pos_proj.bias'):
            assert p + old not in out
    assert torch.equal(out['head.weight'], sd['head.weight'])
    assert 'blocks.0.attn.qkv.weight' in out
    only = convert_reference_state_dict(sd, prefix='blocks.1.')
    assert 'blocks.0.norm1.pos_proj.weight' in only and 'blocks.1.norm1.pos_coef' in only
    var_only = reference_state_dict(2, 4, seed=0, only_var=True)
    assert torch.equal(convert_reference_state_dict(var_only)['mean_gate'],
                       torch.full((2, ), REFERENCE_ONLY_VAR_MEAN_GATE, dtype=torch.float64))


def test_bad_reference_state_dict_raises_naming_key_and_shapes():
    sd = reference_state_dict(4, 8, seed=0)
    sd['pos_proj.weight'] = torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"pos_proj.weight.*\(4, 2\)"):
        convert_reference_state_dict(sd)
    sd = reference_state_dict(4, 8, seed=0)
    sd['var_norm_weight'] = torch.randn(3)
    with pytest.raises(ValueError, match=r"var_norm_weight.*\(3,\)"):
        convert_reference_state_dict(sd)


def test_reference_local_init_is_the_paper_init_for_odd_square_heads():
    """The reference code's local init (k x k heads, k odd) converts into Eq. 7 with the same set of
    neighbourhood offsets as ours: a check of the sign conventions."""
    k = 3
    weight = torch.zeros(k * k, 3)
    centre = k // 2
    for h1 in range(k):  # as the reference code lays out its heads
        for h2 in range(k):
            weight[h1 + k * h2] = torch.tensor([2.0 * (h2 - centre), 2.0 * (h1 - centre), -1.0])
    sd = {'pos_proj.weight': weight, 'var_norm_weight': torch.zeros(9)}
    converted = {tuple(r) for r in convert_reference_state_dict(sd)['pos_coef'].tolist()}
    ours = {tuple(r) for r in DynamicTokenNorm(18, 9).pos_coef.tolist()}
    assert converted == ours
    assert ours == {(-1.0, 2.0 * dx, 2.0 * dy) for dx, dy in neighbourhood_offsets(9)}


def test_reference_compat_gradcheck():
    norm = DynamicTokenNorm(8, 2, pool_size=2, reference_compat=True).double()
    norm.load_state_dict(convert_reference_state_dict(reference_state_dict(2, 8, seed=3)))
    names = [n for n, _ in norm.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in norm.parameters())
    x = torch.randn(2, 20, 8, dtype=torch.float64, requires_grad=True)

    def fn(x, *ps):
        return torch.func.functional_call(norm, dict(zip(names, ps)), (x, (4, 5)))

    assert torch.autograd.gradcheck(fn, (x, *params), fast_mode=True)
    with pytest.raises(ValueError, match='num_features=1'):
        DynamicTokenNorm(1, 1, reference_compat=True)
