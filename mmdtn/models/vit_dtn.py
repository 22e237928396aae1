"""DTN in a plain Vision Transformer (DTN paper, Shao et al., ICLR 2022, Table 1 and App. A.1), for
the timm, mmseg and mmpretrain ViTs alike. Imports with torch.

DTN replaces the two LayerNorms (before attention and before the MLP) of the first ``l^dtn``
encoder blocks (default 10); the last blocks keep LayerNorm. DTN's positional matrix (Eq. 6) lives
on the patch grid, so the class token must not enter those blocks: the paper appends it to the
output of block ``l^dtn``, as ConViT does. Here the model keeps its stock token layout (prefix
tokens, then patches) and a DTN block passes the prefix tokens through unchanged while it runs on
the patches alone. That is the same computation (the first ``l^dtn`` blocks neither see nor change
the class token), with the stock model's parameters, position embedding (its class-token entry
included), output layout and feature indices.

DTN heads default to those of the paper's starred models by width: ViT-T* 4 (192 channels), ViT-S*
6 (384), ViT-B* 16 (768); another width takes its attention heads. No pooling of the inter-token
statistics (the paper pools in PVT and Swin only, App. B.1).
"""
import math
from collections import OrderedDict
from typing import List, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn

from .dtn_stages import BlockGridTokenNorm, DTNStageSettings, dtn_stage_settings
from .layers.reference_compat import convert_reference_state_dict

__all__ = ['VIT_DTN_LAYERS', 'STARRED_DTN_HEADS', 'VIT_DTN_ARGUMENTS', 'vit_dtn_settings',
           'PatchTokenBlockMixin', 'add_vit_dtn', 'set_patch_grid',
           'convert_reference_vit_state_dict']

#: l^dtn of the paper's ViTs: DTN in the first 10 encoder blocks (App. A.1).
VIT_DTN_LAYERS = 10
#: DTN heads of the paper's starred ViTs by embedding width (Table 1: ViT-T*, ViT-S*, ViT-B*).
STARRED_DTN_HEADS = {192: 4, 384: 6, 768: 16}
#: The arguments a DTN ViT takes besides its stock model's (:func:`vit_dtn_settings`'s).
VIT_DTN_ARGUMENTS = ('dtn_layers', 'dtn_heads', 'dtn_pool_sizes', 'dtn_init',
                     'dtn_reference_compat')


def vit_dtn_settings(num_layers: int,
                     embed_dims: int,
                     attention_heads: int,
                     dtn_layers: Optional[int] = None,
                     dtn_heads: Optional[Union[int, Sequence[int]]] = None,
                     dtn_pool_sizes: Union[int, Sequence[int]] = 1,
                     dtn_init: Union[str, Sequence[str]] = 'paper',
                     dtn_reference_compat: bool = False) -> List[Optional[DTNStageSettings]]:
    """The DTN settings of each encoder block of a ViT (``None``: the block keeps LayerNorm).

    Args:
        num_layers, embed_dims, attention_heads: the ViT's depth, width and attention heads.
        dtn_layers: l^dtn, DTN in the first ``dtn_layers`` blocks. Default: 10, or all blocks of a
            shallower model.
        dtn_heads: DTN heads, one value or one per block. Default: :data:`STARRED_DTN_HEADS` of
            the width, else ``attention_heads``.
        dtn_pool_sizes, dtn_init, dtn_reference_compat: as for every DTN model
            (:func:`~mmdtn.models.dtn_stages.dtn_stage_settings`), per block.
    """
    if dtn_layers is None:
        dtn_layers = min(VIT_DTN_LAYERS, num_layers)
    if isinstance(dtn_layers, bool) or not isinstance(dtn_layers, int) \
            or not 0 <= dtn_layers <= num_layers:
        raise ValueError(f'dtn_layers (l^dtn) must be an int from 0 to the {num_layers} encoder '
                         f'blocks, got {dtn_layers!r}')
    if dtn_heads is None:
        dtn_heads = STARRED_DTN_HEADS.get(embed_dims, attention_heads)
    return dtn_stage_settings(num_layers, [i < dtn_layers for i in range(num_layers)], dtn_heads,
                              dtn_pool_sizes, dtn_init, dtn_reference_compat)


