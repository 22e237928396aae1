"""mmseg's VisionTransformer with DTN: a drop-in for the stock backbone (outputs, LayerNorm parity),
and the checkpoints of the timm and mmpretrain routes load into it with DTN's parameters."""
import contextlib
import logging

import pytest
import timm
import torch
import torch.nn.functional as F
from mmseg.models.backbones import VisionTransformer

import mmdtn  # noqa: F401
import mmdtn.models.timm_dtn  # noqa: F401
from mmdtn import VisionTransformerDTN
from mmdtn.models.backbones.pretrained import load_pretrained, vit_checkpoint_to_mmseg
from mmdtn.models.layers import DynamicTokenNorm
from test_vit_dtn import authors_checkpoint, authors_vit

ARCH = dict(img_size=32, patch_size=8, embed_dims=32, num_layers=3, num_heads=4)
DTN = dict(dtn_layers=2, dtn_heads=4)


def randomise_dtn(model, seed=1):
    """Gates and positional coefficients away from their initial values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.rsplit('.', 1)[-1] in ('mean_gate', 'var_gate', 'pos_coef'):
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def load(backbone, caplog=None):
    """Load the backbone's ``init_cfg`` as ``init_weights`` does, logging to ``caplog``."""
    logger = logging.getLogger('test_vit_dtn_mmseg')
    with caplog.at_level(logging.INFO, logger=logger.name) if caplog else contextlib.nullcontext():
        return load_pretrained(backbone, backbone.init_cfg,
                               lambda sd: vit_checkpoint_to_mmseg(sd, backbone, logger), logger)


def stock_with_class_token_after(model, img, layers):
    """Outputs of the stock mmseg ViT with its class token appended after layer ``layers``
    (ConViT), from the stock model's modules: [(patch map, class token)] of every layer."""
    x, hw_shape = model.patch_embed(img)
    pos = model._pos_embeding(torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x], 1),
                              hw_shape, model.pos_embed)
    cls, x = pos[:, :1], pos[:, 1:]
    outs = []
    for i, layer in enumerate(model.layers):
        if i == layers:
            x = torch.cat([cls, x], dim=1)
        x = layer(x)
        if i == len(model.layers) - 1 and model.final_norm:
            x = model.norm1(x)
        patches, token = (x[:, 1:], x[:, 0]) if i >= layers else (x, cls[:, 0])
        outs.append((patches.transpose(1, 2).reshape(x.shape[0], -1, *hw_shape), token))
    return outs


@pytest.mark.parametrize('with_cls_token', [False, True])
def test_layernorm_init_equals_the_stock_backbone(with_cls_token):
    args = dict(ARCH, out_indices=(0, 1, 2), final_norm=True, with_cls_token=with_cls_token,
                output_cls_token=with_cls_token, out_origin=not with_cls_token,
                pre_norm=not with_cls_token)
    torch.manual_seed(0)
    stock = VisionTransformer(**args)
    stock.init_weights()
    dtn = VisionTransformerDTN(**args, **DTN, dtn_init='layernorm')
    missing = dtn.load_state_dict(stock.state_dict(), strict=False).missing_keys
    assert sorted({k.rsplit('.', 1)[1] for k in missing}) == [
        'mean_gate_distance', 'pos_coef', 'var_gate_distance']
    assert [type(layer.ln1) is DynamicTokenNorm for layer in dtn.layers] == \
        [True, True, False]
    img = torch.randn(2, 3, 48, 40)  # not the training size: position embeddings interpolated
    stock.eval()  # (mmseg's train() returns None)
    with torch.no_grad():
        ours = dtn.eval()(img)
        expected = stock_with_class_token_after(stock, img, 2) if with_cls_token else stock(img)
    assert len(ours) == len(expected) == (3 if with_cls_token else 4)
    for a, b in zip(ours, expected):
        for x, y in zip(a, b) if with_cls_token else [(a, b)]:
            assert x.shape == y.shape and (x - y).abs().max() < 1e-4


