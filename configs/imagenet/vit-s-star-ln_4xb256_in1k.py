# ViT-S* with LayerNorm (mmseg's VisionTransformer, 6 attention heads: the DTN paper's Table 1) on
# ImageNet-1k: the DeiT recipe and its deviations from mmpretrain's config are in
# ./_base_/vit_4xb256_in1k.py.
_base_ = './_base_/vit_4xb256_in1k.py'
model = dict(
    backbone=dict(type='mmseg.VisionTransformer', embed_dims=384, num_heads=6),
    head=dict(in_channels=384))
