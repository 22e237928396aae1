"""Dynamic Token Normalization (DTN), Shao et al., "Dynamic Token Normalization Improves Vision
Transformers", ICLR 2022, Sec. 3.2, Eqs. 4-7 and Algorithm 1.

For tokens x (T x C) split into H contiguous channel groups ("heads") x^h::

    mu^h      = lam_m^h mu_ln + (1 - lam_m^h) P^h x^h                                  (Eq. 5)
    sigma2^h  = lam_v^h var_ln + (1 - lam_v^h) [P^h (x^h * x^h) - (P^h x^h)^2]          (Eq. 5)
    y         = gamma * (x - mu) / sqrt(sigma2 + eps) + beta                            (Eq. 4)
    P^h       = softmax_j(a^h . R_ij),  R_ij = [dx^2 + dy^2, dx, dy]                   (Eq. 6)
    a^h       = [-1, 2 Dx^h, 2 Dy^h] at initialisation                                  (Eq. 7)

with mu_ln, var_ln the per-token mean and (biased) variance over all C channels (Eq. 2), lam =
sigmoid(gate) and (dx, dy) the column and row of the source token j minus those of the output
token i.

Implementation notes:

- The logits a^h . R_ij = (a1 dx^2 + a2 dx) + (a1 dy^2 + a3 dy) separate over the two axes, so on a
  rectangular grid the softmax factorises exactly: P^h = P_y^h (kron) P_x^h. P^h x is applied as two
  small matrix products, along W and along H; the T x T matrix is never built (memory O(B C T),
  compute O(B C T (H + W))). :meth:`DynamicTokenNorm.positional_matrix` builds it for inspection.
- ``pool_size`` s > 1 computes the inter-token statistics on the ceil(H/s) x ceil(W/s) grid of
  average-pooled cells (border cells average only real tokens, distances in cells) and every token
  takes the statistics of its cell (the paper's "global average pooling", App. B.1).
- The full-resolution part (Eqs. 2, 4, 5) has a hand-written backward and works in place in two
  buffers per pass (large allocations cost more than passes over memory on CPUs); autograd handles
  the small cell-grid part inside it. ``torch.autograd.gradcheck`` verifies it in the tests.
- Statistics are computed in float32 (or float64) even under autocast; the output has x's dtype. The
  inter-token moments are taken about a per-channel constant (exact, since rows of P sum to 1),
  which avoids the cancellation of E[x^2] - E[x]^2 for features with large offsets.
"""
import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from mmdtn.registry import register_norm_layer

from .reference_compat import PAPER_CONVENTION, REFERENCE_CONVENTION, group_rms_normalize

__all__ = ['DynamicTokenNorm', 'neighbourhood_offsets', 'LAYERNORM_GATE_LOGIT']

#: Gate logit of ``init='layernorm'``. sigmoid never reaches 1: the output differs from LayerNorm by
#: about (1 - lambda) * var_it / var_ln, and for tokens far quieter than their neighbours that ratio
#: can exceed 1e9. With 1 - lambda = sigmoid(-40) = 4e-18 a fresh DTN equals LayerNorm to < 1e-5 for
#: any such features (tested); the price is that the gates start saturated and receive vanishing
#: gradients, so the layer stays LayerNorm unless the gates are lowered (e.g. to 0) for fine-tuning.
LAYERNORM_GATE_LOGIT = 40.0

# Smallest positional logit relative to its row maximum (see _softmax): float32's smallest normal
# number is exp(-87.3).
_LOGIT_FLOOR = -80.0


