# CPU demo: Mask R-CNN with a PVT-Tiny-DTN backbone trained from scratch on the synthetic shapes
# (128 x 128 images, 4 classes), evaluated with COCO bbox and segm AP. Run by `tools/demo.py`.
# Changes against mmdet's Mask R-CNN for the tiny images and the CPU budget: random init, no
# drop-path, 64-channel FPN and heads, anchors of 16-256 px, fewer sampled RoIs and proposals.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    './_base_/synthetic_shapes_instance.py',
    '../_base_/dtn_no_decay.py',
]
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
num_classes = 4
channels = 64
model = dict(
    backbone=dict(
        _delete_=True,
        type='PyramidVisionTransformerDTN',
        pretrain_img_size=128,
        num_layers=[2, 2, 2, 2],
        drop_path_rate=0.0,
        init_cfg=None),
    neck=dict(in_channels=[64, 128, 320, 512], out_channels=channels),
    rpn_head=dict(
        in_channels=channels,
        feat_channels=channels,
        anchor_generator=dict(scales=[4])),
    roi_head=dict(
        bbox_roi_extractor=dict(
            out_channels=channels, roi_layer=dict(sampling_ratio=2)),
        bbox_head=dict(in_channels=channels, fc_out_channels=256, num_classes=num_classes),
        mask_roi_extractor=dict(
            out_channels=channels, roi_layer=dict(sampling_ratio=2)),
        mask_head=dict(in_channels=channels, conv_out_channels=channels, num_classes=num_classes)),
    train_cfg=dict(
        rpn_proposal=dict(nms_pre=1000, max_per_img=300),
        rcnn=dict(sampler=dict(num=64))),
    test_cfg=dict(
        rpn=dict(nms_pre=500, max_per_img=300),
        rcnn=dict(max_per_img=20)))
optim_wrapper = dict(paramwise_cfg=dict(custom_keys={{_base_.dtn_no_decay_keys}}))
