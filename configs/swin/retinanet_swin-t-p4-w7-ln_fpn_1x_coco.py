# RetinaNet, Swin-T with LayerNorm (the stock backbone), COCO: mmdet's config with the optimizer
# of mmdet's Swin-T recipe (AdamW lr 1e-4, weight decay 0.05, none on norms and positions).
_base_ = 'mmdet::swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
optim_wrapper = dict(
    optimizer=dict(
        _delete_=True,
        type='AdamW',
        lr=0.0001,
        betas=(0.9, 0.999),
        weight_decay=0.05),
    paramwise_cfg=dict(
        custom_keys={
            'absolute_pos_embed': dict(decay_mult=0.),
            'relative_position_bias_table': dict(decay_mult=0.),
            'norm': dict(decay_mult=0.)
        }))
