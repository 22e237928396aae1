"""A Triton DynamicTokenNorm layer call: its plan, its forward and backward passes, and the
``torch.library`` custom ops that make it one operation each way.

Forward (Eqs. 2, 4-6), six launches::

    centre      the mean of a sample of the tokens, (B, C) float32        (torch.mean)
    parameters  P_y, P_x (Eq. 6) and the ratios lambda, 1 - lambda (Eq. 5)   (:mod:`.parameters`)
    moments     T of every cell                                           (:mod:`.kernels`)
    products    u = T P_x^T, m = P_y u                                    (:mod:`.products`)
    output      y from x and m (Eqs. 2, 4, 5)                             (:mod:`.kernels`)

Backward, twelve launches without pooling (three of them T, u and m formed again) and nine with:
the token gradients (dL/dm and the parameters' shares, added up by one reduction), the four
products backwards, the input gradient, and the gradients of a^h and the gates (two launches).

Everything that depends only on the shapes and the layer's settings (the cell grid, the strides
of the planes, the programs, the kernels' constexprs) is a :class:`Plan`, made once per (shapes,
settings) and cached; it holds numbers only, never a tensor. A call checks nothing the module has
not checked, looks its plan up, allocates and launches: four allocations forward (the centre, one
buffer for P_y, P_x and the ratios, one for the planes T, u, m, and y) and seven backward (the
planes' gradients, the programs' shares, dx, the shares of the gradient of a^h and the three
parameter gradients).

In eager calls, meta tensors included (their launches recorded, never made: the host's own time
of a call, ``tools/dev/benchmark_norm.py``), the passes run inside an autograd Function; under a
tracer (``torch.compile``, ``torch.export``) or a dispatch mode (FLOP counters, fake tensors) they
run as the custom ops ``mmdtn::dtn_triton_forward`` and ``mmdtn::dtn_triton_backward``
(:func:`...function.traced`), whose fake implementations give the shapes.
"""
import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from ...flops import dtn_flops
from ...function import CUSTOM_OP_IMPLEMENTATIONS, traced
from ...grid import pooled_size
from . import kernels, parameters
from .products import backward_products, forward_products, plane_strides

__all__ = ['Plan', 'plan_of', 'normalize', 'layer_forward', 'layer_backward']


def saved_numels(B, H, W, C, heads, pool):
    """The elements of the buffer of P_y, P_x and the ratios, and of a plane (ints, or symbolic
    ints under dynamic shapes)."""
    Hp, Wp = pooled_size((H, W), pool)
    return heads * (Hp * Hp + Wp * Wp) + 4 * C, 2 * B * Hp * Wp * C


class Plan:
    """Everything about a call that depends only on its shapes and settings (see the module
    docstring): sizes, the strides of the planes, the programs and the kernels' specs."""

    def __init__(self, B, H, W, C, heads, pool, eps, unbiased_ln_var, square_of_pooled,
                 layernorm):
        self.B, self.H, self.W, self.C, self.heads, self.pool = B, H, W, C, heads, pool
        self.d = C // heads
        self.Hp, self.Wp = pooled_size((H, W), pool)
        self.pooled = pool > 1
        self.eps = float(eps)
        self.n_var = float(C - 1 if unbiased_ln_var else C)  # Eq. 2's divisor
        self.centre_stride = kernels.centre_stride(H * W)
        self.strides = plane_strides(B, self.Hp, self.Wp, heads, self.d)
        self.formed, self.plane = saved_numels(B, H, W, C, heads, pool)
        (self.moments, self.output, self.token_gradients,
         self.input_gradient) = kernels.specs(C, pool, square_of_pooled)
        self.parameters, self.factor_gradients, self.parameters_backward = (
            parameters.specs(layernorm))
        tiles = kernels.Tiles(C, pool)
        self.forward_programs = tiles.programs(B, self.Hp, self.Wp, tiles.cells)
        self.backward_programs = tiles.programs(B, self.Hp, self.Wp, tiles.backward_cells)
        self.gradient_programs = tiles.programs(B, self.Hp, self.Wp,
                                                tiles.backward_cells * tiles.tiles)
        self.parameter_programs = (heads, parameters.row_blocks(self.Hp, self.Wp) + 1)
        rows, columns = self.Hp, self.Wp
        self._formed_shapes = ((heads, rows, rows), (heads, columns, columns), (4, C))
        self._formed_splits = (heads * rows * rows, heads * columns * columns, 4 * C)

    def formed_views(self, formed):
        """P_y, P_x and the ratios as views of their buffer."""
        return [part.view(shape) for part, shape in
                zip(formed.split(self._formed_splits), self._formed_shapes)]


