# RetinaNet, Swin-T with LayerNorm (stock backbone), COCO 2017, 1x schedule. LN twin of
# retinanet_swin_tiny_dtn_1x.py. mmdet's RetinaNet Swin-T config with the Swin recipe's optimiser
# (as mmdet's Mask R-CNN Swin-T): AdamW lr 1e-4, betas (0.9, 0.999), weight decay 0.05, none on
# norms and position tables; 12 epochs with steps at 8 and 11, 8 GPUs x 2 images (auto_scale_lr
# base 16), official ImageNet-1k Swin-T weights.
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
