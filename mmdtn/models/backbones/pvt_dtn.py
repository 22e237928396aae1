"""PVT and PVTv2 with Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm.

mmdet's ``PyramidVisionTransformer`` / ``PyramidVisionTransformerV2`` with the two LayerNorms of
every encoder layer in DTN stages replaced by ``DynamicTokenNorm`` (App. A.1: DTN in the first
three stages of PVT, the last stage keeps LayerNorm; App. B.1: pooling sizes 4 and 2 in the first
two stages). Patch-embedding norms, the spatial-reduction norms and the stage output norms stay
LayerNorm. Optionally Dual PatchNorm on the stage-1 patch embedding.
"""
from mmdet.models.backbones.pvt import (PVTEncoderLayer, PyramidVisionTransformer,
                                        PyramidVisionTransformerV2)

from mmdtn.registry import register_model
from .dtn_backbone import DTNBackboneMixin, default_pool_sizes
from .dtn_blocks import TokenNormBlockMixin
from .pretrained import pvt_checkpoint_to_mmdet

__all__ = ['PVTEncoderLayerDTN', 'PyramidVisionTransformerDTN', 'PyramidVisionTransformerV2DTN']


class PVTEncoderLayerDTN(TokenNormBlockMixin, PVTEncoderLayer):
    """mmdet's ``PVTEncoderLayer`` feeding ``hw_shape`` to DTN norms, with optional checkpointing.

    Built by :meth:`convert` from a stock layer; ``norm1``/``norm2`` are ``DynamicTokenNorm`` in
    DTN stages and ``nn.LayerNorm`` otherwise. ``with_cp`` runs the layer under
    ``torch.utils.checkpoint`` in training, as mmdet's Swin blocks do.
    """

    stock_block = PVTEncoderLayer

    def forward(self, x, hw_shape):

        def inner_forward(x):
            x = self.attn(self.apply_norm(self.norm1, x, hw_shape), hw_shape, identity=x)
            x = self.ffn(self.apply_norm(self.norm2, x, hw_shape), hw_shape, identity=x)
            return x

        return self.run(inner_forward, x)


class _PVTDTNMixin(DTNBackboneMixin):
    """Where PVT and PVTv2 keep what :class:`DTNBackboneMixin` needs, and their DTN defaults."""

    dtn_block = PVTEncoderLayerDTN

    def stage_blocks(self):
        return [[b for b in blocks if isinstance(b, PVTEncoderLayer)]  # not the position embedding
                for _, blocks, _ in self.layers]

    def default_dtn_settings(self):
        """DTN in the first three stages (paper App. A.1, l^dtn = 3: PVT's classifier appends its
        class token after them); heads: the stage's attention heads, at least 4 where 4 divides
        its channels (4, 4, 5, 8 in the standard models); pooling 4, 2, then 1 (App. B.1)."""
        heads = []
        for attention_heads in self.num_heads:
            channels = self.embed_dims * attention_heads
            heads.append(max(4, attention_heads) if channels % max(4, attention_heads) == 0
                         else attention_heads)
        return dict(dtn_stages=[i < 3 for i in range(self.num_stages)], dtn_heads=heads,
                    dtn_pool_sizes=default_pool_sizes(self.num_stages))

    def first_patch_embedding(self):
        return self.layers[0][0]

    def checkpoint_to_mmdet(self, state_dict):
        return pvt_checkpoint_to_mmdet(state_dict, self.convert_weights)


@register_model
class PyramidVisionTransformerDTN(_PVTDTNMixin, PyramidVisionTransformer):
    """mmdet's ``PyramidVisionTransformer`` (PVT v1) with DTN and, optionally, Dual PatchNorm.

    Accepts every argument of ``mmdet.models.backbones.PyramidVisionTransformer`` with the same
    meaning and defaults, and returns the same outputs, plus the DTN and Dual PatchNorm arguments
    of :class:`~.dtn_backbone.DTNBackboneMixin` (``with_cp``: mmdet's PVT has none). Their
    defaults here (:meth:`default_dtn_settings`):

    - ``dtn_stages``: the first three stages, (True, True, True, False) with four, as the paper;
    - ``dtn_heads``: the stage's attention heads, at least 4 where 4 divides the stage's channels:
      (4, 4, 5, 8) in the standard models, as the authors' PVT models;
    - ``dtn_pool_sizes``: 4, 2, then 1 (paper App. B.1).
    """


@register_model
class PyramidVisionTransformerV2DTN(_PVTDTNMixin, PyramidVisionTransformerV2):
    """mmdet's ``PyramidVisionTransformerV2`` with DTN and, optionally, Dual PatchNorm.

    Same arguments as :class:`PyramidVisionTransformerDTN` (the PVTv2 architecture switches of
    mmdet's class are fixed as there). With ``dual_patchnorm`` the patch LayerNorm covers each
    7x7x3 receptive field of the overlapping stride-4 stage-1 convolution, zero padding included.
    """
