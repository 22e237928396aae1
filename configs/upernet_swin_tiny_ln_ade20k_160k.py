# Former name, kept for existing commands and work dirs.
_base_ = './swin-tiny-patch4-window7-in1k-pre-ln_upernet_8xb2-160k_ade20k-512x512.py'
