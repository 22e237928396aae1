"""Where DTN goes in a hierarchical vision transformer, stage by stage (DTN paper, Shao et al.,
ICLR 2022, App. A.1 and B.1), for the mmdet/mmseg backbones and the timm models alike.

A DTN model is the stock model with the two LayerNorms of every block (``norm1`` before attention,
``norm2`` before the MLP) of its DTN stages replaced by ``DynamicTokenNorm``. This module holds the
per-stage settings of those layers and their defaults for PVT and Swin, so that a model built by
either library gets the same layers and its weights carry over one to one. Imports with torch.
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

import torch.nn as nn

from .layers import DynamicTokenNorm
from .layers.reference_compat import REFERENCE_EPS

__all__ = ['DTN_ARGUMENTS', 'BlockGridTokenNorm', 'DTNStageSettings', 'dtn_stage_settings',
           'default_pool_sizes', 'pvt_dtn_defaults', 'swin_dtn_defaults']

#: The arguments a DTN model takes besides its stock model's (:func:`dtn_stage_settings`'s).
DTN_ARGUMENTS = ('dtn_stages', 'dtn_heads', 'dtn_pool_sizes', 'dtn_init', 'dtn_reference_compat')


@dataclass(frozen=True)
class DTNStageSettings:
    """DTN settings of one stage: the arguments of its ``DynamicTokenNorm`` layers.

    The layer checks them; :meth:`norm_like` names the model arguments they come from when it
    refuses them.
    """
    num_heads: int
    pool_size: int = 1
    init: str = 'paper'
    reference_compat: bool = False

    def norm_like(self, norm: nn.Module, cls: type = DynamicTokenNorm) -> DynamicTokenNorm:
        """A ``cls`` (a ``DynamicTokenNorm``) replacing the LayerNorm ``norm``: same channels,
        affine weight and bias, device and dtype; its eps, or the reference code's
        (:data:`~mmdtn.models.layers.reference_compat.REFERENCE_EPS`) with ``reference_compat``."""
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            raise ValueError('DTN replaces the LayerNorms of the blocks; norm_cfg built '
                             f'{norm!r} instead')
        channels = norm.normalized_shape[0]
        try:
            dtn = cls(channels, self.num_heads, pool_size=self.pool_size,
                      eps=REFERENCE_EPS if self.reference_compat else norm.eps, init=self.init,
                      reference_compat=self.reference_compat)
        except ValueError as e:
            raise ValueError(f'{channels} channels with dtn_heads={self.num_heads!r}, '
                             f'dtn_pool_sizes={self.pool_size!r}, dtn_init={self.init!r}: '
                             f'{e}') from None
        if norm.weight is None:
            return dtn
        dtn = dtn.to(device=norm.weight.device, dtype=norm.weight.dtype)
        dtn.weight.data.copy_(norm.weight.data)
        if norm.bias is not None:
            dtn.bias.data.copy_(norm.bias.data)
        return dtn


class BlockGridTokenNorm(DynamicTokenNorm):
    """``DynamicTokenNorm`` called as ``norm(x)`` by a stock block that does not pass the grid.

    Tokens (B, H, W, C) carry their grid; tokens (B, N, C) lie on the grid of the block's current
    input, :attr:`hw_shape`, which the model records before its blocks run (timm's PVTv2 and Swin:
    a forward pre-hook of each block; ViT: the model's position embedding step).
    """

    #: (H, W) of the current input of the block this norm belongs to
    hw_shape = None

    def forward(self, x, hw_shape=None):
        if x.dim() == 4:
            B, H, W, C = x.shape
            return super().forward(x.reshape(B, H * W, C), (H, W)).reshape(B, H, W, C)
        hw_shape = self.hw_shape if hw_shape is None else hw_shape
        if hw_shape is None:
            raise ValueError(f'{type(self).__name__} got tokens of shape {tuple(x.shape)} and no '
                             'grid: it runs inside a block converted by mmdtn (timm, or mmseg\'s '
                             'ViT), whose model records the grid of its input')
        return super().forward(x, hw_shape)


def _per_stage(value, num_stages: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != num_stages:
            raise ValueError(f'{name} must be a single value or one value per stage '
                             f'({num_stages} stages), got {list(value)}')
        return list(value)
    return [value] * num_stages


def dtn_stage_settings(num_stages: int,
                       dtn_stages: Union[bool, Sequence[bool]],
                       dtn_heads: Union[int, Sequence[int]],
                       dtn_pool_sizes: Union[int, Sequence[int]] = 1,
                       dtn_init: Union[str, Sequence[str]] = 'paper',
                       dtn_reference_compat: bool = False) -> List[Optional[DTNStageSettings]]:
    """The per-stage DTN settings of a model from its ``dtn_*`` arguments.

    Each setting is a single value for all stages or a list with one value per stage; the values
    themselves are checked by ``DynamicTokenNorm`` when the stage's layers are built.

    Args:
        num_stages: number of stages of the model.
        dtn_stages: whether each stage uses DTN (bools).
        dtn_heads: DTN heads (channel groups) of each stage.
        dtn_pool_sizes: pooling size ``s`` of DTN's inter-token statistics in each stage.
        dtn_init: 'paper' (Eq. 7, gates 0) or 'layernorm' (LayerNorm at init, trainable gates)
            per stage.
        dtn_reference_compat: statistics and eps as the authors' reference code computes them
            (all stages).

    Returns:
        one entry per stage: ``None`` for a LayerNorm stage, else a :class:`DTNStageSettings`.
    """
    stages = _per_stage(dtn_stages, num_stages, 'dtn_stages')
    if not all(isinstance(use, bool) for use in stages):
        raise ValueError(f'dtn_stages must hold bools (one per stage), got {dtn_stages!r}')
    values = zip(stages, _per_stage(dtn_heads, num_stages, 'dtn_heads'),
                 _per_stage(dtn_pool_sizes, num_stages, 'dtn_pool_sizes'),
                 _per_stage(dtn_init, num_stages, 'dtn_init'))
    return [DTNStageSettings(h, s, init, bool(dtn_reference_compat)) if use else None
            for use, h, s, init in values]


def default_pool_sizes(num_stages: int) -> List[int]:
    """Pooling sizes 4 and 2 in the first two stages, none after (paper App. B.1)."""
    return [max(1, 4 >> i) for i in range(num_stages)]


def pvt_dtn_defaults(attention_heads: Sequence[int], channels: Sequence[int]) -> Dict[str, list]:
    """PVT and PVTv2: DTN in the first three stages (App. A.1, l^dtn = 3: PVT's classifier appends
    its class token after them); heads: the stage's attention heads, at least 4 where 4 divides its
    channels (4, 4, 5, 8 in the standard models); pooling 4, 2, then 1 (App. B.1)."""
    heads = [max(4, h) if c % max(4, h) == 0 else h for h, c in zip(attention_heads, channels)]
    num_stages = len(heads)
    return dict(dtn_stages=[i < 3 for i in range(num_stages)], dtn_heads=heads,
                dtn_pool_sizes=default_pool_sizes(num_stages))


def swin_dtn_defaults(attention_heads: Sequence[int]) -> Dict[str, list]:
    """Swin: DTN in all stages (App. A.1: Swin has no class token); heads: the stage's attention
    heads; pooling 4, 2, then 1 (App. B.1)."""
    return dict(dtn_stages=True, dtn_heads=list(attention_heads),
                dtn_pool_sizes=default_pool_sizes(len(attention_heads)))
