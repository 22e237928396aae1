"""The authors' DTN-PVT ImageNet checkpoints load into the configs' backbone, which then computes
what the authors' model computes.

The checkpoint is written in the authors' format (official PVT v1 key names, DTN layers in the
reference code's names) from random parameters; the expected stage outputs come from an
independent implementation of their PVT stages written here, on top of the reference code's DTN
of ``test_reference_compat.reference_forward`` (square grids, as the reference code).
"""
import copy
import logging
import os.path as osp

import pytest
import torch
import torch.nn.functional as F
from mmdet.registry import MODELS
from mmengine.config import Config
from mmengine.registry import init_default_scope

import mmdtn  # noqa: F401
from mmdtn.models.backbones.pretrained import load_pretrained
from mmdtn.models.layers import DynamicTokenNorm
from test_reference_compat import reference_forward
from tiny_datasets import CONFIGS

AUTHORS = osp.join(CONFIGS, 'authors')
TINY = osp.join(AUTHORS, 'retinanet_pvt-t-dtn-authors_fpn_1x_coco.py')

# The authors' DTN-PVT-Tiny: PVT-Tiny's widths with attention heads (4, 4, 5, 8); DTN (4, 4, 5
# heads, pooling 4, 2, 1) in stages 1-3; every eps 1e-5.
WIDTHS, HEADS, DEPTHS = (64, 128, 320, 512), (4, 4, 5, 8), (2, 2, 2, 2)
SR_RATIOS, MLP_RATIOS, PATCHES = (8, 4, 2, 1), (8, 8, 4, 4), (4, 2, 2, 2)
DTN_HEADS, DTN_POOLS, EPS = (4, 4, 5), (4, 2, 1), 1e-5
SIZE = 224  # the checkpoint's position embeddings are those of 224 x 224 images


