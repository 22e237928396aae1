# RetinaNet PVT-Tiny-DTN, 1x COCO, under the short name the project's first commands used; the
# config itself is configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py.
_base_ = './pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py'
