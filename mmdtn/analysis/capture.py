"""Forward hooks that record what the analyses need during one forward pass of a backbone.

* :class:`NormRecorder`: input and output of every block norm (``norm1``/``norm2``, LayerNorm or
  DTN) with the block's ``hw_shape``.
* :class:`AttentionRecorder`: the inputs of every attention module (PVT's spatial-reduction
  attention, Swin's shifted-window attention, a ViT's global attention), as
  :class:`SRAttentionRecord` / :class:`WindowAttentionRecord` / :class:`GlobalAttentionRecord`
  objects that recompute the weights and give token positions.

In a ViT the blocks do not take the grid: it is the patch embedding's output grid, and the class
token (which has no position) is left out of the records: norms record the patch tokens, and
attention the patch queries' weights on the patch keys.

Both are context managers; hooks are removed on exit. Records are cleared by :meth:`clear`.
"""
import torch

from .attention import (grid_positions, mha_attention, reduced_cell_centres, window_attention,
                        window_positions)
from .models import call_argument, call_grid, is_dtn, transformer_blocks

__all__ = ['NormRecord', 'NormRecorder', 'SRAttentionRecord', 'WindowAttentionRecord',
           'GlobalAttentionRecord', 'AttentionRecorder', 'record']


class _Hooks:
    """Hooks on the transformer blocks of ``model``; ``_hw`` holds each block's last hw_shape."""

    def __init__(self, model):
        self._handles = []
        self.records = []
        self.blocks = transformer_blocks(model)
        self._hw = {}
        self._patch_grid = None  # a ViT's: the output grid of its patch embedding
        patch_embed = getattr(model, 'patch_embed', None)
        if isinstance(patch_embed, torch.nn.Module):
            self._handles.append(patch_embed.register_forward_hook(self._patch_grid_hook))

    def _patch_grid_hook(self, module, args, output):
        if isinstance(output, tuple) and len(output) == 2:  # mmseg/mmdet: (tokens, hw_shape)
            self._patch_grid = tuple(output[1])

    def grid_of(self, block):
        """The grid of ``block``'s current call: its ``hw_shape`` argument, else the patch grid."""
        return self._hw.get(block.name) or self._patch_grid

    def _hw_hook(self, block, index):
        """Pre-hook keeping ``hw_shape`` (argument ``index``) of a call under the block's name."""
        def hook(module, args, kwargs):
            self._hw[block.name] = call_argument(args, kwargs, index, 'hw_shape')
        return hook

    def clear(self):
        self.records = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []


class NormRecord:
    """One call of a block norm: ``x`` (B, N, C) in, ``y`` out, on an ``hw_shape`` map."""

    def __init__(self, block, norm_name, module, x, y, hw_shape):
        self.block, self.norm_name, self.module = block, norm_name, module
        self.x, self.y, self.hw_shape = x, y, tuple(int(v) for v in hw_shape)

    @property
    def label(self):
        return f'{self.block.label}.{self.norm_name}'

    @property
    def is_dtn(self):
        return is_dtn(self.module)


class NormRecorder(_Hooks):
    """Records input and output of ``norm1``/``norm2`` of every transformer block of ``model``."""

    def __init__(self, model):
        super().__init__(model)
        for block in self.blocks:
            self._handles.append(block.module.register_forward_pre_hook(
                self._hw_hook(block, 1), with_kwargs=True))
            for norm_name in ('norm1', 'norm2'):
                norm = getattr(block.module, norm_name)
                self._handles.append(norm.register_forward_hook(
                    self._norm_hook(block, norm_name), with_kwargs=True))

    def _norm_hook(self, block, norm_name):
        def hook(module, args, kwargs, output):
            hw = call_grid(module, args, kwargs) or self.grid_of(block)
            x, y = args[0].detach(), output.detach()
            prefix = x.shape[1] - int(hw[0]) * int(hw[1])  # a ViT's class token
            self.records.append(NormRecord(block, norm_name, module, x[:, prefix:],
                                           y[:, prefix:], hw))
        return hook


class SRAttentionRecord:
    """Inputs of one call of PVT's spatial-reduction attention (queries: tokens; keys: cells)."""
    kind = 'spatial-reduction'

    def __init__(self, block, module, query, key, hw_shape):
        self.block, self.module = block, module
        self.query, self.key = query, key  # batch-first (B, N, C)
        self.hw_shape = tuple(int(v) for v in hw_shape)
        self.num_heads = module.attn.num_heads

    def key_positions(self):
        if getattr(self.module, 'sr_ratio', 1) > 1:
            conv = self.module.sr
            pos = reduced_cell_centres(self.hw_shape, conv.kernel_size[0], conv.stride[0],
                                       conv.padding[0] if isinstance(conv.padding, tuple) else 0,
                                       self.query.device)
        else:
            pos = grid_positions(self.hw_shape, self.query.device)
        if pos.shape[0] != self.key.shape[1]:
            raise ValueError(f'{self.block.label}: {self.key.shape[1]} keys but the reduction of a '
                             f'{self.hw_shape} map gives {pos.shape[0]} cells')
        return pos

    @torch.no_grad()
    def weights(self, start=0, stop=None):
        """Attention (B, heads, nq, Nk) of the queries ``start:stop``."""
        return mha_attention(self.module.attn, self.query[:, start:stop], self.key)

    @torch.no_grad()
    def chunks(self, max_queries=2048):
        """Yields ``(attn, q_pos, k_pos, q_valid)`` over chunks of queries (bounded memory)."""
        q_pos_all, k_pos = grid_positions(self.hw_shape, self.query.device), self.key_positions()
        n = self.query.shape[1]
        for start in range(0, n, max_queries):
            stop = min(n, start + max_queries)
            yield self.weights(start, stop), q_pos_all[start:stop], k_pos, None


