# CPU demo: RetinaNet with a PVT-Tiny-DTN backbone trained from scratch on the synthetic shapes
# (128 x 128 images, 4 classes), evaluated with COCO bbox AP.
# Run by `tools/demo.py --model retinanet`.
# Changes against mmdet's RetinaNet for the tiny images and the CPU budget: random init, no
# drop-path, 64-channel FPN and head, anchors of 16-256 px.
_base_ = [
    'mmdet::_base_/models/retinanet_r50_fpn.py',
    './_base_/synthetic_shapes_instance.py',
    '../_base_/dtn_no_decay.py',
]
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
channels = 64
model = dict(
    backbone=dict(
        _delete_=True,
        type='PyramidVisionTransformerDTN',
        pretrain_img_size=128,
        num_layers=[2, 2, 2, 2],
        drop_path_rate=0.0,
        init_cfg=None),
    neck=dict(in_channels=[64, 128, 320, 512], out_channels=channels),
    bbox_head=dict(
        num_classes=4,
        in_channels=channels,
        feat_channels=channels,
        anchor_generator=dict(octave_base_scale=2)),
    test_cfg=dict(max_per_img=20))
train_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='Resize', scale={{_base_.image_size}}, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5, direction=['horizontal', 'vertical']),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile', backend_args=None),
    dict(type='Resize', scale={{_base_.image_size}}, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
val_dataloader = dict(dataset=dict(pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(metric='bbox')
test_evaluator = val_evaluator
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
