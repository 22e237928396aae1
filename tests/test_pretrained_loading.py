"""Loading LN checkpoints (mmdet, official, timm formats) into the DTN backbones.

The LN-parity tests are the proof that the loading and the norm placement are right: a DTN backbone
with LN-equivalent initialization, loaded from an LN checkpoint, computes what mmdet's stock
backbone loaded from the same checkpoint computes.
"""
import logging

import pytest
import timm
import torch
from mmdet.models.backbones import (PyramidVisionTransformer, PyramidVisionTransformerV2,
                                    SwinTransformer)
from mmengine.config import ConfigDict

import mmdtn  # noqa: F401
from mmdtn.models.backbones import (PyramidVisionTransformerDTN, PyramidVisionTransformerV2DTN,
                                    SwinTransformerDTN)
from mmdtn.models.backbones.pretrained import (load_pretrained, load_state_dict_checked,
                                               pvt_checkpoint_to_mmdet, swin_checkpoint_to_mmdet,
                                               timm_pvt_v2_to_official, timm_swin_to_official)
from mmdtn.models.layers import DTN_ONLY_PARAMETERS, DynamicTokenNorm
from mmdtn.models.layers.dtn import DTN_INITS

PVT_TINY_1 = dict(num_layers=[1, 1, 1, 1])  # PVT-Tiny widths, one layer per stage
PVTV2_B0 = dict(embed_dims=32, num_layers=[2, 2, 2, 2])  # timm's pvt_v2_b0
# Swin-T's architecture at half width and two blocks per stage, in mmdet's and timm's arguments
SWIN_S = dict(embed_dims=48, depths=(2, 2, 2, 2))
TIMM_SWIN = dict(embed_dim=48, depths=(2, 2, 2, 2))


class ListHandler(logging.Handler):

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def log():
    logger = logging.getLogger('test_pretrained_loading')
    logger.setLevel(logging.INFO)
    handler = ListHandler()
    logger.addHandler(handler)
    yield logger, handler.messages
    logger.removeHandler(handler)


def perturb_norms(state_dict, seed=0):
    """Non-trivial LayerNorm affines, so that their mapping onto DTN is really tested."""
    g = torch.Generator().manual_seed(seed)
    out = dict(state_dict)
    for k, v in state_dict.items():
        if 'norm' in k and v.dim() == 1 and v.is_floating_point():
            if k.endswith('weight'):
                out[k] = 1 + 0.3 * torch.randn(v.shape, generator=g)
            elif k.endswith('bias'):
                out[k] = 0.2 * torch.randn(v.shape, generator=g)
    return out


def pretrained(path, **kwargs):
    return ConfigDict(type='Pretrained', checkpoint=str(path), **kwargs)


def max_output_diff(a, b, x):
    a.eval()
    b.eval()
    with torch.no_grad():
        return max((p - q).abs().max().item() for p, q in zip(a(x), b(x)))


def test_ln_parity_pvt(tmp_path, log):
    torch.manual_seed(0)
    source = PyramidVisionTransformer(**PVT_TINY_1)
    source.init_weights()
    path = tmp_path / 'pvt_tiny_mmdet.pth'
    torch.save(perturb_norms(source.state_dict()), path)
    stock = PyramidVisionTransformer(**PVT_TINY_1, convert_weights=False,
                                     init_cfg=pretrained(path))
    stock.init_weights()
    torch.manual_seed(1)
    dtn = PyramidVisionTransformerDTN(**PVT_TINY_1, convert_weights=False, dtn_init='layernorm')
    report = load_pretrained(dtn, pretrained(path),
                             lambda sd: pvt_checkpoint_to_mmdet(sd, False), log[0])
    assert not report.missing and not report.unused
    assert len(report.dtn_initialized) == 3 * 2 * 3  # 3 DTN stages x 2 norms x 3 params
    assert max_output_diff(stock, dtn, torch.randn(2, 3, 65, 97)) <= 1e-4
    # ... and through init_cfg, as a config does it
    dtn2 = PyramidVisionTransformerDTN(**PVT_TINY_1, convert_weights=False, dtn_init='layernorm',
                                       init_cfg=pretrained(path))
    dtn2.init_weights()
    assert max_output_diff(stock, dtn2, torch.randn(1, 3, 64, 64)) <= 1e-4


