# ViT-B* with DTN, ImageNet-1k: its LN twin with DTN in the first 10 encoder layers (16 DTN heads;
# the class token skips them; settings and weight decay in configs/README.md).
_base_ = ['./vit-b-star-ln_4xb256_in1k.py', '../_base_/dtn_no_decay.py']
model = dict(backbone=dict(type='VisionTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
