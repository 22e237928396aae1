"""The DTN FLOP formula (mmdtn/models/layers/dtn/flops.py) against operation counts of the layer.

What is compared:

1. ``factorised_dtn`` below computes DynamicTokenNorm's forward as the layer does (P^h applied as
   P_y (kron) P_x on the pooled grid), one PyTorch operation per step of the formula's table, and
   its output is checked against the layer's. Its aten operations are counted with the formula's
   convention (:class:`OperationCounter`: multiply-adds of matrix products, one per element of
   element-wise arithmetic, a fused multiply-add once, reductions one per element read, data
   movement and comparisons free; any other floating-point operation fails the test), and the count
   must equal :func:`dtn_flops` exactly, at two pool sizes and on grids that do not divide by them.
2. ``torch.utils.flop_counter.FlopCounterMode`` (2 FLOPs per multiply-add, matrix products only)
   over the same formulation counts exactly the formula's ``positional_products``.
3. The same counter over the dense reference (mmdtn/models/layers/dtn/reference.py, the paper's
   T x T P^h) counts the ``dense=True`` products plus the reference's two other matrix products:
   the logits R_ij . a^h (3 G T^2 of the 7 G T^2 the dense formula counts for building P^h; the
   softmax is not a matrix product) and its pooling by a dense T x N matrix (2 B T N C, which no
   formulation of the layer performs: the layer pools by summation).
"""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from mmdtn import DynamicTokenNorm
from mmdtn.models.layers.dtn.flops import dtn_flop_terms, dtn_flops
from mmdtn.models.layers.dtn.reference import DenseDynamicTokenNorm

aten = torch.ops.aten


def _numel(t):
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _matmul(args, out):
    return out.numel() * args[0].shape[-1]  # (..., m, k) @ (..., k, n): m n k per matrix


#: FLOPs of each counted aten operation from its (args, output).
COSTS = {
    aten.mm: _matmul,
    aten.bmm: _matmul,
    aten.mean: lambda args, out: _numel(args[0]) + out.numel(),  # sum, then one division each
    aten.sum: lambda args, out: _numel(args[0]),
    aten.avg_pool2d: lambda args, out: _numel(args[0]) + out.numel(),
    aten.lerp: lambda args, out: 2 * out.numel(),  # a + w (b - a): a subtraction, a multiply-add
    aten._softmax: lambda args, out: 4 * out.numel(),  # shift by the maximum, exp, sum, divide
    **{op: lambda args, out: out.numel()
       for op in (aten.mul, aten.add, aten.sub, aten.div, aten.rsqrt, aten.sigmoid, aten.addcmul)},
}
#: Operations that move data or compare, and cost nothing.
FREE = {aten.view, aten._unsafe_view, aten.reshape, aten.permute, aten.expand, aten.unsqueeze,
        aten.squeeze, aten.select, aten.slice, aten.t, aten.transpose, aten.clone, aten._to_copy,
        aten.copy_, aten.index, aten.index_select, aten.clamp_min, aten.arange, aten.detach,
        aten.alias, aten.empty, aten.lift_fresh, aten.repeat_interleave, aten.contiguous}


