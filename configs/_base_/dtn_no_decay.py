# Weight decay of Dynamic Token Normalization's own parameters, shared by every DTN config.
#
# DTN's mixing gates (`mean_gate`, `var_gate`, the logits of lambda in Eq. 5, or with
# dtn_init='layernorm' `mean_gate_distance`, `var_gate_distance`, their distances from LayerNorm)
# and its positional coefficients (`pos_coef`, the a^h of Eq. 6) get no weight decay: decaying them
# would pull lambda towards 0.5 (or 1) and the positional softmax towards uniform attention, i.e.
# towards a fixed normalizer instead of a learnt one. The keys are
# mmdtn.models.layers.DTN_ONLY_PARAMETERS (a config cannot import it; tests/test_configs.py pins
# the two together). DTN's affine `weight` and `bias` are
# treated as the LayerNorm they replace in the LN twin:
#   - PVT / PVTv2 (mmdet's PVT recipe has no paramwise_cfg): they are decayed, like the twin's LN;
#   - Swin (mmdet's and mmseg's Swin recipes set `norm` -> decay_mult=0): the stock key is kept, and
#     since DTN sits at `norm1` / `norm2` it also removes decay from DTN's weight/bias (and gates).
# DTN configs list this file in `_base_` and use `dtn_no_decay_keys` as optim_wrapper's
# paramwise_cfg.custom_keys; mmengine merges them with the twin's own custom_keys.
dtn_no_decay_keys = dict(
    mean_gate=dict(decay_mult=0.),
    var_gate=dict(decay_mult=0.),
    mean_gate_distance=dict(decay_mult=0.),
    var_gate_distance=dict(decay_mult=0.),
    pos_coef=dict(decay_mult=0.))
