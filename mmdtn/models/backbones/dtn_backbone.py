"""What every DTN backbone adds to the mmdet backbone it derives from.

DTN in the blocks of the chosen stages (Shao et al., ICLR 2022, App. A.1), Dual PatchNorm on the
first patch embedding (Kumar et al., 2023), gradient checkpointing of the blocks, and
``init_cfg=dict(type='Pretrained', ...)`` loading through :func:`~.pretrained.load_pretrained`.

The DTN settings default to values derived from the architecture that was built (number of
stages, channels and attention heads of each stage), so that every argument combination of the
stock backbone works; :meth:`DTNBackboneMixin.default_dtn_settings` gives them per backbone.
"""
from typing import Dict, List, Optional, Sequence, Union

import torch.nn as nn

from ..layers import add_dual_patchnorm
from .dtn_blocks import TokenNormBlockMixin, dtn_stage_settings
from .pretrained import StateDict, load_pretrained

__all__ = ['DTNBackboneMixin']


class DTNBackboneMixin:
    """Mixed in before an mmdet backbone class; builds the stock model, then adds DTN and DPN.

    A backbone using it sets :attr:`dtn_block` and implements :meth:`stage_blocks`,
    :meth:`default_dtn_settings`, :meth:`first_patch_embedding` and :meth:`checkpoint_to_mmdet`.

    Args (besides the stock backbone's):
        dtn_stages, dtn_heads, dtn_pool_sizes: which stages use DTN, their DTN heads and pooling
            sizes; one value for all stages or one per stage. ``None``: the backbone's default for
            the architecture that was built.
        dtn_init (str | Sequence[str]): 'paper' (Eq. 7, gates 0) or 'layernorm' (a fresh DTN
            is the LayerNorm it replaces, and its gates train; see ``DynamicTokenNorm``).
            Default: 'paper'.
        dtn_reference_compat (bool): DTN statistics and eps (1e-5, whatever the LayerNorms'
            eps) as the authors' reference code computes them
            (:mod:`mmdtn.models.layers.reference_compat`), to reproduce models trained with it;
            checkpoints in that code's format are converted on loading. Default: False.
        dual_patchnorm (bool): LayerNorm each flattened patch of the first patch embedding before
            its projection (the LayerNorm after it is kept). Default: False.
        with_cp (bool): gradient checkpointing of every block. Default: False.
    """

    #: the DTN block class the stock blocks are converted to
    dtn_block: type = TokenNormBlockMixin

    def __init__(self,
                 *args,
                 dtn_stages: Optional[Union[bool, Sequence[bool]]] = None,
                 dtn_heads: Optional[Union[int, Sequence[int]]] = None,
                 dtn_pool_sizes: Optional[Union[int, Sequence[int]]] = None,
                 dtn_init: Union[str, Sequence[str]] = 'paper',
                 dtn_reference_compat: bool = False,
                 dual_patchnorm: bool = False,
                 with_cp: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.adapt_stock_model()
        stages = self.stage_blocks()
        given = dict(dtn_stages=dtn_stages, dtn_heads=dtn_heads, dtn_pool_sizes=dtn_pool_sizes)
        defaults = self.default_dtn_settings()
        self.dtn_settings = dtn_stage_settings(
            len(stages), **{k: defaults[k] if v is None else v for k, v in given.items()},
            dtn_init=dtn_init, dtn_reference_compat=dtn_reference_compat)
        self.with_cp = with_cp
        for index, (blocks, settings) in enumerate(zip(stages, self.dtn_settings)):
            try:
                for block in blocks:
                    self.dtn_block.convert(block, settings, with_cp=with_cp)
            except ValueError as e:
                raise ValueError(f'{type(self).__name__}: DTN of stage {index + 1}: {e}') from None
        self.dual_patchnorm = dual_patchnorm
        if dual_patchnorm:
            add_dual_patchnorm(self.first_patch_embedding())

    def adapt_stock_model(self):
        """Changes to the stock model before DTN goes in (none by default)."""

    def stage_blocks(self) -> List[List[nn.Module]]:
        """The stock transformer blocks of every stage, as built by the stock ``__init__``."""
        raise NotImplementedError

    def default_dtn_settings(self) -> Dict[str, list]:
        """Per-stage ``dtn_stages``, ``dtn_heads`` and ``dtn_pool_sizes`` for this architecture."""
        raise NotImplementedError

    def first_patch_embedding(self) -> nn.Module:
        """The patch embedding Dual PatchNorm goes into."""
        raise NotImplementedError

    def checkpoint_to_mmdet(self, state_dict: StateDict) -> StateDict:
        """A pretrained checkpoint's state dict in this backbone's (mmdet's) names."""
        raise NotImplementedError

    def init_weights(self):
        """From scratch as the stock backbone; ``init_cfg=dict(type='Pretrained',
        checkpoint=...)`` loads the checkpoints :mod:`~.pretrained` accepts."""
        if self.init_cfg is None:
            super().init_weights()
        else:
            load_pretrained(self, self.init_cfg, self.checkpoint_to_mmdet)
