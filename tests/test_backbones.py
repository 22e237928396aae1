"""The DTN backbones: registry builds (mmdet, mmseg and mmpretrain scopes), drop-in outputs, norm
placement, gradients, checkpointing."""
import copy
import dataclasses
from importlib import import_module

import pytest
import torch
import torch.nn as nn
from mmdet.models.backbones import (PyramidVisionTransformer, PyramidVisionTransformerV2,
                                    SwinTransformer)
from mmdet.models.backbones.pvt import SpatialReductionAttention
from mmdet.models.layers import PatchEmbed, PatchMerging
from mmengine.config import Config
from mmengine.registry import DefaultScope

import mmdtn  # noqa: F401
from mmdtn.models.backbones import (PyramidVisionTransformerDTN, PyramidVisionTransformerV2DTN,
                                    SwinTransformerDTN)
from mmdtn.models.backbones.dtn_blocks import DTNStageSettings, dtn_stage_settings
from mmdtn.models.layers import DynamicTokenNorm
from mmdtn.models.layers.dual_patchnorm import PatchNormConv2d

# Small but legitimate variants: PVT-Tiny and PVTv2-b0 widths with one layer per stage; Swin-T's
# heads at half its width, two blocks (a plain and a shifted-window block) per stage.
CASES = {
    'pvt': (PyramidVisionTransformer, PyramidVisionTransformerDTN, dict(num_layers=[1, 1, 1, 1])),
    'pvtv2': (PyramidVisionTransformerV2, PyramidVisionTransformerV2DTN,
              dict(embed_dims=32, num_layers=[1, 1, 1, 1])),
    'swin': (SwinTransformer, SwinTransformerDTN, dict(embed_dims=48, depths=(2, 2, 2, 2))),
}


def build_pair(name, **dtn_kwargs):
    stock_cls, dtn_cls, kwargs = CASES[name]
    torch.manual_seed(0)
    stock = stock_cls(**kwargs)
    torch.manual_seed(0)
    dtn = dtn_cls(**kwargs, **dtn_kwargs)
    return stock, dtn


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg', 'mmpretrain'])
@pytest.mark.parametrize('name', list(CASES))
def test_build_from_config_in_every_scope_and_outputs_match_stock(tmp_path, scope, name):
    stock_cls, dtn_cls, kwargs = CASES[name]
    cfg_file = tmp_path / 'backbone_cfg.py'
    cfg_file.write_text(
        "custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)\n"
        f"default_scope = '{scope}'\n"
        f'model = dict(type={dtn_cls.__name__!r}, dual_patchnorm=True, **{kwargs!r})\n')
    cfg = Config.fromfile(str(cfg_file))
    MODELS = import_module(f'{scope}.registry').MODELS
    with DefaultScope.overwrite_default_scope(scope):
        model = MODELS.build(cfg.model)
    assert type(model) is dtn_cls
    model.init_weights()
    stock = stock_cls(**kwargs)
    stock.eval()  # mmdet's Swin.train() returns None
    model.eval()
    for size in [(64, 64), (65, 97)]:
        x = torch.randn(1, 3, *size)
        with torch.no_grad():
            ours, ref = model(x), stock(x)
        assert [o.shape for o in ours] == [r.shape for r in ref]
        assert all(torch.isfinite(o).all() for o in ours)


@pytest.mark.parametrize('name', list(CASES))
def test_dtn_only_in_block_norms_and_parameter_names_kept(name):
    stock, dtn = build_pair(name)
    dtn_names = {n for n, m in dtn.named_modules() if isinstance(m, DynamicTokenNorm)}
    assert dtn_names and all(n.rsplit('.', 1)[1] in ('norm1', 'norm2') for n in dtn_names)
    for n, m in dtn.named_modules():
        if isinstance(m, (PatchEmbed, PatchMerging, SpatialReductionAttention)):
            assert not any(isinstance(c, DynamicTokenNorm) for c in m.modules()), n
    # everything of the stock model is there under the same name and shape
    stock_shapes = {k: v.shape for k, v in stock.state_dict().items()}
    dtn_shapes = {k: v.shape for k, v in dtn.state_dict().items()}
    assert all(dtn_shapes[k] == s for k, s in stock_shapes.items())
    extra = set(dtn_shapes) - set(stock_shapes)
    assert all(k.rsplit('.', 1)[1] in ('mean_gate', 'var_gate', 'pos_coef') for k in extra)
    assert len(extra) == 3 * len(dtn_names)


