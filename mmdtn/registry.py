"""Registration of mmdtn's modules where mmdet and mmsegmentation look them up.

mmdet (default_scope ``mmdet``) and mmsegmentation (default_scope ``mmseg``) each have their own
``MODELS`` registry, children of mmengine's root registry. A model is registered in both children so
that ``type='PyramidVisionTransformerDTN'`` resolves in either scope; norm layers are also
registered in the root, where mmcv's ``build_norm_layer`` (and ``build_conv_layer``, for ``PatchNormConv2d``)
finds them from any scope (or none). The layers themselves import with torch alone; this module,
imported by ``import mmdtn`` where the OpenMMLab stack is installed, registers them.
"""
from mmdet.registry import MODELS as MMDET_MODELS
from mmengine.analysis import complexity_analysis
from mmengine.registry import MODELS as ROOT_MODELS
from mmseg.registry import MODELS as MMSEG_MODELS

from .models.layers import DynamicTokenNorm, PatchNormConv2d
from .models.layers.dtn.backends import BACKENDS
from .models.layers.dtn.flops import dtn_flops

__all__ = ['register_model', 'register_norm_layer', 'MMDET_MODELS', 'MMSEG_MODELS', 'ROOT_MODELS']


def register_model(cls=None, *, name=None):
    """Register ``cls`` in mmdet's and mmsegmentation's ``MODELS``; usable as a decorator."""

    def _register(module):
        for registry in (MMDET_MODELS, MMSEG_MODELS):
            registry.register_module(name=name, module=module)
        return module

    return _register if cls is None else _register(cls)


def register_norm_layer(cls=None, *, name=None):
    """Register a norm layer in mmengine's root ``MODELS`` (for ``build_norm_layer``) and in both
    children."""

    def _register(module):
        ROOT_MODELS.register_module(name=name, module=module)
        return register_model(module, name=name)

    return _register if cls is None else _register(cls)


register_norm_layer(DynamicTokenNorm, name='DTN')
register_norm_layer(DynamicTokenNorm, name='DynamicTokenNorm')
register_norm_layer(PatchNormConv2d)


def dtn_flop_handle(inputs, outputs):
    """mmengine's FlopAnalyzer handle of the layer's custom ops (``mmdtn::dtn_<backend>_forward``,
    jit-traced): :func:`~mmdtn.models.layers.dtn.flops.dtn_flops` of the call."""
    from mmengine.analysis.jit_handles import get_shape
    B, _, C = get_shape(inputs[0])
    H, W, pool, heads = (v.toIValue() for v in inputs[6:10])
    return dtn_flops(B, C, heads, (H, W), pool)


# mmengine's analyzers (mmdet's get_flops.py, get_model_complexity_info) take their handles from
# this table; DTN's custom ops are counted like any operator they know.
for _name in BACKENDS:
    complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS[f'mmdtn::dtn_{_name}_forward'] = dtn_flop_handle
