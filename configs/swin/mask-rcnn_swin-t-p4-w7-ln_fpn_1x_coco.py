# Mask R-CNN, Swin-T with LayerNorm (the stock backbone), COCO: mmdet's config, unchanged.
_base_ = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
