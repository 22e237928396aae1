# PVTv2-b2 with LayerNorm (mmdet's PyramidVisionTransformerV2) on ImageNet-1k: the PVT recipe and
# its deviations from mmpretrain's config are in ./_base_/pvt_8xb128_in1k.py.
_base_ = './_base_/pvt_8xb128_in1k.py'
model = dict(
    backbone=dict(type='mmdet.PyramidVisionTransformerV2', embed_dims=64, num_layers=[3, 4, 6, 3]),
    head=dict(in_channels=512))
