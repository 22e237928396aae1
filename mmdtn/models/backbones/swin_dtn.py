"""Swin Transformer with Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm.

mmdet's ``SwinTransformer`` with the two LayerNorms of every Swin block replaced by
``DynamicTokenNorm`` (App. A.1: Swin has no class token, so DTN goes into all blocks; App. B.1:
pooling sizes 4 and 2 in the first two stages). The patch-embedding norm, the patch-merging norms
and the output norms stay LayerNorm. Optionally Dual PatchNorm on the patch embedding.
"""
from mmdet.models.backbones.swin import SwinBlock, SwinTransformer

from mmdtn.registry import register_model
from ..dtn_stages import swin_dtn_defaults
from .dtn_backbone import DTNBackboneMixin
from .dtn_blocks import TokenNormBlockMixin
from .pretrained import swin_checkpoint_to_mmdet

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
class SwinTransformerDTN(DTNBackboneMixin, SwinTransformer):
    """mmdet's ``SwinTransformer`` with DTN and, optionally, Dual PatchNorm.

    Accepts every argument of ``mmdet.models.backbones.SwinTransformer`` with the same meaning
    and defaults, and returns the same outputs, plus the DTN and Dual PatchNorm arguments of
    :class:`~.dtn_backbone.DTNBackboneMixin`. Their defaults here (:meth:`default_dtn_settings`):
    DTN in every stage, with the stage's attention heads and pooling sizes 4, 2, then 1.
    """

    dtn_block = SwinBlockDTN

    def stage_blocks(self):
        return [list(stage.blocks) for stage in self.stages]

    def default_dtn_settings(self):
        """:func:`~mmdtn.models.dtn_stages.swin_dtn_defaults` of the stages' attention heads."""
        return swin_dtn_defaults([stage.blocks[0].attn.w_msa.num_heads if len(stage.blocks) else 1
                                  for stage in self.stages])

    def first_patch_embedding(self):
        return self.patch_embed

    def checkpoint_to_mmdet(self, state_dict):
        return swin_checkpoint_to_mmdet(state_dict, self.convert_weights, self)

    def train(self, mode: bool = True):
        """As mmdet's (frozen stages stay frozen), but returns ``self`` like ``nn.Module.train``."""
        super().train(mode)
        return self
