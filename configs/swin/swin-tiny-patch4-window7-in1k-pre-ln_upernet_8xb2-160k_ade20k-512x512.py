# UperNet, Swin-T with LayerNorm (the stock backbone), ADE20K: mmseg's config, unchanged.
_base_ = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
