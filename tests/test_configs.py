"""Every config in configs/ parses, builds its model, and carries the recipe it promises.

DTN configs are checked against their LayerNorm twins: the merged configs are equal except for the
backbone type, ``dtn_init`` and DTN's no-decay keys; the optimizer built from a DTN config gives
DTN's gates and positional coefficients no weight decay and treats DTN's affine parameters as the
twin treats its LayerNorms. The ImageNet configs are mmpretrain's recipes but for the stated
deviations, with the detection configs' backbones. Models are built, never run (pretrained weights
are not downloaded).
"""
import copy
import functools
import inspect
import os
import os.path as osp
from importlib import import_module

import pytest
from mmengine.config import Config
from mmengine.hub import get_config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope

import mmdtn  # noqa: F401
from mmdtn.models.layers import DTN_ONLY_PARAMETERS
from tiny_datasets import CONFIGS, iter_config_files


def _alias_target(path):
    """The config a short name inherits (a file whose one line of code is ``_base_ = './...'``),
    or None."""
    code = [line for line in open(path).read().splitlines() if not line.startswith('#')]
    if len(code) == 1 and code[0].startswith("_base_ = './"):
        return osp.join(osp.dirname(path), code[0][len("_base_ = './"):-1])
    return None


ALL = iter_config_files()
ALIASES = {p: _alias_target(p) for p in ALL if _alias_target(p)}
CONFIGS_PROPER = [p for p in ALL if p not in ALIASES]
#: The model families' folders of detection and segmentation configs (ViT's: test_vit_dtn_configs).
FAMILIES = ('pvt', 'pvtv2', 'swin')
TASK = [p for p in CONFIGS_PROPER if osp.relpath(osp.dirname(p), CONFIGS) in FAMILIES]
DTN = [p for p in TASK if '-dtn_' in osp.basename(p)]
IMAGENET = [p for p in CONFIGS_PROPER if osp.dirname(p) == osp.join(CONFIGS, 'imagenet')]
IMAGENET_DTN = [p for p in IMAGENET if '-dtn_' in osp.basename(p)]
#: ImageNet config stem: (the detection config of the same backbone, mmpretrain's recipe).
IMAGENET_STEMS = {
    'pvt-t': ('retinanet_pvt-t', 'twins/twins-pcpvt-small_8xb128_in1k.py'),
    'pvt-s': ('retinanet_pvt-s', 'twins/twins-pcpvt-small_8xb128_in1k.py'),
    'pvtv2-b0': ('retinanet_pvtv2-b0', 'twins/twins-pcpvt-small_8xb128_in1k.py'),
    'pvtv2-b1': ('retinanet_pvtv2-b1', 'twins/twins-pcpvt-small_8xb128_in1k.py'),
    'pvtv2-b2': ('retinanet_pvtv2-b2', 'twins/twins-pcpvt-small_8xb128_in1k.py'),
    'swin-t-p4-w7': ('retinanet_swin-t-p4-w7', 'swin_transformer/swin-tiny_16xb64_in1k.py'),
}
#: Detection config stem: its family's folder.
DET = {'retinanet_pvt-t': 'pvt', 'retinanet_pvt-s': 'pvt', 'mask-rcnn_pvt-t': 'pvt',
       'mask-rcnn_pvt-s': 'pvt', 'retinanet_swin-t-p4-w7': 'swin',
       'mask-rcnn_swin-t-p4-w7': 'swin', 'retinanet_pvtv2-b0': 'pvtv2',
       'retinanet_pvtv2-b1': 'pvtv2', 'retinanet_pvtv2-b2': 'pvtv2'}
SEG = ['fpn_pvt-t', 'fpn_pvt-s']
UPERNET = 'swin-tiny-patch4-window7-in1k-pre-{norm}_upernet_8xb2-160k_ade20k-512x512.py'
#: The one short name kept at the top of configs/, the name the first commands used, and the
#: config it stands for.
SHORT_NAMES = {'retinanet_pvt_tiny_dtn_1x.py': 'pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py'}
DTN_KEYS = DTN_ONLY_PARAMETERS
PVT_CHECKPOINTS = {'pvt-t': 'pvt_tiny.pth', 'pvt-s': 'pvt_small.pth',
                   'pvtv2-b0': 'pvt_v2_b0.pth', 'pvtv2-b1': 'pvt_v2_b1.pth',
                   'pvtv2-b2': 'pvt_v2_b2.pth'}