def test_ln_parity_pvtv2_official_and_timm_formats(tmp_path, log):
    timm_sd = perturb_norms(timm.create_model('pvt_v2_b0', pretrained=False).state_dict())
    timm_path, official_path = tmp_path / 'pvt_v2_b0_timm.pth', tmp_path / 'pvt_v2_b0.pth'
    torch.save(timm_sd, timm_path)
    torch.save({'model': timm_pvt_v2_to_official(timm_sd)}, official_path)
    stock = PyramidVisionTransformerV2(**PVTV2_B0, init_cfg=pretrained(official_path))
    stock.init_weights()  # mmdet's own pvt_convert on the official names
    for path in (timm_path, official_path):
        dtn = PyramidVisionTransformerV2DTN(**PVTV2_B0, dtn_init='layernorm')
        report = load_pretrained(dtn, pretrained(path),
                                 lambda sd: pvt_checkpoint_to_mmdet(sd, True), log[0])
        assert not report.missing and not report.unused, (report.missing, report.unused)
        assert max_output_diff(stock, dtn, torch.randn(2, 3, 65, 97)) <= 1e-4


def test_ln_parity_swin_official_timm_and_mmdet_formats(tmp_path, log):
    timm_sd = perturb_norms(
        timm.create_model('swin_tiny_patch4_window7_224', pretrained=False,
                          **TIMM_SWIN).state_dict())
    timm_path, official_path = tmp_path / 'swin_t_timm.pth', tmp_path / 'swin_t_official.pth'
    torch.save(timm_sd, timm_path)
    torch.save({'model': timm_swin_to_official(timm_sd)}, official_path)
    stock = SwinTransformer(**SWIN_S, convert_weights=True, init_cfg=pretrained(official_path))
    stock.init_weights()  # mmdet's own swin_converter on the official names
    mmdet_path = tmp_path / 'swin_t_detector.pth'  # a detector checkpoint: 'backbone.' keys
    torch.save({'state_dict': {'backbone.' + k: v for k, v in stock.state_dict().items()}},
               mmdet_path)
    x = torch.randn(1, 3, 65, 97)
    for path, convert in [(timm_path, False), (official_path, True), (mmdet_path, False)]:
        dtn = SwinTransformerDTN(**SWIN_S, convert_weights=convert, dtn_init='layernorm',
                                 init_cfg=pretrained(path))
        dtn.init_weights()
        assert max_output_diff(stock, dtn, x) <= 1e-4, path.name


