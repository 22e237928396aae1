# UperNet, ViT-B/16 with DTN, ADE20K: its LN twin with DTN in the first 10 encoder layers
# (16 DTN heads, ViT-B*'s; the class token skips them; settings in configs/README.md).
_base_ = [
    './vit_vit-b16-ln_mln_upernet_8xb2-160k_ade20k-512x512.py', '../_base_/dtn_no_decay.py'
]
model = dict(backbone=dict(type='VisionTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
