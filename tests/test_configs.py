"""Every config in configs/ parses, builds its model, and carries the recipe it promises.

DTN configs are checked against their LayerNorm twins: the merged configs are equal except for the
backbone type, ``dtn_init`` and DTN's no-decay keys; the optimiser built from a DTN config gives
DTN's gates and positional coefficients no weight decay and treats DTN's affine parameters as the
twin treats its LayerNorms. Models are built, never run (pretrained weights are not downloaded).
"""
import copy
import functools
import os.path as osp

import pytest
from mmengine.config import Config
from mmengine.hub import get_config
from mmengine.optim import build_optim_wrapper
from mmengine.registry import init_default_scope

import mmdtn  # noqa: F401
from tiny_datasets import CONFIGS, iter_config_files

ALL = iter_config_files()
TOP = [p for p in ALL if osp.dirname(p) == CONFIGS]
DTN = [p for p in TOP if '_dtn_' in osp.basename(p)]
DET = ['retinanet_pvt_tiny', 'retinanet_pvt_small', 'mask_rcnn_pvt_tiny', 'mask_rcnn_pvt_small',
       'retinanet_swin_tiny', 'mask_rcnn_swin_tiny', 'retinanet_pvtv2_b0', 'retinanet_pvtv2_b1',
       'retinanet_pvtv2_b2']
SEG = ['semfpn_pvt_tiny', 'semfpn_pvt_small']
DTN_KEYS = ('mean_gate', 'var_gate', 'pos_coef')
PVT_CHECKPOINTS = {'pvt_tiny': 'pvt_tiny.pth', 'pvt_small': 'pvt_small.pth',
                   'pvtv2_b0': 'pvt_v2_b0.pth', 'pvtv2_b1': 'pvt_v2_b1.pth',
                   'pvtv2_b2': 'pvt_v2_b2.pth'}


@functools.lru_cache(maxsize=None)
def _load(path):
    """Each config is parsed once per session; callers must not modify the result."""
    return Config.fromfile(path)


def _name(path):
    return osp.relpath(path, CONFIGS)


def _models_registry(scope):
    init_default_scope(scope)
    if scope == 'mmdet':
        from mmdet.registry import MODELS
    else:
        from mmseg.registry import MODELS
    return MODELS


def test_expected_files_exist():
    names = {osp.basename(p) for p in TOP}
    for stem in DET:
        for norm in ('dtn', 'ln'):
            assert f'{stem}_{norm}_1x.py' in names
    for stem in SEG:
        for norm in ('dtn', 'ln'):
            assert f'{stem}_{norm}_ade20k_40k.py' in names
    for norm in ('dtn', 'ln'):
        assert f'upernet_swin_tiny_{norm}_ade20k_160k.py' in names


@pytest.mark.parametrize('path', ALL, ids=_name)
def test_config_parses_and_builds(path):
    cfg = _load(path)
    assert cfg.custom_imports == dict(imports=['mmdtn'], allow_failed_imports=False)
    assert cfg.default_scope in ('mmdet', 'mmseg')
    model_cfg = copy.deepcopy(cfg.model)
    model = _models_registry(cfg.default_scope).build(model_cfg)
    n_dtn = sum(type(m).__name__ == 'DynamicTokenNorm' for m in model.modules())
    if '_dtn_' in osp.basename(path):
        assert cfg.model.backbone.type.endswith('DTN')
        assert n_dtn > 0
    elif '_ln_' in osp.basename(path):
        assert n_dtn == 0
    if path in TOP:
        # The optimiser builds on the model (paramwise keys and all).
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


@pytest.mark.parametrize('path', DTN, ids=_name)
def test_dtn_config_is_its_ln_twin_plus_dtn(path):
    twin = path.replace('_dtn_', '_ln_')
    assert osp.isfile(twin)
    dtn_cfg, ln_cfg = _load(path), _load(twin)
    dtn_d, ln_d = copy.deepcopy(dtn_cfg.to_dict()), copy.deepcopy(ln_cfg.to_dict())
    ln_backbone = ln_d['model']['backbone']['type'].split('.')[-1]
    assert dtn_d['model']['backbone']['type'] == ln_backbone + 'DTN'
    # The paper's initialisation: the LN-equivalent one saturates the gates (DTN would stay LN).
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
        cfg = _load(osp.join(CONFIGS, f'{stem}_{norm}_1x.py'))
        if 'swin' in stem:
            _detection_recipe(cfg, 1e-4, 0.05, (0.9, 0.999))
            ckpt = cfg.model.backbone.init_cfg.checkpoint
            assert ckpt.endswith('swin_tiny_patch4_window7_224.pth')
            assert cfg.model.backbone.convert_weights is True
        elif stem.startswith('mask_rcnn'):
            _detection_recipe(cfg, 2e-4, 1e-4)
        else:
            _detection_recipe(cfg, 1e-4, 1e-4)
        if 'pvt' in stem:
            expect = PVT_CHECKPOINTS[stem[stem.index('pvt'):]]
            assert cfg.model.backbone.init_cfg.checkpoint == \
                f'https://github.com/whai362/PVT/releases/download/v2/{expect}'
        metric = cfg.val_evaluator.metric
        assert metric == (['bbox', 'segm'] if stem.startswith('mask_rcnn') else 'bbox')


@pytest.mark.parametrize('stem', SEG)
def test_semantic_fpn_hyper_parameters(stem):
    for norm in ('ln', 'dtn'):
        cfg = _load(osp.join(CONFIGS, f'{stem}_{norm}_ade20k_40k.py'))
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
        cfg = _load(osp.join(CONFIGS, f'upernet_swin_tiny_{norm}_ade20k_160k.py'))
        assert cfg.train_cfg.max_iters == 160000
        assert _plain(cfg.optim_wrapper.optimizer) == _plain(stock.optim_wrapper.optimizer)
        assert _plain(cfg.param_scheduler) == _plain(stock.param_scheduler)
        assert _plain(cfg.model.backbone.init_cfg) == _plain(stock.model.backbone.init_cfg)
        assert cfg.train_dataloader.batch_size == 2


def _decay_by_name(cfg_path):
    """{parameter name: weight decay} of the optimiser a config builds (backbone only)."""
    cfg = _load(cfg_path)
    model = _models_registry(cfg.default_scope).build(copy.deepcopy(cfg.model))
    wrapper = build_optim_wrapper(model, copy.deepcopy(cfg.optim_wrapper))
    by_id = {}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            by_id[id(p)] = group['weight_decay']
    return {n: by_id[id(p)] for n, p in model.named_parameters() if n.startswith('backbone.')}, cfg


@pytest.mark.parametrize('stem', ['retinanet_pvt_tiny', 'mask_rcnn_swin_tiny'])
def test_dtn_parameters_weight_decay(stem):
    dtn, cfg = _decay_by_name(osp.join(CONFIGS, f'{stem}_dtn_1x.py'))
    ln, _ = _decay_by_name(osp.join(CONFIGS, f'{stem}_ln_1x.py'))
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
