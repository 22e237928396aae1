"""Dual PatchNorm: the patch LayerNorm equals unfold + LayerNorm + linear projection exactly."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from mmcv.cnn import build_conv_layer
from mmdet.models.layers import PatchEmbed

from mmdtn.models.layers.dual_patchnorm import PatchNormConv2d, add_dual_patchnorm


def reference_dpn(conv: PatchNormConv2d, x: torch.Tensor) -> torch.Tensor:
    """Unfold every (zero-padded) receptive field, LayerNorm it, project it (the DPN definition)."""
    B = x.shape[0]
    cols = F.unfold(x, conv.kernel_size, conv.dilation, conv.padding, conv.stride)  # (B, D, L)
    D = cols.shape[1]
    normed = F.layer_norm(cols.transpose(1, 2), (D, ), conv.patch_norm.weight,
                          conv.patch_norm.bias, conv.patch_norm.eps)
    y = normed @ conv.weight.reshape(conv.out_channels, D).t()
    if conv.bias is not None:
        y = y + conv.bias
    H = (x.shape[2] + 2 * conv.padding[0] - conv.dilation[0] * (conv.kernel_size[0] - 1) - 1) \
        // conv.stride[0] + 1
    return y.transpose(1, 2).reshape(B, conv.out_channels, H, -1)


def randomised(conv: PatchNormConv2d) -> PatchNormConv2d:
    with torch.no_grad():
        conv.patch_norm.weight.uniform_(0.5, 1.5)
        conv.patch_norm.bias.normal_(0, 0.3)
        if conv.bias is not None:
            conv.bias.normal_()
    return conv


GEOMETRIES = {
    'pvtv2_7x7_s4_p3': dict(kernel_size=7, stride=4, padding=3),
    'pvt_4x4_s4': dict(kernel_size=4, stride=4, padding=0),
    'dilated_3x3_s2_p2': dict(kernel_size=3, stride=2, padding=2, dilation=2),
}


@pytest.mark.parametrize('geometry', list(GEOMETRIES))
@pytest.mark.parametrize('size', [(64, 64), (65, 97)])
def test_equals_unfold_layernorm_projection_float64(geometry, size):
    torch.manual_seed(0)
    conv = randomised(PatchNormConv2d(3, 16, **GEOMETRIES[geometry], dtype=torch.float64))
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    torch.testing.assert_close(conv(x), reference_dpn(conv, x), rtol=0, atol=1e-10)


def test_exact_in_float32_for_inputs_far_from_zero():
    """Centring by a per-image constant keeps E[v^2] - mu^2 accurate on offset inputs."""
    torch.manual_seed(0)
    conv = randomised(PatchNormConv2d(3, 32, 7, stride=4, padding=3))
    x = torch.randn(2, 3, 65, 97) * 3 + 100
    ref = reference_dpn(conv.double(), x.double()).float()
    torch.testing.assert_close(conv.float()(x), ref, rtol=0, atol=1e-4)
    flat = torch.full((1, 3, 32, 32), 255.0)  # constant patches (zero variance): finite
    assert torch.isfinite(conv(flat)).all()


def test_gradients_match_reference():
    torch.manual_seed(0)
    conv = randomised(PatchNormConv2d(3, 8, 7, stride=4, padding=3, dtype=torch.float64))
    x = torch.randn(2, 3, 33, 30, dtype=torch.float64, requires_grad=True)
    params = [x, conv.weight, conv.bias, conv.patch_norm.weight, conv.patch_norm.bias]
    g = torch.randn_like(conv(x))
    ours = torch.autograd.grad((conv(x) * g).sum(), params)
    ref = torch.autograd.grad((reference_dpn(conv, x) * g).sum(), params)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_autocast_and_empty_batch():
    conv = randomised(PatchNormConv2d(3, 8, 7, stride=4, padding=3))
    x = torch.randn(2, 3, 32, 48)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y = conv(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), reference_dpn(conv, x), rtol=0.05, atol=0.1)
    assert conv(torch.randn(0, 3, 32, 48)).shape == (0, 8, 8, 12)


def test_from_conv_keeps_parameters_and_bad_input_is_named():
    conv = nn.Conv2d(3, 8, 7, stride=4, padding=3)
    dpn = PatchNormConv2d.from_conv(conv, patch_norm_eps=1e-5)
    assert torch.equal(dpn.weight, conv.weight) and torch.equal(dpn.bias, conv.bias)
    assert dpn.patch_norm.normalized_shape == (3 * 7 * 7, ) and dpn.patch_norm.eps == 1e-5
    with pytest.raises(ValueError, match=r'\(2, 4, 16, 16\)'):
        dpn(torch.randn(2, 4, 16, 16))
    with pytest.raises(ValueError, match='groups'):
        PatchNormConv2d(4, 8, 3, groups=2)


def test_patch_embed_dual_patchnorm_with_corner_padding():
    """Swin's PatchEmbed pads bottom/right ('corner'); the patch LayerNorm sees those zeros."""
    torch.manual_seed(0)
    embed = PatchEmbed(3, 24, kernel_size=4, stride=4, norm_cfg=dict(type='LN'))
    post_norm = embed.norm
    add_dual_patchnorm(embed)
    assert embed.norm is post_norm and isinstance(embed.projection, PatchNormConv2d)
    randomised(embed.projection)
    x = torch.randn(2, 3, 65, 97)
    out, hw = embed(x)
    assert hw == (17, 25)
    ref = reference_dpn(embed.projection, F.pad(x, (0, 3, 0, 3)))
    torch.testing.assert_close(out, post_norm(ref.flatten(2).transpose(1, 2)), rtol=0,
                               atol=1e-5)
    with pytest.raises(ValueError, match='patch_norm=False'):
        add_dual_patchnorm(PatchEmbed(3, 24, kernel_size=4, stride=4, norm_cfg=None))


def test_registered_as_conv_layer():
    conv = build_conv_layer(dict(type='PatchNormConv2d'), 3, 8, kernel_size=4, stride=4)
    assert isinstance(conv, PatchNormConv2d)