@functools.lru_cache(maxsize=None)
def _load(path):
    """Each config is parsed once per session; callers must not modify the result."""
    return Config.fromfile(path)


def _name(path):
    return osp.relpath(path, CONFIGS)


def _det(stem, norm):
    """The path of a COCO detection config: its stem and ``'dtn'`` or ``'ln'``."""
    return osp.join(CONFIGS, DET[stem], f'{stem}-{norm}_fpn_1x_coco.py')


def _seg(stem, norm):
    """The path of a Semantic FPN ADE20K config (all PVT)."""
    return osp.join(CONFIGS, 'pvt', f'{stem}-{norm}_8xb4-40k_ade20k-512x512.py')


def _models_registry(scope):
    init_default_scope(scope)
    return import_module(f'{scope}.registry').MODELS


def test_expected_files_exist():
    names = {_name(p) for p in TASK}
    for norm in ('dtn', 'ln'):
        for stem in DET:
            assert _name(_det(stem, norm)) in names
        for stem in SEG:
            assert _name(_seg(stem, norm)) in names
        assert osp.join('swin', UPERNET.format(norm=norm)) in names
    assert len(TASK) == 2 * (len(DET) + len(SEG) + 1)
    assert {osp.basename(p) for p in IMAGENET} == {
        f'{stem}-{norm}_8xb128_in1k.py' for stem in IMAGENET_STEMS for norm in ('dtn', 'ln')} | {
        f'vit-{size}-star-{norm}_4xb256_in1k.py' for size in 'tsb' for norm in ('dtn', 'ln')}
    assert set(ALIASES) == {osp.join(CONFIGS, n) for n in SHORT_NAMES}
    # nothing but the short name and the folders at the top of configs/
    assert [f for f in sorted(os.listdir(CONFIGS)) if f.endswith('.py')] == sorted(SHORT_NAMES)


@pytest.mark.parametrize('name', SHORT_NAMES)
def test_short_name_is_its_config(name):
    path = osp.join(CONFIGS, name)
    assert ALIASES[path] == osp.join(CONFIGS, SHORT_NAMES[name]) and ALIASES[path] in TASK
    assert _load(path).to_dict() == _load(ALIASES[path]).to_dict()


def test_dtn_no_decay_keys_are_dtns_own_parameters():
    """configs/_base_/dtn_no_decay.py cannot import DTN_ONLY_PARAMETERS: this pins the two."""
    keys = _load(osp.join(CONFIGS, '_base_', 'dtn_no_decay.py')).dtn_no_decay_keys
    assert keys == {name: dict(decay_mult=0.) for name in DTN_ONLY_PARAMETERS}


@pytest.mark.parametrize('path', CONFIGS_PROPER, ids=_name)
def test_config_parses_and_builds(path):
    cfg = _load(path)
    assert cfg.custom_imports == dict(imports=['mmdtn'], allow_failed_imports=False)
    assert cfg.default_scope in ('mmdet', 'mmseg', 'mmpretrain')
    model_cfg = copy.deepcopy(cfg.model)
    model = _models_registry(cfg.default_scope).build(model_cfg)
    n_dtn = sum(type(m).__name__ == 'DynamicTokenNorm' for m in model.modules())
    if '-dtn_' in osp.basename(path) or '_dtn_' in osp.basename(path):  # (demo: '_dtn_')
        assert cfg.model.backbone.type.endswith('DTN')
        assert n_dtn > 0
    elif '-ln_' in osp.basename(path):
        assert n_dtn == 0
    if path in TASK or path in IMAGENET:
        # The optimizer builds on the model (paramwise keys and all).
        build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))


def _strip_dtn(cfg_dict):
    d = copy.deepcopy(cfg_dict)
    d['model']['backbone'].pop('type')
    d['model']['backbone'].pop('dtn_init', None)
    keys = d['optim_wrapper'].get('paramwise_cfg', {}).get('custom_keys', {})
    for k in DTN_KEYS:
        keys.pop(k, None)
    if 'paramwise_cfg' in d['optim_wrapper'] and not keys:
        d['optim_wrapper'].pop('paramwise_cfg')
    d.pop('dtn_no_decay_keys', None)
    return d


