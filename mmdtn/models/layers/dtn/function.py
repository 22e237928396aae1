"""Forward and backward of Dynamic Token Normalization (Shao et al., ICLR 2022, Eqs. 2, 4, 5) over
a backend's passes, and the two ways a backend is made differentiable and traceable.

Forward, for tokens x (B, N, C) on the grid of :class:`~.grid.TokenGrid`::

    statistics   mu_ln, var_ln per token (Eq. 2); per cell the mean of x and, about a per-channel
                 centre, the mean of (x - centre)^2
    moments      T = (cell mean - centre, second moment about the centre)
    products     u = P_x T, m = P_y u: P^h T by its two factors (Eq. 5); with pooling m's
                 second slot becomes the inter-token variance P T_1 - (P T_0)^2
    output       y = gamma (x - mu) / sqrt(sigma2 + eps) + beta with mu, sigma2 of Eq. 5 (Eq. 4)

and backward mirrors it: the token gradients (dL/dm per cell, the sums for the parameters), the
products backwards (the gradients of P_y, P_x and dL/dT), the input gradient. Rows of P sum to 1, so
the moments about the centre give exactly the statistics about 0 without the cancellation of
E[x^2] - E[x]^2. A backend may fuse the products with the passes over the tokens
(``fuses_products``). The Triton backend runs passes of its own (:mod:`.backends.triton`).

Backends whose passes PyTorch can trace run inside an autograd Function
(:func:`define_traced_function`) that ``torch.compile`` and ``torch.export`` trace through.
Compiled kernels run inside ``torch.library`` custom ops (:func:`define_custom_ops`), with fake
implementations and registered autograd, so that tracing never reaches them. Either way,
everything backward needs goes through ``save_for_backward``.
"""
import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ..reference_compat import StatisticsConvention
from .flops import dtn_flops
from .grid import TokenGrid

__all__ = ['no_autocast', 'TokenStatistics', 'Saved', 'Gradients', 'dtn_forward', 'dtn_backward',
           'inter_token_statistics', 'ln_statistics', 'ln_gradient', 'define_traced_function',
           'define_custom_ops', 'traced', 'watched', 'CUSTOM_OP_IMPLEMENTATIONS']


#: Whether autocast exists on a device type (not on 'meta'), asked once per type outside of
#: tracing: the Dynamo of some torch versions (2.11) cannot trace the query.
AUTOCAST_AVAILABLE = {kind: torch.amp.is_autocast_available(kind)
                      for kind in ('cpu', 'cuda', 'meta')}


def no_autocast(device):
    """Autocast off on ``device`` (a device or its type), where autocast exists (not on 'meta');
    no context where it is off already (nested calls, backward passes: host time)."""
    kind = getattr(device, 'type', device)
    if kind not in AUTOCAST_AVAILABLE:
        AUTOCAST_AVAILABLE[kind] = torch.amp.is_autocast_available(kind)
    if AUTOCAST_AVAILABLE[kind] and torch.is_autocast_enabled(kind):
        return torch.autocast(kind, enabled=False)
    return contextlib.nullcontext()


@dataclass
class TokenStatistics:
    """The statistics pass: per token ``mean_ln``, ``var_ln`` (B, N, 1) (Eq. 2; None where only
    the moments are formed: :meth:`.backends.base.Backend.token_moments`); per image the
    ``centre`` (B, 1, 1, C), a per-channel constant near the tokens' values; per cell
    ``cell_mean`` (B, Hp, Wp, C) and ``cell_second``, the mean of (x - centre)^2, or None where
    the second moment is the square of the first moment (no pooling, or the reference code's
    square of the pooled x)."""

    mean_ln: Optional[Tensor]
    var_ln: Optional[Tensor]
    centre: Tensor
    cell_mean: Tensor
    cell_second: Optional[Tensor]


