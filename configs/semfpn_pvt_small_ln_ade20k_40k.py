# Former name, kept for existing commands and work dirs.
_base_ = './fpn_pvt-s-ln_8xb4-40k_ade20k-512x512.py'
