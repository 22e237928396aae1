"""The per-channel ratios of DynamicTokenNorm's gates (Eq. 5) in Triton, and the gradients of the
gates: the parts of :mod:`.triton_parameters`' kernels that handle them.

Written in PyTorch (:func:`..gates.channel_ratios`) they take five operations forward and six
backward on a few values each, every one a launch, and on a GPU at batch 2 a layer waits for the
host to launch its kernels (docs/gpu.md, "Measured on an H200"). Here a program forms the four
ratios (lambda_m, 1 - lambda_m, lambda_v, 1 - lambda_v) of a head's channels from its gates,

    init='paper'      lambda = sigmoid(g), 1 - lambda = sigmoid(-g)     (g: the logit)
    init='layernorm'  1 - lambda = tanh|u|, lambda = 1 - tanh|u|       (u: the distance from LN)

BLOCK channels at a time, and backward adds up the gradient of the head's two gates over its d
channels in a fixed order (deterministic, no atomics). |u| has derivative +1 at u = 0, as in
:func:`..gates.share_of_distance`.
"""
import triton
import triton.language as tl

__all__ = ['BLOCK']

#: Channels of a head one step covers.
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
def _gate_ratios(gate_ptr, ratios_ptr, h, C, d, LAYERNORM: tl.constexpr, BLOCK: tl.constexpr):
    """lambda and 1 - lambda of gate h in its head's d channels (rows 0 and 1 from
    ``ratios_ptr`` of (., C))."""
    lam, kap, _ = _lambdas(tl.load(gate_ptr + h).to(tl.float32), LAYERNORM)
    for start in range(0, d, BLOCK):
        k = start + tl.arange(0, BLOCK)
        zero = tl.zeros([BLOCK], tl.float32)
        tl.store(ratios_ptr + h * d + k, zero + lam, mask=k < d)
        tl.store(ratios_ptr + C + h * d + k, zero + kap, mask=k < d)


@triton.jit
def _gate_gradient(gate_ptr, grad_ptr, out_ptr, h, C, d, LAYERNORM: tl.constexpr,
                   BLOCK: tl.constexpr):
    """dL/dgate of head h from the gradient (C,) at ``grad_ptr`` of lambda with 1 - lambda tied to
    it (the gradient of lambda less that of 1 - lambda): d lambda / d gate times its sum over the
    head's channels."""
    _, _, slope = _lambdas(tl.load(gate_ptr + h).to(tl.float32), LAYERNORM)
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, d, BLOCK):
        k = start + tl.arange(0, BLOCK)
        total += tl.load(grad_ptr + h * d + k, mask=k < d, other=0.0)
    tl.store(out_ptr + h, (slope * tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty))