class GlobalAttentionRecord(SRAttentionRecord):
    """Inputs of one call of a ViT's global attention; tokens before the patches (the class token)
    attend and are attended to, but only the patch queries' weights on the patch keys are given
    (those on the class token have no distance)."""
    kind = 'global'

    @property
    def num_prefix_tokens(self):
        return self.query.shape[1] - self.hw_shape[0] * self.hw_shape[1]

    def key_positions(self):
        return grid_positions(self.hw_shape, self.query.device)

    @torch.no_grad()
    def weights(self, start=0, stop=None):
        """Attention (B, heads, nq, HW) of the patch queries ``start:stop`` on the patch keys."""
        n = self.num_prefix_tokens
        stop = None if stop is None else stop + n
        return mha_attention(self.module.attn, self.query[:, start + n:stop], self.key)[..., n:]

    @torch.no_grad()
    def chunks(self, max_queries=2048):
        pos = grid_positions(self.hw_shape, self.query.device)
        n = pos.shape[0]
        for start in range(0, n, max_queries):
            stop = min(n, start + max_queries)
            yield self.weights(start, stop), pos[start:stop], pos, None


class WindowAttentionRecord:
    """Inputs of one call of Swin's (shifted) window attention: windows of the padded map."""
    kind = 'window'

    def __init__(self, block, module, windows, mask, hw_shape):
        self.block, self.module = block, module  # module: ShiftWindowMSA
        self.windows, self.mask = windows, mask
        self.hw_shape = tuple(int(v) for v in hw_shape)
        self.num_heads = module.w_msa.num_heads

    def positions(self):
        """(num_windows*B, N, 2) positions and (num_windows*B, N) validity of the window tokens."""
        pos, valid = window_positions(self.hw_shape, self.module.window_size,
                                      self.module.shift_size, self.windows.device)
        reps = self.windows.shape[0] // pos.shape[0]
        return pos.repeat(reps, 1, 1), valid.repeat(reps, 1)

    @torch.no_grad()
    def weights(self):
        """Attention (num_windows*B, heads, N, N) inside every window."""
        return window_attention(self.module.w_msa, self.windows, self.mask)

    @torch.no_grad()
    def chunks(self, max_windows=256):
        pos, valid = self.positions()
        for start in range(0, self.windows.shape[0], max_windows):
            sl = slice(start, start + max_windows)
            attn = window_attention(self.module.w_msa, self.windows[sl], self.mask)
            yield attn, pos[sl], pos[sl], valid[sl]


class AttentionRecorder(_Hooks):
    """Records the inputs of every attention module of the transformer blocks of ``model``."""

    def __init__(self, model):
        super().__init__(model)
        from mmcv.cnn.bricks.transformer import MultiheadAttention
        from mmdet.models.backbones.pvt import SpatialReductionAttention
        from mmdet.models.backbones.swin import ShiftWindowMSA
        for block in self.blocks:
            attn = block.module.attn
            if isinstance(attn, SpatialReductionAttention):
                self._handles.append(attn.register_forward_pre_hook(
                    self._hw_hook(block, 1), with_kwargs=True))
                self._handles.append(attn.attn.register_forward_pre_hook(
                    self._mha_hook(block, attn), with_kwargs=True))
            elif isinstance(attn, ShiftWindowMSA):
                self._handles.append(attn.register_forward_pre_hook(
                    self._hw_hook(block, 1), with_kwargs=True))
                self._handles.append(attn.w_msa.register_forward_pre_hook(
                    self._window_hook(block, attn), with_kwargs=True))
            elif type(attn) is MultiheadAttention:  # a ViT's (mmseg's TransformerEncoderLayer)
                self._handles.append(attn.attn.register_forward_pre_hook(
                    self._mha_hook(block, attn, GlobalAttentionRecord), with_kwargs=True))
            else:
                raise ValueError(f'{block.name}: attention {type(attn).__name__} is not supported '
                                 f'(SpatialReductionAttention, ShiftWindowMSA or a ViT\'s '
                                 f'MultiheadAttention)')

    def _mha_hook(self, block, attention, record_cls=SRAttentionRecord):
        def hook(module, args, kwargs):
            query = call_argument(args, kwargs, 0, 'query')
            key = call_argument(args, kwargs, 1, 'key')
            if not module.batch_first:
                query, key = query.transpose(0, 1), key.transpose(0, 1)
            self.records.append(record_cls(block, attention, query.detach(), key.detach(),
                                           self.grid_of(block)))
        return hook

    def _window_hook(self, block, swmsa):
        def hook(module, args, kwargs):
            mask = call_argument(args, kwargs, 1, 'mask')
            self.records.append(WindowAttentionRecord(
                block, swmsa, args[0].detach(), None if mask is None else mask.detach(),
                self._hw[block.name]))
        return hook


@torch.no_grad()
def record(model, image, *recorders):
    """Run ``model`` on ``image`` with every recorder cleared first; returns the model output."""
    for r in recorders:
        r.clear()
    return model(image)
