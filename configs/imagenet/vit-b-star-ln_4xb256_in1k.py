# ViT-B* with LayerNorm (mmseg's VisionTransformer, 16 attention heads: the DTN paper's Table 1) on
# ImageNet-1k: the DeiT recipe and its deviations from mmpretrain's config are in
# ./_base_/vit_4xb256_in1k.py.
_base_ = './_base_/vit_4xb256_in1k.py'
model = dict(
    backbone=dict(type='mmseg.VisionTransformer', embed_dims=768, num_heads=16),
    head=dict(in_channels=768))
