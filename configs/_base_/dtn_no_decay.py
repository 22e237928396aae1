# Weight decay of Dynamic Token Normalization's own parameters, shared by every DTN config.
#
# Decision: DTN's mixing gates (`mean_gate`, `var_gate`, the logits of lambda in Eq. 4) and its
# positional coefficients (`pos_coef`, the a^h of Eq. 6) get no weight decay in every DTN config;
# decaying them would pull lambda towards 0.5 and the positional softmax towards uniform
# attention, i.e. towards a fixed normaliser instead of a learnt one.
# DTN's affine `weight` and `bias` are treated exactly as the LayerNorm they replace in the LN twin:
#   - PVT / PVTv2 (mmdet's PVT recipe has no paramwise_cfg): they are decayed, like the twin's LN;
#   - Swin (mmdet's and mmseg's Swin recipes set `norm` -> decay_mult=0): the stock key is kept, and
#     since DTN sits at `norm1` / `norm2` it also removes decay from DTN's weight/bias (and gates).
# So the DTN and LN twins differ only in the normaliser, not in the optimiser's treatment of it.
# DTN configs list this file in `_base_` and use `dtn_no_decay_keys` as optim_wrapper's
# paramwise_cfg.custom_keys; mmengine merges them with the twin's own custom_keys.
dtn_no_decay_keys = dict(
    mean_gate=dict(decay_mult=0.),
    var_gate=dict(decay_mult=0.),
    pos_coef=dict(decay_mult=0.))
