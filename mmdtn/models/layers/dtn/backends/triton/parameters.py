"""The small tensors a Triton DynamicTokenNorm layer forms from its parameters, and their
gradients: the positional factors P_y^h, P_x^h from the coefficients a^h (Eq. 6) and the
per-channel ratios lambda, 1 - lambda from the gates (Eq. 5).

Written in PyTorch (:func:`...positional.axis_factors`, :func:`...gates.channel_ratios`) they take
about 25 small operations forward and 20 backward, each a launch. Here forward is one launch: a
program forms ROWS rows of a factor from a^h alone,

    P[h, i, j] = softmax_j(a1 d^2 + a_lin d),   d = j - i,   a_lin = a2 for P_x, a3 for P_y,

truncated as :func:`...positional.truncated_softmax` (weights below eps(float32) 2^-26 of the row
maximum are exact zeros), in chunks of BLOCK entries, so that any L runs with one compiled kernel;
one more program per head forms the ratios of its channels:

    init='paper'      lambda = sigmoid(g), 1 - lambda = sigmoid(-g)     (g: the logit)
    init='layernorm'  1 - lambda = tanh|u|, lambda = 1 - tanh|u|       (u: the distance from LN)

Backward takes the gradients of P_y and P_x from the positional products (:mod:`.products`) and
contracts them with Eq. 6's softmax: with dl = P (dP - sum_j P dP) the gradient of the logits,
da1 = sum d^2 dl over both factors, da2 = sum d dl over P_x and da3 over P_y. A program per head
and block of rows gives its share; a second launch adds the shares up in a fixed order and forms
the gradients of the gates (deterministic, no atomics).
"""
import torch
import triton
import triton.language as tl

from ...positional import truncation_cutoff
from .launch import cdiv, launch

__all__ = ['parameters', 'parameters_backward', 'row_blocks']

#: Rows of a factor a program covers, and entries of those rows one step covers.
ROWS, BLOCK = 16, 64
#: Channels of a head one step of the ratios covers.
CHANNELS = 256
#: Logits below the row maximum by more than this are exact zeros (positional.truncated_softmax).
CUTOFF = truncation_cutoff(torch.float32)
#: Below this |u|, tanh|u| is its Taylor series (to u^7, relative error < 3e-10); above, the
#: closed form (1 - e) / (1 + e), e = exp(-2|u|), whose cancellation costs < 3e-7.
TANH_SERIES_BELOW = tl.constexpr(0.1)


# ---------------------------------------------------------------------------- the factors
@triton.jit
def _rows(b, rows, cols, ROWS: tl.constexpr):
    """Block b of ROWS rows among those of P_y^h followed by those of P_x^h: (whether they are
    P_x's, their indices i (ROWS,), the length L of the factor's rows)."""
    blocks_y = tl.cdiv(rows, ROWS)
    in_x = b >= blocks_y
    i = tl.where(in_x, b - blocks_y, b) * ROWS + tl.arange(0, ROWS)
    return in_x, i, tl.where(in_x, cols, rows)


@triton.jit
def _entries(i, start, length, BLOCK: tl.constexpr):
    """Columns k = start .. start + BLOCK of rows i: (k, d = k - i as float32 (ROWS, BLOCK),
    which entries lie in the factor)."""
    k = start + tl.arange(0, BLOCK)
    d = (k[None, :] - i[:, None]).to(tl.float32)
    return k, d, (i[:, None] < length) & (k[None, :] < length)


@triton.jit
def _logits(a1, a_lin, d, k, length):
    """Eq. 6's logits a1 d^2 + a_lin d, -inf past the row's end."""
    return tl.where(k[None, :] < length, a1 * (d * d) + a_lin * d, float('-inf'))


@triton.jit
def _factor_rows(coef_ptr, p_y_ptr, p_x_ptr, h, b, rows, cols, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr, CUTOFF: tl.constexpr):
    """Block b of ROWS rows of P_y^h or of P_x^h (:func:`_rows`), the truncated softmax of
    Eq. 6: the logits formed again for the row maximum, the row sum and the store."""
    in_x, i, length = _rows(b, rows, cols, ROWS)
    a1 = tl.load(coef_ptr + 3 * h)
    a_lin = tl.load(coef_ptr + 3 * h + tl.where(in_x, 1, 2))
    peak = tl.full((ROWS, ), float('-inf'), tl.float32)
    for start in range(0, length, BLOCK):
        k, d, _ = _entries(i, start, length, BLOCK)
        peak = tl.maximum(peak, tl.max(_logits(a1, a_lin, d, k, length), axis=1))
    total = tl.zeros((ROWS, ), tl.float32)
    for start in range(0, length, BLOCK):
        k, d, _ = _entries(i, start, length, BLOCK)
        shifted = _logits(a1, a_lin, d, k, length) - peak[:, None]
        total += tl.sum(tl.where(shifted < CUTOFF, 0.0, tl.exp(shifted)), axis=1)
    out = tl.where(in_x, p_x_ptr + h * cols * cols, p_y_ptr + h * rows * rows)
    for start in range(0, length, BLOCK):
        k, d, inside = _entries(i, start, length, BLOCK)
        shifted = _logits(a1, a_lin, d, k, length) - peak[:, None]
        p = tl.where(shifted < CUTOFF, 0.0, tl.exp(shifted)) / total[:, None]
        tl.store(out + i[:, None] * length + k[None, :], p, mask=inside)


