# Former name, kept for existing commands and work dirs.
_base_ = './mask-rcnn_pvt-s-dtn_fpn_1x_coco.py'
