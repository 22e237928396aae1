# Mask R-CNN, PVT-Tiny with LayerNorm (the stock backbone), COCO: the PVT paper's recipe
# (AdamW lr 2e-4, weight decay 1e-4, 12 epochs, 8 GPUs x 2 images).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        _delete_=True,
        type='PyramidVisionTransformer',
        num_layers=[2, 2, 2, 2],
        init_cfg=dict(checkpoint='https://github.com/whai362/PVT/'
                      'releases/download/v2/pvt_tiny.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]))
optim_wrapper = dict(
    optimizer=dict(
        _delete_=True, type='AdamW', lr=0.0002, weight_decay=0.0001))