@pytest.mark.parametrize('path', DTN + IMAGENET_DTN, ids=_name)
def test_dtn_config_is_its_ln_twin_plus_dtn(path):
    twin = path.replace('-dtn_', '-ln_')
    assert osp.isfile(twin)
    dtn_cfg, ln_cfg = _load(path), _load(twin)
    dtn_d, ln_d = copy.deepcopy(dtn_cfg.to_dict()), copy.deepcopy(ln_cfg.to_dict())
    ln_backbone = ln_d['model']['backbone']['type'].split('.')[-1]
    assert dtn_d['model']['backbone']['type'] == ln_backbone + 'DTN'
    # The paper's initialization (Algorithm 1); 'layernorm' is the opt-in start from a LN
    # checkpoint.
    assert dtn_d['model']['backbone'].get('dtn_init', 'paper') == 'paper'
    keys = dtn_d['optim_wrapper']['paramwise_cfg']['custom_keys']
    for k in DTN_KEYS:
        assert keys[k] == dict(decay_mult=0.)
    ln_d['model']['backbone'].pop('type')
    # Swin's stock convert_weights default is False, which the seg DTN config states explicitly.
    if 'convert_weights' in dtn_d['model']['backbone'] and 'convert_weights' not in \
            ln_d['model']['backbone']:
        assert dtn_d['model']['backbone'].pop('convert_weights') is False
    assert _strip_dtn(dtn_d) == ln_d


def _detection_recipe(cfg, lr, wd, betas=None):
    opt = cfg.optim_wrapper.optimizer
    assert opt.type == 'AdamW' and opt.lr == lr and opt.weight_decay == wd
    if betas is not None:
        assert tuple(opt.betas) == betas
    assert cfg.train_cfg.max_epochs == 12
    steps = [s for s in cfg.param_scheduler if s.type == 'MultiStepLR']
    assert len(steps) == 1 and list(steps[0].milestones) == [8, 11] and steps[0].by_epoch
    assert cfg.train_dataloader.batch_size == 2  # x 8 GPUs = 16
    assert cfg.auto_scale_lr.base_batch_size == 16
    assert cfg.train_dataloader.dataset.data_root == 'data/coco/'


@pytest.mark.parametrize('stem', DET)
def test_detection_hyper_parameters(stem):
    for norm in ('ln', 'dtn'):
        cfg = _load(_det(stem, norm))
        if 'swin' in stem:
            _detection_recipe(cfg, 1e-4, 0.05, (0.9, 0.999))
            ckpt = cfg.model.backbone.init_cfg.checkpoint
            assert ckpt.endswith('swin_tiny_patch4_window7_224.pth')
            assert cfg.model.backbone.convert_weights is True
        elif stem.startswith('mask-rcnn'):
            _detection_recipe(cfg, 2e-4, 1e-4)
        else:
            _detection_recipe(cfg, 1e-4, 1e-4)
        if 'pvt' in stem:
            expect = PVT_CHECKPOINTS[stem.split('_')[1]]
            assert cfg.model.backbone.init_cfg.checkpoint == \
                f'https://github.com/whai362/PVT/releases/download/v2/{expect}'
        metric = cfg.val_evaluator.metric
        assert metric == (['bbox', 'segm'] if stem.startswith('mask-rcnn') else 'bbox')


@pytest.mark.parametrize('stem', SEG)
def test_semantic_fpn_hyper_parameters(stem):
    for norm in ('ln', 'dtn'):
        cfg = _load(_seg(stem, norm))
        opt = cfg.optim_wrapper.optimizer
        assert opt.type == 'AdamW' and opt.lr == 2e-4 and opt.weight_decay == 1e-4
        (poly,) = cfg.param_scheduler
        assert poly.type == 'PolyLR' and poly.power == 0.9 and poly.eta_min == 0
        assert poly.begin == 0 and poly.end == 40000 and not poly.by_epoch
        assert cfg.train_cfg.max_iters == 40000 and cfg.train_dataloader.batch_size == 4
        assert tuple(cfg.crop_size) == (512, 512)
        assert tuple(cfg.model.data_preprocessor.size) == (512, 512)
        assert cfg.model.decode_head.num_classes == 150 and cfg.model.pretrained is None
        assert cfg.train_dataloader.dataset.data_root == 'data/ade/ADEChallengeData2016'