@dataclass
class Saved:
    """What the backward pass keeps besides the inputs: the per-token statistics and the centre;
    with pooling also the (small) moments T and products u = P_x T and m = P_y u, which without
    pooling are as large as x and are recomputed."""

    mean_ln: Tensor
    var_ln: Tensor
    centre: Tensor
    moments: Optional[Tensor] = None
    row_products: Optional[Tensor] = None
    products: Optional[Tensor] = None

    #: how many tensors :meth:`tensors` gives
    COUNT = 6

    def tensors(self):
        """The six tensors, empty ones standing for None (custom ops return no None)."""
        def given(t):
            return self.centre.new_empty(0) if t is None else t

        return [given(self.mean_ln), given(self.var_ln), self.centre, given(self.moments),
                given(self.row_products), given(self.products)]

    @classmethod
    def from_tensors(cls, tensors, grid):
        mean_ln, var_ln, centre, moments, row_products, products = tensors
        if not grid.pooled:
            moments = row_products = products = None
        return cls(mean_ln, var_ln, centre, moments, row_products, products)

    @staticmethod
    def fake_tensors(x, grid, dtype):
        """Empty tensors of the shapes :meth:`tensors` has for ``grid`` (fake implementations)."""
        T, m = (grid.column_major, grid.head_major) if grid.pooled else ((0, ), (0, ))
        tokens = (grid.B, grid.N, 1)
        return [x.new_empty(tokens, dtype=dtype), x.new_empty(tokens, dtype=dtype),
                x.new_empty(grid.B, 1, 1, grid.C, dtype=dtype), x.new_empty(T, dtype=dtype),
                x.new_empty(m, dtype=dtype), x.new_empty(m, dtype=dtype)]


@dataclass
class Gradients:
    """Gradients of the loss for every differentiable input of the layer's core."""

    x: Tensor
    p_y: Tensor
    p_x: Tensor
    ratios: Tensor
    weight: Tensor
    bias: Tensor


def dtn_forward(backend, x, p_y, p_x, ratios, weight, bias, grid, eps, convention):
    """Eqs. 2, 4, 5 for contiguous tokens x (B, N, C) with the factors p_y (heads, Hp, Hp) and p_x
    (heads, Wp, Wp) of P^h and ``ratios`` (4, C), the per-channel lambda_mean, 1 - lambda_mean,
    lambda_var, 1 - lambda_var. Returns y and what the backward pass needs (:class:`Saved`).
    Autocast is off: the statistics keep the computation dtype."""
    with no_autocast(x.device):
        return _forward(backend, x, p_y, p_x, ratios, weight, bias, grid, eps, convention)


def _forward(backend, x, p_y, p_x, ratios, weight, bias, grid, eps, convention):
    if backend.fuses_products(x, grid, p_x):
        return backend.fused_forward(x, p_y, p_x, ratios, weight, bias, eps, grid, convention)
    stats = backend.statistics(x, grid, convention)
    T = moments(stats, grid)
    u, m = positional_products(T, backend.factor(p_y, 'y'), backend.factor(p_x, 'x'), grid)
    n_var = convention.ln_divisor(grid.C)
    y = backend.output(x, stats, m, ratios, weight, bias, eps, n_var, grid)
    if not grid.pooled:
        return y, Saved(stats.mean_ln, stats.var_ln, stats.centre)
    return y, Saved(stats.mean_ln, stats.var_ln, stats.centre, T, u, m)


def dtn_backward(backend, g, x, p_y, p_x, ratios, weight, saved, grid, eps, convention):
    """The gradients (:class:`Gradients`) of :func:`dtn_forward` for the output gradient g."""
    with no_autocast(x.device):
        return _backward(backend, g, x, p_y, p_x, ratios, weight, saved, grid, eps, convention)


def _backward(backend, g, x, p_y, p_x, ratios, weight, saved, grid, eps, convention):
    C = grid.C
    n_var = convention.ln_divisor(C)
    if backend.fuses_products(x, grid, p_x):
        return backend.fused_backward(g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid)
    factor_y, factor_x = backend.factor(p_y, 'y'), backend.factor(p_x, 'x')
    if grid.pooled:
        T, u, m = saved.moments, saved.row_products, saved.products
    else:  # T = (x - centre, its square), u and m recomputed
        T = backend.token_moments(x, saved.centre, grid)
        u, m = positional_products(T, factor_y, factor_x, grid)

    # pass 1: with D1 = g w rstd (= -dL/dmu) and D2 = D1 xhat rstd (= -2 dL/dvar) per token and
    # channel, dL/dm of every cell and the sums over the tokens for the parameters; ``tokens``
    # holds what pass 2 takes from pass 1 (a backend may keep D1 or recompute it)
    tokens, sums, dm = backend.token_gradients(g, x, saved, m, ratios, weight, eps, n_var, grid)

    # the positional products backwards: dL/dm -> dL/dP_y, dL/du -> dL/dP_x, dL/dT; the
    # temporaries, each of T's size, are dropped as soon as they are used
    grad_p_y = factor_y.outer(by_rows(dm, grid), by_rows(u, grid))
    del u
    du = rows_backward(dm, factor_y, grid)
    del dm
    grad_p_x, dT = columns_backward(du, T, factor_x, grid)
    del du
    d_first, d_second = dT[:, :, 0], dT[:, :, 1]
    if grid.pooled and convention.square_of_pooled:  # second moment = first^2
        d_first = d_first + 2 * T[:, :, 0] * d_second
        d_second = None

    # pass 2: dx = D1 + x beta + alpha + (dL/dT_0 + 2 (x - centre) dL/dT_1) / n, with n the
    # tokens of the cell and beta, alpha the gradient of Eq. 2 (see ln_gradient)
    dx = backend.input_gradient(tokens, g, x, saved, m, ratios, weight, eps, n_var, d_first,
                                d_second, grid)
    return Gradients(dx, grad_p_y, grad_p_x, *backend.parameter_gradients(sums))


