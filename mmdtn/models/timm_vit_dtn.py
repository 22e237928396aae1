"""timm's Vision Transformer with Dynamic Token Normalization (Shao et al., ICLR 2022, Table 1),
registered in timm.

``import mmdtn.models.timm_dtn`` (which imports this module) registers
``vit_tiny_patch16_224_dtn``, ``vit_small_patch16_224_dtn`` and ``vit_base_patch16_224_dtn``:
timm's own ``vit_*_patch16_224`` with DTN in its first l^dtn = 10 blocks, where the class token is
not seen (:mod:`mmdtn.models.vit_dtn`); DTN heads 4, 6 and 16, the paper's ViT-T*, S* and B*
(their attention heads, 4, 6 and 16, are ``--model-kwargs num_heads=...``; timm's default are 3,
6 and 12). No model code of timm is copied: the model records the patch grid for its DTN norms in
its position-embedding step.

``create_model`` takes ``dtn_layers`` (l^dtn) and the other ``dtn_*`` arguments besides timm's.
``pretrained=True`` loads timm's LayerNorm weights before the norms are replaced (DTN takes their
weight and bias). ``load_state_dict`` (so timm's ``checkpoint_path`` and ``--initial-checkpoint``)
also takes the authors' reference-code checkpoints (``vit_norm_*``), converted by
:func:`~mmdtn.models.vit_dtn.convert_reference_vit_state_dict`; build those with
``dtn_reference_compat=True`` and their attention heads.
"""
from typing import Tuple

from timm.layers import PatchDropout
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import Block, VisionTransformer

from .timm_dtn import _data_cfg, _DTNWeightDecay, _timm_model
from .vit_dtn import (PatchTokenBlockMixin, add_vit_dtn, convert_reference_vit_state_dict,
                      set_patch_grid, vit_dtn_settings)

__all__ = ['VisionTransformerDTN', 'BlockDTN']


class BlockDTN(PatchTokenBlockMixin, Block):
    """timm's ViT ``Block`` with DTN, on the patch tokens only."""

    stock_block = Block


class VisionTransformerDTN(_DTNWeightDecay, VisionTransformer):
    """timm's ``VisionTransformer`` with DTN in its first l^dtn blocks; built by
    ``create_model('vit_*_dtn')``."""

    stock_model = VisionTransformer

    def _pos_embed(self, x):
        """timm's step, after recording the patch grid of ``x`` for the DTN norms: (B, H, W, C)
        tokens with ``dynamic_img_size``, else the patch embedding's fixed grid."""
        grid: Tuple[int, int] = x.shape[1:3] if x.dim() == 4 else self.patch_embed.grid_size
        set_patch_grid(self, grid)
        return super()._pos_embed(x)


def _reference_format(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook: the authors' checkpoints converted in place."""
    if any(k.endswith('var_norm_weight') for k in state_dict):
        converted = convert_reference_vit_state_dict(
            {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]
        state_dict.update({prefix + k: v for k, v in converted.items()})


def _vit_dtn(base: str, pretrained: bool, **kwargs) -> VisionTransformerDTN:
    dtn_layers = kwargs.pop('dtn_layers', None)
    model, dtn_args = _timm_model(base, pretrained, kwargs)
    if type(model) is not VisionTransformer:
        raise TypeError(f'VisionTransformerDTN is built from a plain timm VisionTransformer, got '
                        f'{type(model).__name__} (features_only is not supported)')
    if isinstance(model.patch_drop, PatchDropout):
        raise ValueError('VisionTransformerDTN: DTN needs the whole patch grid; patch_drop_rate '
                         f'must be 0, got {model.patch_drop.prob}')
    blocks = list(model.blocks)
    model.__class__ = VisionTransformerDTN
    model.dtn_settings = vit_dtn_settings(
        len(blocks), model.embed_dim, blocks[0].attn.num_heads, dtn_layers=dtn_layers, **dtn_args)
    add_vit_dtn(blocks, BlockDTN, model.dtn_settings, model.num_prefix_tokens,
                'VisionTransformerDTN')
    model._register_load_state_dict_pre_hook(_reference_format, with_module=True)
    return model


default_cfgs = generate_default_cfgs({
    f'{base}_dtn': _data_cfg(base)
    for base in ('vit_tiny_patch16_224', 'vit_small_patch16_224', 'vit_base_patch16_224')
})


@register_model
def vit_tiny_patch16_224_dtn(pretrained=False, **kwargs) -> VisionTransformerDTN:
    """timm's ``vit_tiny_patch16_224`` with DTN in blocks 1-10 (4 DTN heads, as ViT-T*)."""
    return _vit_dtn('vit_tiny_patch16_224', pretrained, **kwargs)


@register_model
def vit_small_patch16_224_dtn(pretrained=False, **kwargs) -> VisionTransformerDTN:
    """timm's ``vit_small_patch16_224`` with DTN in blocks 1-10 (6 DTN heads, as ViT-S*)."""
    return _vit_dtn('vit_small_patch16_224', pretrained, **kwargs)


@register_model
def vit_base_patch16_224_dtn(pretrained=False, **kwargs) -> VisionTransformerDTN:
    """timm's ``vit_base_patch16_224`` with DTN in blocks 1-10 (16 DTN heads, as ViT-B*)."""
    return _vit_dtn('vit_base_patch16_224', pretrained, **kwargs)
