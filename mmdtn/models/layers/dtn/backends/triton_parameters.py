"""The small tensors a Triton DynamicTokenNorm layer forms from its parameters, one launch forward
and one backward: the positional factors P_y^h, P_x^h from the coefficients a^h (Eq. 6,
:mod:`.triton_factors`) and the per-channel ratios lambda, 1 - lambda from the gates (Eq. 5,
:mod:`.triton_ratios`); backward, the gradients of a^h from the shares of it that the layer's
programs give, and those of the gates.

At batch 2 a layer on a GPU waits for the host to launch its kernels (docs/gpu.md, "Measured on an
H200"), so the two run in one kernel each way, a program per head and block of factor rows, plus one
per head for its ratios; backward, a program per head adds up the shares of the gradient of its a^h
and forms those of its two gates (sums in a fixed order: deterministic). :class:`KernelParameters`
runs them inside the Triton backend's layer op.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..function import FormedParameters
from . import triton_factors as factors
from . import triton_ratios as ratios
from .triton_launch import launch

__all__ = ['run_parameters', 'run_parameters_backward', 'KernelParameters', 'specializations']


@triton.jit(do_not_specialize=['rows', 'cols', 'C', 'd'])
def _parameters_kernel(coef_ptr, mean_ptr, var_ptr, p_y_ptr, p_x_ptr, ratios_ptr, rows, cols, C,
                       d, ROWS: tl.constexpr, BLOCK: tl.constexpr, CUTOFF: tl.constexpr,
                       LAYERNORM: tl.constexpr, CHANNELS: tl.constexpr):
    """Program (h, b): block b of the rows of P_y^h and P_x^h, or, for the last b, the four ratios
    (4, C) of head h's d channels."""
    h, b = tl.program_id(0), tl.program_id(1)
    if b == tl.num_programs(1) - 1:
        ratios._gate_ratios(mean_ptr, ratios_ptr, h, C, d, LAYERNORM, CHANNELS)
        ratios._gate_ratios(var_ptr, ratios_ptr + 2 * C, h, C, d, LAYERNORM, CHANNELS)
    else:
        factors._factor_rows(coef_ptr, p_y_ptr, p_x_ptr, h, b, rows, cols, ROWS, BLOCK, CUTOFF)


@triton.jit(do_not_specialize=['C', 'd', 'programs', 'other_programs'])
def _parameters_backward_kernel(shares_ptr, other_shares_ptr, mean_ptr, var_ptr, grad_ratios_ptr,
                                grad_coef_ptr, grad_mean_ptr, grad_var_ptr, C, d, programs,
                                other_programs, BLOCK: tl.constexpr, LAYERNORM: tl.constexpr,
                                CHANNELS: tl.constexpr):
    """Program h: the gradients of a^h (3,), from two tensors of programs' shares (programs,
    heads, 3) of it, and of head h's two gates, from those of the ratios with 1 - lambda tied to
    lambda (2, C)."""
    h = tl.program_id(0)
    k = tl.arange(0, 4)
    total = (factors._coefficient_shares(shares_ptr, h, programs, BLOCK)
             + factors._coefficient_shares(other_shares_ptr, h, other_programs, BLOCK))
    tl.store(grad_coef_ptr + 3 * h + k, total, mask=k < 3)
    ratios._gate_gradient(mean_ptr, grad_ratios_ptr, grad_mean_ptr, h, C, d, LAYERNORM, CHANNELS)
    ratios._gate_gradient(var_ptr, grad_ratios_ptr + C, grad_var_ptr, h, C, d, LAYERNORM,
                          CHANNELS)


def _parameters_spec(layernorm):
    return _parameters_kernel, dict(ROWS=factors.ROWS, BLOCK=factors.BLOCK,
                                    CUTOFF=factors.CUTOFF, LAYERNORM=layernorm,
                                    CHANNELS=ratios.BLOCK), 4


def _parameters_backward_spec(layernorm):
    return _parameters_backward_kernel, dict(BLOCK=factors.BLOCK, LAYERNORM=layernorm,
                                             CHANNELS=ratios.BLOCK), 4


def specializations():
    """The compiled kernels of the parameters, as (kernel, constexprs, num_warps): one per
    ``init`` and direction; the same for every layer and grid."""
    return [spec for layernorm in (False, True)
            for spec in (_parameters_spec(layernorm), _parameters_backward_spec(layernorm))]


