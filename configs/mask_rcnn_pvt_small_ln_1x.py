# Mask R-CNN, PVT-Small with LayerNorm (stock backbone), COCO 2017, 1x schedule. LN twin of
# mask_rcnn_pvt_small_dtn_1x.py; the recipe of mask_rcnn_pvt_tiny_ln_1x.py.
_base_ = './mask_rcnn_pvt_tiny_ln_1x.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(
        num_layers=[3, 4, 6, 3],
        init_cfg=dict(checkpoint='https://github.com/whai362/PVT/'
                      'releases/download/v2/pvt_small.pth')))
