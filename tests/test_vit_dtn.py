"""DTN in plain ViTs (mmdtn.models.vit_dtn), through timm: placement, heads, LayerNorm parity, and
the authors' reference-code ViT checkpoints against an independent implementation of their forward.
"""
import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import mmdtn.models.timm_dtn  # noqa: F401  (registers the DTN models)
from mmdtn.models.dtn_stages import BlockGridTokenNorm
from mmdtn.models.timm_vit_dtn import VisionTransformerDTN
from mmdtn.models.vit_dtn import convert_reference_vit_state_dict, vit_dtn_settings
from test_reference_compat import reference_forward

SMALL = dict(img_size=32, patch_size=8, depth=3, num_classes=5)


@pytest.mark.parametrize('name,width,heads', [('vit_tiny_patch16_224_dtn', 192, 4),
                                              ('vit_small_patch16_224_dtn', 384, 6),
                                              ('vit_base_patch16_224_dtn', 768, 16)])
def test_registered_models_have_dtn_in_the_first_ten_blocks(name, width, heads):
    with torch.device('meta'):  # the structure only (fast); the small model runs below
        model = timm.create_model(name)
    assert isinstance(model, VisionTransformerDTN) and len(model.blocks) == 12
    for i, block in enumerate(model.blocks):
        for norm in (block.norm1, block.norm2):
            if i < 10:
                assert isinstance(norm, BlockGridTokenNorm)
                assert (norm.num_heads, norm.pool_size, norm.num_features) == (heads, 1, width)
            else:
                assert isinstance(norm, nn.LayerNorm) and not isinstance(norm, BlockGridTokenNorm)
    assert 'blocks.0.norm1.var_gate' in model.no_weight_decay()


def test_forward_and_backward():
    model = timm.create_model('vit_tiny_patch16_224_dtn', img_size=64, depth=3, num_classes=5)
    out = model(torch.randn(2, 3, 64, 64))
    out.sum().backward()
    assert out.shape == (2, 5) and model.blocks[0].norm1.var_gate.grad is not None
    assert model.blocks[0].norm1.hw_shape == (4, 4)


def test_non_square_inputs_with_dynamic_image_size():
    model = timm.create_model('vit_tiny_patch16_224_dtn', **SMALL, dynamic_img_size=True)
    assert model(torch.randn(1, 3, 48, 24)).shape == (1, 5)
    assert model.blocks[0].norm1.hw_shape == (6, 3)


def test_settings_are_checked():
    with pytest.raises(ValueError, match='dtn_layers .* from 0 to the 3 encoder blocks, got 4'):
        timm.create_model('vit_tiny_patch16_224_dtn', **SMALL, dtn_layers=4)
    with pytest.raises(ValueError, match='encoder block 0: 192 channels with dtn_heads=5'):
        timm.create_model('vit_tiny_patch16_224_dtn', **SMALL, dtn_heads=5)
    with pytest.raises(ValueError, match='patch_drop_rate must be 0'):
        timm.create_model('vit_tiny_patch16_224_dtn', **SMALL, patch_drop_rate=0.5)
    assert [s is not None for s in vit_dtn_settings(12, 100, 5)] == [True] * 10 + [False] * 2
    assert vit_dtn_settings(2, 100, 5, dtn_layers=1)[0].num_heads == 5  # not starred: attention's


def stock_forward_class_token_after(model, img, layers):
    """The stock LayerNorm ViT with its class token appended after block ``layers`` (ConViT), from
    the stock model's modules."""
    x = model.patch_embed(img) + model.pos_embed[:, 1:]
    for block in model.blocks[:layers]:
        x = block(x)
    cls = (model.cls_token + model.pos_embed[:, :1]).expand(x.shape[0], -1, -1)
    x = torch.cat([cls, x], dim=1)
    for block in model.blocks[layers:]:
        x = block(x)
    return model.forward_head(model.norm(x))


@pytest.mark.parametrize('class_token', [True, False])
def test_layernorm_init_equals_the_layernorm_model(class_token):
    args = dict(SMALL, **({} if class_token else dict(class_token=False, global_pool='avg')))
    torch.manual_seed(0)
    ln = timm.create_model('vit_tiny_patch16_224', **args).eval()
    dtn = timm.create_model('vit_tiny_patch16_224_dtn', **args, dtn_layers=2,
                            dtn_init='layernorm').eval()
    missing = dtn.load_state_dict(ln.state_dict(), strict=False).missing_keys
    assert sorted({k.rsplit('.', 1)[1] for k in missing}) == [
        'mean_gate_distance', 'pos_coef', 'var_gate_distance']
    img = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = stock_forward_class_token_after(ln, img, 2) if class_token else ln(img)
        assert (dtn(img) - expected).abs().max() < 1e-4
    if class_token:  # the stock model, whose class token enters every block, differs
        assert (ln(img) - expected).abs().max() > 1e-3


# ------------------------------------------------------------------ the authors' ViT checkpoints
# A small ViT-T*-like model: 4 attention heads, 4 DTN heads, DTN in the first 2 of 3 blocks.
C, HEADS, DEPTH, L_DTN, PATCH, SIDE = 32, 4, 3, 2, 8, 4
REF_EPS, LN_EPS = 1e-5, 1e-6  # the reference DTN's eps; timm's ViT LayerNorms'


