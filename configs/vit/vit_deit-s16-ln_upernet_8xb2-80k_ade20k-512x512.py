# UperNet, DeiT-S/16 with LayerNorm (mmseg's VisionTransformer), ADE20K: mmseg's config, unchanged.
_base_ = 'mmseg::vit/vit_deit-s16_upernet_8xb2-80k_ade20k-512x512.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
