"""Vision Transformer with Dynamic Token Normalization (Shao et al., ICLR 2022, Table 1, App.
A.1) for mmsegmentation and mmpretrain.

mmseg's ``VisionTransformer`` with the two LayerNorms (``ln1``, ``ln2``) of its first l^dtn encoder
layers replaced by ``DynamicTokenNorm``; those layers run on the patch tokens only and pass the
class token through (:mod:`mmdtn.models.vit_dtn`). Patch embedding, pre- and final norms and the
last layers stay LayerNorm.
"""
from typing import Optional, Sequence, Union

from mmseg.models.backbones.vit import TransformerEncoderLayer, VisionTransformer

from mmdtn.registry import register_model
from ..layers import DynamicTokenNorm
from ..vit_dtn import PatchTokenBlockMixin, add_vit_dtn, set_patch_grid, vit_dtn_settings
from .dtn_blocks import TokenNormBlockMixin
from .pretrained import load_pretrained, vit_checkpoint_to_mmseg

__all__ = ['ViTEncoderLayerDTN', 'VisionTransformerDTN']


class ViTEncoderLayerDTN(PatchTokenBlockMixin, TokenNormBlockMixin, TransformerEncoderLayer):
    """mmseg's ``TransformerEncoderLayer`` with DTN, on the patch tokens only, feeding the patch
    grid to its norms; ``with_cp`` as in mmseg."""

    stock_block = TransformerEncoderLayer
    norm_cls = DynamicTokenNorm

    @staticmethod
    def norm_names(block):
        return (block.norm1_name, block.norm2_name)

    def forward_patches(self, x):
        hw_shape = self.hw_shape

        def inner_forward(x):
            x = self.attn(self.norm1(x, hw_shape), identity=x)
            return self.ffn(self.norm2(x, hw_shape), identity=x)

        return self.run(inner_forward, x)


@register_model
class VisionTransformerDTN(VisionTransformer):
    """mmseg's ``VisionTransformer`` with DTN in its first l^dtn encoder layers.

    Accepts every argument of ``mmseg.models.backbones.VisionTransformer`` with the same meaning
    and defaults, and returns the same outputs (``out_indices``, ``out_origin``,
    ``output_cls_token``, ``final_norm``, position embeddings interpolated to the input size). The
    class token (``with_cls_token``) skips the DTN layers: an output taken before layer l^dtn
    carries it as it enters layer l^dtn.

    Args (besides mmseg's):
        dtn_layers (int, optional): l^dtn. Default: 10, or every layer of a shallower model.
        dtn_heads (int | Sequence[int], optional): DTN heads. Default: 4, 6, 16 at widths 192,
            384, 768 (the paper's ViT-T*, S*, B*), else ``num_heads``.
        dtn_pool_sizes, dtn_init, dtn_reference_compat: as in every DTN backbone. Default: 1,
            'paper', False.

    ``init_cfg=dict(type='Pretrained', checkpoint=...)`` (or mmseg's ``pretrained``) loads mmseg
    and mmpretrain classifier checkpoints of this backbone or the stock one, timm's ViT and DeiT
    checkpoints (those of ``vit_*_dtn`` included) and the authors' (reference-code) ones, with
    the position embedding resized to ``img_size`` as mmseg does
    (:func:`~.pretrained.vit_checkpoint_to_mmseg`).
    """

    def __init__(self,
                 *args,
                 dtn_layers: Optional[int] = None,
                 dtn_heads: Optional[Union[int, Sequence[int]]] = None,
                 dtn_pool_sizes: Union[int, Sequence[int]] = 1,
                 dtn_init: Union[str, Sequence[str]] = 'paper',
                 dtn_reference_compat: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        layers = list(self.layers)
        attention = layers[0].attn.attn
        self.dtn_settings = vit_dtn_settings(
            len(layers), attention.embed_dim, attention.num_heads, dtn_layers, dtn_heads,
            dtn_pool_sizes, dtn_init, dtn_reference_compat)
        add_vit_dtn(layers, ViTEncoderLayerDTN, self.dtn_settings, int(self.with_cls_token),
                    type(self).__name__)
        self._freeze()  # frozen_exclude covers the new norms too

    def _pos_embeding(self, patched_img, hw_shape, pos_embed):
        """mmseg's step, after recording the patch grid for the DTN norms."""
        set_patch_grid(self, hw_shape)
        return super()._pos_embeding(patched_img, hw_shape, pos_embed)

    def init_weights(self):
        if isinstance(self.init_cfg, dict) and self.init_cfg.get('type') == 'Pretrained':
            load_pretrained(self, self.init_cfg,
                            lambda state_dict: vit_checkpoint_to_mmseg(state_dict, self))
        else:
            super().init_weights()

    def train(self, mode: bool = True):
        """As mmseg's (``norm_eval``), but returns ``self`` like ``nn.Module.train``."""
        super().train(mode)
        return self
