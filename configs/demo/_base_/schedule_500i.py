# The CPU demo's schedule, shared by the detection demo and the backbone's pretraining: 500
# iterations of AdamW from scratch, linear warm-up then cosine decay; evaluation at the end.
max_iters = 500
train_cfg = dict(type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=30),
    dict(type='CosineAnnealingLR', by_epoch=False, begin=30, end=max_iters, eta_min_ratio=0.05),
]
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=1e-3, betas=(0.9, 0.999), weight_decay=0.05),
    clip_grad=dict(max_norm=10.0, norm_type=2))
# the runtime's default_hooks with the schedule's logging and checkpoint (in a config:
# default_hooks = {{_base_.schedule_hooks}}, which is merged into the runtime's hooks)
schedule_hooks = dict(
    logger=dict(type='LoggerHook', interval=10),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=max_iters, max_keep_ckpts=1))
