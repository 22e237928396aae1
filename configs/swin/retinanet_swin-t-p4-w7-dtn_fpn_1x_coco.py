# RetinaNet, Swin-T with DTN, COCO: its LN twin with DTN in the blocks
# (recipe: README.md of this folder; DTN settings and weight decay: configs/README.md).
_base_ = ['./retinanet_swin-t-p4-w7-ln_fpn_1x_coco.py', '../_base_/dtn_no_decay.py']
model = dict(backbone=dict(type='SwinTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
