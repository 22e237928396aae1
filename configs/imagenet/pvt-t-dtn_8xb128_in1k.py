# PVT-Tiny with DTN, ImageNet-1k: its LN twin with DTN in the blocks
# (settings and weight decay in configs/README.md).
_base_ = ['./pvt-t-ln_8xb128_in1k.py', '../_base_/dtn_no_decay.py']
model = dict(backbone=dict(type='PyramidVisionTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
