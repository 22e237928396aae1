# CPU demo pretraining: the demo detectors' PVT-Tiny-DTN backbone as an mmpretrain image classifier
# (global average pooling of the last stage, linear head) on crops of the synthetic shapes
# (mmdtn.datasets.shape_crops, 32 x 32, 4 classes), the embedded stand-in for ImageNet. Run by
# `tools/demo.py --pretrain`, which then trains the demo detector from this checkpoint.
# At 32 x 32 the classifier learns the shapes within the schedule (99 % top-1; 80 % at 64 x 64),
# and a detector gains from this start only then (at 64 x 64 it scores below one trained from
# scratch): docs/get_started.md has the measurements.
# The backbone is the detectors' (tests/test_configs.py pins it) at the crops' size:
# pretrain_img_size=32, so PVT's position embeddings are resampled to the detectors' 128 grid when
# they load it. The schedule is the detection demo's (_base_/schedule_500i.py).
_base_ = [
    'mmpretrain::_base_/default_runtime.py', './_base_/schedule_500i.py',
    '../_base_/dtn_no_decay.py'
]
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)

data_root = 'data/shape_crops/'
crop_size = 32
# settings of the generator (mmdtn.datasets.ShapeCropsSpec); tools/demo.py writes the data with them
shape_crops_spec = dict(shapes=dict(num_train=1000, num_val=100, seed=1), crop_size=crop_size)
# mmpretrain's CustomDataset numbers the class folders in sorted order: the classes in that order
classes = ('circle', 'square', 'star', 'triangle')

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
data_preprocessor = dict(  # the detectors' normalization (mmdet's DetDataPreprocessor)
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
crops = dict(type='CustomDataset', data_root=data_root, metainfo=dict(classes=classes))
train_dataloader = dict(
    batch_size=32,
    num_workers=1,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(crops, data_prefix='train', pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=64,
    num_workers=1,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(crops, data_prefix='val', pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='Accuracy', topk=(1, ))
test_evaluator = val_evaluator

optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
default_hooks = {{_base_.schedule_hooks}}
log_processor = dict(by_epoch=False)
randomness = dict(seed=0)