# ---------------------------------------------------------------------------- the launches
def _empty_parameters(pos_coef, rows, cols, channels):
    """Uninitialised P_y, P_x (in a^h's dtype) and ratios (float32) for :func:`run_parameters`."""
    heads = pos_coef.shape[0]
    return (pos_coef.new_empty(heads, rows, rows), pos_coef.new_empty(heads, cols, cols),
            pos_coef.new_empty(4, channels, dtype=torch.float32))


def run_parameters(pos_coef: Tensor, mean_gate: Tensor, var_gate: Tensor, rows: int, cols: int,
                   d: int, layernorm: bool) -> tuple[Tensor, Tensor, Tensor]:
    """P_y (heads, rows, rows), P_x (heads, cols, cols) of :func:`..positional.axis_factors`
    (in a^h's dtype) and the ratios (4, heads * d) of :func:`..gates.channel_ratios` (float32)
    from a^h (heads, 3) and the gates (heads,): one launch."""
    coef = pos_coef.contiguous()
    heads = coef.shape[0]
    p_y, p_x, channel_ratios = _empty_parameters(coef, rows, cols, heads * d)
    launch('triton.parameters', _parameters_spec(layernorm),
           (heads, factors.row_blocks(rows, cols) + 1), [coef, mean_gate, var_gate],
           [p_y, p_x, channel_ratios], coef, mean_gate, var_gate, p_y, p_x, channel_ratios,
           rows, cols, heads * d, d)
    return p_y, p_x, channel_ratios


def run_parameters_backward(shares: list[Tensor], mean_gate: Tensor, var_gate: Tensor,
                            grad_ratios: Tensor, d: int,
                            layernorm: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of a^h (heads, 3), in the gates' dtype, from one or two tensors of the
    programs' ``shares`` (programs, heads, 3) of it (contiguous float32; the fused passes and the
    cell products give one, the factors' outer products one each), and of the two gates from
    ``grad_ratios`` (2, C), that of the ratios with 1 - lambda tied to lambda: of lambda_mean and
    lambda_var, less those of 1 - lambda_mean and 1 - lambda_var (contiguous float32; the gates set
    each pair together): one launch."""
    if len(shares) not in (1, 2):
        raise ValueError(f'the gradient of a^h is added up from one or two tensors of shares, '
                         f'got {len(shares)}')
    first, other = shares if len(shares) == 2 else (shares[0], shares[0][:0])
    heads = first.shape[1]
    grad_coef = mean_gate.new_empty(heads, 3)
    grad_mean, grad_var = torch.empty_like(mean_gate), torch.empty_like(var_gate)
    launch('triton.parameters_backward', _parameters_backward_spec(layernorm), (heads, ),
           [first, other, mean_gate, var_gate, grad_ratios], [grad_coef, grad_mean, grad_var],
           first, other, mean_gate, var_gate, grad_ratios, grad_coef, grad_mean, grad_var,
           heads * d, d, first.shape[0], other.shape[0])
    return grad_coef, grad_mean, grad_var


class KernelParameters(FormedParameters):
    """The Triton layer op takes the layer's own parameters, a^h (heads, 3) and the gates
    (heads,) each, and forms P_y, P_x and the ratios inside (:func:`run_parameters`); backward
    keeps the three, adds up the shares of the gradient of a^h that the backward pass gives
    instead of the gradients of P_y and P_x (:class:`..function.Gradients`), and turns that of
    the ratios into those of the gates (:func:`run_parameters_backward`)."""

    def form(self, pos_coef, mean_gate, var_gate, grid, layernorm):
        return run_parameters(pos_coef, mean_gate, var_gate, grid.Hp, grid.Wp, grid.d, layernorm)

    def kept(self, p_y, p_x, channel_ratios):
        return [p_y, p_x, channel_ratios]

    def fake_kept(self, inputs, grid):
        return list(_empty_parameters(inputs[0], grid.Hp, grid.Wp, grid.C))

    def formed(self, inputs, kept):
        return kept

    def gradients(self, inputs, formed, grads, grid, layernorm):
        return run_parameters_backward(grads.coefficients, *inputs[1:], grads.ratios.contiguous(),
                                       grid.d, layernorm)
