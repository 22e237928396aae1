"""Swin Transformer with Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm.

mmdet's ``SwinTransformer`` with the two LayerNorms of every Swin block replaced by
``DynamicTokenNorm`` (App. A.1: Swin has no class token, so DTN goes into all blocks; App. B.1:
pooling sizes 4 and 2 in the first two stages). The patch-embedding norm, the patch-merging norms
and the output norms stay LayerNorm. Optionally Dual PatchNorm on the patch embedding.
"""
from typing import Optional, Sequence, Union

from mmdet.models.backbones.swin import SwinBlock, SwinTransformer

from mmdtn.registry import register_model
from ..layers.dual_patchnorm import add_dual_patchnorm
from .dtn_blocks import TokenNormBlockMixin, dtn_stage_settings
from .pretrained import load_pretrained, swin_checkpoint_to_mmdet

__all__ = ['SwinBlockDTN', 'SwinTransformerDTN']


class SwinBlockDTN(TokenNormBlockMixin, SwinBlock):
    """mmdet's ``SwinBlock`` feeding ``hw_shape`` to its DTN norms (built by :meth:`convert`).

    The block's tokens are the full H x W map (window partition, shift and padding happen inside
    the attention), so DTN sees the stage's whole grid. ``with_cp`` behaves as in mmdet.
    """

    stock_block = SwinBlock

    def forward(self, x, hw_shape):

        def inner_forward(x):
            x = self.attn(self.apply_norm(self.norm1, x, hw_shape), hw_shape) + x
            return self.ffn(self.apply_norm(self.norm2, x, hw_shape), identity=x)

        return self.run(inner_forward, x)


@register_model
class SwinTransformerDTN(SwinTransformer):
    """mmdet's ``SwinTransformer`` with DTN and, optionally, Dual PatchNorm.

    Accepts every argument of ``mmdet.models.backbones.SwinTransformer`` with the same meaning
    and defaults, and returns the same outputs, plus:

    Args:
        dtn_stages (bool | Sequence[bool]): which stages use DTN. Default: True (all stages).
        dtn_heads (int | Sequence[int] | None): DTN heads per stage, independent of the attention
            heads. Default: None, the stage's attention heads.
        dtn_pool_sizes (int | Sequence[int]): pooling size of DTN's inter-token statistics per
            stage. Default: (4, 2, 1, 1) (paper App. B.1).
        dtn_init (str | Sequence[str]): 'paper' (Eq. 7, gates 0) or 'layernorm' (a fresh DTN
            equals LayerNorm). Default: 'paper'.
        dtn_reference_compat (bool): DTN statistics as the authors' reference code computes them
            (:mod:`mmdtn.models.layers.reference_compat`), to reproduce models trained with it;
            checkpoints in that code's format are converted on loading. Default: False.
        dual_patchnorm (bool): LayerNorm each flattened patch before the patch projection (the
            LayerNorm after it, ``patch_norm=True``, is kept). Default: False.
    """

    def __init__(self,
                 *args,
                 dtn_stages: Union[bool, Sequence[bool]] = True,
                 dtn_heads: Optional[Union[int, Sequence[int]]] = None,
                 dtn_pool_sizes: Union[int, Sequence[int]] = (4, 2, 1, 1),
                 dtn_init: Union[str, Sequence[str]] = 'paper',
                 dtn_reference_compat: bool = False,
                 dual_patchnorm: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        if dtn_heads is None:  # the attention heads of each stage
            dtn_heads = [stage.blocks[0].attn.w_msa.num_heads if len(stage.blocks) else 1
                         for stage in self.stages]
        self.dtn_settings = dtn_stage_settings(len(self.stages), dtn_stages, dtn_heads,
                                               dtn_pool_sizes, dtn_init, dtn_reference_compat)
        for stage, settings in zip(self.stages, self.dtn_settings):
            for block in stage.blocks:
                SwinBlockDTN.convert(block, settings)
        self.dual_patchnorm = dual_patchnorm
        if dual_patchnorm:
            add_dual_patchnorm(self.patch_embed)

    def train(self, mode: bool = True):
        """As mmdet's (frozen stages stay frozen), but returns ``self`` like ``nn.Module.train``."""
        super().train(mode)
        return self

    def init_weights(self):
        """From scratch as mmdet's Swin; ``init_cfg=dict(type='Pretrained', checkpoint=...)``
        loads official Swin, timm ``swin_*`` or mmdet/mmpretrain checkpoints (see
        :func:`mmdtn.models.backbones.pretrained.load_pretrained`)."""
        if self.init_cfg is None:
            super().init_weights()
        else:
            load_pretrained(self, self.init_cfg,
                            lambda sd: swin_checkpoint_to_mmdet(sd, self.convert_weights, self))