def moments(stats, grid):
    """The inputs T of the positional products, column-major (heads, Wp, 2, B, Hp, d): the cell
    means about the centre and the second moment about the centre."""
    first = stats.cell_mean - stats.centre
    second = first * first if stats.cell_second is None else stats.cell_second
    T = torch.stack([grid.to_column_major(first), grid.to_column_major(second)], dim=2)
    return T.contiguous()


def by_columns(T, grid):
    """T as matrices (heads, Wp, 2 * B * Hp * d) for the products with P_x."""
    return T.view(grid.heads, grid.Wp, -1)


def row_products(T, factor_x, grid):
    """u = P_x^h T along every row of cells, head-major (heads, 2, B, Hp, Wp, d)."""
    return factor_x.matmul(by_columns(T, grid), inner=grid.d).view(grid.head_major)


def positional_products(T, factor_y, factor_x, grid):
    """u = P_x T and m = P_y u = P^h T (Eq. 5), both head-major. With pooling m's second slot is
    turned into the inter-token variance P T_1 - (P T_0)^2 (clamped at 0); without, it keeps the
    raw second moment, and the passes over the tokens form the variance."""
    u = row_products(T, factor_x, grid)
    m = factor_y.matmul(by_rows(u, grid)).view(u.shape)
    if grid.pooled:  # in place: m is this function's own tensor
        first, second = m.select(1, 0), m.select(1, 1)  # single views: in-place is traceable
        second.addcmul_(first, first, value=-1).clamp_min_(0)
    return u, m


def by_rows(t, grid):
    """A head-major cell tensor as matrices (heads * 2 * B, Hp, Wp * d): the products with P_y."""
    return t.view(-1, grid.Hp, grid.Wp * grid.d)


def rows_backward(dm, factor_y, grid):
    """m = P_y u backwards: dL/du, column-major (heads, Wp, ...), from dL/dm (head-major, with
    respect to the raw moments). The gradient of P_y is ``factor_y.outer(by_rows(dm),
    by_rows(u))``."""
    du = factor_y.matmul(by_rows(dm, grid), transpose=True, inner=grid.d)
    return du.view(grid.heads, grid.Wp, -1)


def columns_backward(du, T, factor_x, grid):
    """u = P_x T backwards: the gradient of P_x and dL/dT (column-major, as T) from the
    column-major dL/du."""
    grad_p_x = factor_x.outer(du, by_columns(T, grid))
    return grad_p_x, factor_x.matmul(du, transpose=True).view(grid.column_major)


def ln_statistics(x, n_var):
    """Eq. 2 per token of x (B, N, C): the mean as a sum / C (exact for constant tokens) and the
    variance about it (two passes) divided by n_var, each (B, N, 1)."""
    mean_ln = x.sum(-1, keepdim=True) / x.shape[-1]
    return mean_ln, (x - mean_ln).square().sum(-1, keepdim=True) / n_var


def ln_gradient(tok1, tok2, mean_ln, C, n_var):
    """beta, alpha (B, N, 1) of dx = ... + x beta + alpha, the gradient through Eq. 2, from the
    per-token sums tok1 = sum_c D1 lambda_m and tok2 = sum_c D2 lambda_v: dL/dmu_ln = -tok1,
    dL/dvar_ln = -tok2 / 2, beta = 2 dL/dvar_ln / n_var, alpha = dL/dmu_ln / C - beta mu_ln."""
    beta = tok2 * (-1.0 / n_var)
    return beta, tok1 * (-1.0 / C) - beta * mean_ln


#: Each channel parameter's gradient as a multiple of one row of the sums over the tokens (6, C)
#: of xhat g, g, mu_ln D1, var_ln D2, mu_it D1 and var_it D2 (D1 = -dL/dmu, D2 = -2 dL/dvar):
#: (row, factor) for the weight, the bias and the ratios' rows lambda_m, kappa_m, lambda_v and
#: kappa_v (Eq. 4's mixtures).
PARAMETER_SUMS = ((0, 1.0), (1, 1.0), (2, -1.0), (4, -1.0), (3, -0.5), (5, -0.5))


