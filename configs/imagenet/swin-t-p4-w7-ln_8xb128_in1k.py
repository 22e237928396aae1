# Swin-T with LayerNorm (mmdet's SwinTransformer, the detectors' backbone) on ImageNet-1k:
# mmpretrain's Swin-T recipe (the Swin paper's): 300 epochs, AdamW lr 5e-4 x 1024 / 512 = 1e-3,
# weight decay 0.05 (none on norms, biases, position tables), 20 epochs of linear warm-up then
# cosine decay to 1e-5, RandAugment (rand-m9-mstd0.5), random erasing 0.25, Mixup 0.8, CutMix
# 1.0, label smoothing 0.1, drop-path 0.2, gradient clipping at 5, 224 x 224 crops. Data:
# mmpretrain's ImageNet layout under data/imagenet/.
#
# Deviations from the inherited config:
# - the backbone: mmdet's Swin-T with the detection configs' arguments, so that its weights load
#   into the detectors one to one (mmpretrain's own SwinTransformer names its weights otherwise);
#   it returns the last stage (out_indices=(3,), with its norm), pooled by
#   StageGlobalAveragePooling (mmpretrain's global average pooling, taking the list mmdet's
#   backbones return) into the linear head;
# - 8 GPUs x 128 images instead of 16 x 64: the same 1024 images per iteration and learning rate.
_base_ = 'mmpretrain::swin_transformer/swin-tiny_16xb64_in1k.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='mmdet.SwinTransformer',
        embed_dims=96,
        depths=[2, 2, 6, 2],
        num_heads=[3, 6, 12, 24],
        window_size=7,
        mlp_ratio=4,
        qkv_bias=True,
        drop_path_rate=0.2,
        patch_norm=True,
        out_indices=(3, )),
    neck=dict(type='StageGlobalAveragePooling'))
train_dataloader = dict(batch_size=128)
