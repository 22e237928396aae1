# RetinaNet, PVT-Tiny with Dynamic Token Normalization (Shao et al., ICLR 2022), COCO 2017, 1x
# schedule. The LN twin retinanet_pvt_tiny_ln_1x.py with only the backbone's block norms changed:
# DTN in stages 1-3 (stage 4 keeps LN), 4/4/5 heads, pool sizes 4/2/1 (the backbone's defaults,
# paper A.1 and B.1). DTN's gates and positional coefficients get no weight decay (see
# _base_/dtn_no_decay.py). The ImageNet checkpoint is the twin's LayerNorm one: DTN takes its LN
# weight/bias; its gates and positional coefficients start as in the paper (dtn_init='paper': Eq.
# 7, Algorithm 1, lambda = 0.5), as the LN-equivalent init saturates the gates and would keep DTN a
# LayerNorm.
_base_ = ['./retinanet_pvt_tiny_ln_1x.py', './_base_/dtn_no_decay.py']
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(backbone=dict(type='PyramidVisionTransformerDTN', dtn_init='paper'))
optim_wrapper = dict(
    paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
