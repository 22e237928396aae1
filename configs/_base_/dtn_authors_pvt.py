# The DTN-PVT-Tiny/Small ImageNet models of the authors' reference code (Shao et al., ICLR 2022) as
# mmdet backbones, so that the backbone computes what the authors' model computes:
#   - attention heads (4, 4, 5, 8) at the standard widths 64 x num_heads = (64, 128, 320, 512);
#   - DTN as the reference code computes it (dtn_reference_compat=True: its statistics, DTN eps
#     1e-5, its checkpoint format converted on loading) in the default places (stages 1-3, DTN
#     heads 4, 4, 5, pooling 4, 2, 1);
#   - every LayerNorm with the same eps 1e-5 (norm_cfg; mmdet's PVT default is 1e-6): change it here
#     if your checkpoint's LayerNorms used another.
# The checkpoints (the reference code's ImageNet training output, official PVT key names) are read
# from checkpoints/dtn_authors/; loading drops the classifier head and names every other key it did
# not use. Used as `model = dict(backbone={{_base_.dtn_authors_pvt_tiny}})` (or _small).
dtn_authors_pvt_tiny = dict(
    attention_heads=[4, 4, 5, 8],
    dtn_reference_compat=True,
    norm_cfg=dict(type='LN', eps=1e-5),
    convert_weights=True,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/dtn_authors/dtn_pvt_tiny.pth'))
dtn_authors_pvt_small = dict(
    dtn_authors_pvt_tiny,
    init_cfg=dict(type='Pretrained', checkpoint='checkpoints/dtn_authors/dtn_pvt_small.pth'))
