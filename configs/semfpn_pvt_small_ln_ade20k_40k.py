# Semantic FPN, PVT-Small with LayerNorm (mmdet's stock backbone), ADE20K, 512 x 512 crops, 40k
# iters. LN twin of semfpn_pvt_small_dtn_ade20k_40k.py; the recipe of
# semfpn_pvt_tiny_ln_ade20k_40k.py.
_base_ = './semfpn_pvt_tiny_ln_ade20k_40k.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        num_layers=[3, 4, 6, 3],
        init_cfg=dict(checkpoint='https://github.com/whai362/PVT/'
                      'releases/download/v2/pvt_small.pth')))
