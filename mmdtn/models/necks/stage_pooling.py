"""Global average pooling of the stage outputs of an mmdet backbone, for mmpretrain classifiers.

mmpretrain's ``ImageClassifier`` pools its backbone's outputs with ``GlobalAveragePooling``, which
takes the tuple of stage outputs mmpretrain's backbones return; mmdet's backbones (and so the DTN
backbones) return a list. A classifier on the DTN backbones (global average pooling of the last
stage and a linear head, as the DTN paper's PVT and Swin classifiers) uses this neck instead.
"""
from mmpretrain.models.necks import GlobalAveragePooling
from mmpretrain.registry import MODELS

__all__ = ['StageGlobalAveragePooling']


@MODELS.register_module()
class StageGlobalAveragePooling(GlobalAveragePooling):
    """mmpretrain's ``GlobalAveragePooling`` that also takes a list of stage outputs (as mmdet's
    backbones return them) and returns the tuple of pooled stages."""

    def forward(self, inputs):
        return super().forward(tuple(inputs) if isinstance(inputs, list) else inputs)
