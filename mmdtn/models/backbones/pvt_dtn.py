"""PVT and PVTv2 with Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm.

mmdet's ``PyramidVisionTransformer`` / ``PyramidVisionTransformerV2`` with the two LayerNorms of
every encoder layer in DTN stages replaced by ``DynamicTokenNorm`` (App. A.1: DTN in the first
three stages of PVT, the last stage keeps LayerNorm; App. B.1: pooling sizes 4 and 2 in the first
two stages). Patch-embedding norms, the spatial-reduction norms and the stage output norms stay
LayerNorm. Optionally Dual PatchNorm on the stage-1 patch embedding, and attention heads set
independently of the stage widths (``attention_heads``), as the authors' DTN-PVT models have them.
"""
from typing import Optional, Sequence, Union

from mmdet.models.backbones.pvt import (PVTEncoderLayer, PyramidVisionTransformer,
                                        PyramidVisionTransformerV2)

from mmdtn.registry import register_model
from ..dtn_stages import pvt_dtn_defaults
from .dtn_backbone import DTNBackboneMixin
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
    """Where PVT and PVTv2 keep what :class:`DTNBackboneMixin` needs, their DTN defaults, and the
    per-stage attention heads.

    Args (besides those of :class:`DTNBackboneMixin` and mmdet's backbone):
        attention_heads (int | Sequence[int], optional): attention heads of each stage. mmdet's
            ``num_heads`` sets both a stage's width (``embed_dims * num_heads[i]``) and its heads;
            given, these heads replace the latter and the widths stay. The authors' DTN-PVT
            models: ``num_heads=[1, 2, 5, 8]`` (widths 64, 128, 320, 512) with
            ``attention_heads=[4, 4, 5, 8]``. Default: ``num_heads``.
    """

    dtn_block = PVTEncoderLayerDTN

    def __init__(self, *args, attention_heads: Optional[Union[int, Sequence[int]]] = None,
                 **kwargs):
        # A plain attribute may be set before the stock __init__; adapt_stock_model applies it.
        self.attention_heads = attention_heads
        super().__init__(*args, **kwargs)

    def adapt_stock_model(self):
        """Give every stage's attention ``attention_heads`` heads (its weights do not depend on
        them); ``self.attention_heads`` becomes the list of each stage's heads."""
        heads = self.attention_heads
        if heads is None:
            heads = list(self.num_heads)
        elif isinstance(heads, int):
            heads = [heads] * self.num_stages
        elif len(heads) != self.num_stages:
            raise ValueError(f'attention_heads must be a single value or one value per stage '
                             f'({self.num_stages} stages), got {list(heads)}')
        for index, (blocks, h) in enumerate(zip(self.stage_blocks(), heads)):
            for block in blocks:
                attention = block.attn.attn  # the torch.nn.MultiheadAttention
                if not isinstance(h, int) or h < 1 or attention.embed_dim % h:
                    raise ValueError(f'{type(self).__name__}: stage {index + 1} has '
                                     f'{attention.embed_dim} channels, which attention_heads='
                                     f'{h!r} do not divide into equal heads')
                attention.num_heads, attention.head_dim = h, attention.embed_dim // h
                block.attn.num_heads = h
        self.attention_heads = list(heads)

    def stage_blocks(self):
        return [[b for b in blocks if isinstance(b, PVTEncoderLayer)]  # not the position embedding
                for _, blocks, _ in self.layers]

    def default_dtn_settings(self):
        """:func:`~mmdtn.models.dtn_stages.pvt_dtn_defaults` of the attention heads and widths."""
        return pvt_dtn_defaults(self.attention_heads,
                                [self.embed_dims * h for h in self.num_heads])

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
    - ``dtn_heads``: the stage's attention heads (``attention_heads``), at least 4 where 4 divides
      the stage's channels: (4, 4, 5, 8) in the standard models, as the authors' PVT models;
    - ``dtn_pool_sizes``: 4, 2, then 1 (paper App. B.1).
    """


@register_model
class PyramidVisionTransformerV2DTN(_PVTDTNMixin, PyramidVisionTransformerV2):
    """mmdet's ``PyramidVisionTransformerV2`` with DTN and, optionally, Dual PatchNorm.

    Same arguments as :class:`PyramidVisionTransformerDTN` (the PVTv2 architecture switches of
    mmdet's class are fixed as there). With ``dual_patchnorm`` the patch LayerNorm covers each
    7x7x3 receptive field of the overlapping stride-4 stage-1 convolution, zero padding included.
    """
