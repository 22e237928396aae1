# Semantic FPN, PVT-Tiny with LayerNorm (the stock backbone), ADE20K: the PVT paper's recipe
# (AdamW lr 2e-4, weight decay 1e-4, poly 0.9 to 0, 40k iterations, 8 GPUs x 4 images).
_base_ = [
    'mmseg::_base_/models/fpn_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_40k.py',
]
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
crop_size = (512, 512)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=data_preprocessor,
    pretrained=None,
    backbone=dict(
        _delete_=True,
        # mmseg has no PVT: the stock class is mmdet's, reached through its registry scope.
        type='mmdet.PyramidVisionTransformer',
        num_layers=[2, 2, 2, 2],
        init_cfg=dict(checkpoint='https://github.com/whai362/PVT/'
                      'releases/download/v2/pvt_tiny.pth')),
    neck=dict(in_channels=[64, 128, 320, 512]),
    decode_head=dict(num_classes=150))
optim_wrapper = dict(
    optimizer=dict(
        _delete_=True, type='AdamW', lr=0.0002, weight_decay=0.0001))
param_scheduler = [
    dict(
        type='PolyLR',
        eta_min=0.0,
        power=0.9,
        begin=0,
        end=40000,
        by_epoch=False)
]
