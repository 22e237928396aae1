"""Normalization layers: Dynamic Token Normalization (with reference-code compatibility) and
Dual PatchNorm."""
from .dtn import (DTN_ONLY_PARAMETERS, GATE_PARAMETERS, LAYERNORM_GATE_LOGIT, DynamicTokenNorm,
                  available_backends, get_dtn_backend, neighbourhood_offsets, set_dtn_backend)
from .reference_compat import convert_reference_state_dict
from .dual_patchnorm import PatchNormConv2d, add_dual_patchnorm

__all__ = [
    'DynamicTokenNorm',
    'DTN_ONLY_PARAMETERS',
    'GATE_PARAMETERS',
    'LAYERNORM_GATE_LOGIT',
    'neighbourhood_offsets',
    'set_dtn_backend',
    'get_dtn_backend',
    'available_backends',
    'convert_reference_state_dict',
    'PatchNormConv2d',
    'add_dual_patchnorm',
]