def authors_checkpoint(seed=0):
    """Random float64 weights under the names of the authors' DTN-PVT-Tiny checkpoint."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    sd = {'cls_token': rnd(1, 1, WIDTHS[-1], std=0.02), 'norm.weight': 1 + rnd(512, std=0.3),
          'norm.bias': rnd(512, std=0.2), 'head.weight': rnd(1000, 512, std=0.02),
          'head.bias': rnd(1000, std=0.02)}
    c_in = 3
    for i, (c, depth, sr, mlp, p) in enumerate(zip(WIDTHS, DEPTHS, SR_RATIOS, MLP_RATIOS, PATCHES)):
        s, cells = i + 1, (SIZE // (4 * 2**i))**2
        sd[f'patch_embed{s}.proj.weight'] = rnd(c, c_in, p, p, std=(c_in * p * p)**-0.5)
        sd[f'patch_embed{s}.proj.bias'] = rnd(c, std=0.1)
        sd[f'pos_embed{s}'] = rnd(1, cells + (s == 4), c, std=0.5)  # stage 4: + class token
        norms = [f'patch_embed{s}.norm'] + [
            f'block{s}.{j}.{n}' for j in range(depth)
            for n in ('norm1', 'norm2', 'attn.norm')[:2 + (sr > 1)]]
        for key in norms:
            sd[key + '.weight'], sd[key + '.bias'] = 1 + rnd(c, std=0.3), rnd(c, std=0.2)
        for j in range(depth):
            b = f'block{s}.{j}.'
            for name, (out, inp) in {'attn.q': (c, c), 'attn.kv': (2 * c, c), 'attn.proj': (c, c),
                                     'mlp.fc1': (mlp * c, c), 'mlp.fc2': (c, mlp * c)}.items():
                sd[b + name + '.weight'], sd[b + name + '.bias'] = rnd(out, inp, std=inp**-0.5), \
                    rnd(out, std=0.1)
            if sr > 1:
                sd[b + 'attn.sr.weight'] = rnd(c, c, sr, sr, std=(c * sr * sr)**-0.5)
                sd[b + 'attn.sr.bias'] = rnd(c, std=0.1)
            if i < 3:  # the reference code's DTN layer
                h = DTN_HEADS[i]
                for n in ('norm1', 'norm2'):
                    proj = rnd(h, 3, std=0.5)
                    proj[:, 2] = -proj[:, 2].abs() - 0.1
                    sd.update({b + n + '.mean_norm_weight': rnd(h, std=1.0),
                               b + n + '.var_norm_weight': rnd(h, std=1.0),
                               b + n + '.pos_proj.weight': proj,
                               b + n + '.pos_proj.bias': rnd(h, std=1.0)})
        c_in = c
    return sd


def layer_norm(x, sd, key):
    return F.layer_norm(x, x.shape[-1:], sd[key + '.weight'], sd[key + '.bias'], EPS)


def authors_norm(x, sd, key, stage, side):
    if stage < 3:
        layer = {k[len(key) + 1:]: v for k, v in sd.items() if k.startswith(key + '.')}
        return reference_forward(x, layer, DTN_HEADS[stage], side, DTN_POOLS[stage], EPS)
    return layer_norm(x, sd, key)


def authors_attention(x, sd, key, heads, sr, side):
    """PVT's spatial-reduction attention: keys and values from the sr x sr strided, normed map."""
    B, N, C = x.shape
    q = F.linear(x, sd[key + '.q.weight'], sd[key + '.q.bias'])
    q = q.reshape(B, N, heads, C // heads).transpose(1, 2)
    if sr > 1:
        img = x.transpose(1, 2).reshape(B, C, side, side)
        x = F.conv2d(img, sd[key + '.sr.weight'], sd[key + '.sr.bias'], stride=sr)
        x = layer_norm(x.flatten(2).transpose(1, 2), sd, key + '.norm')
    kv = F.linear(x, sd[key + '.kv.weight'], sd[key + '.kv.bias'])
    k, v = kv.reshape(B, -1, 2, heads, C // heads).permute(2, 0, 3, 1, 4)
    attn = (q @ k.transpose(-2, -1) * (C // heads)**-0.5).softmax(dim=-1)
    out = (attn @ v).transpose(1, 2).reshape(B, N, C)
    return F.linear(out, sd[key + '.proj.weight'], sd[key + '.proj.bias'])


def authors_pvt(img, sd):
    """The four stage outputs (B, C, H, W) of the authors' DTN-PVT as a detection backbone."""
    outs, x = [], img
    for i in range(4):
        s = i + 1
        x = F.conv2d(x, sd[f'patch_embed{s}.proj.weight'], sd[f'patch_embed{s}.proj.bias'],
                     stride=PATCHES[i])
        B, side = x.shape[0], x.shape[-1]
        x = layer_norm(x.flatten(2).transpose(1, 2), sd, f'patch_embed{s}.norm')
        pos = sd[f'pos_embed{s}']
        x = x + (pos[:, 1:] if s == 4 else pos)  # a backbone has no class token
        for j in range(DEPTHS[i]):
            b = f'block{s}.{j}.'
            x = x + authors_attention(authors_norm(x, sd, b + 'norm1', i, side), sd, b + 'attn',
                                      HEADS[i], SR_RATIOS[i], side)
            h = F.gelu(F.linear(authors_norm(x, sd, b + 'norm2', i, side),
                                sd[b + 'mlp.fc1.weight'], sd[b + 'mlp.fc1.bias']))
            x = x + F.linear(h, sd[b + 'mlp.fc2.weight'], sd[b + 'mlp.fc2.bias'])
        x = x.transpose(1, 2).reshape(B, -1, side, side)
        outs.append(x)
    return outs


def config_backbone(path, checkpoint):
    backbone = copy.deepcopy(Config.fromfile(path).model.backbone)
    backbone.init_cfg.checkpoint = str(checkpoint)
    return backbone


@pytest.fixture(scope='module')
def checkpoint(tmp_path_factory):
    sd = authors_checkpoint()
    path = tmp_path_factory.mktemp('authors') / 'dtn_pvt_tiny.pth'
    torch.save({'model': sd}, path)
    return sd, path


def test_authors_checkpoint_computes_the_authors_stage_outputs(checkpoint, caplog):
    sd, path = checkpoint
    init_default_scope('mmdet')
    backbone = MODELS.build(config_backbone(TINY, path)).double()  # float64 before loading
    norms = [blocks[1].norm1 for _, blocks, _ in backbone.layers]
    assert [(n.num_heads, n.pool_size, n.eps, n.reference_compat) for n in norms[:3]] == \
        [(h, p, EPS, True) for h, p in zip(DTN_HEADS, DTN_POOLS)]
    assert norms[3].eps == EPS and backbone.layers[0][0].norm.eps == EPS
    assert backbone.attention_heads == list(HEADS)
    logger = logging.getLogger('test_authors_checkpoints')
    with caplog.at_level(logging.INFO, logger=logger.name):
        report = load_pretrained(backbone, backbone.init_cfg,
                                 backbone.checkpoint_to_mmdet, logger)
    assert not report.missing and not report.unused and not report.dtn_initialized
    assert report.classifier_head == ['head.weight', 'head.bias']
    assert "converting 12 DTN layers from the reference code's format" in caplog.text
    assert 'dropped the classifier head of the checkpoint: head.weight, head.bias' in caplog.text

    img = torch.randn(1, 3, SIZE, SIZE, dtype=torch.float64)
    with torch.no_grad():
        ours = backbone.eval()(img)
        expected = authors_pvt(img, sd)
    for stage, (a, b) in enumerate(zip(ours, expected)):
        assert a.shape == b.shape
        assert (a - b).abs().max() <= 1e-9 * b.abs().max(), f'stage {stage + 1}'

    # the stock attention heads (1, 2, 5, 8 at these widths) compute something else (stage 1)
    stock_heads = MODELS.build({**config_backbone(TINY, path), 'attention_heads': None}).double()
    stock_heads.init_weights()
    patch_embed, blocks, _ = stock_heads.eval().layers[0]
    with torch.no_grad():
        x, hw_shape = patch_embed(img)
        for block in blocks:
            x = block(x, hw_shape)  # the position embedding, then the encoder layers
    assert (x.transpose(1, 2).reshape(expected[0].shape) - expected[0]).abs().max() > \
        1e-2 * expected[0].abs().max()


@pytest.mark.parametrize('model', ['retinanet', 'mask-rcnn'])
@pytest.mark.parametrize('size', ['tiny', 'small'])
def test_authors_configs(model, size):
    """Each config is its DTN config (``_base_``) with the authors' backbone and checkpoint."""
    path = osp.join(AUTHORS, f'{model}_pvt-{size[0]}-dtn-authors_fpn_1x_coco.py')
    backbone = Config.fromfile(path).model.backbone
    assert backbone == dict(
        type='PyramidVisionTransformerDTN', dtn_init='paper',
        num_layers=dict(tiny=[2, 2, 2, 2], small=[3, 4, 6, 3])[size],
        attention_heads=list(HEADS), dtn_reference_compat=True,
        norm_cfg=dict(type='LN', eps=EPS), convert_weights=True,
        init_cfg=dict(type='Pretrained', checkpoint=f'checkpoints/dtn_authors/dtn_pvt_{size}.pth'))


def test_attention_heads_are_checked_per_stage():
    from mmdtn.models.backbones import PyramidVisionTransformerDTN
    with pytest.raises(ValueError, match='stage 3 has 320 channels, which attention_heads=3'):
        PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1], attention_heads=[4, 4, 3, 8])
    with pytest.raises(ValueError, match=r'one value per stage \(4 stages\)'):
        PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1], attention_heads=[4, 4])
    model = PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1], attention_heads=4)
    layer = model.layers[2][1][1]  # [0]: the position embedding
    assert layer.attn.attn.num_heads == 4 and layer.attn.attn.head_dim == 80
    assert isinstance(layer.norm1, DynamicTokenNorm) and layer.norm1.num_heads == 4
