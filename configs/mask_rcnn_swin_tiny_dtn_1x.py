# Former name, kept for existing commands and work dirs.
_base_ = './mask-rcnn_swin-t-p4-w7-dtn_fpn_1x_coco.py'
