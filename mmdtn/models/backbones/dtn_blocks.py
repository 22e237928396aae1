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
from typing import Callable, List, Optional, Sequence, Union

import torch.nn as nn
from torch.utils import checkpoint as cp

from ..layers.dtn import DynamicTokenNorm

__all__ = ['DTNStageSettings', 'dtn_stage_settings', 'TokenNormBlockMixin']

DTN_INITS = ('paper', 'layernorm')


class DTNStageSettings(dict):
    """DTN settings of one stage: ``num_heads``, ``pool_size``, ``init``, ``reference_compat``
    (a plain dict)."""


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
                       dtn_pool_sizes: Union[int, Sequence[int]],
                       dtn_init: Union[str, Sequence[str]],
                       dtn_reference_compat: bool = False) -> List[Optional[DTNStageSettings]]:
    """Validate the per-stage DTN settings of a backbone.

    Each setting is a single value for all stages or a list with one value per stage.

    Args:
        num_stages: number of stages of the backbone.
        dtn_stages: whether each stage uses DTN (bools).
        dtn_heads: DTN heads (channel groups) of each stage.
        dtn_pool_sizes: pooling size ``s`` of DTN's inter-token statistics in each stage.
        dtn_init: 'paper' (Eq. 7, gates 0) or 'layernorm' (equal to LayerNorm at init) per stage.
        dtn_reference_compat: statistics as the authors' reference code computes them (all stages).

    Returns:
        one entry per stage: ``None`` for a LayerNorm stage, else a :class:`DTNStageSettings`.
    """
    stages = _per_stage(dtn_stages, num_stages, 'dtn_stages')
    heads = _per_stage(dtn_heads, num_stages, 'dtn_heads')
    pools = _per_stage(dtn_pool_sizes, num_stages, 'dtn_pool_sizes')
    inits = _per_stage(dtn_init, num_stages, 'dtn_init')
    settings = []
    for i, (use, h, s, init) in enumerate(zip(stages, heads, pools, inits)):
        if not isinstance(use, bool):
            raise ValueError(f'dtn_stages must hold bools (one per stage), got {dtn_stages!r}')
        if not use:
            settings.append(None)
            continue
        if not isinstance(h, int) or h < 1:
            raise ValueError(f'dtn_heads of stage {i} must be a positive int, got {h!r}')
        if not isinstance(s, int) or s < 1:
            raise ValueError(f'dtn_pool_sizes of stage {i} must be a positive int, got {s!r}')
        if init not in DTN_INITS:
            raise ValueError(f'dtn_init of stage {i} must be one of {DTN_INITS}, got {init!r}')
        settings.append(DTNStageSettings(num_heads=h, pool_size=s, init=init,
                                         reference_compat=bool(dtn_reference_compat)))
    return settings


def dtn_like(norm: nn.Module, settings: DTNStageSettings) -> DynamicTokenNorm:
    """A ``DynamicTokenNorm`` replacing the LayerNorm ``norm`` (same features and eps)."""
    if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
        raise ValueError('DTN replaces the LayerNorms of the blocks; norm_cfg built '
                         f'{norm!r} instead')
    num_features = norm.normalized_shape[0]
    if num_features % settings['num_heads']:
        raise ValueError(f'DTN heads ({settings["num_heads"]}) must divide the embedding dims '
                         f'({num_features})')
    dtn = DynamicTokenNorm(num_features, settings['num_heads'], pool_size=settings['pool_size'],
                           eps=norm.eps, init=settings['init'],
                           reference_compat=settings.get('reference_compat', False))
    return dtn.to(device=norm.weight.device, dtype=norm.weight.dtype) \
        if norm.weight is not None else dtn


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
            block.norm1 = dtn_like(block.norm1, settings)
            block.norm2 = dtn_like(block.norm2, settings)
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
