# Mask R-CNN, Swin-T with LayerNorm (stock backbone), COCO 2017, 1x schedule. LN twin of
# mask_rcnn_swin_tiny_dtn_1x.py; mmdet's own recipe, unchanged: AdamW lr 1e-4, betas (0.9, 0.999),
# weight decay 0.05 (none on norms and position tables), 12 epochs with steps at 8 and 11, 8 GPUs x
# 2 images (auto_scale_lr base 16), official ImageNet-1k Swin-T weights.
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
