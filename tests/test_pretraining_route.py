"""From ImageNet to COCO: DTN models pretrained with timm or mmpretrain, loaded into the mmdet and
mmseg DTN backbones of the detection and segmentation configs.

The classifiers are randomly initialized and their DTN parameters (gates, positional
coefficients, affines) randomized, so that only parameters really carried over reproduce the
classifier's features in the detector's backbone.
"""
import argparse
import copy
import logging
import logging.handlers
import os.path as osp

import pytest
import timm
import torch
import torch.nn.functional as F
from mmdet.registry import MODELS as MMDET_MODELS
from mmengine.config import Config
from mmengine.logging import MMLogger
from mmengine.optim import build_optim_wrapper
from mmpretrain.registry import MODELS as MMPRETRAIN_MODELS
from mmpretrain.structures import DataSample
from mmseg.registry import MODELS as MMSEG_MODELS
from timm.layers import DropPath
from timm.utils import CheckpointSaver

import mmdtn.models.timm_dtn  # noqa: F401  (registers the timm DTN models: the documented import)
from mmdtn.models.backbones import PyramidVisionTransformerDTN, SwinTransformerDTN
from mmdtn.models.layers import DTN_ONLY_PARAMETERS, LAYERNORM_GATE_LOGIT, DynamicTokenNorm
from mmdtn.models.timm_dtn import BlockGridTokenNorm

CONFIGS = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs')

#: timm's DTN models and the detection config whose backbone they are pretrained for
TIMM_DETECTORS = {
    'pvt_v2_b0_dtn': 'pvtv2/retinanet_pvtv2-b0-dtn_fpn_1x_coco',
    'pvt_v2_b1_dtn': 'pvtv2/retinanet_pvtv2-b1-dtn_fpn_1x_coco',
    'pvt_v2_b2_dtn': 'pvtv2/retinanet_pvtv2-b2-dtn_fpn_1x_coco',
    'swin_tiny_patch4_window7_224_dtn': 'swin/retinanet_swin-t-p4-w7-dtn_fpn_1x_coco',
}
DTN_ATTRIBUTES = ('num_features', 'num_heads', 'pool_size', 'eps', 'init', 'reference_compat')


# ---------------------------------------------------------------------------------- helpers
@pytest.fixture
def mmlogger_messages():
    """What the backbones' ``init_weights`` reports (to mmengine's current logger)."""
    logger = MMLogger.get_current_instance()
    handler = logging.handlers.BufferingHandler(capacity=1 << 20)
    logger.addHandler(handler)
    yield LoggedMessages(handler)
    logger.removeHandler(handler)


class LoggedMessages:
    """The messages a ``BufferingHandler`` holds, iterated as strings."""

    def __init__(self, handler):
        self.handler = handler

    def __iter__(self):
        return (record.getMessage() for record in self.handler.buffer)


def config(name):
    return Config.fromfile(osp.join(CONFIGS, name + '.py'))


def pretrained_backbone(config_name, checkpoint, registry=MMDET_MODELS, **overrides):
    """The backbone of a detection/segmentation config, built by ``registry`` and initialized
    with ``init_cfg=dict(type='Pretrained', checkpoint=checkpoint)``, in eval mode."""
    cfg = config(config_name).model.backbone
    cfg['init_cfg'] = dict(type='Pretrained', checkpoint=str(checkpoint))
    cfg.update(overrides)
    backbone = registry.build(cfg)
    backbone.init_weights()
    return backbone.eval()


def classifier(config_name, **backbone):
    """An mmpretrain ImageClassifier of ``configs/imagenet/``, randomly initialized."""
    cfg = config('imagenet/' + config_name).model
    cfg.backbone.update(backbone)
    model = MMPRETRAIN_MODELS.build(cfg)
    model.init_weights()
    return model


def dtn_layers(model):
    return [m for m in model.modules() if isinstance(m, DynamicTokenNorm)]