def parameter_gradients(sums):
    """The gradients of the ratios (4, C), weight and bias (each its own tensor) from the sums over
    the tokens (6, C) (:data:`PARAMETER_SUMS`)."""
    weight, bias, *ratios = (sums[row] * factor for row, factor in PARAMETER_SUMS)
    return torch.stack(ratios), weight, bias


def inter_token_statistics(backend, x, p_y, p_x, grid, convention):
    """Eq. 2 and the inter-token terms of Eq. 5 per cell: (TokenStatistics, mean_it, var_it), the
    last two (B, Hp, Wp, C). For analysis."""
    stats = backend.statistics(x, grid, convention)
    if stats.mean_ln is None:
        stats.mean_ln, stats.var_ln = ln_statistics(x.float(), convention.ln_divisor(grid.C))
    T = moments(stats, grid)
    _, m = positional_products(T, backend.factor(p_y, 'y'), backend.factor(p_x, 'x'), grid)
    first, second = (grid.cells_of(grid.from_head_major(t)) for t in m.unbind(1))
    if not grid.pooled:
        second = (second - first * first).clamp_min(0)
    return stats, first + stats.centre, second


# ---------------------------------------------------------------------------- differentiable entry
def _convention(unbiased_ln_var, square_of_pooled):
    return StatisticsConvention(unbiased_ln_var=unbiased_ln_var, square_of_pooled=square_of_pooled)


def _layer_forward(backend, x, p_y, p_x, ratios, weight, bias, grid, eps, convention):
    """y and the tensors backward keeps besides x, the parameter inputs and the weight."""
    y, saved = dtn_forward(backend, x, p_y, p_x, ratios, weight, bias, grid, eps, convention)
    return y, saved.tensors()


def _layer_backward(backend, grad, x, p_y, p_x, ratios, weight, kept, grid, eps, convention):
    """The gradients of x, P_y, P_x, the ratios, the weight and the bias."""
    saved = Saved.from_tensors(kept, grid)
    grads = dtn_backward(backend, grad, x, p_y, p_x, ratios, weight, saved, grid, eps, convention)
    return [grads.x, grads.p_y, grads.p_x, grads.ratios, grads.weight, grads.bias]


def define_traced_function(backend):
    """DTN over a backend's passes as an autograd Function: forward and the hand-written backward
    both run as the backend's Python, and for a backend whose passes PyTorch can trace (no custom
    ops) ``torch.compile`` (including ``fullgraph=True``), ``torch.export`` and
    ``torch.jit.trace`` follow them. Arguments other than tensors are plain numbers, which every
    tracer records.

    Returns:
        callable: ``apply(x, a, b, c, weight, bias, grid, eps, convention) -> y``, with a, b, c
        the factors P_y, P_x and the ratios (4, C).
    """

    class TracedDynamicTokenNorm(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x, a, b, c, weight, bias, H, W, pool, heads, eps, unbiased_ln_var,
                    square_of_pooled):
            grid = TokenGrid(x.shape[0], H, W, x.shape[2], heads, pool)
            convention = _convention(unbiased_ln_var, square_of_pooled)
            y, kept = _layer_forward(backend, x, a, b, c, weight, bias, grid, eps, convention)
            ctx.save_for_backward(x, a, b, c, weight, *kept)
            ctx.grid, ctx.eps, ctx.convention = grid, eps, convention
            return y

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_y):
            x, a, b, c, weight, *kept = ctx.saved_tensors
            grads = _layer_backward(backend, grad_y.to(x.dtype).contiguous(), x, a, b, c, weight,
                                    kept, ctx.grid, ctx.eps, ctx.convention)
            return (*grads, None, None, None, None, None, None, None)

    def apply(x, a, b, c, weight, bias, grid, eps, convention):
        return TracedDynamicTokenNorm.apply(x, a, b, c, weight, bias, grid.H, grid.W, grid.pool,
                                            grid.heads, eps, convention.unbiased_ln_var,
                                            convention.square_of_pooled)

    return apply


#: The Python implementations of the custom ops of :func:`define_custom_ops`, by qualified name
#: ('mmdtn::dtn_cpu_forward', ...), for tools that look inside them (benchmarks counting launches).
CUSTOM_OP_IMPLEMENTATIONS = {}


