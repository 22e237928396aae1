# Mask R-CNN, Swin-T with Dynamic Token Normalization (Shao et al., ICLR 2022), COCO 2017, 1x
# schedule. The LN twin mask_rcnn_swin_tiny_ln_1x.py with only the backbone's block norms changed:
# DTN in all four stages, heads = the stage's attention heads, pool sizes 4/2/1/1 (the backbone's
# defaults, paper B.1). DTN's gates and positional coefficients get no weight decay (see
# _base_/dtn_no_decay.py). The stock 'norm' key already removes decay from DTN's weight/bias, as
# from the twin's LayerNorms. The ImageNet checkpoint is the twin's LayerNorm one: DTN takes its LN
# weight/bias; its gates and positional coefficients start as in the paper (dtn_init='paper': Eq.
# 7, Algorithm 1, lambda = 0.5), as the LN-equivalent init saturates the gates and would keep DTN a
# LayerNorm.
_base_ = ['./mask_rcnn_swin_tiny_ln_1x.py', './_base_/dtn_no_decay.py']
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(backbone=dict(type='SwinTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