def randomise_dtn(model, seed=0):
    """Random values in every DTN parameter (decisive gates, a^h near Eq. 7's, non-trivial
    affines)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in dtn_layers(model):
            for p in (*layer.gates, layer.weight, layer.bias):
                p.copy_((p is layer.weight) + 0.5 * torch.randn(p.shape, generator=g))
            layer.pos_coef.mul_(1 + 0.3 * torch.rand(layer.pos_coef.shape, generator=g))
    return model


def assert_same_dtn_layers(source, target):
    """The same DTN layers (settings and every parameter, bit for bit) in the same order."""
    a, b = dtn_layers(source), dtn_layers(target)
    assert len(a) == len(b) > 0
    for index, (p, q) in enumerate(zip(a, b)):
        assert [getattr(p, k) for k in DTN_ATTRIBUTES] == [getattr(q, k) for k in DTN_ATTRIBUTES]
        named = dict(q.named_parameters())
        assert list(named) == [name for name, _ in p.named_parameters()]
        for name, value in p.named_parameters():
            assert torch.equal(value, named[name]), (index, name)


def assert_features_close(a, b, tol=1e-5):
    assert len(a) == len(b)
    for i, (p, q) in enumerate(zip(a, b)):
        assert p.shape == q.shape, (i, p.shape, q.shape)
        torch.testing.assert_close(p, q, rtol=tol, atol=tol, msg=lambda m: f'stage {i}: {m}')


@pytest.fixture(scope='module')
def timm_model():
    """``timm_model(name, **kwargs)``: a fresh copy of ``timm.create_model(name, **kwargs)``,
    built once for the tests of this file."""
    built = {}

    def fresh_copy(name, **kwargs):
        key = (name, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = timm.create_model(name, **kwargs)
        return copy.deepcopy(built[key])

    yield fresh_copy
    built.clear()


# ---------------------------------------------------------------------------------- timm
@pytest.mark.parametrize('name', list(TIMM_DETECTORS))
def test_timm_dtn_model_has_dtn_in_its_block_norms_and_trains(name, timm_model):
    """timm's own model with DTN in the block norms of the paper's stages and in no other norm;
    forward and backward at 224 x 224 and at a non-square size, a gradient for every DTN
    parameter. (That these are the detector's DTN layers, heads and pooling sizes included, is
    checked by the transfer test below.)

    timm's Swin checks the input size against its ``img_size`` (224: timm's
    ``create_model(..., img_size=...)`` sets another); built with ``dynamic_img_size=True``
    (timm's argument: attention masks made per input) it takes any size. Its PVTv2 takes any
    size."""
    model = timm_model(name)
    assert type(model).__name__ == ('SwinDTN' if 'swin' in name else 'PvtV2DTN')
    stages = model.layers if 'swin' in name else model.stages
    # DTN in every stage of Swin, in stages 1-3 of PVTv2 (App. A.1), and in no other norm
    dtn_stages = [True] * 4 if 'swin' in name else [True, True, True, False]
    for stage, dtn in zip(stages, dtn_stages):
        norms = [n for b in stage.blocks for n in (b.norm1, b.norm2)]
        assert all(isinstance(n, BlockGridTokenNorm if dtn else torch.nn.LayerNorm)
                   for n in norms)
    assert len(dtn_layers(model)) == sum(2 * len(s.blocks) for s, d in zip(stages, dtn_stages) if d)
    assert {f'{n}.{p}' for n, m in model.named_modules() if isinstance(m, DynamicTokenNorm)
            for p, _ in m.named_parameters() if p in DTN_ONLY_PARAMETERS} <= model.no_weight_decay()

    for size in [(224, 224), (64, 96)]:
        if size != (224, 224) and 'swin' in name:
            with pytest.raises(AssertionError, match='224'):  # timm's own check
                model(torch.randn(1, 3, *size))
            model = timm_model(name, dynamic_img_size=True)
        model.train().zero_grad()
        for m in model.modules():  # no stochastic depth: every block gets a gradient
            if isinstance(m, DropPath):
                m.drop_prob = 0.
        out = model(torch.randn(1, 3, *size))
        assert out.shape == (1, 1000)
        F.cross_entropy(out, torch.tensor([7])).backward()
        for layer in dtn_layers(model):
            for p in layer.parameters():
                assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0


def with_timm_layernorm_eps(backbone, model):
    """The backbone's LayerNorms with the eps of timm's: mmdet's PVTv2 builds all of them with
    1e-6, timm's (as the official PVTv2) keeps PyTorch's 1e-5 in its patch embeddings and
    spatial reductions, a difference of the stock models."""
    ours, theirs = ([m for m in net.modules() if isinstance(m, torch.nn.LayerNorm)]
                    for net in (backbone, model))
    assert [m.normalized_shape for m in ours] == [m.normalized_shape for m in theirs]
    for m, eps in zip(ours, [m.eps for m in theirs]):
        m.eps = eps
    return backbone


def timm_stage_features(model, backbone, x):
    """The stage outputs of a timm classifier, as the mmdet backbone returns them: PVTv2's are
    its stage outputs; Swin's pass through the backbone's output norms (``norm{i}``, which a
    classifier does not have)."""
    with torch.no_grad():
        features = model.forward_intermediates(x, intermediates_only=True, norm=False)
        if isinstance(backbone, SwinTransformerDTN):
            features = [getattr(backbone, f'norm{i}')(f.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
                        for i, f in enumerate(features)]
    return [features[i] for i in backbone.out_indices]


def saved_by_timm_train(model, name, directory):
    """The best checkpoint of timm's train.py (its ``CheckpointSaver``: weights under
    ``state_dict``, the optimizer, the command line as an ``argparse.Namespace``)."""
    args = argparse.Namespace(model=name, lr=1e-3, epochs=300,
                              model_kwargs=dict(dtn_init='paper'), input_size=None)
    optimizer = torch.optim.AdamW(model.parameters())
    CheckpointSaver(model, optimizer, args, checkpoint_dir=str(directory),
                    recovery_dir=str(directory)).save_checkpoint(epoch=299, metric=75.0)
    return directory / 'model_best.pth.tar'


@pytest.mark.parametrize('name', list(TIMM_DETECTORS))
def test_timm_classifier_loads_into_the_detector_backbone(name, timm_model, tmp_path,
                                                          mmlogger_messages):
    """A checkpoint of timm's train.py: every DTN layer carried over (settings and parameters),
    the head dropped and reported, the same multi-scale features.

    mmdet's Swin shifts the windows of every other block in every stage (as the Swin detection
    code); timm's Swin-T does not where a stage's map fits one window (stage 4 at 224), unless
    set to ``always_partition=True`` (the weights stay the same), as the comparison at 224 does
    after saving the checkpoint."""
    model = randomise_dtn(timm_model(name)).eval()
    path = saved_by_timm_train(model, name, tmp_path)
    backbone = pretrained_backbone(TIMM_DETECTORS[name], path, out_indices=(0, 1, 2, 3))

    assert_same_dtn_layers(model, backbone)
    head = 'head.fc.weight, head.fc.bias' if 'swin' in name else 'head.weight, head.bias'
    assert any(f'dropped the classifier head of the checkpoint: {head}' in m
               for m in mmlogger_messages)
    assert not any('DTN-only parameters are not in the checkpoint' in m for m in mmlogger_messages)
    if 'swin' in name:
        model.set_input_size(window_size=7, always_partition=True)
        size = (224, 224)
    else:
        with_timm_layernorm_eps(backbone, model)
        size = (96, 128)
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        assert_features_close(backbone(x), timm_stage_features(model, backbone, x))


#: mmpretrain classifiers of configs/imagenet/, the configs they are loaded into, and by which
#: library's registry
MMPRETRAIN_ROUTES = [
    ('pvt-t-dtn_8xb128_in1k', 'pvt/retinanet_pvt-t-dtn_fpn_1x_coco', MMDET_MODELS),
    ('pvtv2-b0-dtn_8xb128_in1k', 'pvtv2/retinanet_pvtv2-b0-dtn_fpn_1x_coco', MMDET_MODELS),
    ('swin-t-p4-w7-dtn_8xb128_in1k', 'swin/retinanet_swin-t-p4-w7-dtn_fpn_1x_coco', MMDET_MODELS),
    ('pvt-t-dtn_8xb128_in1k', 'pvt/fpn_pvt-t-dtn_8xb4-40k_ade20k-512x512', MMSEG_MODELS),
]


@pytest.mark.parametrize('imagenet, dense, registry', MMPRETRAIN_ROUTES,
                         ids=[f'{a}-to-{osp.basename(b).split("_")[0]}'
                              for a, b, _ in MMPRETRAIN_ROUTES])
def test_mmpretrain_classifier_loads_into_the_dense_backbone(imagenet, dense, registry, tmp_path,
                                                             mmlogger_messages):
    """A checkpoint of an mmpretrain ImageClassifier (``state_dict`` with ``backbone.``,
    ``head.`` keys, as mmengine's runner saves it) in a detection / segmentation config. The
    classifier is built with every stage as an output (its config has the last), so that its
    backbone gives the multi-scale features to compare (Swin: with output norms of every stage)."""
    model = randomise_dtn(classifier(imagenet, out_indices=(0, 1, 2, 3))).eval()
    path = tmp_path / 'epoch_300.pth'
    torch.save({'meta': dict(epoch=300), 'state_dict': model.state_dict()}, path)
    backbone = pretrained_backbone(dense, path, registry, out_indices=(0, 1, 2, 3))

    assert_same_dtn_layers(model.backbone, backbone)
    assert any('2 tensors outside \'backbone.\' are not loaded: head.fc.weight, head.fc.bias' in m
               for m in mmlogger_messages)
    assert not any('not in the checkpoint' in m for m in mmlogger_messages)  # every key loaded
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        assert_features_close(backbone(x), model.backbone(x))


def test_mismatched_dtn_weights_are_an_error_naming_the_key(timm_model, tmp_path):
    """Classifiers pretrained with other DTN heads than the detector's do not load."""
    torch.save(timm_model('pvt_v2_b0_dtn', dtn_heads=2).state_dict(), tmp_path / 'timm.pth')
    with pytest.raises(ValueError, match=r'layers\.0\.1\.0\.norm1\.mean_gate: checkpoint \(2,\) '
                       r'vs model \(4,\)'):
        pretrained_backbone('pvtv2/retinanet_pvtv2-b0-dtn_fpn_1x_coco', tmp_path / 'timm.pth')
    model = classifier('pvtv2-b0-dtn_8xb128_in1k', dtn_heads=[2, 2, 5, 8])
    torch.save({'state_dict': model.state_dict()}, tmp_path / 'mmpretrain.pth')
    with pytest.raises(ValueError, match=r'layers\.1\.1\.0\.norm1\.var_gate: checkpoint '
                       r'\(2,\) vs model \(4,\)'):
        pretrained_backbone('pvtv2/retinanet_pvtv2-b0-dtn_fpn_1x_coco', tmp_path / 'mmpretrain.pth')


# ---------------------------------------------------------------------------- LayerNorm start
def perturb_layernorms(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return model


def test_layernorm_start_is_the_layernorm_model_then_its_gates_train(tmp_path):
    """``dtn_init='layernorm'`` from a LayerNorm classifier: the LayerNorm model's features at
    step 0 (1e-4), gates that leave LayerNorm under AdamW at a fine-tuning learning rate (1e-4,
    the config's optimizer) on the classifier's loss, and a checkpoint that carries them into
    the detector's backbone."""
    torch.manual_seed(0)
    ln = perturb_layernorms(classifier('pvtv2-b0-ln_8xb128_in1k', out_indices=(0, 1, 2, 3)))
    torch.save({'state_dict': ln.state_dict()}, tmp_path / 'ln.pth')
    dtn = classifier('pvtv2-b0-dtn_8xb128_in1k', out_indices=(0, 1, 2, 3), dtn_init='layernorm',
                     init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'ln.pth')))
    dtn.head.load_state_dict(ln.head.state_dict())
    layers = dtn_layers(dtn)
    assert len(layers) == 12 and all(m.init == 'layernorm' for m in layers)
    x = torch.randn(2, 3, 64, 96)
    ln.eval(), dtn.eval()
    with torch.no_grad():
        assert_features_close(dtn.backbone(x), ln.backbone(x), tol=1e-4)

    cfg = config('imagenet/pvtv2-b0-dtn_8xb128_in1k').optim_wrapper
    cfg.optimizer.lr = 1e-4
    optim_wrapper = build_optim_wrapper(dtn, cfg)
    assert type(optim_wrapper.optimizer).__name__ == 'AdamW'
    labels = [DataSample().set_gt_label(i) for i in (3, 997)]
    dtn.train()
    steps = 5
    for step in range(steps):
        optim_wrapper.backward(sum(dtn.loss(x, labels).values()))
        if step == 0:  # every gate at LayerNorm gets a gradient
            assert all(torch.count_nonzero(gate.grad) == m.num_heads
                       for m in layers for gate in m.gates)
        optim_wrapper.step()
        optim_wrapper.zero_grad()
    away = torch.cat([torch.cat([1 - m.mean_lambda, 1 - m.var_lambda]) for m in layers])
    # each step moves a gate's 1 - lambda by about lr (AdamW), and none stays at LayerNorm
    assert away.min() > 0 and away.median() > 1e-4 and away.max() < 2 * steps * 1e-4
    gates = {k.rsplit('.', 1)[1] for k in dtn.state_dict() if '_gate' in k}
    assert gates == {'mean_gate_distance', 'var_gate_distance'}  # saved as they train

    torch.save({'state_dict': dtn.state_dict()}, tmp_path / 'dtn.pth')
    dtn.eval()
    with torch.no_grad():
        features = dtn.backbone(x)
    for init in ('paper', 'layernorm'):
        backbone = pretrained_backbone('pvtv2/retinanet_pvtv2-b0-dtn_fpn_1x_coco',
                                       tmp_path / 'dtn.pth', dtn_init=init)
        for p, q in zip(layers, dtn_layers(backbone)):
            torch.testing.assert_close(q.mean_lambda, p.mean_lambda, rtol=1e-6, atol=1e-9)
            torch.testing.assert_close(q.var_lambda, p.var_lambda, rtol=1e-6, atol=1e-9)
        with torch.no_grad():
            assert_features_close(backbone(x), features)


