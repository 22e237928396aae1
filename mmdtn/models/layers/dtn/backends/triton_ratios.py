"""The per-channel ratios of DynamicTokenNorm's gates (Eq. 5) in Triton: one launch forward, one
backward.

Written in PyTorch (:func:`..gates.channel_ratios`) they take five operations forward and six
backward on a few values each, every one a launch, and on a GPU at batch 2 a layer waits for the
host to launch its kernels (README, "DTN on GPUs"). Here a program forms BLOCK channels of the
four ratios (lambda_m, 1 - lambda_m, lambda_v, 1 - lambda_v) from the gates of their heads,

    init='paper'      lambda = sigmoid(g), 1 - lambda = sigmoid(-g)     (g: the logit)
    init='layernorm'  1 - lambda = tanh|u|, lambda = 1 - tanh|u|       (u: the distance from LN)

and backward a program per head adds up the gradient of its two gates over its d channels in a
fixed order (deterministic, no atomics). |u| has derivative +1 at u = 0, as in
:func:`..gates.share_of_distance`.
"""
import torch
import triton
import triton.language as tl
from torch import Tensor

from ..function import define_parameter_op
from .triton_kernels import _launch

__all__ = ['channel_ratios', 'run_ratios', 'run_ratios_backward', 'fake_ratios',
           'specializations']

#: Channels per program.
BLOCK = 256
#: Below this |u|, tanh|u| is its Taylor series (to u^7, relative error < 3e-10); above, the
#: closed form (1 - e) / (1 + e), e = exp(-2|u|), whose cancellation costs < 3e-7.
TANH_SERIES_BELOW = tl.constexpr(0.1)


@triton.jit
def _tanh(a):
    """tanh(a) for a >= 0 (Triton's language has no tanh its interpreter runs)."""
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    return tl.where(a < TANH_SERIES_BELOW, series, (1.0 - e) / (1.0 + e))


@triton.jit
def _lambdas(gate, LAYERNORM: tl.constexpr):
    """(lambda, 1 - lambda, d lambda / d gate) of gate values."""
    if LAYERNORM:
        share = _tanh(tl.abs(gate))
        return 1.0 - share, share, -(1.0 - share * share) * tl.where(gate < 0, -1.0, 1.0)
    else:
        lam, kap = 1.0 / (1.0 + tl.exp(-gate)), 1.0 / (1.0 + tl.exp(gate))
        return lam, kap, lam * kap


@triton.jit
def _gate_ratios(gate_ptr, ratios_ptr, c, C, d, LAYERNORM: tl.constexpr):
    """lambda and 1 - lambda of channels c (rows 0 and 1 from ``ratios_ptr``) of one gate."""
    inside = c < C
    lam, kap, _ = _lambdas(tl.load(gate_ptr + c // d, mask=inside).to(tl.float32), LAYERNORM)
    tl.store(ratios_ptr + c, lam, mask=inside)
    tl.store(ratios_ptr + C + c, kap, mask=inside)


@triton.jit(do_not_specialize=['C', 'd'])
def _ratios_kernel(mean_ptr, var_ptr, ratios_ptr, C, d, LAYERNORM: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Channels of block ``program_id(0)`` of the four ratios (4, C), float32."""
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _gate_ratios(mean_ptr, ratios_ptr, c, C, d, LAYERNORM)
    _gate_ratios(var_ptr, ratios_ptr + 2 * C, c, C, d, LAYERNORM)


@triton.jit
def _gate_gradient(gate_ptr, grad_ptr, out_ptr, h, C, d, LAYERNORM: tl.constexpr,
                   BLOCK: tl.constexpr):
    """dL/dgate of head h from the gradients (2, C) at ``grad_ptr`` of lambda and 1 - lambda:
    d lambda / d gate times the sum over the head's channels of their difference."""
    _, _, slope = _lambdas(tl.load(gate_ptr + h).to(tl.float32), LAYERNORM)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, d, BLOCK):
        k = start + tl.arange(0, BLOCK)
        c = h * d + k
        total += (tl.load(grad_ptr + c, mask=k < d, other=0.0) -
                  tl.load(grad_ptr + C + c, mask=k < d, other=0.0))
    tl.store(out_ptr + h, (slope * tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=['C', 'd'])
def _ratios_backward_kernel(mean_ptr, var_ptr, grad_ptr, grad_mean_ptr, grad_var_ptr, C, d,
                            LAYERNORM: tl.constexpr, BLOCK: tl.constexpr):
    """The gradients of both gates of head ``program_id(0)`` from that of the ratios (4, C)."""
    h = tl.program_id(0)
    _gate_gradient(mean_ptr, grad_ptr, grad_mean_ptr, h, C, d, LAYERNORM, BLOCK)
    _gate_gradient(var_ptr, grad_ptr + 2 * C, grad_var_ptr, h, C, d, LAYERNORM, BLOCK)


def _ratios_spec(layernorm):
    return _ratios_kernel, dict(LAYERNORM=layernorm, BLOCK=BLOCK), 4


def _ratios_backward_spec(layernorm):
    return _ratios_backward_kernel, dict(LAYERNORM=layernorm, BLOCK=BLOCK), 4


def specializations():
    """The compiled kernels of the ratios, as (kernel, constexprs, num_warps): one per ``init``
    for every layer."""
    return [spec(layernorm) for spec in (_ratios_spec, _ratios_backward_spec)
            for layernorm in (False, True)]


# ---------------------------------------------------------------------------- the operation
def run_ratios(mean_gate: Tensor, var_gate: Tensor, d: int, layernorm: bool) -> Tensor:
    heads = mean_gate.shape[0]
    ratios = mean_gate.new_empty(4, heads * d, dtype=torch.float32)
    _launch('triton.channel_ratios', _ratios_spec(layernorm), (-(-heads * d // BLOCK), ),
            [mean_gate, var_gate], [ratios], mean_gate, var_gate, ratios, heads * d, d)
    return ratios


def run_ratios_backward(mean_gate: Tensor, var_gate: Tensor, grad: Tensor, d: int,
                        layernorm: bool) -> tuple[Tensor, Tensor]:
    grad_mean, grad_var = torch.empty_like(mean_gate), torch.empty_like(var_gate)
    _launch('triton.channel_ratios_backward', _ratios_backward_spec(layernorm),
            (mean_gate.shape[0], ), [mean_gate, var_gate, grad], [grad_mean, grad_var], mean_gate,
            var_gate, grad, grad_mean, grad_var, grad.shape[1], d)
    return grad_mean, grad_var


def fake_ratios(mean_gate, var_gate, d, layernorm):
    return mean_gate.new_empty(4, mean_gate.shape[0] * d, dtype=torch.float32)


def _fake_backward(mean_gate, var_gate, grad, d, layernorm):
    return torch.empty_like(mean_gate), torch.empty_like(var_gate)


#: ``(mean_gate, var_gate, d, layernorm) -> ratios (4, C)``, differentiable: the custom op
#: ``mmdtn::dtn_triton_channel_ratios`` where traced (:func:`..function.define_parameter_op`).
channel_ratios_op = define_parameter_op('dtn_triton_channel_ratios', run_ratios,
                                        run_ratios_backward, fake_ratios, _fake_backward,
                                        lambda inputs, output: inputs[:2], tensors=2)


def channel_ratios(mean_gate, var_gate, d, layernorm):
    """The ratios of :func:`..gates.channel_ratios` in float32, in the kernels of this module."""
    return channel_ratios_op(mean_gate, var_gate, d, layernorm)
