"""The banded positional-product kernels of DynamicTokenNorm's CPU extension against dense
products (the layer-level tests in test_dtn_backends.py check them inside the layer)."""
import os

import pytest
import torch


def cpu_kernels():
    from mmdtn.models.layers.dtn.backends.cpu import kernels
    if kernels is None:
        if os.environ.get('MMDTN_WITH_OPS') == '0':
            pytest.skip('mmdtn was installed with MMDTN_WITH_OPS=0, without its CPU kernels')
        pytest.fail('the CPU kernels of DynamicTokenNorm are not built: run `pip install -e .`')
    return kernels


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('L,N,group', [(84, 3200, 1), (50, 2688, 2), (13, 70, 3), (9, 5, 1)])
def test_banded_kernels_equal_dense_products(dtype, L, N, group):
    """band_matmul (P X and P^T X) and band_outer (A X^T where P is nonzero) against dense
    products, for P with rows of different spans, a zero row, rows and widths that are not
    multiples of the kernels' blocks and tiles."""
    ops = cpu_kernels()
    torch.manual_seed(L)
    offsets = torch.arange(L)[None, :] - torch.arange(L)[:, None]
    P = torch.rand(3, L, L, dtype=dtype)
    for h, (lo, hi) in enumerate([(2, 5), (7, 0), (0, 3)]):
        P[h] *= ((offsets >= -lo) & (offsets <= hi)).to(dtype)
    P[1, L // 2] = 0
    X, A = torch.randn(2, 3 * group, L, N, dtype=dtype).unbind(0)
    dense = P.repeat_interleave(group, 0)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-10)
    for transpose in (False, True):
        out = ops.band_matmul(p=P, x=X, group=group, transpose=transpose)
        ref = torch.bmm(dense.transpose(1, 2) if transpose else dense, X)
        assert torch.allclose(out, ref, **tol)
    G = ops.band_outer(p=P, a=A, x=X, group=group)
    spans = torch.zeros_like(dense, dtype=torch.bool)
    for k, p in enumerate(dense):
        for i, row in enumerate(p):
            nonzero = row.nonzero()
            if len(nonzero):
                spans[k, i, nonzero.min():nonzero.max() + 1] = True
    ref = torch.bmm(A, X.transpose(1, 2)) * spans
    assert torch.allclose(G, ref, **tol)