def test_ema_models_average_the_gates_of_a_layernorm_start():
    """EMA models average ``state_dict()`` values (timm's ``ModelEmaV2``, mmengine's ``EMAHook``
    with ``update_buffers=True``) or the parameters (timm's ``ModelEmaV3``): the gates of
    ``dtn_init='layernorm'``, distances u from LayerNorm, are averaged like any parameter."""
    from mmengine.model import ExponentialMovingAverage
    from timm.utils import ModelEmaV2, ModelEmaV3

    model = torch.nn.Sequential(DynamicTokenNorm(8, 2, init='layernorm'))
    layer = model[0]
    live = dict(model.named_parameters())
    assert all(model.state_dict(keep_vars=True)[k] is v for k, v in live.items())
    averages = [ModelEmaV2(model, decay=0.9), ModelEmaV3(model, decay=0.9),
                ExponentialMovingAverage(model, momentum=0.1, update_buffers=True)]
    averages[2].update_parameters(model)  # mmengine's first update copies the model
    with torch.no_grad():
        layer.mean_gate_distance.fill_(0.5), layer.var_gate_distance.fill_(-1.0)
    for ema in averages:
        ema.update(model) if hasattr(ema, 'update') else ema.update_parameters(model)
    for ema in averages:
        averaged = ema.module[0]
        assert torch.allclose(averaged.mean_gate_distance, torch.full((2, ), 0.05))
        assert torch.allclose(averaged.var_gate_distance, torch.full((2, ), -0.1))
        assert torch.allclose(1 - averaged.var_lambda, torch.tanh(torch.tensor(0.1)))


