# UperNet, Swin-T with LayerNorm (stock backbone), ADE20K, 512 x 512 crops, 160k iterations. LN
# twin of upernet_swin_tiny_dtn_ade20k_160k.py; mmseg's own Swin recipe, unchanged: AdamW lr 6e-5,
# betas (0.9, 0.999), weight decay 0.01 (none on norms and position tables), 1500 iterations of
# linear warm-up then poly (power 1), 8 GPUs x 2 images, mmseg's ImageNet-1k Swin-T weights.
_base_ = 'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
