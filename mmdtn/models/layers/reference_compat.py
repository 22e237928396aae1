"""Compatibility with the authors' reference implementation of DTN (Shao et al., ICLR 2022).

The released reference code computes DTN's statistics slightly differently from the paper's
Eqs. 4-6. ``DynamicTokenNorm(..., reference_compat=True)`` reproduces it exactly by switching to
:data:`REFERENCE_CONVENTION`:

1. every channel group ("head") of a token is first divided by its RMS over the group's channels,
   ``x / sqrt(mean(x^2) + eps)``; all statistics and the output use this rescaled input;
2. the intra-token (LN) variance is the unbiased one (divides by C - 1 instead of C);
3. with pooling, the inter-token second moment is ``P (pool(x))^2`` instead of ``P pool(x^2)``.

Its positional weights are an ``nn.Linear(3, heads)`` named ``pos_proj`` applied to
``[dx, dy, dx^2 + dy^2]`` with dx, dy measured as output minus source token, i.e. the opposite sign
of Eq. 6's convention used here; the linear layer's bias is constant over source tokens and cancels
in the softmax. :func:`convert_reference_state_dict` maps such weights onto DynamicTokenNorm's.
"""
from collections import OrderedDict
from dataclasses import dataclass

import torch

__all__ = [
    'StatisticsConvention', 'PAPER_CONVENTION', 'REFERENCE_CONVENTION', 'group_rms_normalize',
    'convert_reference_state_dict', 'REFERENCE_ONLY_VAR_MEAN_GATE', 'REFERENCE_EPS'
]

#: eps of the reference code's DTN layers (in the group-RMS pre-normalization and the variance).
#: The backbones' ``dtn_reference_compat=True`` builds their DTN layers with it, whatever the eps of
#: the LayerNorms they replace.
REFERENCE_EPS = 1e-5

#: Mean-gate logit given to converted ``only_var`` reference layers (no ``mean_norm_weight``), whose
#: mean is always the LN mean: sigmoid(40) rounds to exactly 1 in float32 and float64.
REFERENCE_ONLY_VAR_MEAN_GATE = 40.0


@dataclass(frozen=True)
class StatisticsConvention:
    """How DynamicTokenNorm computes its statistics (the paper's way or the reference code's).

    Attributes:
        group_rms_prenorm: divide each channel group of each token by its RMS before everything.
        unbiased_ln_var: intra-token variance divides by C - 1 instead of C.
        square_of_pooled: inter-token second moment from the square of the pooled x instead of the
            pooled square of x (only differs for pool_size > 1).
    """

    group_rms_prenorm: bool = False
    unbiased_ln_var: bool = False
    square_of_pooled: bool = False

    def ln_divisor(self, C):
        """What the intra-token variance of C channels (Eq. 2) divides by: C, or C - 1."""
        return C - 1 if self.unbiased_ln_var else C


#: Eqs. 4-6 of the paper (the default).
PAPER_CONVENTION = StatisticsConvention()
#: The authors' reference code.
REFERENCE_CONVENTION = StatisticsConvention(
    group_rms_prenorm=True, unbiased_ln_var=True, square_of_pooled=True)


def group_rms_normalize(x, num_heads, eps):
    """Divide each of the ``num_heads`` contiguous channel groups of every token by its RMS.

    Args:
        x (Tensor): tokens of shape (..., C) with C divisible by ``num_heads``.
        num_heads (int): number of channel groups.
        eps (float): added to the mean square before the square root.

    Returns:
        Tensor: same shape as ``x``.
    """
    groups = x.unflatten(-1, (num_heads, -1))
    rms = groups.square().mean(dim=-1, keepdim=True).add(eps).sqrt()
    return (groups / rms).flatten(-2)


def convert_reference_state_dict(state_dict, prefix=''):
    """Convert the reference code's DTN parameters into DynamicTokenNorm's.

    Every layer whose keys ``<p>pos_proj.weight`` and ``<p>var_norm_weight`` are present (for any
    prefix ``<p>`` starting with ``prefix``) is converted:

    - ``mean_norm_weight`` -> ``mean_gate``; ``var_norm_weight`` -> ``var_gate`` (both are logits,
      lambda = sigmoid). A layer without ``mean_norm_weight`` (the reference's ``only_var``) uses
      the LN mean, expressed as ``mean_gate = REFERENCE_ONLY_VAR_MEAN_GATE``.
    - ``pos_proj.weight`` (heads, 3), columns [dx, dy, dx^2+dy^2] with dx, dy = output - source
      -> ``pos_coef`` (heads, 3) = [w_dd, -w_dx, -w_dy] (coefficients of [dx^2+dy^2, dx, dy] with
      dx, dy = source - output, Eq. 6). ``pos_proj.bias`` is dropped: it cancels in the softmax.
    - ``weight`` and ``bias`` are kept. All other keys are passed through unchanged.

    The converted layers must be built with ``reference_compat=True`` to reproduce the reference
    outputs.

    Args:
        state_dict (Mapping[str, Tensor]): reference-format weights (a single layer or a model).
        prefix (str): only convert layers whose key prefix starts with this.

    Returns:
        OrderedDict: the converted state dict (input tensors are not modified).

    Raises:
        ValueError: a ``pos_proj.weight`` that is not of shape (heads, 3), or gates whose shape does
            not match it; the message names the key and the shapes.
    """
    layer_prefixes = [
        key[:-len('pos_proj.weight')] for key in state_dict
        if key.endswith('pos_proj.weight') and key.startswith(prefix)
        and key[:-len('pos_proj.weight')] + 'var_norm_weight' in state_dict
    ]
    converted = OrderedDict()
    consumed = set()
    for p in layer_prefixes:
        proj = state_dict[p + 'pos_proj.weight']
        if proj.dim() != 2 or proj.shape[1] != 3:
            raise ValueError(f"'{p}pos_proj.weight' must have shape (heads, 3), "
                             f'got {tuple(proj.shape)}')
        heads = proj.shape[0]
        var_gate = state_dict[p + 'var_norm_weight'].reshape(-1)
        if var_gate.numel() != heads:
            raise ValueError(f"'{p}var_norm_weight' has shape {tuple(var_gate.shape)}, expected "
                             f"({heads},) to match '{p}pos_proj.weight' {tuple(proj.shape)}")
        if p + 'mean_norm_weight' in state_dict:
            mean_gate = state_dict[p + 'mean_norm_weight'].reshape(-1)
            if mean_gate.numel() != heads:
                raise ValueError(f"'{p}mean_norm_weight' has shape {tuple(mean_gate.shape)}, "
                                 f"expected ({heads},) to match '{p}pos_proj.weight'")
            consumed.add(p + 'mean_norm_weight')
        else:
            mean_gate = torch.full_like(var_gate, REFERENCE_ONLY_VAR_MEAN_GATE)
        # reference: w_dx * dx' + w_dy * dy' + w_dd * (dx'^2 + dy'^2), dx' = -dx (Eq. 6's dx)
        pos_coef = torch.stack([proj[:, 2], -proj[:, 0], -proj[:, 1]], dim=1)
        converted[p + 'mean_gate'] = mean_gate.clone()
        converted[p + 'var_gate'] = var_gate.clone()
        converted[p + 'pos_coef'] = pos_coef.contiguous()
        consumed.update({p + 'var_norm_weight', p + 'pos_proj.weight', p + 'pos_proj.bias'})
    for key, value in state_dict.items():
        if key not in consumed:
            converted[key] = value
    return converted