def authors_checkpoint(seed=0, class_position=False):
    """Random float64 weights in the authors' ViT format: timm's ViT names, DTN layers in the
    reference code's names, a position embedding of the patches (+ the class token's)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * std

    sd = {'cls_token': rnd(1, 1, C, std=0.5), 'pos_embed': rnd(1, SIDE**2 + class_position, C),
          'patch_embed.proj.weight': rnd(C, 3, PATCH, PATCH, std=0.1),
          'patch_embed.proj.bias': rnd(C, std=0.1), 'norm.weight': 1 + rnd(C, std=0.3),
          'norm.bias': rnd(C, std=0.2), 'head.weight': rnd(5, C, std=0.2), 'head.bias': rnd(5)}
    for i in range(DEPTH):
        b = f'blocks.{i}.'
        for name, (out, inp) in {'attn.qkv': (3 * C, C), 'attn.proj': (C, C),
                                 'mlp.fc1': (4 * C, C), 'mlp.fc2': (C, 4 * C)}.items():
            sd[b + name + '.weight'], sd[b + name + '.bias'] = rnd(out, inp, std=inp**-0.5), \
                rnd(out, std=0.1)
        for n in ('norm1', 'norm2'):
            sd[b + n + '.weight'], sd[b + n + '.bias'] = 1 + rnd(C, std=0.3), rnd(C, std=0.2)
            if i < L_DTN:
                proj = rnd(HEADS, 3, std=0.5)
                proj[:, 2] = -proj[:, 2].abs() - 0.1
                sd.update({b + n + '.mean_norm_weight': rnd(HEADS), b + n + '.pos_proj.bias':
                           rnd(HEADS), b + n + '.var_norm_weight': rnd(HEADS),
                           b + n + '.pos_proj.weight': proj})
    return sd


def authors_vit(img, sd):
    """The authors' ViT-DTN logits: DTN blocks on the patches, the class token appended after
    block l^dtn (ConViT), LayerNorm blocks after it, the class token classified."""
    x = F.conv2d(img, sd['patch_embed.proj.weight'], sd['patch_embed.proj.bias'], stride=PATCH)
    x = x.flatten(2).transpose(1, 2)
    pos = sd['pos_embed']
    x = x + pos[:, -SIDE**2:]
    cls = sd['cls_token'] + (pos[:, :1] if pos.shape[1] > SIDE**2 else 0)

    def norm(x, key, i):
        if i < L_DTN:
            layer = {k[len(key) + 1:]: v for k, v in sd.items() if k.startswith(key + '.')}
            return reference_forward(x, layer, HEADS, SIDE, 1, REF_EPS)
        return F.layer_norm(x, (C, ), sd[key + '.weight'], sd[key + '.bias'], LN_EPS)

    for i in range(DEPTH):
        b = f'blocks.{i}.'
        if i == L_DTN:
            x = torch.cat([cls.expand(x.shape[0], -1, -1), x], dim=1)
        B, N, _ = x.shape
        qkv = F.linear(norm(x, b + 'norm1', i), sd[b + 'attn.qkv.weight'], sd[b + 'attn.qkv.bias'])
        q, k, v = qkv.reshape(B, N, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (C // HEADS)**-0.5).softmax(-1)
        out = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = x + F.linear(out, sd[b + 'attn.proj.weight'], sd[b + 'attn.proj.bias'])
        h = F.gelu(F.linear(norm(x, b + 'norm2', i), sd[b + 'mlp.fc1.weight'],
                            sd[b + 'mlp.fc1.bias']))
        x = x + F.linear(h, sd[b + 'mlp.fc2.weight'], sd[b + 'mlp.fc2.bias'])
    x = F.layer_norm(x, (C, ), sd['norm.weight'], sd['norm.bias'], LN_EPS)
    return F.linear(x[:, 0], sd['head.weight'], sd['head.bias'])


def authors_model():
    return timm.create_model('vit_tiny_patch16_224_dtn', img_size=PATCH * SIDE, patch_size=PATCH,
                             embed_dim=C, depth=DEPTH, num_heads=HEADS, num_classes=5,
                             dtn_layers=L_DTN, dtn_heads=HEADS, dtn_reference_compat=True).double()


@pytest.mark.parametrize('class_position', [False, True])
def test_authors_checkpoint_reproduces_the_authors_forward(class_position):
    sd = authors_checkpoint(class_position=class_position)
    model = authors_model()
    model.load_state_dict(sd)  # strict: converted by the model's load hook
    img = torch.randn(2, 3, PATCH * SIDE, PATCH * SIDE, dtype=torch.float64)
    with torch.no_grad():
        ours, expected = model.eval()(img), authors_vit(img, sd)
    assert (ours - expected).abs().max() <= 1e-9 * expected.abs().max()
    # the paper's statistics instead of the reference code's compute something else
    paper = timm.create_model('vit_tiny_patch16_224_dtn', img_size=PATCH * SIDE,
                              patch_size=PATCH, embed_dim=C, depth=DEPTH, num_heads=HEADS,
                              num_classes=5, dtn_layers=L_DTN, dtn_heads=HEADS).double()
    paper.load_state_dict(sd)
    with torch.no_grad():
        assert (paper.eval()(img) - expected).abs().max() > 1e-3


def test_reference_conversion_of_the_position_embedding():
    patches_only = convert_reference_vit_state_dict(authors_checkpoint())
    assert patches_only['pos_embed'].shape == (1, SIDE**2 + 1, C)
    assert not patches_only['pos_embed'][:, 0].any()
    assert 'blocks.0.norm1.pos_coef' in patches_only and 'blocks.0.norm1.pos_proj.weight' \
        not in patches_only
    with_class = authors_checkpoint(class_position=True)
    assert torch.equal(convert_reference_vit_state_dict(with_class)['pos_embed'],
                       with_class['pos_embed'])
