# CPU demo pretraining: the demo detectors' PVT-Tiny-DTN backbone as an mmpretrain image classifier
# (global average pooling of the last stage, linear head) on crops of the synthetic shapes
# (mmdtn.datasets.shape_crops, 64 x 64, 4 classes), the embedded stand-in for ImageNet. Run by
# `tools/demo.py --pretrain`, which then trains the demo detector from this checkpoint.
# The backbone is the detectors' (tests/test_configs.py pins it) at the crops' size:
# pretrain_img_size=64, so PVT's position embeddings are resampled to the detectors' 128 grid when
# they load it. The schedule is the detection demo's (AdamW, linear warm-up, cosine decay).
_base_ = ['mmpretrain::_base_/default_runtime.py', '../_base_/dtn_no_decay.py']
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)

data_root = 'data/shape_crops/'
crop_size = 64
# settings of the generator (mmdtn.datasets.ShapeCropsSpec); tools/demo.py writes the data from these
shape_crops_spec = dict(shapes=dict(num_train=1000, num_val=100, seed=1), crop_size=crop_size)
classes = ('circle', 'square', 'triangle', 'star')

model = dict(
    type='ImageClassifier',
    backbone=dict(
        type='PyramidVisionTransformerDTN',
        pretrain_img_size=crop_size,
        num_layers=[2, 2, 2, 2],
        drop_path_rate=0.0,
        out_indices=(3, ),
        init_cfg=None),
    neck=dict(type='StageGlobalAveragePooling'),
    head=dict(
        type='LinearClsHead',
        num_classes=len(classes),
        in_channels=512,
        loss=dict(type='CrossEntropyLoss', loss_weight=1.0),
        topk=(1, )))
data_preprocessor = dict(  # the detectors' normalisation (mmdet's DetDataPreprocessor)
    num_classes=len(classes),
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    to_rgb=True)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='RandomFlip', prob=0.5, direction=['horizontal', 'vertical']),
    dict(type='PackInputs'),
]
test_pipeline = [dict(type='LoadImageFromFile'), dict(type='PackInputs')]
train_dataloader = dict(
    batch_size=32,
    num_workers=1,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        type='CustomDataset',
        data_root=data_root,
        data_prefix='train',
        metainfo=dict(classes=classes),
        pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=64,
    num_workers=1,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(
        type='CustomDataset',
        data_root=data_root,
        data_prefix='val',
        metainfo=dict(classes=classes),
        pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator

max_iters = 500
train_cfg = dict(by_epoch=False, max_iters=max_iters, val_interval=max_iters)
val_cfg = dict()
test_cfg = dict()
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=30, end=max_iters, eta_min_ratio=0.05),
]
optim_wrapper = dict(
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}),
    clip_grad=dict(max_norm=10.0, norm_type=2))
default_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters, max_keep_ckpts=1))
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
