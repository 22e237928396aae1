# CPU demo pretraining, LayerNorm twin of classifier_pvt_tiny_dtn_shape_crops.py: the same
# classifier with DTN off in every stage (the stock PVT-Tiny's LayerNorms); it pretrains the
# backbone of the LayerNorm demo detectors.
_base_ = './classifier_pvt_tiny_dtn_shape_crops.py'
model = dict(backbone=dict(dtn_stages=False))
