"""Necks of image classifiers built on the DTN backbones (mmpretrain)."""
from .stage_pooling import StageGlobalAveragePooling

__all__ = ['StageGlobalAveragePooling']
