"""The contract between DynamicTokenNorm and its backends.

A backend runs the passes of :mod:`..function` (statistics, output, token gradients, input
gradient, and the products with the positional factors) for the inputs it supports, and makes them
differentiable with :func:`..function.define_traced_function` (passes PyTorch can trace) or
:func:`..function.define_custom_ops` (compiled kernels).
"""
from typing import Optional

import torch

__all__ = ['Backend', 'DenseFactor']


class Backend:
    """Base class of the DTN backends; see :mod:`mmdtn.models.layers.dtn.backends`."""

    #: the name used by ``set_dtn_backend`` and ``MMDTN_DTN_BACKEND``
    name = None
    #: device types whose inputs ``auto`` hands to this backend, before the portable one
    devices = ()
    #: dtypes of x read as they are; x of another dtype is first converted to the computation
    #: dtype (float32 or float64)
    input_dtypes = (torch.float32, torch.float64)

    def supports(self, x, grid) -> Optional[str]:
        """Why this backend cannot run tokens ``x`` on ``grid``, or None if it can. The layer
        converts x of a dtype not in :attr:`input_dtypes` before the call."""
        raise NotImplementedError

    def apply(self, x, p_y, p_x, ratios, weight, bias, grid, eps, convention):
        """DTN of x (differentiable with respect to every tensor argument)."""
        raise NotImplementedError

    # the passes of function.dtn_forward and function.dtn_backward
    def statistics(self, x, grid, convention):
        """Eq. 2 per token and the cell moments: a TokenStatistics."""
        raise NotImplementedError

    def factor(self, p):
        """The products with one positional factor p (heads, L, L): an object with
        ``matmul(x, transpose=False)`` and ``outer(a, x)`` (see :class:`DenseFactor`)."""
        return DenseFactor(p)

    def output(self, x, stats, m, ratios, weight, bias, eps, grid):
        """Eqs. 4-5: y from x, the statistics and the head-major products m."""
        raise NotImplementedError

    def token_gradients(self, g, x, saved, m, ratios, weight, eps, grid):
        """Backward pass 1: (D1, tok1, tok2, sums (6, C), dL/dm head-major); see dtn_backward."""
        raise NotImplementedError

    def input_gradient(self, d1, x, beta, alpha, d_first, d_second, centre, grid):
        """Backward pass 2: dx from D1, the gradient of Eq. 2 and the column-major dL/dT."""
        raise NotImplementedError

    def fuses_products(self, x, grid, p_x):
        """Whether the positional products are fused with the passes over the tokens (then
        ``fused_output`` and ``fused_backward`` replace the staged passes)."""
        return False


class DenseFactor:
    """Products with one positional factor P (heads, L, L) as batched dense matrix products.
    Batches x (heads * group, L, N) use P[k // group] for matrix k."""

    def __init__(self, p):
        self.p = p

    def _factors(self, x):
        heads, L = self.p.shape[0], self.p.shape[-1]
        group = x.shape[0] // heads
        return self.p[:, None].expand(heads, group, L, L).reshape(-1, L, L)

    def matmul(self, x, transpose=False):
        """P X, or P^T X with ``transpose``."""
        p = self._factors(x)
        return torch.bmm(p.transpose(1, 2) if transpose else p, x)

    def outer(self, a, x):
        """The gradient of P for u = P x and dL/du = a, per matrix: a x^T (n, L, L)."""
        return torch.bmm(a, x.transpose(1, 2))