def traced():
    """Whether a call runs under a tracer (``torch.compile``, ``torch.export``,
    ``torch.jit.trace``) or a dispatch mode (FLOP and byte counters, fake tensors): then a
    backend's compiled kernels must run as custom ops."""
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch._C._len_torch_dispatch_stack() > 0)


def watched(x):
    """Whether a call on tensor ``x`` must run as its custom ops: when :func:`traced`, or on meta
    tensors, which the C++ kernels cannot run. Otherwise the same Python runs as an autograd
    Function, without the custom ops' dispatch."""
    return x.device.type == 'meta' or traced()


def define_custom_ops(backend, name):
    """``torch.library`` custom ops ``mmdtn::dtn_<name>_forward`` and ``..._backward`` running DTN
    over ``backend``'s compiled passes, with fake implementations and registered autograd; in
    eager calls (:func:`watched`) the same passes run in :func:`define_traced_function`'s Function.

    Returns:
        callable: ``apply(x, a, b, c, weight, bias, grid, eps, convention) -> y``, as
        :func:`define_traced_function`'s.
    """

    def run_forward(x: Tensor, a: Tensor, b: Tensor, c: Tensor, weight: Tensor, bias: Tensor,
                    H: int, W: int, pool: int, heads: int, eps: float, unbiased_ln_var: bool,
                    square_of_pooled: bool) -> list[Tensor]:
        grid = TokenGrid(x.shape[0], H, W, x.shape[2], heads, pool)
        y, kept = _layer_forward(backend, x, a, b, c, weight, bias, grid, eps,
                                 _convention(unbiased_ln_var, square_of_pooled))
        return [y, *kept]

    names = f'mmdtn::dtn_{name}_forward', f'mmdtn::dtn_{name}_backward'
    forward = torch.library.custom_op(names[0], mutates_args=())(run_forward)

    @forward.register_fake
    def _(x, a, b, c, weight, bias, H, W, pool, heads, *options):
        grid = TokenGrid(x.shape[0], H, W, x.shape[2], heads, pool)
        return [torch.empty_like(x), *Saved.fake_tensors(x, grid, weight.dtype)]

    def run_backward(grad: Tensor, x: Tensor, a: Tensor, b: Tensor, c: Tensor, weight: Tensor,
                     kept: list[Tensor], H: int, W: int, pool: int, heads: int, eps: float,
                     unbiased_ln_var: bool, square_of_pooled: bool) -> list[Tensor]:
        grid = TokenGrid(x.shape[0], H, W, x.shape[2], heads, pool)
        return _layer_backward(backend, grad, x, a, b, c, weight, kept, grid, eps,
                               _convention(unbiased_ln_var, square_of_pooled))

    backward = torch.library.custom_op(names[1], mutates_args=())(run_backward)

    @backward.register_fake
    def _(grad, x, a, b, c, weight, *args):
        return [torch.empty_like(t) for t in (x, a, b, c, weight, weight)]

    def setup_context(ctx, inputs, output):
        x, a, b, c, weight, _, *options = inputs
        ctx.save_for_backward(x, a, b, c, weight, *output[1:])
        ctx.options = options
        # the kept tensors are outputs for save_for_backward only: no gradients flow into them,
        # and none are filled with zeros for the backward pass
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)

    def differentiate(ctx, grads):
        x, a, b, c, weight, *kept = ctx.saved_tensors
        if grads[0] is None:  # y takes no part in the loss
            return (None, ) * (6 + len(ctx.options))
        grad = grads[0].to(x.dtype).contiguous()
        result = backward(grad, x, a, b, c, weight, kept, *ctx.options)
        return (*result, *([None] * len(ctx.options)))

    forward.register_autograd(differentiate, setup_context=setup_context)

    @register_flop_formula(getattr(torch.ops.mmdtn, f'dtn_{name}_forward'))
    def flops(x_shape, *args, out_shape=None, **kwargs):
        """The layer's FLOPs for ``torch.utils.flop_counter`` (2 per multiply-add)."""
        H, W, pool, heads = args[5:9]
        return 2 * dtn_flops(x_shape[0], x_shape[2], heads, (H, W), pool)

    eager = define_traced_function(backend)

    def apply(x, a, b, c, weight, bias, grid, eps, convention):
        if not watched(x):
            return eager(x, a, b, c, weight, bias, grid, eps, convention)
        return forward(x, a, b, c, weight, bias, grid.H, grid.W, grid.pool, grid.heads, eps,
                       convention.unbiased_ln_var, convention.square_of_pooled)[0]

    CUSTOM_OP_IMPLEMENTATIONS.update(zip(names, (run_forward, run_backward)))
    return apply