def test_arguments_and_outputs_of_the_stock_backbone():
    model = VisionTransformerDTN(**ARCH, out_indices=-1, frozen_exclude=['layers.2'])
    assert model.dtn_settings[0].num_heads == 4 and model.out_indices == [2]
    assert not model.layers[0].ln1.var_gate.requires_grad  # frozen like the stock parameters
    assert model.layers[2].ln1.weight.requires_grad
    out = model(torch.randn(1, 3, 32, 32))
    assert len(out) == 1 and out[0].shape == (1, 32, 4, 4)
    checkpointed = VisionTransformerDTN(**ARCH, with_cp=True).train()
    checkpointed(torch.randn(1, 3, 32, 40))[0].sum().backward()  # grid of this very call
    assert checkpointed.layers[0].ln1.var_gate.grad is not None
    with pytest.raises(ValueError, match='dtn_layers .* got 5'):
        VisionTransformerDTN(**ARCH, dtn_layers=5)


def test_timm_route_loads_with_dtn_parameters(tmp_path, caplog):
    torch.manual_seed(0)
    timm_model = randomise_dtn(timm.create_model(
        'vit_tiny_patch16_224_dtn', img_size=32, patch_size=8, embed_dim=32, depth=3,
        num_heads=4, num_classes=5, **DTN)).eval()
    path = tmp_path / 'timm_vit_dtn.pth'
    torch.save(timm_model.state_dict(), path)
    backbone = VisionTransformerDTN(**ARCH, **DTN, out_indices=(0, 1, 2), patch_bias=True,
                                    norm_cfg=dict(type='LN', eps=1e-6),  # timm's
                                    init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    report = load(backbone, caplog)
    assert report.classifier_head == ['head.weight', 'head.bias']
    assert report.unused == ['ln1.weight', 'ln1.bias']  # timm's final norm: final_norm=False
    assert not report.missing and not report.dtn_initialized
    assert torch.equal(backbone.layers[1].ln2.pos_coef, timm_model.blocks[1].norm2.pos_coef)
    img = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = timm_model.forward_intermediates(img, indices=3, intermediates_only=True)
        ours = backbone.eval()(img)
    for a, b in zip(ours, expected):
        assert (a - b).abs().max() < 1e-5

    resized = VisionTransformerDTN(**dict(ARCH, img_size=48), **DTN,
                                   init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    load(resized, caplog)
    assert "position embedding resized from the checkpoint's 4x4 grid to the model's 6x6" \
        in caplog.text


def test_mmpretrain_route_loads_with_dtn_parameters(tmp_path):
    from mmengine.registry import init_default_scope
    from mmpretrain.registry import MODELS
    init_default_scope('mmpretrain')  # whatever an earlier test set
    classifier = MODELS.build(dict(
        type='ImageClassifier',
        backbone=dict(type='VisionTransformerDTN', **ARCH, **DTN, final_norm=True,
                      output_cls_token=True),
        head=dict(type='VisionTransformerClsHead', num_classes=5, in_channels=32)))
    randomise_dtn(classifier)
    assert classifier(torch.randn(2, 3, 32, 32), mode='tensor').shape == (2, 5)
    path = tmp_path / 'classifier.pth'
    torch.save({'state_dict': classifier.state_dict()}, path)
    backbone = VisionTransformerDTN(**ARCH, **DTN, final_norm=True,
                                    init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    backbone.init_weights()
    for key, value in classifier.backbone.state_dict().items():
        assert torch.equal(backbone.state_dict()[key], value), key


def test_authors_checkpoint_computes_the_authors_forward(tmp_path):
    sd = authors_checkpoint()
    path = tmp_path / 'authors.pth'
    torch.save({'model': sd}, path)
    backbone = VisionTransformerDTN(**ARCH, **DTN, final_norm=True, output_cls_token=True,
                                    patch_bias=True, norm_cfg=dict(type='LN', eps=1e-6),
                                    dtn_reference_compat=True,
                                    init_cfg=dict(type='Pretrained', checkpoint=str(path))).double()
    report = load(backbone)
    assert not report.missing and not report.unused and not report.dtn_initialized
    assert not backbone.pos_embed[0, 0].any()  # ConViT: no position for the class token
    img = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        cls = backbone.eval()(img)[-1][1]
        expected = authors_vit(img, sd)
    logits = F.linear(cls, sd['head.weight'], sd['head.bias'])
    assert (logits - expected).abs().max() <= 1e-9 * expected.abs().max()