class PatchTokenBlockMixin:
    """Mixed in before a stock ViT block: its DTN norms see the patch grid only.

    The block runs on the patch tokens (:meth:`forward_patches`, by default the stock forward);
    its ``num_prefix_tokens`` first tokens (class token, register tokens) pass through unchanged.
    Subclasses set :attr:`stock_block`, :meth:`norm_names` where the block keeps its norms under
    other names, and :attr:`norm_cls`: a ``BlockGridTokenNorm`` where the stock forward calls
    ``norm(x)``, or ``DynamicTokenNorm`` where :meth:`forward_patches` passes :attr:`hw_shape`.
    """

    #: the stock block class this DTN block derives from (set by subclasses)
    stock_block: type = None
    #: the class of the DTN norms
    norm_cls: type = BlockGridTokenNorm
    #: tokens before the patches, which the block passes through
    num_prefix_tokens: int = 0
    #: (H, W) patch grid of the current input (:func:`set_patch_grid`)
    hw_shape = None

    @staticmethod
    def norm_names(block: nn.Module) -> Sequence[str]:
        """Attribute names of the block's LayerNorms before attention and before the MLP."""
        return ('norm1', 'norm2')

    @classmethod
    def convert(cls, block: nn.Module, settings: DTNStageSettings,
                num_prefix_tokens: int) -> nn.Module:
        """Re-class a stock block in place and replace its two LayerNorms by DTN."""
        if type(block) is not cls.stock_block:
            raise TypeError(f'{cls.__name__}.convert expects a {cls.stock_block.__name__}, '
                            f'got {type(block).__name__}')
        for name in cls.norm_names(block):
            setattr(block, name, settings.norm_like(getattr(block, name), cls.norm_cls))
        block.__class__ = cls
        block.num_prefix_tokens = num_prefix_tokens
        return block

    def forward(self, x, *args, **kwargs):
        n = self.num_prefix_tokens
        if not n:
            return self.forward_patches(x, *args, **kwargs)
        return torch.cat([x[:, :n], self.forward_patches(x[:, n:], *args, **kwargs)], dim=1)

    def forward_patches(self, x, *args, **kwargs):
        """The block on patch tokens alone: the stock forward."""
        return super().forward(x, *args, **kwargs)


def add_vit_dtn(blocks: Sequence[nn.Module], block_cls: type,
                settings: Sequence[Optional[DTNStageSettings]], num_prefix_tokens: int,
                model_name: str) -> None:
    """Convert the ``blocks`` whose ``settings`` are not ``None`` to ``block_cls`` (in place)."""
    for index, (block, setting) in enumerate(zip(blocks, settings)):
        if setting is None:
            continue
        try:
            block_cls.convert(block, setting, num_prefix_tokens)
        except ValueError as e:
            raise ValueError(f'{model_name}: DTN of encoder block {index}: {e}') from None


def set_patch_grid(model: nn.Module, hw_shape: Sequence[int]) -> None:
    """Tell the DTN blocks and norms of ``model`` the (H, W) patch grid of the running input."""
    hw_shape = tuple(int(s) for s in hw_shape)
    for module in model.modules():
        if isinstance(module, (BlockGridTokenNorm, PatchTokenBlockMixin)):
            module.hw_shape = hw_shape


def convert_reference_vit_state_dict(state_dict: Mapping[str, torch.Tensor],
                                     ) -> 'OrderedDict[str, torch.Tensor]':
    """The authors' ViT-DTN weights (``vit_norm_*``: timm's ViT names, DTN layers in the reference
    code's names) in the DTN ViT's.

    DTN layers are converted by
    :func:`~mmdtn.models.layers.reference_compat.convert_reference_state_dict`. A position
    embedding of the patches alone (ConViT's layout: a square number of tokens beside a
    ``cls_token``, which is appended after block l^dtn without one) gets a zero class-token entry,
    the layout of timm's and mmseg's ViTs; one with a class-token entry is kept.
    """
    converted = convert_reference_state_dict(state_dict)
    pos, cls = converted.get('pos_embed'), converted.get('cls_token')
    if pos is not None and cls is not None and pos.dim() == 3 \
            and math.isqrt(pos.shape[1])**2 == pos.shape[1]:
        converted['pos_embed'] = torch.cat([pos.new_zeros(pos.shape[0], 1, pos.shape[2]), pos],
                                           dim=1)
    return converted
