# Mask R-CNN, the authors' DTN-PVT-Tiny ImageNet checkpoint, COCO: the recipe of
# ../pvt/mask-rcnn_pvt-t-dtn_fpn_1x_coco.py with the backbone of _base_/dtn_authors_pvt.py.
_base_ = ['../pvt/mask-rcnn_pvt-t-dtn_fpn_1x_coco.py', '../_base_/dtn_authors_pvt.py']
model = dict(backbone={{_base_.dtn_authors_pvt_tiny}})
