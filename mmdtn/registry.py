"""Registration of mmdtn's modules where mmdet, mmsegmentation and mmpretrain look them up.

mmdet (default_scope ``mmdet``), mmsegmentation (``mmseg``) and mmpretrain (``mmpretrain``) each
have their own ``MODELS`` registry, children of mmengine's root registry. A model is registered in
each child so that ``type='PyramidVisionTransformerDTN'`` resolves in any of these scopes (in
mmpretrain's only where mmpretrain is installed); norm layers are also registered in the root,
where mmcv's ``build_norm_layer`` (and ``build_conv_layer``, for ``PatchNormConv2d``) finds them
from any scope (or none). The layers themselves import with torch alone; this module, imported by
``import mmdtn`` where the OpenMMLab stack is installed, registers them.
"""
from mmdet.registry import MODELS as MMDET_MODELS
from mmengine.analysis import complexity_analysis
from mmengine.registry import MODELS as ROOT_MODELS
from mmseg.registry import MODELS as MMSEG_MODELS

from . import WITH_MMPRETRAIN
from .models.layers import DynamicTokenNorm, PatchNormConv2d
from .models.layers.dtn.backends import BACKENDS
from .models.layers.dtn.flops import dtn_flops

__all__ = ['register_model', 'register_norm_layer', 'MMDET_MODELS', 'MMSEG_MODELS',
           'MMPRETRAIN_MODELS', 'ROOT_MODELS']

if WITH_MMPRETRAIN:
    from mmpretrain.registry import MODELS as MMPRETRAIN_MODELS
else:
    MMPRETRAIN_MODELS = None

SCOPE_MODELS = tuple(r for r in (MMDET_MODELS, MMSEG_MODELS, MMPRETRAIN_MODELS) if r is not None)


def register_model(cls=None, *, name=None):
    """Register ``cls`` in the ``MODELS`` of mmdet, mmsegmentation and (where installed)
    mmpretrain; usable as a decorator."""

    def _register(module):
        for registry in SCOPE_MODELS:
            registry.register_module(name=name, module=module)
        return module

    return _register if cls is None else _register(cls)


def register_norm_layer(cls=None, *, name=None):
    """Register a norm layer in mmengine's root ``MODELS`` (for ``build_norm_layer``) and in the
    children of :func:`register_model`."""

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
