# RetinaNet, PVTv2-b0 with LayerNorm (stock backbone), COCO 2017, 1x schedule. LN twin of
# retinanet_pvtv2_b0_dtn_1x.py; mmdet's own recipe, unchanged: AdamW lr 1e-4, weight decay 1e-4, 12
# epochs with steps at 8 and 11, 8 GPUs x 2 images (auto_scale_lr base 16), ImageNet weights.
_base_ = 'mmdet::pvt/retinanet_pvtv2-b0_fpn_1x_coco.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
