# ImageNet-1k classification with mmseg's ViT (the segmenters' backbone) as the backbone of an
# mmpretrain ImageClassifier: the DeiT recipe, mmpretrain's DeiT config, which is the DTN paper's
# ViT recipe (App. B.1): 4 GPUs x 256 images, 300 epochs, AdamW lr 5e-4 x 1024 / 512 = 1e-3, weight
# decay 0.05 (none on norms, biases, other 1-d parameters, the class token and the position
# embedding), 20 epochs of linear warm-up then cosine decay to 1e-5, RandAugment (rand-m9-mstd0.5),
# random erasing 0.25, Mixup 0.8, CutMix 1.0, label smoothing 0.1, gradient clipping at 5, 224 x 224
# crops. Data: mmpretrain's ImageNet layout under data/imagenet/.
#
# Deviations from the inherited config:
# - the backbone: mmseg's VisionTransformer (set by each config) with timm's and DeiT's layout
#   (patch-embedding bias, LayerNorm eps 1e-6, final norm), so that its weights load into the
#   segmentation configs (configs/vit/) one to one; it returns the class token of the last layer
#   (output_cls_token), which mmpretrain's VisionTransformerClsHead classifies;
# - drop-path rate 0.1, DeiT's (mmpretrain's DeiT-S/T configs use none).
_base_ = 'mmpretrain::deit/deit-small_4xb256_in1k.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        img_size=224,
        patch_size=16,
        num_layers=12,
        mlp_ratio=4,
        qkv_bias=True,
        patch_bias=True,
        drop_path_rate=0.1,
        with_cls_token=True,
        output_cls_token=True,
        final_norm=True,
        norm_cfg=dict(type='LN', eps=1e-6),
        out_indices=-1))
