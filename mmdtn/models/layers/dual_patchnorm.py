"""Dual PatchNorm (Kumar et al., 2023): LayerNorm before and after the patch projection.

Dual PatchNorm (DPN) normalizes every flattened input patch (``kh * kw * in_channels`` values)
with a LayerNorm before the patch-embedding projection and keeps the LayerNorm after it. ViT's
patches do not overlap, so they can simply be cut out; PVTv2's stage-1 projection is a 7x7 conv
with stride 4 and padding 3, whose receptive fields overlap and include zero padding. The patch
LayerNorm here normalizes each receptive field *exactly as the convolution sees it* (padding zeros
included) without materializing the unfolded patches, which would be ``kh * kw / stride^2`` (~3x for
PVTv2) times the input.

For a patch ``v`` (D values) with mean ``mu`` and variance ``var``, LayerNorm weight ``g`` and bias
``b``, and projection weight ``W_o`` / bias ``c_o`` of output channel ``o``::

    W_o . (g * (v - mu) / sqrt(var + eps) + b) + c_o
        = (conv(v, W_o * g) - mu * sum(W_o * g)) / sqrt(var + eps) + W_o . b + c_o

so one convolution with the gain folded into the weight gives the projection, and ``mu``, ``var``
come from two single-channel box sums (of the channel-summed input and of its square) with the
convolution's own kernel size, stride, padding and dilation. The input is first centred by a
per-image constant, padding included (LayerNorm is invariant to it), so that ``E[v^2] - mu^2``
does not suffer cancellation on inputs far from zero.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ['PatchNormConv2d', 'add_dual_patchnorm']


class PatchNormConv2d(nn.Conv2d):
    """A ``Conv2d`` that layer-normalizes each of its input patches before projecting it.

    Equivalent to unfolding the (zero-padded) input into patches of ``in_channels * kh * kw``
    values, applying ``nn.LayerNorm`` to every patch and multiplying by the flattened convolution
    weight, but computed without the unfold (see the module docstring).

    The patch LayerNorm's parameters live in ``self.patch_norm`` (an ``nn.LayerNorm`` of
    ``in_channels * kh * kw`` features, ordered like the flattened convolution weight:
    channel-major, then kernel row, then kernel column, as ``torch.nn.functional.unfold``). Its
    ``forward`` is never called; it holds the affine parameters and ``eps``.

    Args:
        *args, **kwargs: as ``nn.Conv2d`` (``groups`` must be 1 and ``padding_mode`` 'zeros').
        patch_norm_eps (float): epsilon of the patch LayerNorm. Default: 1e-6 (as ViT's DPN).
    """

    def __init__(self, *args, patch_norm_eps: float = 1e-6, **kwargs):
        super().__init__(*args, **kwargs)
        if self.groups != 1 or self.padding_mode != 'zeros' or isinstance(self.padding, str):
            raise ValueError(
                'PatchNormConv2d needs groups=1, padding_mode="zeros" and numeric padding, got '
                f'groups={self.groups}, padding_mode={self.padding_mode!r}, '
                f'padding={self.padding!r}')
        kh, kw = self.kernel_size
        self.patch_norm = nn.LayerNorm(self.in_channels * kh * kw, eps=patch_norm_eps,
                                       device=self.weight.device, dtype=self.weight.dtype)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, patch_norm_eps: float = 1e-6) -> 'PatchNormConv2d':
        """Build a ``PatchNormConv2d`` with ``conv``'s geometry and a copy of its parameters."""
        if type(conv) is not nn.Conv2d and not isinstance(conv, cls):
            raise ValueError(f'expected a torch.nn.Conv2d projection, got {type(conv).__name__}')
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                  padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                  bias=conv.bias is not None, padding_mode=conv.padding_mode,
                  patch_norm_eps=patch_norm_eps, device=conv.weight.device,
                  dtype=conv.weight.dtype)
        with torch.no_grad():
            new.weight.copy_(conv.weight)
            if conv.bias is not None:
                new.bias.copy_(conv.bias)
        return new

    def _patch_moments(self, x: torch.Tensor):
        """Mean and variance of every receptive field of ``x`` (already padded): (B, 1, H', W')."""
        kh, kw = self.kernel_size
        ones = x.new_ones(1, 1, kh, kw)
        count = x.shape[1] * kh * kw

        def box_mean(t):
            return F.conv2d(t, ones, None, self.stride, 0, self.dilation) / count

        mean = box_mean(x.sum(1, keepdim=True))
        var = (box_mean(x.square().sum(1, keepdim=True)) - mean.square()).clamp_min(0)
        return mean, var

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.in_channels:
            raise ValueError(f'PatchNormConv2d expects (B, {self.in_channels}, H, W) input, '
                             f'got shape {tuple(x.shape)}')
        gain = self.patch_norm.weight.view(self.in_channels, *self.kernel_size)
        shift = self.patch_norm.bias.view(self.in_channels, *self.kernel_size)
        weight = self.weight * gain  # W_o * g
        weight_sum = weight.sum((1, 2, 3))  # sum(W_o * g), for the mean term
        const = (self.weight * shift).sum((1, 2, 3))  # W_o . b + c_o
        if self.bias is not None:
            const = const + self.bias

        # Zero-pad as the convolution would, then centre everything (padding included) by a
        # per-image constant: each patch is shifted as a whole, which LayerNorm ignores.
        ph, pw = self.padding
        x = F.pad(x, (pw, pw, ph, ph))
        x = x - x.detach().mean((1, 2, 3), keepdim=True)
        y = F.conv2d(x, weight, None, self.stride, 0, self.dilation)

        # Patch statistics and the normalization in (at least) float32, also under autocast.
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            mean, var = self._patch_moments(x.to(dtype))
            rstd = torch.rsqrt(var + self.patch_norm.eps)
            out = (y.to(dtype) - mean * weight_sum.to(dtype).view(1, -1, 1, 1)) * rstd \
                + const.to(dtype).view(1, -1, 1, 1)
        return out.to(y.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ', patch_norm=LayerNorm'


def add_dual_patchnorm(patch_embed: nn.Module, patch_norm_eps: Optional[float] = None) -> nn.Module:
    """Turn an mmdet ``PatchEmbed`` into a Dual PatchNorm embedding, in place.

    Replaces ``patch_embed.projection`` (an ``nn.Conv2d``) by a :class:`PatchNormConv2d` with the
    same geometry and parameters, so the stock ``PatchEmbed.forward`` now normalizes every patch
    before projecting it; the LayerNorm after the projection (``patch_embed.norm``) is kept.

    Args:
        patch_embed: an ``mmdet.models.layers.PatchEmbed`` with a post-projection norm.
        patch_norm_eps: epsilon of the patch LayerNorm; default: that of ``patch_embed.norm``.

    Returns:
        ``patch_embed``.
    """
    post_norm = getattr(patch_embed, 'norm', None)
    if post_norm is None:
        raise ValueError('Dual PatchNorm keeps the LayerNorm after the patch projection, but this '
                         'patch embedding has none (e.g. Swin with patch_norm=False)')
    if patch_norm_eps is None:
        patch_norm_eps = getattr(post_norm, 'eps', 1e-6)
    patch_embed.projection = PatchNormConv2d.from_conv(patch_embed.projection, patch_norm_eps)
    return patch_embed
