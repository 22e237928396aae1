# CPU demo, LayerNorm twin of mask_rcnn_pvt_tiny_dtn_shapes.py: the same detector, data and
# schedule with DTN off in every stage (the stock PVT-Tiny's LayerNorms). Compared with its twin by
# `tools/demo_compare.py`.
_base_ = './mask_rcnn_pvt_tiny_dtn_shapes.py'
model = dict(backbone=dict(dtn_stages=False))
