"""Normalisation layers: Dynamic Token Normalization (with reference-code compatibility) and
Dual PatchNorm."""
from .dynamic_token_norm import LAYERNORM_GATE_LOGIT, DynamicTokenNorm, neighbourhood_offsets
from .reference_compat import convert_reference_state_dict
from .dual_patchnorm import PatchNormConv2d, add_dual_patchnorm

__all__ = [
    'DynamicTokenNorm',
    'LAYERNORM_GATE_LOGIT',
    'neighbourhood_offsets',
    'convert_reference_state_dict',
    'PatchNormConv2d',
    'add_dual_patchnorm',
]