def test_gates_of_either_init_load_into_either():
    """Checkpoints name the gates as they train (logits or distances u from LayerNorm); a layer of
    the other ``init`` converts them on loading, to the same lambda (u comes back as |u|)."""
    g = torch.Generator().manual_seed(0)
    layers = {init: DynamicTokenNorm(8, 4, init=init) for init in ('paper', 'layernorm')}
    with torch.no_grad():
        for layer in layers.values():
            for gate in layer.gates:
                gate.copy_(torch.randn(4, generator=g))
    for source in layers.values():
        for init in ('paper', 'layernorm'):
            target = DynamicTokenNorm(8, 4, init=init)
            target.load_state_dict(source.state_dict())  # strict: every key used
            for name in ('mean_lambda', 'var_lambda'):
                torch.testing.assert_close(getattr(target, name), getattr(source, name))
            if init == source.init:
                assert all(torch.equal(a, b) for a, b in zip(target.gates, source.gates))
    # a layer at LayerNorm (u = 0) loads into a paper layer at the largest logit
    paper = DynamicTokenNorm(8, 4)
    paper.load_state_dict(DynamicTokenNorm(8, 4, init='layernorm').state_dict())
    assert torch.equal(paper.mean_gate, torch.full((4, ), LAYERNORM_GATE_LOGIT))


