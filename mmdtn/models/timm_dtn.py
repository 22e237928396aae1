"""timm's PVTv2 and Swin with Dynamic Token Normalization (Shao et al., ICLR 2022), registered in
timm.

``import mmdtn.models.timm_dtn`` registers ``pvt_v2_b0_dtn``, ``pvt_v2_b1_dtn``, ``pvt_v2_b2_dtn``
and ``swin_tiny_patch4_window7_224_dtn``. ``timm.create_model(name)`` builds timm's own model
(``pvt_v2_b0``, ...) and replaces the two LayerNorms of every block of its DTN stages by
``DynamicTokenNorm``, with the placement, heads and pooling sizes of mmdtn's mmdet/mmseg backbones
(:mod:`mmdtn.models.dtn_stages`), so that its weights load into them one to one
(``init_cfg=dict(type='Pretrained', checkpoint=...)``). No model code of timm is copied: its
blocks call ``self.norm1(x)``; a forward pre-hook on each DTN block records the grid of the
block's input (PVTv2: its ``feat_size`` argument; Swin: its (B, H, W, C) tokens) for its norms.

``create_model`` takes the ``dtn_*`` arguments of the mmdet backbones besides timm's (for timm's
train.py: ``--model-kwargs dtn_init=layernorm``). ``pretrained=True`` loads timm's LayerNorm
ImageNet weights into the model before its norms are replaced: DTN takes their weight and bias.
``no_weight_decay()`` adds DTN's gates and positional coefficients, as mmdtn's configs do.
``tools/timm_train.py`` runs timm's train.py with these models registered, and with the DTN ViTs
of :mod:`mmdtn.models.timm_vit_dtn` (``vit_*_patch16_224_dtn``), which this module imports.
"""
import functools
from typing import Callable, List

import timm
import torch.nn as nn
from timm.models import generate_default_cfgs, get_pretrained_cfg, register_model
from timm.models.pvt_v2 import PyramidVisionTransformerV2
from timm.models.swin_transformer import SwinTransformer

from .dtn_stages import (DTN_ARGUMENTS, BlockGridTokenNorm, dtn_stage_settings, pvt_dtn_defaults,
                         swin_dtn_defaults)
from .layers import DTN_ONLY_PARAMETERS

__all__ = ['BlockGridTokenNorm', 'PvtV2DTN', 'SwinDTN']


def _record_grid(grid_of: Callable, block: nn.Module, args, kwargs):
    """Forward pre-hook of a DTN block: its norms use the grid of its input."""
    hw_shape = grid_of(args, kwargs)
    for norm in (block.norm1, block.norm2):
        norm.hw_shape = hw_shape


def _pvt_v2_grid(args, kwargs):
    """``Block.forward(x, feat_size)`` of timm's PVTv2."""
    return tuple(args[1] if len(args) > 1 else kwargs['feat_size'])


def _swin_grid(args, kwargs):
    """``SwinTransformerBlock.forward(x)`` of timm's Swin, x of shape (B, H, W, C)."""
    return tuple((args[0] if args else kwargs['x']).shape[1:3])


class _DTNWeightDecay:
    """``no_weight_decay()`` with DTN's gates and positional coefficients (timm's optimizer factory
    does not decay the parameters it names; DTN's 1-d ones it already spares)."""

    def no_weight_decay(self):
        own = {name for name, _ in self.named_parameters()
               if name.rsplit('.', 1)[-1] in DTN_ONLY_PARAMETERS}
        return set(super().no_weight_decay()) | own


class PvtV2DTN(_DTNWeightDecay, PyramidVisionTransformerV2):
    """timm's ``PyramidVisionTransformerV2`` with DTN; built by
    ``create_model('pvt_v2_b*_dtn')``."""

    stock_model = PyramidVisionTransformerV2


class SwinDTN(_DTNWeightDecay, SwinTransformer):
    """timm's ``SwinTransformer`` with DTN; built by ``create_model('swin_*_dtn')``."""

    stock_model = SwinTransformer