def test_timm_weights_compute_what_timm_computes(tmp_path):
    """Independent of our own renaming: timm's forward equals the mmdet backbone loaded from the
    timm state dict (with LayerNorm everywhere), last-stage features."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 224, 224)
    tm = timm.create_model('pvt_v2_b0', pretrained=False).eval()
    sd = perturb_norms(tm.state_dict())
    tm.load_state_dict(sd)
    torch.save(sd, tmp_path / 'b0.pth')
    ours = PyramidVisionTransformerV2DTN(**PVTV2_B0, dtn_stages=False,
                                         init_cfg=pretrained(tmp_path / 'b0.pth')).eval()
    ours.init_weights()
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[3], tm.forward_features(x), rtol=1e-4, atol=1e-4)

    # 448 x 448, so that every stage is larger than a window: mmdet's Swin shifts the windows
    # even of a stage that fits in one window (7 x 7 at 224), the official code and timm do not.
    x = torch.randn(1, 3, 448, 448)
    tm = timm.create_model('swin_tiny_patch4_window7_224', pretrained=False, img_size=448,
                           **TIMM_SWIN).eval()
    sd = perturb_norms(tm.state_dict())
    tm.load_state_dict(sd)
    torch.save(sd, tmp_path / 'swin.pth')
    ours = SwinTransformerDTN(**SWIN_S, dtn_stages=False, out_indices=(3, ),
                              init_cfg=pretrained(tmp_path / 'swin.pth')).eval()
    ours.init_weights()
    with torch.no_grad():  # timm's final norm is Swin's norm3 (mmdet does not load it)
        ours.norm3.load_state_dict({'weight': sd['norm.weight'], 'bias': sd['norm.bias']})
        torch.testing.assert_close(ours(x)[0], tm.forward_features(x).permute(0, 3, 1, 2),
                                   rtol=1e-4, atol=1e-4)


def test_non_dpn_checkpoint_into_dpn_backbone_is_reported(tmp_path, log):
    logger, messages = log
    torch.save(timm.create_model('pvt_v2_b0', pretrained=False).state_dict(), tmp_path / 'b0.pth')
    model = PyramidVisionTransformerV2DTN(**PVTV2_B0, dual_patchnorm=True)
    report = load_pretrained(model, pretrained(tmp_path / 'b0.pth'),
                             lambda sd: pvt_checkpoint_to_mmdet(sd, True), logger)
    assert report.dpn_initialized == ['layers.0.0.projection.patch_norm.weight',
                                      'layers.0.0.projection.patch_norm.bias']
    assert not report.missing
    assert torch.equal(model.layers[0][0].projection.patch_norm.weight, torch.ones(147))
    assert any('Dual PatchNorm' in m and 'patch_norm.weight' in m for m in messages)
    assert any('mean_gate' in m and 'init=paper' in m for m in messages)


def test_unused_and_missing_keys_are_logged_by_name(tmp_path, log):
    logger, messages = log
    sd = timm_swin_to_official(
        timm.create_model('swin_tiny_patch4_window7_224', pretrained=False,
                          **TIMM_SWIN).state_dict())
    del sd['layers.0.blocks.0.norm1.bias']
    torch.save(sd, tmp_path / 'swin.pth')
    model = SwinTransformerDTN(**SWIN_S, convert_weights=True)
    report = load_pretrained(model, pretrained(tmp_path / 'swin.pth'),
                             lambda s: swin_checkpoint_to_mmdet(s, True, model), logger)
    assert report.missing == ['stages.0.blocks.0.norm1.bias'] + [
        f'norm{i}.{p}' for i in range(4) for p in ('weight', 'bias')]
    assert report.unused == ['norm.weight', 'norm.bias']  # the classifier's final norm
    assert len(report.derived) == 8  # relative_position_index: timm does not save them
    text = '\n'.join(messages)
    assert 'stages.0.blocks.0.norm1.bias' in text and 'norm.weight' in text


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    torch.save(PyramidVisionTransformer(**PVT_TINY_1).state_dict(), tmp_path / 'tiny.pth')
    model = PyramidVisionTransformerDTN(num_layers=[1, 1, 1, 1], embed_dims=32, dtn_heads=2,
                                        convert_weights=False,
                                        init_cfg=pretrained(tmp_path / 'tiny.pth'))
    with pytest.raises(ValueError, match=r'layers\.0\.0\.projection\.weight: checkpoint '
                       r'\(64, 3, 4, 4\) vs model \(32, 3, 4, 4\)'):
        model.init_weights()


def test_dtn_only_parameters_are_the_layers_parameters_beyond_layernorm():
    names = {n for init in DTN_INITS
             for n, _ in DynamicTokenNorm(8, 2, init=init).named_parameters()}
    assert names - {'weight', 'bias'} == set(DTN_ONLY_PARAMETERS)


def test_strict_loading_refuses_partial_weights_and_loads_nothing(log):
    """The analysis tools' mode: every key must fit but DTN-only ones, which keep their init."""
    sd = dict(PyramidVisionTransformer(**PVT_TINY_1).state_dict())
    del sd['layers.0.1.1.norm1.bias']
    sd['head.weight'] = torch.zeros(3)
    model = PyramidVisionTransformerDTN(**PVT_TINY_1, convert_weights=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r'(?s)1 checkpoint key\(s\) not in the model: head\.weight'
                       r'.*1 model key\(s\) missing from the checkpoint: '
                       r'layers\.0\.1\.1\.norm1\.bias'):
        load_state_dict_checked(model, sd, log[0], strict=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    report = load_state_dict_checked(model, sd, log[0])  # the backbones' init: logged, not refused
    assert report.unused == ['head.weight'] and report.missing == ['layers.0.1.1.norm1.bias']
    del sd['head.weight']
    sd['layers.0.1.1.norm1.bias'] = before['layers.0.1.1.norm1.bias']
    report = load_state_dict_checked(model, sd, log[0], strict=True)
    assert report.dtn_initialized and all(k.rsplit('.', 1)[1] in DTN_ONLY_PARAMETERS
                                          for k in report.dtn_initialized)


def test_missing_file_and_bad_init_cfg(tmp_path):
    model = SwinTransformerDTN(**SWIN_S, init_cfg=pretrained(tmp_path / 'nope.pth'))
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        model.init_weights()
    with pytest.raises(ValueError, match='Pretrained'):
        SwinTransformerDTN(**SWIN_S, init_cfg=dict(type='Normal')).init_weights()


def test_prefix_selects_the_backbone_of_a_larger_checkpoint(tmp_path, log):
    source = PyramidVisionTransformer(**PVT_TINY_1)
    sd = {f'model.encoder.{k}': v for k, v in source.state_dict().items()}
    sd['model.head.weight'] = torch.zeros(3)
    torch.save({'state_dict': sd}, tmp_path / 'ckpt.pth')
    model = PyramidVisionTransformerDTN(**PVT_TINY_1, convert_weights=False)
    report = load_pretrained(model, pretrained(tmp_path / 'ckpt.pth', prefix='model.encoder'),
                             lambda s: pvt_checkpoint_to_mmdet(s, False), log[0])
    assert not report.missing and not report.unused
    torch.testing.assert_close(model.layers[0][0].projection.weight,
                               source.layers[0][0].projection.weight)
    with pytest.raises(ValueError, match="prefix 'decoder.'"):
        load_pretrained(model, pretrained(tmp_path / 'ckpt.pth', prefix='decoder'),
                        lambda s: s, log[0])


def to_reference_format(state_dict, seed=0):
    """DTN layers in the names of the authors' reference code (inverse of
    ``convert_reference_state_dict``; ``pos_proj.bias`` is random: it cancels in the softmax)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state_dict.items():
        prefix, _, name = k.rpartition('.')
        if name == 'mean_gate':
            out[prefix + '.mean_norm_weight'] = v
        elif name == 'var_gate':
            out[prefix + '.var_norm_weight'] = v
        elif name == 'pos_coef':  # [dd, dx, dy] with dx = source - output -> [dx', dy', dd]
            out[prefix + '.pos_proj.weight'] = torch.stack([-v[:, 1], -v[:, 2], v[:, 0]], dim=1)
            out[prefix + '.pos_proj.bias'] = torch.randn(v.shape[0], generator=g)
        else:
            out[k] = v
    return out


def test_reference_code_dtn_checkpoint_loads_and_reproduces_the_model(tmp_path, log):
    torch.manual_seed(0)
    source = PyramidVisionTransformerDTN(**PVT_TINY_1, dtn_reference_compat=True)
    source.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in source.named_parameters():
            if name.endswith(('mean_gate', 'var_gate')):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith('pos_coef'):
                p.copy_(torch.randn(p.shape, generator=g))
                p[:, 0] = -0.2 - torch.rand(p.shape[0], generator=g)
    path = tmp_path / 'pvt_tiny_dtn_reference.pth'
    torch.save(to_reference_format(source.state_dict()), path)
    model = PyramidVisionTransformerDTN(**PVT_TINY_1, convert_weights=False,
                                        dtn_reference_compat=True)
    report = load_pretrained(model, pretrained(path),
                             lambda sd: pvt_checkpoint_to_mmdet(sd, False), log[0])
    assert not report.missing and not report.unused and not report.dtn_initialized
    assert any("6 DTN layers from the reference code's format" in m for m in log[1])
    assert not any('dtn_reference_compat=True' in m for m in log[1])
    assert max_output_diff(source, model, torch.randn(2, 3, 64, 96)) <= 1e-6
    # a backbone computing the paper's statistics loads the weights too, with a warning
    plain = PyramidVisionTransformerDTN(**PVT_TINY_1, convert_weights=False)
    report = load_pretrained(plain, pretrained(path),
                             lambda sd: pvt_checkpoint_to_mmdet(sd, False), log[0])
    assert not report.missing and not report.unused
    assert any('dtn_reference_compat=True' in m for m in log[1])