# ---------------------------------------------------------------------------- position embeddings
def resampled_by_interpolation(pos, grid):
    """(1, s*s, C) -> (1, H*W, C): bicubic with antialiasing on the square grid of the tokens."""
    side = int(pos.shape[1]**0.5)
    image = pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
    image = F.interpolate(image, size=grid, mode='bicubic', align_corners=False, antialias=True)
    return image.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)


def randomise_position_embeddings(model):
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith('pos_embed'):
                p.normal_()
    return model


@pytest.mark.parametrize('pretrain_img_size', [(256, 320), 192])
def test_pvt_position_embeddings_of_another_grid_are_resampled(pretrain_img_size, tmp_path,
                                                               mmlogger_messages):
    """PVT v1's per-stage ``pos_embed`` of a classifier pretrained at 224, in a backbone built
    for another ``pretrain_img_size`` (larger and non-square; smaller)."""
    source = randomise_position_embeddings(PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1]))
    torch.save(source.state_dict(), tmp_path / 'pvt_224.pth')
    model = PyramidVisionTransformerDTN(
        num_layers=[1, 1, 1, 1], pretrain_img_size=pretrain_img_size, convert_weights=False,
        init_cfg=dict(type='Pretrained', checkpoint=str(tmp_path / 'pvt_224.pth')))
    model.init_weights()
    size = pretrain_img_size if isinstance(pretrain_img_size, tuple) else (pretrain_img_size, ) * 2
    keys = [k for k in source.state_dict() if k.endswith('pos_embed')]
    assert len(keys) == 4
    for i, key in enumerate(keys):
        grid = (size[0] // 2**(i + 2), size[1] // 2**(i + 2))
        side = 56 // 2**i
        torch.testing.assert_close(model.state_dict()[key],
                                   resampled_by_interpolation(source.state_dict()[key], grid))
        assert any(f"{key}: position embedding resampled from the checkpoint's {side}x{side} "
                   f"grid to the model's {grid[0]}x{grid[1]}" in m for m in mmlogger_messages)
    assert model(torch.randn(1, 3, *size))[3].shape == (1, 512, size[0] // 32, size[1] // 32)


def test_swin_absolute_position_embedding_is_resampled_and_bad_grids_named(
        tmp_path, mmlogger_messages):
    swin = dict(embed_dims=48, depths=(2, 2, 2, 2), use_abs_pos_embed=True)
    source = randomise_position_embeddings(SwinTransformerDTN(**swin))
    torch.save(source.state_dict(), tmp_path / 'swin_224.pth')
    model = SwinTransformerDTN(**swin, pretrain_img_size=256,
                               init_cfg=dict(type='Pretrained',
                                             checkpoint=str(tmp_path / 'swin_224.pth')))
    model.init_weights()
    torch.testing.assert_close(model.absolute_pos_embed,
                               resampled_by_interpolation(source.absolute_pos_embed, (64, 64)))
    assert any("absolute_pos_embed: position embedding resampled from the checkpoint's 56x56 "
               "grid to the model's 64x64" in m for m in mmlogger_messages)
    assert model(torch.randn(1, 3, 256, 256))[3].shape == (1, 384, 8, 8)

    state = source.state_dict()
    state['absolute_pos_embed'] = state['absolute_pos_embed'][:, :3130]  # not a square grid
    torch.save(state, tmp_path / 'swin_bad.pth')
    model = SwinTransformerDTN(**swin, pretrain_img_size=256,
                               init_cfg=dict(type='Pretrained',
                                             checkpoint=str(tmp_path / 'swin_bad.pth')))
    with pytest.raises(ValueError, match=r"absolute_pos_embed: the checkpoint's position "
                       r'embedding \(1, 3130, 48\) is not on a square grid'):
        model.init_weights()
