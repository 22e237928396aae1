"""Normalisation layers: Dynamic Token Normalization (with reference-code compatibility) and
Dual PatchNorm."""
from .dtn import (LAYERNORM_GATE_LOGIT, DynamicTokenNorm, available_backends, get_dtn_backend,
                  neighbourhood_offsets, set_dtn_backend)
from .reference_compat import convert_reference_state_dict
from .dual_patchnorm import PatchNormConv2d, add_dual_patchnorm

#: Parameters of DynamicTokenNorm that the LayerNorm it replaces does not have: the gate logits of
#: lambda (Eq. 5) and the positional coefficients a^h (Eq. 6). An LN checkpoint lacks them, and
#: the configs give them no weight decay (configs/_base_/dtn_no_decay.py, pinned by a test).
DTN_ONLY_PARAMETERS = ('mean_gate', 'var_gate', 'pos_coef')

__all__ = [
    'DynamicTokenNorm',
    'DTN_ONLY_PARAMETERS',
    'LAYERNORM_GATE_LOGIT',
    'neighbourhood_offsets',
    'set_dtn_backend',
    'get_dtn_backend',
    'available_backends',
    'convert_reference_state_dict',
    'PatchNormConv2d',
    'add_dual_patchnorm',
]