@triton.jit
def _factor_gradient_rows(p_y_ptr, p_x_ptr, dp_y_ptr, dp_x_ptr, h, b, rows, cols,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """The share of block b of rows of P_y^h or P_x^h in the gradient of a^h, (4,) with the last
    0: dl = P (dP - sum_j P dP) per row, then sum d^2 dl into a1 and sum d dl into a2 (P_x) or
    a3 (P_y)."""
    in_x, i, length = _rows(b, rows, cols, ROWS)
    p_ptr = tl.where(in_x, p_x_ptr + h * cols * cols, p_y_ptr + h * rows * rows)
    dp_ptr = tl.where(in_x, dp_x_ptr + h * cols * cols, dp_y_ptr + h * rows * rows)
    dot = tl.zeros((ROWS, ), tl.float32)
    for start in range(0, length, BLOCK):
        k, d, inside = _entries(i, start, length, BLOCK)
        at = i[:, None] * length + k[None, :]
        p = tl.load(p_ptr + at, mask=inside, other=0.0)
        dot += tl.sum(p * tl.load(dp_ptr + at, mask=inside, other=0.0), axis=1)
    square = tl.zeros((ROWS, BLOCK), tl.float32)
    linear = tl.zeros((ROWS, BLOCK), tl.float32)
    for start in range(0, length, BLOCK):
        k, d, inside = _entries(i, start, length, BLOCK)
        at = i[:, None] * length + k[None, :]
        p = tl.load(p_ptr + at, mask=inside, other=0.0)
        dl = p * (tl.load(dp_ptr + at, mask=inside, other=0.0) - dot[:, None])
        square += d * d * dl
        linear += d * dl
    k = tl.arange(0, 4)
    a1, a_lin = tl.sum(tl.sum(square, axis=1), axis=0), tl.sum(tl.sum(linear, axis=1), axis=0)
    lin_slot = tl.where(in_x, 1, 2)
    return tl.where(k == 0, a1, 0.0) + tl.where(k == lin_slot, a_lin, 0.0)


@triton.jit
def _coefficient_shares(shares_ptr, h, programs, BLOCK: tl.constexpr):
    """The sum of the programs' shares (programs, heads, 4) of the gradient of a^h, added up over
    the programs in a fixed order, BLOCK at a time: (4,), the last 0."""
    heads = tl.num_programs(0)
    k = tl.arange(0, 4)
    total = tl.zeros([BLOCK, 4], tl.float32)
    for start in range(0, programs, BLOCK):
        p = start + tl.arange(0, BLOCK)
        at = ((p * heads + h) * 4)[:, None] + k[None, :]
        total += tl.load(shares_ptr + at, mask=(p < programs)[:, None], other=0.0)
    return tl.sum(total, axis=0)


def row_blocks(rows, cols):
    """Blocks of ROWS rows of P_y^h and P_x^h together: the programs per head of the factors."""
    return cdiv(rows, ROWS) + cdiv(cols, ROWS)


# ---------------------------------------------------------------------------- the ratios
@triton.jit
def _tanh(a):
    """tanh(a) for a >= 0 (Triton's language has no tanh its interpreter runs)."""
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0))))
    e = tl.exp(-2.0 * a)
    return tl.where(a < TANH_SERIES_BELOW, series, (1.0 - e) / (1.0 + e))


