# UperNet, DeiT-S/16 with DTN, ADE20K: its LN twin with DTN in the first 10 encoder layers
# (6 DTN heads, ViT-S*'s; the class token skips them; settings in configs/README.md).
_base_ = [
    './vit_deit-s16-ln_upernet_8xb2-80k_ade20k-512x512.py', '../_base_/dtn_no_decay.py'
]
model = dict(backbone=dict(type='VisionTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
