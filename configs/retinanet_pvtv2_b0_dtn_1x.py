# Former name, kept for existing commands and work dirs.
_base_ = './retinanet_pvtv2-b0-dtn_fpn_1x_coco.py'
