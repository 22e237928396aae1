"""Dynamic Token Normalization (Shao et al., ICLR 2022), one concept per module:

- :mod:`.reference`: the dense formulation, line by line against Eqs. 2 and 4-7 (the oracle);
- :mod:`.positional`: P^h = softmax(R a^h) as its two axis factors (Eqs. 6-7);
- :mod:`.gates`: the weight ratios lambda of Eq. 5, as logits or as distances from LayerNorm;
- :mod:`.grid`: the token grid of one call and the layouts of its tensors;
- :mod:`.function`: forward and backward over a backend's passes, differentiable and traceable;
- :mod:`.backends`: where the passes run (``torch``, ``cpu``, ...) and how one is chosen;
- :mod:`.module`: the ``nn.Module``.

Imports with torch alone; mmdet and mmseg find the layer once ``mmdtn`` is imported.
"""
from .backends import available_backends, get_dtn_backend, set_dtn_backend
from .module import (DTN_INITS, DTN_ONLY_PARAMETERS, GATE_PARAMETERS, LAYERNORM_GATE_LOGIT,
                     DynamicTokenNorm)
from .positional import neighbourhood_offsets

__all__ = ['DynamicTokenNorm', 'LAYERNORM_GATE_LOGIT', 'DTN_INITS', 'DTN_ONLY_PARAMETERS',
           'GATE_PARAMETERS', 'neighbourhood_offsets',
           'set_dtn_backend', 'get_dtn_backend', 'available_backends']
