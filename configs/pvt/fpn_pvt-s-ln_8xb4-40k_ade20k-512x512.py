# Semantic FPN, PVT-Small with LayerNorm (the stock backbone), ADE20K: the recipe of the PVT-Tiny
# config with PVT-Small (README.md of this folder).
_base_ = './fpn_pvt-t-ln_8xb4-40k_ade20k-512x512.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        num_layers=[3, 4, 6, 3],
        init_cfg=dict(checkpoint='https://github.com/whai362/PVT/'
                      'releases/download/v2/pvt_small.pth')))