_plans = {}
#: Plans kept at most (one per layer shape and resolution); past it the cache starts again.
PLAN_LIMIT = 4096


def plan_of(B, H, W, C, heads, pool, eps, unbiased_ln_var, square_of_pooled, layernorm):
    """The cached :class:`Plan` of these shapes and settings."""
    key = (B, H, W, C, heads, pool, eps, unbiased_ln_var, square_of_pooled, layernorm)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= PLAN_LIMIT:
            _plans.clear()
        plan = _plans[key] = Plan(*key)
    return plan


# ---------------------------------------------------------------------------- the passes
def layer_forward(x, pos_coef, mean_gate, var_gate, weight, bias, plan):
    """y, and what backward keeps besides the inputs: the centre (B, C), the buffer of P_y, P_x
    and the ratios, and with pooling the planes T, u, m (an empty tensor without)."""
    f32 = torch.float32
    centre = kernels.sample_centre(x, plan.centre_stride)
    formed = x.new_empty(plan.formed, dtype=f32)
    p_y, p_x, ratios = parameters.parameters(pos_coef, mean_gate, var_gate, formed, plan)
    planes = x.new_empty(3, plan.plane, dtype=f32)
    T, u, m = planes[0], planes[1], planes[2]
    kernels.moments(x, centre, T, plan)
    forward_products(T, u, m, p_y, p_x, plan)
    y = kernels.output(x, m, centre, ratios, weight, bias, plan)
    return y, centre, formed, planes if plan.pooled else planes.new_empty(0)


def layer_backward(g, x, mean_gate, var_gate, weight, centre, formed, planes, plan):
    """The gradients of x, a^h, the two gates, and (4, C) those of the weight, the bias and the
    ratios with 1 - lambda tied to lambda (rows 2 and 3, taken by the gates' gradients)."""
    p_y, p_x, ratios = plan.formed_views(formed)
    if plan.pooled:  # T, u, m kept; their gradients in a buffer of their own
        T, u, m = planes[0], planes[1], planes[2]
        work = x.new_empty(3, plan.plane, dtype=torch.float32)
        dm, du, dT = work[0], work[1], work[2]
    else:  # T, u, m formed again; du and dT overwrite u and T after their last reads
        work = x.new_empty(4, plan.plane, dtype=torch.float32)
        T, u, m, dm = work[0], work[1], work[2], work[3]
        kernels.moments(x, centre, T, plan)
        forward_products(T, u, m, p_y, p_x, plan)
        du, dT = u, T
    sums = kernels.token_gradients(g, x, m, centre, ratios, weight, dm, plan)
    grad_p_y, grad_p_x = backward_products(dm, T, u, p_y, p_x, du, dT, plan)
    dx = kernels.input_gradient(g, x, m, centre, ratios, weight, dT, T, plan)
    grad_coef, grad_mean, grad_var = parameters.parameters_backward(
        p_y, p_x, grad_p_y, grad_p_x, mean_gate, var_gate, sums[2:], plan)
    return dx, grad_coef, grad_mean, grad_var, sums


# ---------------------------------------------------------------------------- eager calls
class TritonDynamicTokenNorm(torch.autograd.Function):
    """The layer in eager calls: one autograd node, the passes of :func:`layer_forward` and
    :func:`layer_backward`."""

    @staticmethod
    def forward(ctx, x, pos_coef, mean_gate, var_gate, weight, bias, plan):
        y, *kept = layer_forward(x, pos_coef, mean_gate, var_gate, weight, bias, plan)
        ctx.save_for_backward(x, mean_gate, var_gate, weight, *kept)
        ctx.plan = plan
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, mean_gate, var_gate, weight, *kept = ctx.saved_tensors
        dx, grad_coef, grad_mean, grad_var, sums = layer_backward(
            grad.to(x.dtype).contiguous(), x, mean_gate, var_gate, weight, *kept, ctx.plan)
        return dx, grad_coef, grad_mean, grad_var, sums[0], sums[1], None


# ---------------------------------------------------------------------------- the custom ops
def _run_forward(x: Tensor, pos_coef: Tensor, mean_gate: Tensor, var_gate: Tensor,
                 weight: Tensor, bias: Tensor, H: int, W: int, pool: int, heads: int, eps: float,
                 unbiased_ln_var: bool, square_of_pooled: bool,
                 layernorm: bool) -> list[Tensor]:
    plan = plan_of(x.shape[0], H, W, x.shape[2], heads, pool, eps, unbiased_ln_var,
                   square_of_pooled, layernorm)
    return list(layer_forward(x, pos_coef, mean_gate, var_gate, weight, bias, plan))


