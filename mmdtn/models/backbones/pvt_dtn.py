"""PVT and PVTv2 with Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm.

mmdet's ``PyramidVisionTransformer`` / ``PyramidVisionTransformerV2`` with the two LayerNorms of
every encoder layer in DTN stages replaced by ``DynamicTokenNorm`` (App. A.1: DTN in the first
three stages of PVT, the last stage keeps LayerNorm; App. B.1: pooling sizes 4 and 2 in the first
two stages). Patch-embedding norms, the spatial-reduction norms and the stage output norms stay
LayerNorm. Optionally Dual PatchNorm on the stage-1 patch embedding.
"""
from typing import Sequence, Union

from mmdet.models.backbones.pvt import (PVTEncoderLayer, PyramidVisionTransformer,
                                        PyramidVisionTransformerV2)

from mmdtn.registry import register_model
from ..layers.dual_patchnorm import add_dual_patchnorm
from .dtn_blocks import TokenNormBlockMixin, dtn_stage_settings
from .pretrained import load_pretrained, pvt_checkpoint_to_mmdet

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


class _PVTDTNMixin:
    """DTN/DPN settings, block conversion and checkpoint loading shared by PVT and PVTv2."""

    def __init__(self,
                 *args,
                 dtn_stages: Union[bool, Sequence[bool]] = (True, True, True, False),
                 dtn_heads: Union[int, Sequence[int]] = (4, 4, 5, 8),
                 dtn_pool_sizes: Union[int, Sequence[int]] = (4, 2, 1, 1),
                 dtn_init: Union[str, Sequence[str]] = 'paper',
                 dtn_reference_compat: bool = False,
                 dual_patchnorm: bool = False,
                 with_cp: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.dtn_settings = dtn_stage_settings(self.num_stages, dtn_stages, dtn_heads,
                                               dtn_pool_sizes, dtn_init, dtn_reference_compat)
        self.with_cp = with_cp
        for (_, blocks, _), settings in zip(self.layers, self.dtn_settings):
            for block in blocks:
                if isinstance(block, PVTEncoderLayer):  # not the AbsolutePositionEmbedding
                    PVTEncoderLayerDTN.convert(block, settings, with_cp=with_cp)
        self.dual_patchnorm = dual_patchnorm
        if dual_patchnorm:
            add_dual_patchnorm(self.layers[0][0])

    def init_weights(self):
        """From scratch as mmdet's PVT; ``init_cfg=dict(type='Pretrained', checkpoint=...)``
        loads official PVT/PVTv2, timm ``pvt_v2_*`` or mmdet checkpoints (see
        :func:`mmdtn.models.backbones.pretrained.load_pretrained`)."""
        if self.init_cfg is None:
            super().init_weights()
        else:
            load_pretrained(self, self.init_cfg,
                            lambda sd: pvt_checkpoint_to_mmdet(sd, self.convert_weights))


@register_model
class PyramidVisionTransformerDTN(_PVTDTNMixin, PyramidVisionTransformer):
    """mmdet's ``PyramidVisionTransformer`` (PVT v1) with DTN and, optionally, Dual PatchNorm.

    Accepts every argument of ``mmdet.models.backbones.PyramidVisionTransformer`` with the same
    meaning and defaults, and returns the same outputs, plus:

    Args:
        dtn_stages (bool | Sequence[bool]): which stages use DTN in their encoder layers.
            Default: (True, True, True, False), the paper's PVT.
        dtn_heads (int | Sequence[int]): DTN heads (channel groups with their own positional
            matrix and gates) per stage, independent of the attention heads.
            Default: (4, 4, 5, 8), the authors' PVT models.
        dtn_pool_sizes (int | Sequence[int]): pooling size of DTN's inter-token statistics per
            stage. Default: (4, 2, 1, 1) (paper App. B.1).
        dtn_init (str | Sequence[str]): 'paper' (Eq. 7, gates 0) or 'layernorm' (a fresh DTN
            equals LayerNorm: for inserting DTN into an LN-pretrained network). Default: 'paper'.
        dtn_reference_compat (bool): DTN statistics as the authors' reference code computes them
            (:mod:`mmdtn.models.layers.reference_compat`), to reproduce models trained with it;
            checkpoints in that code's format are converted on loading. Default: False.
        dual_patchnorm (bool): LayerNorm each flattened stage-1 patch before the projection (the
            LayerNorm after it is kept). Default: False.
        with_cp (bool): gradient checkpointing of every encoder layer (mmdet's PVT has none).
            Default: False.
    """


@register_model
class PyramidVisionTransformerV2DTN(_PVTDTNMixin, PyramidVisionTransformerV2):
    """mmdet's ``PyramidVisionTransformerV2`` with DTN and, optionally, Dual PatchNorm.

    Same arguments as :class:`PyramidVisionTransformerDTN` (the PVTv2 architecture switches of
    mmdet's class are fixed as there). With ``dual_patchnorm`` the patch LayerNorm covers each
    7x7x3 receptive field of the overlapping stride-4 stage-1 convolution, zero padding included.
    """