def test_default_stage_settings_follow_the_paper():
    pvt = PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1])
    norms = [blocks[-1].norm1 for _, blocks, _ in pvt.layers]
    assert [type(n) for n in norms] == [DynamicTokenNorm] * 3 + [nn.LayerNorm]
    assert [(n.num_heads, n.pool_size, n.eps) for n in norms[:3]] == [(4, 4, 1e-6), (4, 2, 1e-6),
                                                                      (5, 1, 1e-6)]
    swin = SwinTransformerDTN(embed_dims=48, depths=(2, 2, 2, 2))
    norms = [stage.blocks[1].norm2 for stage in swin.stages]
    assert [(n.num_heads, n.pool_size, n.eps) for n in norms] == [(3, 4, 1e-5), (6, 2, 1e-5),
                                                                  (12, 1, 1e-5), (24, 1, 1e-5)]
    custom = SwinTransformerDTN(embed_dims=48, depths=(2, 2, 2, 2),
                                dtn_stages=[True, False, True, False], dtn_heads=4,
                                dtn_pool_sizes=2, dtn_init=['paper', 'paper', 'layernorm', 'paper'])
    norms = [stage.blocks[0].norm1 for stage in custom.stages]
    assert isinstance(norms[1], nn.LayerNorm) and isinstance(norms[3], nn.LayerNorm)
    assert (norms[2].num_heads, norms[2].pool_size, norms[2].init) == (4, 2, 'layernorm')


@pytest.mark.parametrize('kwargs, match', [
    (dict(dtn_heads=[4, 4]), r'dtn_heads must be .* one value per stage \(4 stages\)'),
    (dict(dtn_stages=[0, 1, 1, 0]), 'bools'),
    (dict(dtn_pool_sizes=0), 'DTN of stage 1: 64 channels with dtn_heads=4, dtn_pool_sizes=0'),
    (dict(dtn_init='ln'), "DTN of stage 1: .*dtn_init='ln'"),
    (dict(dtn_heads=3), 'DTN of stage 1: 64 channels with dtn_heads=3'),
])
def test_bad_settings_are_named(kwargs, match):
    """The layer checks the values; the backbone names the argument that set them."""
    with pytest.raises(ValueError, match=match):
        PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1], **kwargs)


