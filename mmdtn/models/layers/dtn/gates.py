"""The gates of DynamicTokenNorm (Eq. 5): the weight ratios lambda_mean and lambda_var of each
head, as the logits of lambda (``init='paper'``) or as distances u from LayerNorm with
1 - lambda = tanh|u| (``init='layernorm'``, see :class:`.module.DynamicTokenNorm`), the
conversions between the two, and the per-channel ratios the passes take."""
import math

import torch

__all__ = ['LAYERNORM_GATE_LOGIT', 'share_of_distance', 'distance_to_logit', 'logit_to_distance',
           'channel_ratios']

#: Largest gate logit a distance from LayerNorm converts to, the one that stands for lambda = 1:
#: 1 - sigmoid(40) = 4e-18, so that a layer loaded with it equals LayerNorm to < 1e-5 even for
#: tokens far quieter than their neighbours (the output differs by about (1 - lambda) * var_it /
#: var_ln). A gate of ``init='layernorm'`` at LayerNorm (lambda = 1 exactly) loads as this logit
#: into a layer of ``init='paper'``.
LAYERNORM_GATE_LOGIT = 40.0


def share_of_distance(distance):
    """1 - lambda = tanh|u| of the gates of ``init='layernorm'`` (u: distance from LayerNorm).

    |u| is taken with derivative +1 at u = 0, so that a gate at LayerNorm receives the full
    gradient of the loss with respect to 1 - lambda."""
    return torch.tanh(torch.where(distance < 0, -distance, distance))


def distance_to_logit(distance):
    """The logit of lambda = 1 - tanh|u|, log((1 - tanh|u|) / tanh|u|), computed in float64 and
    clipped to +-:data:`LAYERNORM_GATE_LOGIT` (u = 0, lambda = 1, becomes that logit)."""
    logit = math.log(2.0) - torch.log(torch.expm1(2 * distance.double().abs()))
    return logit.clamp(-LAYERNORM_GATE_LOGIT, LAYERNORM_GATE_LOGIT).to(distance.dtype)


def logit_to_distance(logit):
    """The distance u >= 0 with 1 - tanh(u) = sigmoid(logit): u = log(1 + 2 exp(-logit)) / 2."""
    clipped = logit.double().clamp(-LAYERNORM_GATE_LOGIT, LAYERNORM_GATE_LOGIT)
    return (0.5 * torch.log1p(2 * torch.exp(-clipped))).to(logit.dtype)


def channel_ratios(mean_gate, var_gate, d, layernorm, dtype):
    """Per-channel (lambda_mean, 1 - lambda_mean, lambda_var, 1 - lambda_var), shape (4, heads d),
    in ``dtype`` from the gate parameters (heads,) each: logits, or with ``layernorm`` distances u.

    1 - lambda is computed as sigmoid(-logit) (or tanh|u|) so that it stays accurate near
    lambda = 1."""
    if layernorm:
        shares = share_of_distance(torch.stack([mean_gate, var_gate]).to(dtype))
        ratios = torch.stack([1 - shares[0], shares[0], 1 - shares[1], shares[1]])
    else:
        gates = torch.stack([mean_gate, -mean_gate, var_gate, -var_gate])
        ratios = torch.sigmoid(gates.to(dtype))
    return ratios.repeat_interleave(d, dim=1)
