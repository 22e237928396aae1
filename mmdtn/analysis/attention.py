"""Attention weights recomputed from a module's own parameters, token positions, attention distance.

The weights are never read from inside mmdet's forward: the hooks of :mod:`.capture` record the
inputs of the attention modules and the functions here recompute ``softmax(q k^T / sqrt(d) + bias)``
from the modules' projection parameters:

* PVT / PVTv2 (mmdet's ``SpatialReductionAttention``): the inner ``nn.MultiheadAttention`` gets the
  queries (all tokens) and the spatially reduced keys. A key is a cell of the reduction convolution
  and sits at the centre of that cell, ``r * stride - padding + (kernel - 1) / 2``, in token units.
* Swin (mmdet's ``ShiftWindowMSA`` / ``WindowMSA``): attention inside each window of the (padded,
  cyclically shifted) map, with the relative position bias and the shift mask. Token positions are
  those of the original map (the shift undone); queries on padding are left out.

Mean attention distance (DTN paper, Fig. 2 and appendix B.1): for query i of head h,
``d_i = sum_j A_ij * ||p_i - p_j||`` and the layer's value is the mean of d_i over the queries.
"""
import torch
import torch.nn.functional as F

__all__ = ['grid_positions', 'reduced_cell_centres', 'window_positions', 'mha_attention',
           'mha_output', 'window_attention', 'window_output', 'distance_sums',
           'mean_attention_distance']


def grid_positions(hw_shape, device=None):
    """(H*W, 2) (row, column) of the tokens of an H x W map, row-major."""
    h, w = hw_shape
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                indexing='ij')
    return torch.stack([rows.flatten(), cols.flatten()], -1).float()


def reduced_cell_centres(hw_shape, kernel, stride, padding=0, device=None):
    """(h*w, 2) centres, in token units, of the cells of a convolution over an H x W token map."""
    h, w = hw_shape
    oh = (h + 2 * padding - kernel) // stride + 1
    ow = (w + 2 * padding - kernel) // stride + 1
    cells = grid_positions((oh, ow), device)
    return cells * stride - padding + (kernel - 1) / 2


def window_positions(hw_shape, window_size, shift_size, device=None):
    """Original (row, col) of every token of every window of Swin's shifted, padded map.

    Returns ``positions`` (num_windows, window_size**2, 2) and ``valid`` (num_windows,
    window_size**2), False for tokens on the padding. Windows are in the order of mmdet's
    ``window_partition`` (row-major over the padded map), tokens row-major inside a window.
    """
    h, w = hw_shape
    ws = window_size
    hp, wp = -(-h // ws) * ws, -(-w // ws) * ws
    pos = grid_positions((hp, wp), device).view(hp, wp, 2)
    if shift_size:
        pos = torch.roll(pos, shifts=(-shift_size, -shift_size), dims=(0, 1))
    pos = pos.view(hp // ws, ws, wp // ws, ws, 2).permute(0, 2, 1, 3, 4).reshape(-1, ws * ws, 2)
    valid = (pos[..., 0] < h) & (pos[..., 1] < w)
    return pos, valid


def _mha_projections(mha):
    c = mha.embed_dim
    if getattr(mha, 'bias_k', None) is not None or getattr(mha, 'add_zero_attn', False):
        raise ValueError('attention with add_bias_kv/add_zero_attn is not supported')
    if mha._qkv_same_embed_dim:
        wq, wk, wv = mha.in_proj_weight.split(c)
    else:
        wq, wk, wv = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    bq = bk = bv = None
    if mha.in_proj_bias is not None:
        bq, bk, bv = mha.in_proj_bias.split(c)
    return (wq, bq), (wk, bk), (wv, bv)


def _heads(x, num_heads):
    b, n, c = x.shape
    return x.view(b, n, num_heads, c // num_heads).transpose(1, 2)


def mha_attention(mha, query, key):
    """Attention weights (B, heads, Nq, Nk) of an ``nn.MultiheadAttention``; batch-first inputs."""
    (wq, bq), (wk, bk), _ = _mha_projections(mha)
    q = _heads(F.linear(query, wq, bq), mha.num_heads)
    k = _heads(F.linear(key, wk, bk), mha.num_heads)
    scale = (q.shape[-1]) ** -0.5
    return torch.softmax((q * scale) @ k.transpose(-2, -1), dim=-1)


def mha_output(mha, attn, value):
    """``out_proj(concat_h(attn_h @ v_h))``: what the module outputs for the weights ``attn``."""
    _, _, (wv, bv) = _mha_projections(mha)
    v = _heads(F.linear(value, wv, bv), mha.num_heads)
    out = (attn @ v).transpose(1, 2).flatten(2)
    return mha.out_proj(out)


def _window_qkv(w_msa, x):
    b, n, c = x.shape
    qkv = w_msa.qkv(x).view(b, n, 3, w_msa.num_heads, c // w_msa.num_heads).permute(2, 0, 3, 1, 4)
    return qkv[0], qkv[1], qkv[2]


def window_attention(w_msa, x, mask=None):
    """Attention weights (num_windows*B, heads, N, N) of mmdet's ``WindowMSA`` for windows ``x``.

    Adds the module's relative position bias (from its own table and index) and the shift mask
    (num_windows, N, N) when given.
    """
    q, k, _ = _window_qkv(w_msa, x)
    logits = (q * w_msa.scale) @ k.transpose(-2, -1)
    n = x.shape[1]
    bias = w_msa.relative_position_bias_table[w_msa.relative_position_index.view(-1)]
    logits = logits + bias.view(n, n, -1).permute(2, 0, 1)[None]
    if mask is not None:
        nw = mask.shape[0]
        logits = (logits.view(-1, nw, w_msa.num_heads, n, n) + mask[None, :, None]).view_as(logits)
    return torch.softmax(logits, dim=-1)


def window_output(w_msa, attn, x):
    """``proj(concat_h(attn_h @ v_h))`` for the windows ``x``: what ``WindowMSA`` outputs."""
    _, _, v = _window_qkv(w_msa, x)
    return w_msa.proj((attn @ v).transpose(1, 2).flatten(2))


def distance_sums(attn, q_pos, k_pos, q_valid=None):
    """Per head: the sum over (valid) queries of ``d_i = sum_j A_ij ||p_i - p_j||``, and the count.

    ``attn`` (L, heads, Nq, Nk); ``q_pos`` (L or 1, Nq, 2) or (Nq, 2); ``k_pos`` likewise with Nk;
    ``q_valid`` (L or 1, Nq) bool. Returns ``(sums (heads,), count)``, in float64.
    """
    q_pos = q_pos if q_pos.dim() == 3 else q_pos[None]
    k_pos = k_pos if k_pos.dim() == 3 else k_pos[None]
    dist = torch.cdist(q_pos.double(), k_pos.double())  # (L|1, Nq, Nk)
    d = (attn.double() * dist[:, None]).sum(-1)  # (L, heads, Nq)
    if q_valid is None:
        q_valid = torch.ones(d.shape[0], d.shape[2], dtype=torch.bool, device=d.device)
    q_valid = q_valid.expand(d.shape[0], d.shape[2])
    sums = (d * q_valid[:, None]).sum((0, 2))
    return sums, int(q_valid.sum())


def mean_attention_distance(attn, q_pos, k_pos, q_valid=None):
    """Mean attention distance per head (heads,), as defined in the DTN paper's appendix B.1."""
    sums, count = distance_sums(attn, q_pos, k_pos, q_valid)
    return sums / count