def test_stage_settings_helper():
    s = dtn_stage_settings(2, True, [2, 4], 1, 'layernorm')
    assert s == [DTNStageSettings(2, 1, 'layernorm'), DTNStageSettings(4, 1, 'layernorm')]
    s = dtn_stage_settings(2, [False, True], 3, [4, 2], 'paper', dtn_reference_compat=True)
    assert s == [None, DTNStageSettings(num_heads=3, pool_size=2, init='paper',
                                        reference_compat=True)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        s[1].num_heads = 4


# mmdet's arguments for other architectures than the default: the DTN defaults follow them.
STOCK_VARIANTS = {
    'pvt heads [1, 2, 4, 8]': (PyramidVisionTransformer, PyramidVisionTransformerDTN,
                               dict(num_layers=[1, 1, 1, 1], num_heads=[1, 2, 4, 8]),
                               [(4, 4), (4, 2), (4, 1), None]),
    'pvtv2 heads [1, 2, 4, 8]': (PyramidVisionTransformerV2, PyramidVisionTransformerV2DTN,
                                 dict(embed_dims=32, num_layers=[1, 1, 1, 1],
                                      num_heads=[1, 2, 4, 8]),
                                 [(4, 4), (4, 2), (4, 1), None]),
    'pvt 3 stages': (PyramidVisionTransformer, PyramidVisionTransformerDTN,
                     dict(num_stages=3, num_layers=[1, 1, 1], num_heads=[1, 2, 5],
                          patch_sizes=[4, 2, 2], strides=[4, 2, 2], sr_ratios=[8, 4, 2],
                          out_indices=(0, 1, 2)),
                     [(4, 4), (4, 2), (5, 1)]),
    'pvt 5 stages, odd widths': (PyramidVisionTransformer, PyramidVisionTransformerDTN,
                                 dict(embed_dims=6, num_stages=5, num_layers=[1] * 5,
                                      num_heads=[1, 2, 3, 4, 6], patch_sizes=[4, 2, 2, 2, 1],
                                      strides=[4, 2, 2, 2, 1], paddings=[0] * 5,
                                      sr_ratios=[8, 4, 2, 1, 1],
                                      mlp_ratios=[2] * 5, out_indices=(0, 1, 2, 3, 4)),
                                 [(1, 4), (4, 2), (3, 1), None, None]),
    'swin 3 stages': (SwinTransformer, SwinTransformerDTN,
                      dict(embed_dims=48, depths=(2, 2, 2), num_heads=(3, 6, 12),
                           strides=(4, 2, 2), out_indices=(0, 1, 2)),
                      [(3, 4), (6, 2), (12, 1)]),
}


@pytest.mark.parametrize('variant', list(STOCK_VARIANTS))
def test_drop_in_for_other_stock_architectures(variant):
    stock_cls, dtn_cls, kwargs, expected = STOCK_VARIANTS[variant]
    torch.manual_seed(0)
    stock = stock_cls(**kwargs)
    dtn = dtn_cls(**kwargs)
    found = []
    for settings in dtn.dtn_settings:
        found.append(None if settings is None else (settings.num_heads, settings.pool_size))
    assert found == expected
    stock.eval()
    dtn.eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        assert [o.shape for o in dtn(x)] == [o.shape for o in stock(x)]


@pytest.mark.parametrize('name', list(CASES))
def test_every_dtn_parameter_receives_a_gradient(name):
    _, model = build_pair(name, dual_patchnorm=True, drop_path_rate=0.)  # no dropped branches
    model.init_weights()
    model.train()
    outs = model(torch.randn(2, 3, 64, 96))
    sum(o.square().mean() for o in outs).backward()
    dtn_params = [(n, p) for n, p in model.named_parameters()
                  if any(n.endswith(s) for s in ('mean_gate', 'var_gate', 'pos_coef'))
                  or '.norm1.' in n or '.norm2.' in n or 'patch_norm' in n]
    assert dtn_params
    for n, p in dtn_params:
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
        assert p.grad.abs().sum() > 0, n


@pytest.mark.parametrize('name', list(CASES))
def test_with_cp_gives_same_outputs_and_gradients(name):
    _, plain = build_pair(name, drop_path_rate=0.)  # deterministic in training mode
    plain.init_weights()
    ckpt = copy.deepcopy(plain)
    for m in ckpt.modules():
        if hasattr(m, 'with_cp'):
            m.with_cp = True
    if name.startswith('pvt'):  # the constructor argument sets it on every encoder layer
        assert PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1],
                                           with_cp=True).layers[0][1][1].with_cp
    x = torch.randn(1, 3, 33, 47)
    grads = []
    for model in (plain, ckpt):
        model.train()
        outs = model(x)
        sum(o.sum() for o in outs).backward()
        grads.append(([o.detach() for o in outs],
                      {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (out_a, g_a), (out_b, g_b) = grads
    for a, b in zip(out_a, out_b):
        torch.testing.assert_close(a, b)
    assert g_a.keys() == g_b.keys()
    for n in g_a:  # summation order varies between runs: tolerance relative to the scale
        scale = g_a[n].abs().max().item()
        torch.testing.assert_close(g_a[n], g_b[n], rtol=1e-4, atol=1e-5 + 1e-5 * scale)


@pytest.mark.parametrize('name', list(CASES))
def test_odd_sizes_batches_and_autocast(name):
    stock, model = build_pair(name, dual_patchnorm=True)
    model.init_weights()
    model.eval()
    stock.eval()
    for batch, size in [(1, (65, 97)), (3, (33, 47))]:
        x = torch.randn(batch, 3, *size)
        with torch.no_grad():
            outs = model(x)
            ref = stock(x)
        assert [o.shape for o in outs] == [r.shape for r in ref]
        assert all(torch.isfinite(o).all() for o in outs)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16):
        outs = model(torch.randn(2, 3, 32, 48))
    assert all(torch.isfinite(o.float()).all() for o in outs)


def test_dual_patchnorm_on_and_off():
    for cls, kwargs, embed in [
        (PyramidVisionTransformerV2DTN, dict(embed_dims=32, num_layers=[1, 1, 1, 1]),
         lambda m: m.layers[0][0]),
        (PyramidVisionTransformerDTN, dict(num_layers=[1, 1, 1, 1]), lambda m: m.layers[0][0]),
        (SwinTransformerDTN, dict(embed_dims=48, depths=(2, 2, 2, 2)), lambda m: m.patch_embed),
    ]:
        off, on = cls(**kwargs), cls(**kwargs, dual_patchnorm=True)
        assert type(embed(off).projection) is nn.Conv2d
        proj = embed(on).projection
        assert isinstance(proj, PatchNormConv2d) and isinstance(embed(on).norm, nn.LayerNorm)
        assert proj.patch_norm.normalized_shape[0] == 3 * proj.kernel_size[0] ** 2
        # only the stage-1 patch embedding gets the patch LayerNorm
        assert sum(isinstance(m, PatchNormConv2d) for m in on.modules()) == 1
    with pytest.raises(ValueError, match='patch_norm=False'):
        SwinTransformerDTN(embed_dims=48, depths=(2, 2, 2, 2), patch_norm=False,
                           dual_patchnorm=True)


@pytest.mark.parametrize('recipe', ['pvt', 'swin'])
def test_proposed_paramwise_cfg_removes_decay_from_gates_and_positions_only(recipe):
    """PVT recipe (no paramwise_cfg): only DTN's gates and a^h lose weight decay; Swin recipe
    ('norm' -> decay_mult=0): DTN's weight/bias lose it too, like the LayerNorms they replace."""
    from mmengine.optim import DefaultOptimWrapperConstructor
    custom_keys = dict(mean_gate=dict(decay_mult=0.), var_gate=dict(decay_mult=0.),
                       pos_coef=dict(decay_mult=0.))
    if recipe == 'swin':
        custom_keys.update(norm=dict(decay_mult=0.), absolute_pos_embed=dict(decay_mult=0.),
                           relative_position_bias_table=dict(decay_mult=0.))
    detector = nn.Module()
    detector.backbone = (SwinTransformerDTN(embed_dims=24, depths=(2, 2, 2, 2)) if recipe == 'swin'
                         else PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1]))
    constructor = DefaultOptimWrapperConstructor(
        dict(optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.05)),
        paramwise_cfg=dict(custom_keys=custom_keys))
    groups = constructor(detector).optimizer.param_groups
    decay = {id(p): g['weight_decay'] for g in groups for p in g['params']}
    for name, module in detector.named_modules():
        if isinstance(module, DynamicTokenNorm):
            for p in ('mean_gate', 'var_gate', 'pos_coef'):
                assert decay[id(getattr(module, p))] == 0, f'{name}.{p}'
            expected = 0 if recipe == 'swin' else 0.05
            assert decay[id(module.weight)] == decay[id(module.bias)] == expected, name
    assert decay[id(detector.backbone.patch_embed.projection.weight if recipe == 'swin'
                    else detector.backbone.layers[0][0].projection.weight)] == 0.05
