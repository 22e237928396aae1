"""Backbones: mmdet's PVT, PVTv2 and Swin and mmseg's ViT with Dynamic Token Normalization (and
Dual PatchNorm).

Importing this package registers the backbones in mmdet's, mmsegmentation's and mmpretrain's
``MODELS``.
"""
from .pvt_dtn import PyramidVisionTransformerDTN, PyramidVisionTransformerV2DTN
from .swin_dtn import SwinTransformerDTN
from .vit_dtn import VisionTransformerDTN

__all__ = ['PyramidVisionTransformerDTN', 'PyramidVisionTransformerV2DTN', 'SwinTransformerDTN',
           'VisionTransformerDTN']