class OperationCounter(TorchDispatchMode):
    """Counts the FLOPs of floating-point aten operations by :data:`COSTS`."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        if isinstance(out, torch.Tensor) and out.is_floating_point() and packet not in FREE:
            assert packet in COSTS, f'no cost given for {func}'
            self.flops += COSTS[packet](args, out)
        return out


def factorised_dtn(x, hw_shape, norm):
    """DynamicTokenNorm's forward (paper statistics), step by step as counted by the formula."""
    B, N, C = x.shape
    H, W = hw_shape
    G, s, eps = norm.num_heads, norm.pool_size, norm.eps
    h, w = math.ceil(H / s), math.ceil(W / s)
    # Eq. 2: intra-token statistics
    mean_ln = x.mean(-1, keepdim=True)
    square = x * x
    var_ln = torch.addcmul(square.mean(-1, keepdim=True), mean_ln, mean_ln, value=-1)
    # App. B.1: average pooling onto the h x w grid (border cells average their real tokens)
    moments = []
    for t in (x, square):
        if s > 1:
            t = F.avg_pool2d(t.view(B, H, W, C).permute(0, 3, 1, 2), s, s, ceil_mode=True)
            t = t.permute(0, 2, 3, 1)
        moments.append(t.reshape(B, h, w, G, C // G))
    # Eq. 6: the factors of P^h = P_y (kron) P_x, from integer offset tables (source - output)
    a = norm.pos_coef.to(x.dtype)

    def factor(length, linear):
        pos = torch.arange(length)
        d = (pos[None, :] - pos[:, None]).to(x.dtype)
        d2 = (pos[None, :] - pos[:, None]).square().to(x.dtype)
        logits = torch.addcmul(a[:, 0, None, None] * d2, a[:, linear, None, None], d)
        return torch.softmax(logits, -1)

    p_y, p_x = factor(h, 2), factor(w, 1)
    # Eq. 5: P^h x and P^h x^2, along W then along H
    mean_it, second = (torch.einsum('gik,bkjgd->bijgd', p_y,
                                    torch.einsum('gjk,bikgd->bijgd', p_x, m)) for m in moments)
    var_it = torch.addcmul(second, mean_it, mean_it, value=-1).clamp_min(0)
    # every token takes the statistics of its cell
    cell = ((torch.arange(H)[:, None] // s) * w + torch.arange(W)[None, :] // s).flatten()
    mean_it, var_it = (t.reshape(B, h * w, C)[:, cell] for t in (mean_it, var_it))
    # Eq. 5: mixing with lambda = sigmoid(gate) per head
    lam_mean, lam_var = (torch.sigmoid(g.to(x.dtype)).repeat_interleave(C // G)
                         for g in (norm.mean_gate, norm.var_gate))
    mean = torch.lerp(mean_it, mean_ln, lam_mean)
    var = torch.lerp(var_it, var_ln, lam_var)
    # Eq. 4
    normalised = (x - mean) * torch.rsqrt(var + eps)
    return torch.addcmul(norm.bias.to(x.dtype), normalised, norm.weight.to(x.dtype))


def _layer(channels, heads, pool_size):
    torch.manual_seed(0)
    norm = DynamicTokenNorm(channels, heads, pool_size=pool_size).double()
    with torch.no_grad():  # away from the initialization: gates and positions of their own
        norm.mean_gate.normal_()
        norm.var_gate.normal_()
        norm.pos_coef.add_(0.3 * torch.randn_like(norm.pos_coef))
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


@pytest.mark.parametrize('pool_size, hw_shape', [(1, (7, 10)), (4, (13, 18))])
def test_formula_counts_the_factorised_forward(pool_size, hw_shape):
    batch, channels, heads = 2, 12, 3
    norm = _layer(channels, heads, pool_size)
    x = 2 + torch.randn(batch, hw_shape[0] * hw_shape[1], channels, dtype=torch.float64)
    with torch.no_grad():
        expected = norm(x, hw_shape)
        with OperationCounter() as counter:
            y = factorised_dtn(x, hw_shape, norm)
        with FlopCounterMode(display=False) as matmuls:
            factorised_dtn(x, hw_shape, norm)
    torch.testing.assert_close(y, expected, rtol=1e-9, atol=1e-9)
    terms = dtn_flop_terms(batch, channels, heads, hw_shape, pool_size)
    assert counter.flops == dtn_flops(batch, channels, heads, hw_shape, pool_size) == \
        sum(terms.values())
    assert matmuls.get_total_flops() == 2 * terms['positional_products']
    assert (terms['pooling'] > 0) == (pool_size > 1)
    h, w = norm.pooled_shape(hw_shape)
    assert terms['positional_factors'] == 6 * heads * (h * h + w * w)


@pytest.mark.parametrize('pool_size, hw_shape', [(1, (5, 6)), (2, (9, 7))])
def test_dense_formula_counts_the_dense_reference(pool_size, hw_shape):
    batch, channels, heads = 2, 8, 4
    norm = _layer(channels, heads, pool_size)
    x = torch.randn(batch, hw_shape[0] * hw_shape[1], channels, dtype=torch.float64)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        DenseDynamicTokenNorm(norm)(x, hw_shape)
    h, w = norm.pooled_shape(hw_shape)
    t, n = h * w, hw_shape[0] * hw_shape[1]
    dense = dtn_flop_terms(batch, channels, heads, hw_shape, pool_size, dense=True)
    assert dense['positional_factors'] == 7 * heads * t * t
    assert counter.get_total_flops() == 2 * (dense['positional_products'] + 3 * heads * t * t
                                             + 2 * batch * t * n * channels)
    factorised = dtn_flop_terms(batch, channels, heads, hw_shape, pool_size)
    assert {k: v for k, v in dense.items() if not k.startswith('positional')} == \
        {k: v for k, v in factorised.items() if not k.startswith('positional')}


def test_formula_rejects_impossible_shapes():
    with pytest.raises(ValueError, match='pool_size'):
        dtn_flops(1, 8, 2, (4, 4), 0)
    with pytest.raises(ValueError, match='hw_shape'):
        dtn_flops(1, 8, 2, (0, 4))