_forward_op = torch.library.custom_op('mmdtn::dtn_triton_forward', mutates_args=())(_run_forward)


@_forward_op.register_fake
def _(x, pos_coef, mean_gate, var_gate, weight, bias, H, W, pool, heads, *settings):
    B, _, C = x.shape
    formed, plane = saved_numels(B, H, W, C, heads, pool)
    f32 = torch.float32
    planes = (3, plane) if pool > 1 else (0, )
    return [torch.empty_like(x), x.new_empty(B, C, dtype=f32), x.new_empty(formed, dtype=f32),
            x.new_empty(planes, dtype=f32)]


def _run_backward(grad: Tensor, x: Tensor, mean_gate: Tensor, var_gate: Tensor, weight: Tensor,
                  centre: Tensor, formed: Tensor, planes: Tensor, H: int, W: int, pool: int,
                  heads: int, eps: float, unbiased_ln_var: bool, square_of_pooled: bool,
                  layernorm: bool) -> list[Tensor]:
    plan = plan_of(x.shape[0], H, W, x.shape[2], heads, pool, eps, unbiased_ln_var,
                   square_of_pooled, layernorm)
    return list(layer_backward(grad, x, mean_gate, var_gate, weight, centre, formed, planes,
                               plan))


_backward_op = torch.library.custom_op('mmdtn::dtn_triton_backward',
                                       mutates_args=())(_run_backward)
CUSTOM_OP_IMPLEMENTATIONS.update({'mmdtn::dtn_triton_forward': _run_forward,
                                  'mmdtn::dtn_triton_backward': _run_backward})


@_backward_op.register_fake
def _(grad, x, mean_gate, var_gate, weight, *args):
    return [torch.empty_like(x), mean_gate.new_empty(mean_gate.shape[0], 3),
            torch.empty_like(mean_gate), torch.empty_like(var_gate),
            weight.new_empty(4, weight.shape[0], dtype=torch.float32)]


def _setup_context(ctx, inputs, output):
    x, _, mean_gate, var_gate, weight, _, *settings = inputs
    ctx.save_for_backward(x, mean_gate, var_gate, weight, *output[1:])
    ctx.settings = settings
    ctx.mark_non_differentiable(*output[1:])  # kept for backward only
    ctx.set_materialize_grads(False)


def _differentiate(ctx, grads):
    x, mean_gate, var_gate, weight, *kept = ctx.saved_tensors
    if grads[0] is None:  # y takes no part in the loss
        return (None, ) * (6 + len(ctx.settings))
    dx, grad_coef, grad_mean, grad_var, sums = _backward_op(
        grads[0].to(x.dtype).contiguous(), x, mean_gate, var_gate, weight, *kept, *ctx.settings)
    return (dx, grad_coef, grad_mean, grad_var, sums[0], sums[1], *([None] * len(ctx.settings)))


_forward_op.register_autograd(_differentiate, setup_context=_setup_context)


@register_flop_formula(torch.ops.mmdtn.dtn_triton_forward)
def _flops(x_shape, *args, out_shape=None, **kwargs):
    """The layer's FLOPs for ``torch.utils.flop_counter`` (2 per multiply-add)."""
    H, W, pool, heads = args[5:9]
    return 2 * dtn_flops(x_shape[0], x_shape[2], heads, (H, W), pool)


# ---------------------------------------------------------------------------- the entry
def normalize(x, pos_coef, mean_gate, var_gate, weight, bias, grid, eps, convention, layernorm):
    """DTN of contiguous tokens x (B, N, C) on ``grid`` (a :class:`...grid.TokenGrid`) from the
    layer's parameters in float32: eagerly one autograd node, under tracing the custom ops."""
    if traced():
        return _forward_op(x, pos_coef, mean_gate, var_gate, weight, bias, grid.H, grid.W,
                           grid.pool, grid.heads, eps, convention.unbiased_ln_var,
                           convention.square_of_pooled, layernorm)[0]
    plan = plan_of(grid.B, grid.H, grid.W, grid.C, grid.heads, grid.pool, eps,
                   convention.unbiased_ln_var, convention.square_of_pooled, layernorm)
    return TritonDynamicTokenNorm.apply(x, pos_coef, mean_gate, var_gate, weight, bias, plan)