def _plain(x):
    """Config values without the ``_scope_`` keys mmengine's get_config adds."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items() if k != '_scope_'}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def test_upernet_swin_is_mmsegs_recipe():
    stock = get_config(
        'mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py')
    for norm in ('ln', 'dtn'):
        cfg = _load(osp.join(CONFIGS, 'swin', UPERNET.format(norm=norm)))
        assert cfg.train_cfg.max_iters == 160000
        assert _plain(cfg.optim_wrapper.optimizer) == _plain(stock.optim_wrapper.optimizer)
        assert _plain(cfg.param_scheduler) == _plain(stock.param_scheduler)
        assert _plain(cfg.model.backbone.init_cfg) == _plain(stock.model.backbone.init_cfg)
        assert cfg.train_dataloader.batch_size == 2


def _decay_by_name(cfg_path):
    """{parameter name: weight decay} of the optimizer a config builds (backbone only)."""
    cfg = _load(cfg_path)
    model = _models_registry(cfg.default_scope).build(copy.deepcopy(cfg.model))
    wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    by_id = {}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            by_id[id(p)] = group['weight_decay']
    return {n: by_id[id(p)] for n, p in model.named_parameters() if n.startswith('backbone.')}, cfg


@pytest.mark.parametrize('stem', ['retinanet_pvt-t', 'mask-rcnn_swin-t-p4-w7'])
def test_dtn_parameters_weight_decay(stem):
    dtn, cfg = _decay_by_name(_det(stem, 'dtn'))
    ln, _ = _decay_by_name(_det(stem, 'ln'))
    wd = cfg.optim_wrapper.optimizer.weight_decay
    dtn_only = [n for n in dtn if n.rsplit('.', 1)[-1] in DTN_KEYS]
    assert dtn_only, 'no DTN parameters found'
    assert all(dtn[n] == 0 for n in dtn_only)
    # Everything the twins share (including norm1/norm2 weight and bias) is decayed alike.
    shared = [n for n in dtn if n in ln]
    assert len(shared) == len(ln)
    assert {n: dtn[n] for n in shared} == ln
    norm_affine = [n for n in shared if '.norm1.' in n or '.norm2.' in n]
    expected = 0 if 'swin' in stem else wd
    assert norm_affine and all(dtn[n] == expected for n in norm_affine)


def _effective_backbone(backbone_cfg):
    """A backbone config's arguments with the class defaults filled in, without the type's scope
    and the arguments that do not shape the weights."""
    d = _plain(backbone_cfg.to_dict() if hasattr(backbone_cfg, 'to_dict') else backbone_cfg)
    cls = import_module('mmdet.registry').MODELS.get(d.pop('type').split('.')[-1])
    defaults = {}  # a DTN backbone's own arguments, then those of the stock class it derives from
    for klass in cls.__mro__:
        for k, p in inspect.signature(klass.__init__).parameters.items():
            if p.default is not inspect.Parameter.empty:
                defaults.setdefault(k, p.default)
    for key in ('init_cfg', 'pretrained', 'convert_weights', 'out_indices', 'with_cp'):
        d.pop(key, None)
        defaults.pop(key, None)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in {**defaults, **d}.items()}


@pytest.mark.parametrize('stem', IMAGENET_STEMS)
def test_imagenet_backbone_is_the_detectors(stem):
    """The classifier's backbone has the arguments of the detection configs' backbone (but the
    returned stages), so that its weights load into the detectors one to one."""
    det, _ = IMAGENET_STEMS[stem]
    for norm in ('ln', 'dtn'):
        cls_cfg = _load(osp.join(CONFIGS, 'imagenet', f'{stem}-{norm}_8xb128_in1k.py'))
        det_cfg = _load(_det(det, norm))
        assert cls_cfg.model.backbone.type.split('.')[-1] == det_cfg.model.backbone.type
        assert _effective_backbone(cls_cfg.model.backbone) == \
            _effective_backbone(det_cfg.model.backbone)
        assert tuple(cls_cfg.model.backbone.out_indices) == (3, )


@pytest.mark.parametrize('stem', IMAGENET_STEMS)
def test_imagenet_recipe_is_mmpretrains_with_the_stated_deviations(stem):
    """The PVT and Swin papers' recipe, as mmpretrain's configs have it: only the backbone, the
    pooling neck, the batch split (8 x 128), PVT's drop-path rate and position-embedding decay
    differ."""
    _, recipe = IMAGENET_STEMS[stem]
    stock = get_config(f'mmpretrain::{recipe}')
    for norm in ('ln', 'dtn'):
        cfg = _load(osp.join(CONFIGS, 'imagenet', f'{stem}-{norm}_8xb128_in1k.py'))
        assert cfg.default_scope == 'mmpretrain'
        for key in ('param_scheduler', 'train_cfg', 'val_dataloader', 'val_evaluator',
                    'data_preprocessor', 'auto_scale_lr'):
            assert _plain(cfg[key]) == _plain(stock[key]), key
        assert _plain(cfg.train_dataloader.dataset) == _plain(stock.train_dataloader.dataset)
        assert _plain(cfg.optim_wrapper.optimizer) == _plain(stock.optim_wrapper.optimizer)
        assert cfg.optim_wrapper.clip_grad == dict(max_norm=5.0)
        stock_model, model = _plain(stock.model), _plain(cfg.model)
        for key in ('type', 'init_cfg', 'train_cfg'):
            assert model[key] == stock_model[key], key
        assert {k: v for k, v in model['head'].items() if k != 'in_channels'} == \
            {k: v for k, v in stock_model['head'].items() if k != 'in_channels'}
        assert model['neck'] == dict(type='StageGlobalAveragePooling')
        # the recipe the configs promise, as numbers
        opt = cfg.optim_wrapper.optimizer
        assert opt.type == 'AdamW' and opt.weight_decay == 0.05
        assert cfg.train_dataloader.batch_size == 128 and opt.lr == 5e-4 * 8 * 128 / 512
        assert cfg.train_cfg.max_epochs == 300
        warmup, cosine = cfg.param_scheduler
        assert warmup.type == 'LinearLR' and cosine.type == 'CosineAnnealingLR'
        assert warmup.end == (20 if 'swin' in stem else 5)
        assert cfg.model.train_cfg.augments == [dict(type='Mixup', alpha=0.8),
                                                dict(type='CutMix', alpha=1.0)]
        assert cfg.model.head.loss.label_smooth_val == 0.1
        steps = {t.type: t for t in cfg.train_dataloader.dataset.pipeline}
        assert steps['RandAugment'].magnitude_level == 9
        assert steps['RandomErasing'].erase_prob == 0.25
        assert cfg.model.backbone.drop_path_rate == (0.2 if 'swin' in stem else 0.1)
        assert _plain(cfg.val_evaluator) == dict(type='Accuracy', topk=[1, 5])
        assert cfg.train_dataloader.dataset.data_root == 'data/imagenet'


@pytest.mark.parametrize('stem', ['pvt-t', 'swin-t-p4-w7'])
def test_imagenet_dtn_parameters_weight_decay(stem):
    dtn, cfg = _decay_by_name(osp.join(CONFIGS, 'imagenet', f'{stem}-dtn_8xb128_in1k.py'))
    ln, _ = _decay_by_name(osp.join(CONFIGS, 'imagenet', f'{stem}-ln_8xb128_in1k.py'))
    dtn_only = [n for n in dtn if n.rsplit('.', 1)[-1] in DTN_KEYS]
    assert dtn_only and all(dtn[n] == 0 for n in dtn_only)
    shared = [n for n in dtn if n in ln]
    assert len(shared) == len(ln) and {n: dtn[n] for n in shared} == ln
    # norms, biases and position embeddings: no decay (mmpretrain's rule, PVT's pos_embed)
    assert all(dtn[n] == 0 for n in shared if n.endswith(('bias', 'pos_embed')) or
               '.norm' in n)
    assert any(dtn[n] == cfg.optim_wrapper.optimizer.weight_decay for n in shared)


@pytest.mark.parametrize('norm', ['dtn', 'ln'])
def test_demo_classifier_backbone_is_the_demo_detectors(norm):
    classifier = _load(osp.join(CONFIGS, 'demo', f'classifier_pvt_tiny_{norm}_shape_crops.py'))
    for model in ('mask_rcnn', 'retinanet'):
        det = _load(osp.join(CONFIGS, 'demo', f'{model}_pvt_tiny_{norm}_shapes.py'))
        a, b = _effective_backbone(classifier.model.backbone), \
            _effective_backbone(det.model.backbone)
        # the crops' size: PVT's position embeddings are resampled when the detector loads them
        assert a.pop('pretrain_img_size') == classifier.crop_size == 32
        assert b.pop('pretrain_img_size') == 128
        assert a == b