def neighbourhood_offsets(num_heads):
    """Distinct (Dx, Dy) cell offsets of the smallest k x k neighbourhood with k^2 >= num_heads.

    The neighbourhood spans offsets -floor((k-1)/2) .. ceil((k-1)/2) on both axes and contains the
    token itself (offset (0, 0)). Cells are handed out nearest first (then row-major), so that e.g.
    5 heads take the token and its four direct neighbours.

    Returns:
        list[tuple[int, int]]: ``num_heads`` distinct (Dx, Dy) offsets.
    """
    k = math.ceil(math.sqrt(num_heads))
    lo = -((k - 1) // 2)
    cells = [(dx, dy) for dy in range(lo, lo + k) for dx in range(lo, lo + k)]
    cells.sort(key=lambda c: (c[0]**2 + c[1]**2, c[1], c[0]))
    return cells[:num_heads]


@functools.lru_cache(maxsize=256)
def _relative_offsets(length, device, dtype):
    """Table d[i, j] = j - i (source minus output) for one grid axis, cached per (length, device,
    dtype); created outside inference mode so that it can be used in training afterwards."""
    with torch.inference_mode(False):
        pos = torch.arange(length, device=device, dtype=dtype)
        return pos[None, :] - pos[:, None]


@functools.lru_cache(maxsize=256)
def _cell_index(length, pool_size, device):
    """Index of the pooled cell of every position along one axis (nearest upsampling)."""
    with torch.inference_mode(False):
        return torch.arange(length, device=device) // pool_size


@functools.lru_cache(maxsize=256)
def _cell_counts(H, W, pool_size, device, dtype):
    """Number of real tokens in every cell of the ceil(H/s) x ceil(W/s) grid, (Hp, Wp, 1)."""
    with torch.inference_mode(False):
        rows = (H - torch.arange(0, H, pool_size, device=device)).clamp(max=pool_size)
        cols = (W - torch.arange(0, W, pool_size, device=device)).clamp(max=pool_size)
        return (rows[:, None] * cols[None, :]).to(dtype)[..., None]


@register_norm_layer(name='DynamicTokenNorm')
@register_norm_layer(name='DTN')
class DynamicTokenNorm(nn.Module):
    """Dynamic Token Normalization (Shao et al., ICLR 2022) for tokens on an H x W grid.

    Args:
        num_features (int): number of channels C.
        num_heads (int): number of channel groups H with their own positional matrix P^h and gates.
        pool_size (int): inter-token statistics on the grid average-pooled by this factor (>= 1).
        eps (float): added to the variance (Eq. 4).
        init (str): ``'paper'``: gates 0 (lambda = 0.5), a^h by Eq. 7 with distinct neighbourhood
            offsets; ``'layernorm'``: same a^h, gates = :data:`LAYERNORM_GATE_LOGIT` so that a fresh
            layer equals ``nn.LayerNorm`` with the same weight and bias (to < 1e-5).
        reference_compat (bool): compute the statistics as the authors' reference code does (see
            :mod:`mmdtn.models.layers.reference_compat`); parameters keep their names and meaning.

    Shape:
        ``forward(x, hw_shape)``: x (B, N, C) with N = H * W tokens in row-major order,
        ``hw_shape = (H, W)``; returns a tensor of x's shape and dtype.

    Parameters: ``weight``, ``bias`` (C,); ``mean_gate``, ``var_gate`` (num_heads,) logits of the
    mean and variance weight ratios lambda; ``pos_coef`` (num_heads, 3), the a^h of Eq. 6 for
    R = [dx^2 + dy^2, dx, dy].
    """

    _abbr_ = 'dtn'

    def __init__(self, num_features, num_heads, pool_size=1, eps=1e-6, init='paper',
                 reference_compat=False):
        super().__init__()
        if num_heads < 1 or num_features % num_heads != 0:
            raise ValueError(f'num_features={num_features} channels cannot be split into '
                             f'num_heads={num_heads} equal groups')
        if int(pool_size) != pool_size or pool_size < 1:
            raise ValueError(f'pool_size must be an integer >= 1, got {pool_size}')
        if init not in ('paper', 'layernorm'):
            raise ValueError(f"init must be 'paper' or 'layernorm', got {init!r}")
        if reference_compat and num_features < 2:
            raise ValueError('reference_compat=True uses the unbiased variance over C channels '
                             f'and needs C >= 2, got num_features={num_features}')
        self.num_features = num_features
        self.num_heads = num_heads
        self.pool_size = int(pool_size)
        self.eps = eps
        self.init = init
        self.reference_compat = bool(reference_compat)
        self.convention = REFERENCE_CONVENTION if reference_compat else PAPER_CONVENTION
        self.weight = nn.Parameter(torch.empty(num_features))
        self.bias = nn.Parameter(torch.empty(num_features))
        self.mean_gate = nn.Parameter(torch.empty(num_heads))
        self.var_gate = nn.Parameter(torch.empty(num_heads))
        self.pos_coef = nn.Parameter(torch.empty(num_heads, 3))
        self.reset_parameters()

    def reset_parameters(self):
        """Affine to identity, a^h by Eq. 7, gates by ``self.init`` (Algorithm 1, line 2)."""
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()
            gate = LAYERNORM_GATE_LOGIT if self.init == 'layernorm' else 0.0
            self.mean_gate.fill_(gate)
            self.var_gate.fill_(gate)
            offsets = torch.tensor(neighbourhood_offsets(self.num_heads), dtype=torch.float64)
            self.pos_coef[:, 0] = -1.0  # Eq. 7: a^h = [-1, 2 Dx^h, 2 Dy^h]
            self.pos_coef[:, 1:] = 2 * offsets

    def extra_repr(self):
        return (f'{self.num_features}, num_heads={self.num_heads}, pool_size={self.pool_size}, '
                f'eps={self.eps}, init={self.init!r}, reference_compat={self.reference_compat}')

    # ------------------------------------------------------------------ public helpers
    @property
    def mean_lambda(self):
        """Weight ratio of the intra-token mean, sigmoid(mean_gate), shape (num_heads,)."""
        return torch.sigmoid(self.mean_gate)

    @property
    def var_lambda(self):
        """Weight ratio of the intra-token variance, sigmoid(var_gate), shape (num_heads,)."""
        return torch.sigmoid(self.var_gate)

    def pooled_shape(self, hw_shape):
        """Shape (ceil(H/s), ceil(W/s)) of the grid the inter-token statistics are computed on."""
        H, W = hw_shape
        s = self.pool_size
        return (-(-H // s), -(-W // s))

    def axis_matrices(self, hw_shape, dtype=None):
        """Factors (P_y, P_x) of P^h = P_y^h (kron) P_x^h on the pooled grid (Eq. 6).

        Returns:
            tuple[Tensor, Tensor]: P_y (num_heads, Hp, Hp) and P_x (num_heads, Wp, Wp), rows sum
            to 1; P_x[h, i, j] = softmax_j(a1 (j - i)^2 + a2 (j - i)) and likewise P_y with a3.
        """
        Hp, Wp = self.pooled_shape(hw_shape)
        coef = self.pos_coef if dtype is None else self.pos_coef.to(dtype)
        a1, a2, a3 = (c[:, None, None] for c in coef.unbind(1))
        dx = _relative_offsets(Wp, coef.device, coef.dtype)
        dy = _relative_offsets(Hp, coef.device, coef.dtype)
        return _softmax(a1 * dy.square() + a3 * dy), _softmax(a1 * dx.square() + a2 * dx)

    def positional_matrix(self, hw_shape):
        """Dense P^h of Eq. 6, shape (num_heads, T, T) with T = Hp * Wp cells in row-major order.

        For analysis and inspection only (the forward pass never builds it); rows sum to 1.
        """
        p_y, p_x = self.axis_matrices(hw_shape)
        T = p_y.shape[-1] * p_x.shape[-1]
        return torch.einsum('hac,hbd->habcd', p_y, p_x).reshape(self.num_heads, T, T)

    def statistics(self, x, hw_shape):
        """The normalisation constants of Eqs. 2 and 5 for tokens ``x`` (B, N, C).

        Returns:
            dict[str, Tensor]: 'mean_ln', 'var_ln' (B, N, 1); 'mean_it', 'var_it', 'mean', 'var'
            (B, N, C), all in the computation dtype (float32 or float64). 'var' excludes eps. With
            ``reference_compat`` they refer to the group-RMS-normalised input.
        """
        H, W = self._check_input(x, hw_shape)
        B, N, C = x.shape
        with torch.autocast(x.device.type, enabled=False):
            xc = self._prepare(x)
            grid = _Grid(xc, H, W, self.pool_size)
            conv = self.convention
            # Eq. 2: intra-token statistics over all C channels
            var_ln, mean_ln = torch.var_mean(
                xc, dim=-1, keepdim=True, correction=1 if conv.unbiased_ln_var else 0)
            pooled = grid.pool(xc)
            centre = pooled.detach().mean(dim=(1, 2), keepdim=True)
            second = None
            if not conv.square_of_pooled:
                second = grid.pool((xc - centre.flatten(1, 2)).square())
            p_y, p_x = self.axis_matrices((H, W), dtype=xc.dtype)
            mean_it, var_it = _inter_token_statistics(pooled, second, centre, p_y, p_x)

            def to_tokens(t):
                return grid.cells(t).expand(grid.shape6).reshape(B, N, C)

            _, kap_m, lam_v, kap_v = self._channel_ratios(xc.dtype).unbind(0)
            mean_it, var_it = to_tokens(mean_it), to_tokens(var_it)
            return {
                'mean_ln': mean_ln,
                'var_ln': var_ln,
                'mean_it': mean_it,
                'var_it': var_it,
                'mean': mean_ln + kap_m * (mean_it - mean_ln),  # Eq. 5
                'var': lam_v * var_ln + kap_v * var_it,  # Eq. 5
            }

    # ------------------------------------------------------------------ forward
    def forward(self, x, hw_shape):
        """Normalise tokens ``x`` (B, N, C) laid out row-major on the ``hw_shape`` = (H, W) grid."""
        H, W = self._check_input(x, hw_shape)
        with torch.autocast(x.device.type, enabled=False):
            xc = self._prepare(x).contiguous()
            dtype = xc.dtype
            weight, bias = self.weight.to(dtype), self.bias.to(dtype)
            if xc.numel() == 0:
                return (xc * weight + bias).to(x.dtype)
            p_y, p_x = self.axis_matrices((H, W), dtype=dtype)
            ratios = self._channel_ratios(dtype)
            options = (_Grid(xc, H, W, self.pool_size), self.eps, self.convention)
            inputs = (xc, p_y, p_x, ratios, weight, bias)
            if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
                y = _DynamicTokenNormFunction.apply(*inputs, options)
            else:
                y = _normalize(*inputs, *options, track=False)[0]
        return y.to(x.dtype)

    # ------------------------------------------------------------------ internals
    def _check_input(self, x, hw_shape):
        if x.dim() != 3:
            raise ValueError(f'DynamicTokenNorm expects x of shape (B, N, C), got {tuple(x.shape)}')
        try:
            H, W = (int(v) for v in hw_shape)
        except (TypeError, ValueError):
            raise ValueError(f'hw_shape must be (H, W), got {hw_shape!r}') from None
        B, N, C = x.shape
        if C != self.num_features:
            raise ValueError(f'x of shape {tuple(x.shape)} has C={C} channels, expected '
                             f'num_features={self.num_features}')
        if H < 1 or W < 1 or N != H * W:
            raise ValueError(f'x of shape {tuple(x.shape)} has N={N} tokens, which does not match '
                             f'hw_shape=({H}, {W}) (H * W = {H * W})')
        return H, W

    def _prepare(self, x):
        """x in the computation dtype (at least float32), group-RMS-normalised if so configured."""
        dtype = torch.promote_types(torch.promote_types(x.dtype, self.weight.dtype), torch.float32)
        xc = x.to(dtype)
        if self.convention.group_rms_prenorm:
            xc = group_rms_normalize(xc, self.num_heads, self.eps)
        return xc

    def _channel_ratios(self, dtype):
        """Per-channel (lambda_mean, 1 - lambda_mean, lambda_var, 1 - lambda_var), shape (4, C).

        1 - lambda is computed as sigmoid(-gate) so that it stays accurate near lambda = 1."""
        d = self.num_features // self.num_heads
        gates = torch.stack([self.mean_gate, -self.mean_gate, self.var_gate, -self.var_gate])
        return torch.sigmoid(gates.to(dtype)).repeat_interleave(d, dim=1)


class _Grid:
    """Layout helpers for tokens (B, N, C) on an H x W grid with s x s pooling cells.

    ``view(t)`` shows a token tensor (B, N, k) as (B, Hc, sy, Wc, sx, k) and ``cells(t)`` a cell
    tensor (B, Hp, Wp, C) as (B, Hc, 1, Wc, 1, C), so that cell statistics broadcast to the tokens
    of their cell without copies. If s does not divide H and W the cells are first upsampled to
    tokens (nearest) and the layout uses unit cells."""

    def __init__(self, x, H, W, s):
        B, N, C = x.shape
        self.B, self.C, self.H, self.W, self.s = B, C, H, W, s
        self.Hp, self.Wp = -(-H // s), -(-W // s)
        self.divisible = H % s == 0 and W % s == 0
        if self.divisible:
            self.shape6 = (B, self.Hp, s, self.Wp, s, C)
        else:
            self.shape6 = (B, H, 1, W, 1, C)
            self.rows = _cell_index(H, s, x.device)
            self.cols = _cell_index(W, s, x.device)
        self.counts = _cell_counts(H, W, s, x.device, x.dtype)  # (Hp, Wp, 1) tokens per cell

    def view(self, t):
        return t.view(*self.shape6[:-1], t.shape[-1])

    def cells(self, t):
        if not self.divisible:
            t = t[:, self.rows][:, :, self.cols]
        return t.view(self.shape6[0], self.shape6[1], 1, self.shape6[3], 1, self.C)

    def pool(self, t):
        """Average of every cell over its real tokens: (B, N, C) -> (B, Hp, Wp, C)."""
        image = t.view(self.B, self.H, self.W, self.C)
        if self.s == 1:
            return image
        # channels-last view; ceil-mode windows are clipped to the input and divide by their size
        pooled = F.avg_pool2d(image.permute(0, 3, 1, 2), self.s, self.s, ceil_mode=True)
        return pooled.permute(0, 2, 3, 1)


def _inter_token_statistics(pooled, second, centre, p_y, p_x):
    """Eq. 5's inter-token mean P^h x^h and variance P^h (x^h x^h) - (P^h x^h)^2 on the cell grid.

    Args:
        pooled (Tensor): cell means of x, (B, Hp, Wp, C).
        second (Tensor | None): cell means of (x - centre)^2; None takes (pooled - centre)^2.
        centre (Tensor): per-channel constant (B, 1, 1, C) the moments are taken about (rows of P
            sum to 1, so the result does not depend on it; it only avoids cancellation).
        p_y, p_x (Tensor): factors of P^h = P_y^h (kron) P_x^h (Eq. 6).

    Returns:
        tuple[Tensor, Tensor]: mean and variance, (B, Hp, Wp, C) each.
    """
    B, Hp, Wp, C = pooled.shape
    pooled_c = pooled - centre
    if second is None:
        second = pooled_c.square()
    moments = _apply_positional(pooled_c, second, p_y, p_x)
    first_moment, second_moment = (t.reshape(B, Hp, Wp, C) for t in moments)
    mean_it = first_moment + centre
    var_it = torch.addcmul(second_moment, first_moment, first_moment, value=-1).clamp_min(0)
    return mean_it, var_it


def _normalize(x, p_y, p_x, ratios, weight, bias, grid, eps, convention, track):
    """Eqs. 2, 4 and 5 for contiguous tokens x (B, N, C); ratios (4, C) as _channel_ratios.

    Full-resolution work is done in two buffers with in-place operations (on CPUs, allocating a
    large tensor costs several times more than a pass over it). With ``track`` the small cell-grid
    computation (pooled moments -> inter-token statistics) keeps an autograd graph for backward.

    Returns:
        (y, state): output (B, N, C) and what the backward pass needs.
    """
    B, N, C = x.shape
    lam_m, kap_m, lam_v, kap_v = ratios.unbind(0)
    x6 = grid.view(x)
    # Eq. 2: intra-token mean and variance in one fused pass of LayerNorm's kernel (eps = 0 gives
    # rstd = 1 / sqrt(var), inf for constant tokens: var = 0); its normalised output only serves
    # as the work buffer that becomes the output
    y, mean_ln, rstd_ln = torch.native_layer_norm(x, (C, ), None, None, 0.0)
    var_ln = rstd_ln.square().reciprocal_()
    n_var = C - 1 if convention.unbiased_ln_var else C
    if n_var != C:
        var_ln.mul_(C / n_var)
    # Eq. 5 inputs: cell means of x and of (x - centre)^2
    pooled = grid.pool(x)
    centre = pooled.mean(dim=(1, 2), keepdim=True)
    second = None  # without pooling, the second moment is the square of the (pooled) x itself
    if grid.s > 1 and not convention.square_of_pooled:
        second = grid.pool(torch.sub(x, centre.flatten(1, 2), out=y).square_())
    leaves = [t.detach().requires_grad_(track) if t is not None else None
              for t in (pooled, second, p_y, p_x)]
    with torch.set_grad_enabled(track):
        mean_it, var_it = _inter_token_statistics(leaves[0], leaves[1], centre, *leaves[2:])
    mi, vi = mean_it.detach(), var_it.detach()
    # Eq. 5 (variance) + eps of Eq. 4: cell and token statistics meet at full resolution
    rstd = torch.addcmul(grid.cells(kap_v * vi + eps), grid.view(var_ln), lam_v).rsqrt_()
    # Eq. 4 with the mean of Eq. 5 written as x - mu = (x - mu_ln) - (1 - lam)(mu_it - mu_ln):
    # exactly 0 for constant tokens, however close lam is to 0 or 1
    y6 = grid.view(y)
    torch.sub(x6, grid.view(mean_ln), out=y6)
    y6.sub_(grid.cells(kap_m * mi)).addcmul_(grid.view(mean_ln), kap_m).mul_(rstd)
    torch.addcmul(bias, y6, weight, out=y6)
    state = (mean_ln, var_ln, n_var, centre, mean_it, var_it, leaves, rstd)
    return y, state


class _DynamicTokenNormFunction(torch.autograd.Function):
    """Eqs. 2, 4, 5 with a hand-written backward for the full-resolution part (the cell-grid part
    is differentiated by autograd inside). Verified against autograd by gradcheck in the tests."""

    @staticmethod
    def forward(ctx, x, p_y, p_x, ratios, weight, bias, options):
        grid, eps, convention = options
        y, state = _normalize(x, p_y, p_x, ratios, weight, bias, grid, eps, convention, True)
        ctx.grid, ctx.state = grid, state
        ctx.save_for_backward(x, ratios, weight)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, ratios, weight = ctx.saved_tensors
        grid = ctx.grid
        mean_ln, var_ln, n_var, centre, mean_it, var_it, leaves, rstd = ctx.state
        lam_m, kap_m, lam_v, kap_v = ratios.unbind(0)
        B, N, C = x.shape
        g = grad_y.contiguous()
        x6, g6 = grid.view(x), grid.view(g)
        mi, vi = mean_it.detach(), var_it.detach()
        flat = (-1, C)
        grad_bias = g.view(flat).sum(0)
        # xhat = (x - mu) * rstd, recomputed in the buffer that becomes D2 = g w xhat rstd^2
        d2 = torch.sub(x6, grid.view(mean_ln))
        d2.sub_(grid.cells(kap_m * mi)).addcmul_(grid.view(mean_ln), kap_m).mul_(rstd).mul_(g6)
        grad_weight = d2.view(flat).sum(0)
        d2.mul_(weight).mul_(rstd).mul_(rstd)
        # D1 = g w rstd = -dL/dmu; later the buffer of dL/dx
        d1 = torch.mul(g6, weight).mul_(rstd)
        d1_3, d2_3 = d1.view(B, N, C), d2.view(B, N, C)
        # Eq. 5 backward: dL/dmu = -D1, dL/dvar = -D2 / 2
        cell_d1 = grid.pool(d1_3) * grid.counts  # sums over the tokens of each cell
        cell_d2 = grid.pool(d2_3) * grid.counts
        grad_mean_it = -kap_m * cell_d1
        grad_var_it = -0.5 * kap_v * cell_d2
        # the forward uses mu = mu_ln + (1 - lam_m) (mu_it - mu_ln): no gradient to lam_m itself
        grad_ratios = torch.stack([
            torch.zeros_like(lam_m),
            (mean_ln.transpose(1, 2) @ d1_3).sum((0, 1)) - (mi * cell_d1).sum((0, 1, 2)),
            -0.5 * (var_ln.transpose(1, 2) @ d2_3).sum((0, 1)),
            -0.5 * (vi * cell_d2).sum((0, 1, 2)),
        ])
        grad_mean_ln = -(d1_3 @ (1 - kap_m)[:, None])  # (B, N, 1)
        grad_var_ln = -0.5 * (d2_3 @ lam_v[:, None])
        del d2, d2_3
        # cell grid: autograd through P^h (Eq. 5, 6)
        used = [t for t in leaves if t is not None]
        grads = torch.autograd.grad((mean_it, var_it), used, (grad_mean_it, grad_var_it),
                                    retain_graph=True, allow_unused=True)
        grads = iter(grads)
        g_pooled, g_second, g_py, g_px = (next(grads) if t is not None else None for t in leaves)
        # dx = D1 + x (beta + F) + (alpha + E): beta, alpha from the intra-token statistics (Eq. 2),
        # E, F from the cell means of x and (x - centre)^2
        beta = grad_var_ln * (2.0 / n_var)
        alpha = grad_mean_ln / C - beta * mean_ln
        d1.addcmul_(x6, grid.view(beta)).add_(grid.view(alpha))
        e_cells = g_pooled / grid.counts
        if g_second is not None:
            f_cells = g_second * (2.0 / grid.counts)
            e_cells = e_cells - f_cells * centre
            d1.addcmul_(x6, grid.cells(f_cells))
        d1.add_(grid.cells(e_cells))
        return d1_3, g_py, g_px, grad_ratios, grad_weight, grad_bias, None


def _softmax(logits):
    """Row softmax whose weights stay >= exp(_LOGIT_FLOOR) relative to the row maximum: weights
    below that (< 2e-35) would be subnormal floats, which make matrix products on CPUs crawl."""
    shifted = logits - logits.detach().amax(dim=-1, keepdim=True)
    return torch.softmax(shifted.clamp_min(_LOGIT_FLOOR), dim=-1)


def _apply_positional(first, second, p_y, p_x):
    """P^h applied to two cell tensors (B, Hp, Wp, C), P^h = P_y^h (kron) P_x^h.

    Two batched matrix products per head on one head-major copy of both inputs: along W
    (right-multiplying by P_x^T) and along H (left-multiplying by P_y). Returns two
    (B, Hp, Wp, heads, C / heads) views of the result."""
    B, Hp, Wp, C = first.shape
    nh = p_x.shape[0]
    d = C // nh

    def head_major(t):  # (heads, Hp, 1, B, d, Wp) view
        return t.view(B, Hp, Wp, nh, d).permute(3, 1, 0, 4, 2).unsqueeze(2)

    t = torch.cat([head_major(first), head_major(second)], dim=2).view(nh, Hp * 2 * B * d, Wp)
    t = torch.bmm(t, p_x.transpose(1, 2))  # sum over source column j: P_x[i, j] t[..., j]
    t = torch.bmm(p_y, t.view(nh, Hp, 2 * B * d * Wp))  # sum over source row j: P_y[i, j] t[j]
    t = t.view(nh, Hp, 2, B, d, Wp).permute(2, 3, 1, 5, 0, 4)
    return t[0], t[1]
