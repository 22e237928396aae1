# RetinaNet, PVT-Small with LayerNorm (the stock backbone), COCO: mmdet's config, unchanged.
_base_ = 'mmdet::pvt/retinanet_pvt-s_fpn_1x_coco.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