@triton.jit
def _lambdas(gate, LAYERNORM: tl.constexpr):
    """(lambda, 1 - lambda, d lambda / d gate) of gate values; |u| has derivative +1 at u = 0, as
    in :func:`...gates.share_of_distance`."""
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
def _gate_gradient(gate_ptr, grad_ptr, out_ptr, h, d, LAYERNORM: tl.constexpr,
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


# ---------------------------------------------------------------------------- the kernels
@triton.jit(do_not_specialize=['rows', 'cols', 'C', 'd'])
def _parameters_kernel(coef_ptr, mean_ptr, var_ptr, p_y_ptr, p_x_ptr, ratios_ptr, rows, cols, C,
                       d, ROWS: tl.constexpr, BLOCK: tl.constexpr, CUTOFF: tl.constexpr,
                       LAYERNORM: tl.constexpr, CHANNELS: tl.constexpr):
    """Program (h, b): block b of the rows of P_y^h and P_x^h, or, for the last b, the four ratios
    (4, C) of head h's d channels."""
    h, b = tl.program_id(0), tl.program_id(1)
    if b == tl.num_programs(1) - 1:
        _gate_ratios(mean_ptr, ratios_ptr, h, C, d, LAYERNORM, CHANNELS)
        _gate_ratios(var_ptr, ratios_ptr + 2 * C, h, C, d, LAYERNORM, CHANNELS)
    else:
        _factor_rows(coef_ptr, p_y_ptr, p_x_ptr, h, b, rows, cols, ROWS, BLOCK, CUTOFF)


@triton.jit(do_not_specialize=['rows', 'cols'])
def _factor_gradients_kernel(p_y_ptr, p_x_ptr, dp_y_ptr, dp_x_ptr, shares_ptr, rows, cols,
                             ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Program (h, b): the share of block b of the rows of P_y^h and P_x^h in the gradient of
    a^h, at shares[b, h] (row_blocks, heads, 4)."""
    h, b = tl.program_id(0), tl.program_id(1)
    share = _factor_gradient_rows(p_y_ptr, p_x_ptr, dp_y_ptr, dp_x_ptr, h, b, rows, cols, ROWS,
                                  BLOCK)
    tl.store(shares_ptr + (b * tl.num_programs(0) + h) * 4 + tl.arange(0, 4), share)


@triton.jit(do_not_specialize=['C', 'd', 'programs'])
def _parameters_backward_kernel(shares_ptr, mean_ptr, var_ptr, grad_ratios_ptr, grad_coef_ptr,
                                grad_mean_ptr, grad_var_ptr, C, d, programs,
                                BLOCK: tl.constexpr, LAYERNORM: tl.constexpr,
                                CHANNELS: tl.constexpr):
    """Program h: the gradient of a^h (3,) from the shares (programs, heads, 4), and those of head
    h's two gates from the gradient of the ratios with 1 - lambda tied to lambda (2, C)."""
    h = tl.program_id(0)
    k = tl.arange(0, 4)
    total = _coefficient_shares(shares_ptr, h, programs, BLOCK)
    tl.store(grad_coef_ptr + 3 * h + k, total.to(grad_coef_ptr.dtype.element_ty), mask=k < 3)
    _gate_gradient(mean_ptr, grad_ratios_ptr, grad_mean_ptr, h, d, LAYERNORM, CHANNELS)
    _gate_gradient(var_ptr, grad_ratios_ptr + C, grad_var_ptr, h, d, LAYERNORM, CHANNELS)


def specs(layernorm):
    """The (kernel, constexprs, num_warps) of the parameters' three kernels for a layer's
    ``init``: forward, the factors' gradient shares, the sums and the gates' gradients. The same
    for every layer and grid."""
    return ((_parameters_kernel, dict(ROWS=ROWS, BLOCK=BLOCK, CUTOFF=CUTOFF,
                                      LAYERNORM=layernorm, CHANNELS=CHANNELS), 4),
            (_factor_gradients_kernel, dict(ROWS=ROWS, BLOCK=BLOCK), 4),
            (_parameters_backward_kernel, dict(BLOCK=BLOCK, LAYERNORM=layernorm,
                                               CHANNELS=CHANNELS), 4))


# ---------------------------------------------------------------------------- the launches
def parameters(pos_coef, mean_gate, var_gate, formed, plan):
    """Writes P_y (heads, Hp, Hp), P_x (heads, Wp, Wp) and the ratios (4, C), float32 views of
    one buffer ``formed`` (:attr:`.layer.Plan.formed_views`), from a^h (heads, 3) and the gates
    (heads,) each: one launch."""
    p_y, p_x, ratios = plan.formed_views(formed)
    launch('triton.parameters', plan.parameters, plan.parameter_programs,
           [pos_coef, mean_gate, var_gate], [formed], pos_coef, mean_gate, var_gate, p_y, p_x,
           ratios, plan.Hp, plan.Wp, plan.C, plan.d)
    return p_y, p_x, ratios


def parameters_backward(p_y, p_x, grad_p_y, grad_p_x, mean_gate, var_gate, grad_ratios, plan):
    """The gradients of a^h (heads, 3) and of the two gates (heads,) each, in the gates' dtype,
    from those of P_y and P_x (float32, contiguous) and ``grad_ratios`` (2, C), the gradient of
    the ratios with 1 - lambda tied to lambda: two launches."""
    heads = plan.heads
    programs = plan.parameter_programs[1] - 1
    shares = torch.empty(programs, heads, 4, dtype=torch.float32, device=p_y.device)
    launch('triton.factor_gradients', plan.factor_gradients, (heads, programs),
           [p_y, p_x, grad_p_y, grad_p_x], [shares], p_y, p_x, grad_p_y, grad_p_x, shares,
           plan.Hp, plan.Wp)
    grad_coef = mean_gate.new_empty(heads, 3)
    grad_mean, grad_var = torch.empty_like(mean_gate), torch.empty_like(var_gate)
    launch('triton.parameters_backward', plan.parameters_backward, (heads, ),
           [shares, mean_gate, var_gate, grad_ratios], [grad_coef, grad_mean, grad_var], shares,
           mean_gate, var_gate, grad_ratios, grad_coef, grad_mean, grad_var, plan.C, plan.d,
           programs)
    return grad_coef, grad_mean, grad_var
