# ImageNet-1k classification with mmdet's PVT / PVTv2 (the detectors' backbones) as the backbone of
# an mmpretrain ImageClassifier: mmpretrain's recipe of the PVT family, that of its Twins-PCPVT
# configs (PCPVT is PVT with conditional position encoding, trained with PVT's recipe), which is
# the PVT papers': 8 GPUs x 128 images, 300 epochs, AdamW lr 5e-4 x 1024 / 512 = 1e-3, weight decay
# 0.05 (none on norms, biases and other 1-d parameters), 5 epochs of linear warm-up then cosine
# decay to 1e-5, RandAugment (rand-m9-mstd0.5), random erasing 0.25, Mixup 0.8, CutMix 1.0, label
# smoothing 0.1, gradient clipping at 5, 224 x 224 crops. Data: mmpretrain's ImageNet layout under
# data/imagenet/ (train/ and val/, one folder per class, or meta/{train,val}.txt).
#
# Deviations from the inherited config:
# - the backbone: mmdet's PVT (set by each config), the same arguments as the detection configs'
#   backbone, so that its weights load into the detectors one to one; it returns the last stage
#   only (out_indices=(3,)), pooled by StageGlobalAveragePooling (mmpretrain's global average
#   pooling, taking the list mmdet's backbones return) into the linear head. mmdet's PVT v1 has
#   neither PVT's class token nor a norm after its last stage, so the classifier pools the last
#   stage's tokens as they come out of its blocks; PVTv2 has a norm after every stage, as PVTv2.
# - drop-path rate 0.1, PVT's and PVTv2's (b0-b2) rate (PCPVT's is 0.2-0.3);
# - no weight decay on PVT v1's position embeddings (`pos_embed`), as in PVT's code.
_base_ = 'mmpretrain::twins/twins-pcpvt-small_8xb128_in1k.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(_delete_=True, drop_path_rate=0.1, out_indices=(3, )),
    neck=dict(type='StageGlobalAveragePooling'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={'.pos_embed': dict(decay_mult=0.)}))
