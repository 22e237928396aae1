# UperNet, Swin-T with DTN, ADE20K: its LN twin with DTN in the blocks
# (recipe: README.md of this folder; DTN settings and weight decay: configs/README.md).
_base_ = [
    './swin-tiny-patch4-window7-in1k-pre-ln_upernet_8xb2-160k_ade20k-512x512.py',
    '../_base_/dtn_no_decay.py'
]
model = dict(backbone=dict(type='SwinTransformerDTN', convert_weights=False, dtn_init='paper'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
