"""Backbones: mmdet's PVT, PVTv2 and Swin with Dynamic Token Normalization and Dual PatchNorm.

Importing this package registers the backbones in mmdet's and mmsegmentation's ``MODELS``.
"""
from .pvt_dtn import PyramidVisionTransformerDTN, PyramidVisionTransformerV2DTN
from .swin_dtn import SwinTransformerDTN

__all__ = ['PyramidVisionTransformerDTN', 'PyramidVisionTransformerV2DTN', 'SwinTransformerDTN']
