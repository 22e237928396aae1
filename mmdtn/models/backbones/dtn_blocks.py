"""Turning mmdet's transformer blocks into DTN blocks (DTN paper, Shao et al., ICLR 2022, App. A.1).

DTN replaces the two LayerNorms inside each transformer block (``norm1`` before attention, ``norm2``
before the MLP) and needs the block's spatial shape ``hw_shape`` for its positional matrix (Eq. 6).
mmdet's blocks call ``self.norm1(x)`` without it, so a DTN block overrides only ``forward`` to pass
``hw_shape`` to its norms; everything else (attention, MLP, drop path, parameter names) is the
stock block's.

mmdet's backbones build their blocks inside their own ``__init__``. Rather than copying that code,
a DTN backbone builds the stock model and then *re-classes* each block in place to its DTN
subclass (the technique PyTorch's FSDP2 ``fully_shard`` uses), swapping ``norm1``/``norm2`` for
``DynamicTokenNorm`` modules in DTN stages. The new norms keep the attribute names, so an LN
checkpoint's ``norm1.weight``/``norm1.bias`` land on DTN's affine ``weight``/``bias``.
"""
from typing import Callable, Optional

import torch.nn as nn
from torch.utils import checkpoint as cp

from ..dtn_stages import DTNStageSettings, dtn_stage_settings
from ..layers import DynamicTokenNorm

__all__ = ['DTNStageSettings', 'dtn_stage_settings', 'TokenNormBlockMixin']


class TokenNormBlockMixin:
    """Forward helpers shared by the DTN blocks, and the in-place conversion of a stock block."""

    #: the stock mmdet block class the DTN block derives from (set by subclasses)
    stock_block: type = None
    with_cp: bool = False

    @classmethod
    def convert(cls, block: nn.Module, settings: Optional[DTNStageSettings],
                with_cp: Optional[bool] = None) -> nn.Module:
        """Re-class a stock block in place; swap its ``norm1``/``norm2`` for DTN if ``settings``.

        Args:
            block: a block built by mmdet (exactly of type ``cls.stock_block``).
            settings: DTN settings of the block's stage, or ``None`` to keep its LayerNorms.
            with_cp: if not ``None``, sets the block's gradient checkpointing.
        """
        if type(block) is not cls.stock_block:
            raise TypeError(f'{cls.__name__}.convert expects a {cls.stock_block.__name__}, '
                            f'got {type(block).__name__}')
        block.__class__ = cls
        if with_cp is not None:
            block.with_cp = with_cp
        if settings is not None:
            block.norm1 = settings.norm_like(block.norm1)
            block.norm2 = settings.norm_like(block.norm2)
        return block

    @staticmethod
    def apply_norm(norm: nn.Module, x, hw_shape):
        """``norm(x, hw_shape)`` for DTN, ``norm(x)`` for a LayerNorm."""
        return norm(x, hw_shape) if isinstance(norm, DynamicTokenNorm) else norm(x)

    def run(self, inner_forward: Callable, x):
        """Run ``inner_forward(x)``, under gradient checkpointing if ``with_cp`` (as mmdet).

        ``inner_forward`` closes over ``hw_shape``, so the recomputation in the backward pass sees
        the shape of this very call.
        """
        if self.with_cp and x.requires_grad:
            return cp.checkpoint(inner_forward, x, use_reentrant=False)
        return inner_forward(x)
