"""The ViT configs: UperNet ViT-B / DeiT-S on ADE20K (configs/vit/) and ViT-T*/S*/B* on ImageNet
(configs/imagenet/vit-*), each DTN config its LN twin plus DTN; they parse and build, carry their
recipes, and a tiny UperNet ViT-DTN trains and reports mIoU through tools/train.py and test.py."""
import copy
import os.path as osp
import re
import sys

import pytest
from mmengine.config import Config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope

import mmdtn  # noqa: F401
from mmdtn.models.layers import DTN_ONLY_PARAMETERS
from test_train_tools import SEG_OVERRIDES, TEST, TRAIN, assert_ok, run
from tiny_datasets import CONFIGS, make_seg, write_config

SEG = ['vit/vit_vit-b16-{norm}_mln_upernet_8xb2-160k_ade20k-512x512.py',
       'vit/vit_deit-s16-{norm}_upernet_8xb2-80k_ade20k-512x512.py']
CLS = [f'imagenet/vit-{size}-star-{{norm}}_4xb256_in1k.py' for size in 'tsb']
#: (embedding width, attention heads = DTN heads) of ViT-T*, S*, B* (the authors' Table 1)
STARRED = {'t': (192, 4), 's': (384, 6), 'b': (768, 16)}


def without_scopes(x):
    """A config dict without the ``_scope_`` keys mmengine adds to what it inherits from a
    package."""
    if isinstance(x, dict):
        return {k: without_scopes(v) for k, v in x.items() if k != '_scope_'}
    if isinstance(x, (list, tuple)):
        return type(x)(without_scopes(v) for v in x)
    return x


def _path(name, norm):
    return osp.join(CONFIGS, name.format(norm=norm))


def _registry(scope):
    init_default_scope(scope)
    if scope == 'mmseg':
        from mmseg.registry import MODELS
    else:
        from mmpretrain.registry import MODELS
    return MODELS


def _build(cfg):
    model = _registry(cfg.default_scope).build(copy.deepcopy(cfg.model))
    wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    decay = {id(p): g['weight_decay'] for g in wrapper.optimizer.param_groups for p in g['params']}
    return model, {n: decay[id(p)] for n, p in model.named_parameters()}


def check_twins(name):
    """The DTN config of ``name`` is its LN twin plus DTN; returns its backbone and config."""
    dtn_cfg, ln_cfg = Config.fromfile(_path(name, 'dtn')), Config.fromfile(_path(name, 'ln'))
    dtn, ln = dtn_cfg.to_dict(), ln_cfg.to_dict()
    assert dtn_cfg.custom_imports == dict(imports=['mmdtn'], allow_failed_imports=False)
    assert ln['model']['backbone'].pop('type').split('.')[-1] + 'DTN' == \
        dtn['model']['backbone'].pop('type') == 'VisionTransformerDTN'
    assert dtn['model']['backbone'].pop('dtn_init') == 'paper'
    keys = dtn['optim_wrapper']['paramwise_cfg']['custom_keys']
    assert all(keys.pop(k) == dict(decay_mult=0.) for k in DTN_ONLY_PARAMETERS)
    dtn.pop('dtn_no_decay_keys')
    assert dtn == ln

    dtn_model, dtn_decay = _build(dtn_cfg)
    ln_model, ln_decay = _build(ln_cfg)
    backbone = dtn_model.backbone
    assert [s is not None for s in backbone.dtn_settings] == [True] * 10 + [False] * 2
    # DTN's gates and positional coefficients are not decayed; everything the twins share
    # (DTN's weight and bias included: the twin's LayerNorm's) is decayed alike.
    assert all(d == 0 for n, d in dtn_decay.items() if n.rsplit('.', 1)[-1] in DTN_ONLY_PARAMETERS)
    assert {n: d for n, d in dtn_decay.items() if n in ln_decay} == ln_decay
    return backbone, dtn_cfg


@pytest.mark.parametrize('size', 'tsb')
def test_imagenet_configs_are_the_deit_recipe_with_the_starred_models(size):
    backbone, cfg = check_twins(CLS['tsb'.index(size)])
    width, heads = STARRED[size]
    attention = backbone.layers[0].attn.attn
    assert (attention.embed_dim, attention.num_heads) == (width, heads)
    assert backbone.dtn_settings[0].num_heads == heads and backbone.dtn_settings[0].pool_size == 1
    opt = cfg.optim_wrapper.optimizer
    assert opt.type == 'AdamW' and opt.lr == 5e-4 * 1024 / 512 and opt.weight_decay == 0.05
    assert cfg.train_cfg.max_epochs == 300 and cfg.train_dataloader.batch_size == 256
    assert cfg.auto_scale_lr.base_batch_size == 1024
    assert [a['type'] for a in cfg.model.train_cfg.augments] == ['Mixup', 'CutMix']
    assert cfg.model.head.loss.label_smooth_val == 0.1
    steps = [t['type'] for t in cfg.train_pipeline]
    assert 'RandAugment' in steps and 'RandomErasing' in steps
    assert cfg.model.backbone.output_cls_token and cfg.model.head.type == \
        'VisionTransformerClsHead'


@pytest.mark.parametrize('name,heads', [(SEG[0], 16), (SEG[1], 6)])
def test_segmentation_configs_are_mmsegs(name, heads):
    backbone, cfg = check_twins(name)
    mmseg_cfg = Config.fromfile(_path(name, 'ln')).to_dict()
    mmseg_cfg.pop('custom_imports')
    import mmseg
    stock = Config.fromfile(osp.join(osp.dirname(mmseg.__file__), '.mim', 'configs',
                                     name.format(norm='').replace('-_', '_'))).to_dict()
    assert without_scopes(mmseg_cfg) == stock  # mmseg's config, unchanged
    assert backbone.dtn_settings[0].num_heads == heads and backbone.with_cls_token


UPERNET_MODEL = """dict(
    pretrained=None, data_preprocessor=dict(size=crop_size),
    backbone=dict(img_size=crop_size, embed_dims=64, num_heads=4, num_layers=4,
                  out_indices=(0, 1, 2, 3), dtn_layers=2, drop_path_rate=0.0),
    decode_head=dict(num_classes=3, in_channels=[64] * 4, channels=32),
    auxiliary_head=dict(num_classes=3, in_channels=64, channels=16))
"""


def test_upernet_vit_dtn_trains_then_reports_miou(tmp_path):
    root = str(tmp_path / 'seg')
    make_seg(root)
    cfg = write_config(tmp_path / 'upernet.py', SEG[1].format(norm='dtn'),
                       SEG_OVERRIDES.format(root=root), UPERNET_MODEL)
    work = tmp_path / 'work'
    assert_ok(*run([sys.executable, TRAIN, cfg, '--work-dir', work], tmp_path))
    rc, out = run([sys.executable, TEST, cfg, work / 'iter_3.pth', '--work-dir', tmp_path / 'test'],
                  tmp_path)
    assert rc == 0, out[-4000:]
    assert 'per class results:' in out
    miou = float(re.search(r'mIoU: ([0-9.]+)', out).group(1))
    assert 0 <= miou <= 100