def _add_dtn(model: nn.Module, dtn_cls: type, stages: List[List[nn.Module]], defaults: dict,
             grid_of: Callable, dtn_args: dict) -> nn.Module:
    """Re-class timm's ``model`` to ``dtn_cls`` and put DTN into the blocks of its DTN stages."""
    if type(model) is not dtn_cls.stock_model:
        raise TypeError(f'{dtn_cls.__name__} is built from a plain timm '
                        f'{dtn_cls.stock_model.__name__}, got {type(model).__name__} '
                        '(features_only is not supported)')
    model.__class__ = dtn_cls
    model.dtn_settings = dtn_stage_settings(len(stages), **{**defaults, **dtn_args})
    for index, (blocks, settings) in enumerate(zip(stages, model.dtn_settings)):
        if settings is None:
            continue
        for block in blocks:
            try:
                block.norm1 = settings.norm_like(block.norm1, BlockGridTokenNorm)
                block.norm2 = settings.norm_like(block.norm2, BlockGridTokenNorm)
            except ValueError as e:
                raise ValueError(f'{dtn_cls.__name__}: DTN of stage {index + 1}: {e}') from None
            block.register_forward_pre_hook(functools.partial(_record_grid, grid_of),
                                            with_kwargs=True)
    return model


def _timm_model(base: str, pretrained: bool, kwargs: dict):
    """timm's ``base`` model, and the ``dtn_*`` arguments taken out of ``kwargs``."""
    dtn_args = {k: kwargs.pop(k) for k in DTN_ARGUMENTS if k in kwargs}
    kwargs.pop('pretrained_cfg', None)  # the DTN model's own (no weights); base resolves its own
    return timm.create_model(base, pretrained=pretrained, **kwargs), dtn_args


def _pvt_v2_dtn(base: str, pretrained: bool, **kwargs) -> PvtV2DTN:
    model, dtn_args = _timm_model(base, pretrained, kwargs)
    stages = [list(stage.blocks) for stage in model.stages]
    defaults = pvt_dtn_defaults([blocks[0].attn.num_heads for blocks in stages],
                                [blocks[0].attn.dim for blocks in stages])
    return _add_dtn(model, PvtV2DTN, stages, defaults, _pvt_v2_grid, dtn_args)


def _swin_dtn(base: str, pretrained: bool, **kwargs) -> SwinDTN:
    model, dtn_args = _timm_model(base, pretrained, kwargs)
    stages = [list(stage.blocks) for stage in model.layers]
    defaults = swin_dtn_defaults([blocks[0].attn.num_heads for blocks in stages])
    return _add_dtn(model, SwinDTN, stages, defaults, _swin_grid, dtn_args)


def _data_cfg(base: str) -> dict:
    """The base model's pretrained config without its weights (input size, crop, mean, std ...),
    which timm's train.py reads for the data pipeline."""
    cfg = get_pretrained_cfg(base).to_dict(remove_source=True)
    for key in ('architecture', 'tag'):
        cfg.pop(key, None)
    return cfg


default_cfgs = generate_default_cfgs({
    f'{base}_dtn': _data_cfg(base)
    for base in ('pvt_v2_b0', 'pvt_v2_b1', 'pvt_v2_b2', 'swin_tiny_patch4_window7_224')
})


@register_model
def pvt_v2_b0_dtn(pretrained=False, **kwargs) -> PvtV2DTN:
    """timm's ``pvt_v2_b0`` with DTN in the blocks of stages 1-3 (heads 4, 4, 5;
    pooling 4, 2, 1)."""
    return _pvt_v2_dtn('pvt_v2_b0', pretrained, **kwargs)


@register_model
def pvt_v2_b1_dtn(pretrained=False, **kwargs) -> PvtV2DTN:
    """timm's ``pvt_v2_b1`` with DTN in the blocks of stages 1-3 (heads 4, 4, 5;
    pooling 4, 2, 1)."""
    return _pvt_v2_dtn('pvt_v2_b1', pretrained, **kwargs)


@register_model
def pvt_v2_b2_dtn(pretrained=False, **kwargs) -> PvtV2DTN:
    """timm's ``pvt_v2_b2`` with DTN in the blocks of stages 1-3 (heads 4, 4, 5;
    pooling 4, 2, 1)."""
    return _pvt_v2_dtn('pvt_v2_b2', pretrained, **kwargs)


@register_model
def swin_tiny_patch4_window7_224_dtn(pretrained=False, **kwargs) -> SwinDTN:
    """timm's ``swin_tiny_patch4_window7_224`` with DTN in every block (heads 3, 6, 12, 24;
    pooling 4, 2, 1, 1)."""
    return _swin_dtn('swin_tiny_patch4_window7_224', pretrained, **kwargs)


from . import timm_vit_dtn  # noqa: E402,F401  (registers the DTN ViTs too)
