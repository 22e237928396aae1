"""DynamicTokenNorm, the module: parameters, initialization (Algorithm 1), input checks, the dtype
policy and the analysis helpers. The math lives in :mod:`.function` and the backends."""
import torch
from torch import nn

from ..reference_compat import PAPER_CONVENTION, REFERENCE_CONVENTION, group_rms_normalize
from .backends import BACKENDS, PORTABLE, select_backend
from .function import inter_token_statistics, no_autocast
from .gates import (LAYERNORM_GATE_LOGIT, channel_ratios, distance_to_logit, logit_to_distance,
                    share_of_distance)
from .grid import TokenGrid, pooled_size
from .positional import axis_factors, paper_coefficients, positional_matrix

__all__ = ['DynamicTokenNorm', 'LAYERNORM_GATE_LOGIT', 'DTN_INITS', 'GATE_PARAMETERS',
           'DTN_ONLY_PARAMETERS']

#: The initializations of DynamicTokenNorm (its ``init`` argument).
DTN_INITS = ('paper', 'layernorm')

#: The gate parameters (mean, variance; Eq. 5) of each ``init``: the logits of lambda, or the
#: distances u from LayerNorm with 1 - lambda = tanh|u| (see :class:`DynamicTokenNorm`).
GATE_PARAMETERS = {
    'paper': ('mean_gate', 'var_gate'),
    'layernorm': ('mean_gate_distance', 'var_gate_distance'),
}

#: Parameters of DynamicTokenNorm that the LayerNorm it replaces does not have: the gates of either
#: ``init`` and the positional coefficients a^h (Eq. 6). An LN checkpoint lacks them, and the
#: configs give them no weight decay (configs/_base_/dtn_no_decay.py, pinned by a test).
DTN_ONLY_PARAMETERS = GATE_PARAMETERS['paper'] + GATE_PARAMETERS['layernorm'] + ('pos_coef', )


class DynamicTokenNorm(nn.Module):
    """Dynamic Token Normalization (Shao et al., ICLR 2022) for tokens on an H x W grid.

    For tokens x (N x C) split into ``num_heads`` contiguous channel groups x^h (Sec. 3.2)::

        mu^h     = lam_m^h mu_ln + (1 - lam_m^h) P^h x^h                                (Eq. 5)
        sigma2^h = lam_v^h var_ln + (1 - lam_v^h) [P^h (x^h * x^h) - (P^h x^h)^2]       (Eq. 5)
        y        = gamma * (x - mu) / sqrt(sigma2 + eps) + beta                         (Eq. 4)
        P^h      = softmax_j(a^h . R_ij),  R_ij = [dx^2 + dy^2, dx, dy]                (Eq. 6)

    with mu_ln, var_ln each token's mean and variance over its C channels (Eq. 2) and
    lam = sigmoid(gate). P^h is applied as its two axis factors, never as a T x T matrix, on the
    grid average-pooled by ``pool_size`` (App. B.1), on any H x W. The computation runs on a
    backend chosen per call (:mod:`.backends`; ``mmdtn.set_dtn_backend``).

    Args:
        num_features (int): number of channels C.
        num_heads (int): number of channel groups with their own P^h and gates.
        pool_size (int): inter-token statistics on the grid average-pooled by this factor (>= 1).
        eps (float): added to the variance (Eq. 4).
        init (str): ``'paper'``: gates 0 (lambda = 0.5), a^h by Eq. 7 with distinct neighbourhood
            offsets; ``'layernorm'``: same a^h, lambda = 1, so that a fresh layer is
            ``nn.LayerNorm`` with the same weight and bias, and gates that train (see below).
        reference_compat (bool): compute the statistics as the authors' reference code does (see
            :mod:`mmdtn.models.layers.reference_compat`); parameters keep their names and meaning.

    Shape:
        ``forward(x, hw_shape)``: x (B, N, C) with N = H * W tokens in row-major order,
        ``hw_shape = (H, W)``; returns a tensor of x's shape and dtype. Statistics are computed in
        float32 (float64 for float64 inputs or parameters), also under autocast.

    Parameters: ``weight``, ``bias`` (C,); ``mean_gate``, ``var_gate`` (num_heads,) logits of the
    mean and variance weight ratios lambda (``init='layernorm'``: ``mean_gate_distance``,
    ``var_gate_distance``, see below); ``pos_coef`` (num_heads, 3), the a^h of Eq. 6.

    Starting from LayerNorm (``init='layernorm'``): LayerNorm is lambda = 1, which a logit reaches
    only at infinity, where its gradient lambda (1 - lambda) vanishes; near it an optimizer moves
    a logit by about its learning rate per step, so 1 - lambda grows by a factor e per unit of
    logit it travels. Such a layer therefore trains its gates as their distance u from LayerNorm,
    1 - lambda = tanh|u|, starting at u = 0: it is LayerNorm exactly (any input), the gradient of
    u is that of 1 - lambda (undamped), and an AdamW step of learning rate lr changes 1 - lambda
    by about lr. The cost: the gates learn in another coordinate than the paper's (their
    dynamics differ from ``init='paper'``'s), and a head whose loss prefers LayerNorm hovers
    within a few lr of it (|u| has a kink at 0) instead of settling there. Such a layer's gates
    are the parameters ``mean_gate_distance``/``var_gate_distance`` (u), saved under these names
    like any parameter (so that EMA models, which average ``state_dict()`` values, average them).
    ``load_state_dict`` converts gates saved by a layer of the other ``init`` (logits <-> u, see
    :meth:`adapt_gates`), so that weights trained with either load into either.
    """

    _abbr_ = 'dtn'

    def __init__(self, num_features, num_heads, pool_size=1, eps=1e-6, init='paper',
                 reference_compat=False):
        super().__init__()
        if (not isinstance(num_heads, int) or num_heads < 1
                or num_features % num_heads != 0):
            raise ValueError(f'num_features={num_features} channels cannot be split into '
                             f'num_heads={num_heads!r} equal groups')
        if int(pool_size) != pool_size or pool_size < 1:
            raise ValueError(f'pool_size must be an integer >= 1, got {pool_size!r}')
        if init not in DTN_INITS:
            raise ValueError(f'init must be one of {DTN_INITS}, got {init!r}')
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
        for name in GATE_PARAMETERS[init]:
            self.register_parameter(name, nn.Parameter(torch.empty(num_heads)))
        self.pos_coef = nn.Parameter(torch.empty(num_heads, 3))
        self.reset_parameters()

    def reset_parameters(self):
        """Affine to identity, a^h by Eq. 7, gates by ``self.init`` (Algorithm 1, line 2): 0, which
        is lambda = 0.5 for ``'paper'`` (a logit), lambda = 1 for ``'layernorm'`` (a distance)."""
        with torch.no_grad():
            self.weight.fill_(1.0)
            self.bias.zero_()
            for gate in self.gates:
                gate.zero_()
            self.pos_coef.copy_(paper_coefficients(self.num_heads, torch.float64))

    def extra_repr(self):
        return (f'{self.num_features}, num_heads={self.num_heads}, pool_size={self.pool_size}, '
                f'eps={self.eps}, init={self.init!r}, reference_compat={self.reference_compat}')

    # ------------------------------------------------------------------ analysis helpers
    @property
    def gate_names(self):
        """The names of the gate parameters (mean, variance) of this layer's ``init``."""
        return GATE_PARAMETERS[self.init]

    @property
    def gates(self):
        """The gate parameters (mean, variance): logits, or distances from LayerNorm."""
        return tuple(getattr(self, name) for name in self.gate_names)

    def gate_logits(self):
        """The logits of (lambda_m, lambda_v), shape (num_heads,) each, whatever ``init``."""
        if self.init == 'layernorm':
            return tuple(distance_to_logit(gate) for gate in self.gates)
        return self.gates

    @property
    def mean_lambda(self):
        """Weight ratio of the intra-token mean lambda_m, shape (num_heads,)."""
        return self._lambda(self.gates[0])

    @property
    def var_lambda(self):
        """Weight ratio of the intra-token variance lambda_v, shape (num_heads,)."""
        return self._lambda(self.gates[1])

    def pooled_shape(self, hw_shape):
        """Shape (ceil(H/s), ceil(W/s)) of the grid the inter-token statistics are computed on."""
        return pooled_size(hw_shape, self.pool_size)

    def axis_matrices(self, hw_shape, dtype=None, backend=None):
        """Factors (P_y, P_x) of P^h = P_y^h (kron) P_x^h on the pooled grid (Eq. 6), formed by
        ``backend`` (a DTN backend) where given.

        Returns:
            tuple[Tensor, Tensor]: P_y (num_heads, Hp, Hp) and P_x (num_heads, Wp, Wp), rows sum
            to 1; P_x[h, i, j] = softmax_j(a1 (j - i)^2 + a2 (j - i)) and likewise P_y with a3.
        """
        coef = self.pos_coef if dtype is None else self.pos_coef.to(dtype)
        if backend is None:
            return axis_factors(coef, *self.pooled_shape(hw_shape))
        return backend.axis_factors(coef, *self.pooled_shape(hw_shape))

    def positional_matrix(self, hw_shape):
        """Dense P^h of Eq. 6, shape (num_heads, T, T) with T = Hp * Wp cells in row-major order.

        For analysis and inspection only (the forward pass never builds it); rows sum to 1.
        """
        return positional_matrix(*self.axis_matrices(hw_shape))

    def statistics(self, x, hw_shape):
        """The normalization constants of Eqs. 2 and 5 for tokens ``x`` (B, N, C).

        Returns:
            dict[str, Tensor]: 'mean_ln', 'var_ln' (B, N, 1); 'mean_it', 'var_it', 'mean', 'var'
            (B, N, C), all in the computation dtype (float32 or float64). 'var' excludes eps. With
            ``reference_compat`` they refer to the group-RMS-normalized input.
        """
        grid = self._grid(x, hw_shape)
        with no_autocast(x.device), torch.no_grad():
            dtype = self._computation_dtype(x)
            xc = self._prepare(x.to(dtype))
            backend = select_backend(xc, grid, dtype)
            if not backend.runs_passes:
                backend = BACKENDS[PORTABLE]
            p_y, p_x = self.axis_matrices(hw_shape, dtype, backend)
            stats, mean_it, var_it = inter_token_statistics(backend, xc, p_y, p_x, grid,
                                                            self.convention)
            mean_it, var_it = grid.to_tokens(mean_it), grid.to_tokens(var_it)
            mean_it, var_it = mean_it.to(dtype), var_it.to(dtype)
            lam_m, kap_m, lam_v, kap_v = self._channel_ratios(dtype).unbind(0)
            return {
                'mean_ln': stats.mean_ln,
                'var_ln': stats.var_ln,
                'mean_it': mean_it,
                'var_it': var_it,
                'mean': lam_m * stats.mean_ln + kap_m * mean_it,  # Eq. 5
                'var': lam_v * stats.var_ln + kap_v * var_it,  # Eq. 5
            }

    # ------------------------------------------------------------------ forward
    def forward(self, x, hw_shape):
        """Normalize tokens ``x`` (B, N, C) laid out row-major on the ``hw_shape`` = (H, W) grid."""
        grid = self._grid(x, hw_shape)
        with no_autocast(x.device):
            dtype = self._computation_dtype(x)
            weight, bias = self.weight.to(dtype), self.bias.to(dtype)
            if x.numel() == 0:
                return (x.to(dtype) * weight + bias).to(x.dtype)
            backend = select_backend(x, grid, dtype)
            # a backend that reads 16-bit tokens gets them as they are, unless the group-RMS
            # prenormalization (reference_compat) comes first: part of the statistics, it runs
            # in `dtype` as on every backend (its rounding to 16 bits moved the parameters'
            # gradients by up to 1.7%: test_dtn_triton.py)
            direct = x.dtype in backend.input_dtypes and not self.convention.group_rms_prenorm
            xc = self._prepare(x if direct else x.to(dtype)).contiguous()
            gates = tuple(gate.to(dtype) for gate in self.gates)
            y = backend.apply(xc, self.pos_coef.to(dtype), gates, weight, bias, grid, self.eps,
                              self.convention, self.init == 'layernorm')
        return y.to(x.dtype)

    # ------------------------------------------------------------------ internals
    def _grid(self, x, hw_shape):
        """The TokenGrid of ``x`` after checking that it lies on ``hw_shape``."""
        if x.dim() != 3:
            raise ValueError(f'DynamicTokenNorm expects x of shape (B, N, C), got {tuple(x.shape)}')
        try:
            H, W = hw_shape
            H, W = (v if isinstance(v, torch.SymInt) else int(v) for v in (H, W))
        except (TypeError, ValueError):
            raise ValueError(f'hw_shape must be (H, W), got {hw_shape!r}') from None
        B, N, C = x.shape
        if C != self.num_features:
            raise ValueError(f'x of shape {tuple(x.shape)} has C={C} channels, expected '
                             f'num_features={self.num_features}')
        if H < 1 or W < 1 or N != H * W:
            raise ValueError(f'x of shape {tuple(x.shape)} has N={N} tokens, which does not match '
                             f'hw_shape=({H}, {W}) (H * W = {H * W})')
        return TokenGrid.of(x, (H, W), self.num_heads, self.pool_size)

    def _computation_dtype(self, x):
        """At least float32: the statistics need it, under autocast too."""
        return torch.promote_types(torch.promote_types(x.dtype, self.weight.dtype), torch.float32)

    def _prepare(self, x):
        """x group-RMS-normalized if so configured (the reference code's convention)."""
        if self.convention.group_rms_prenorm:
            x = group_rms_normalize(x, self.num_heads, self.eps)
        return x

    def _lambda(self, gate):
        """lambda of a gate parameter: sigmoid(logit), or 1 - tanh|u| with ``init='layernorm'``."""
        return 1 - share_of_distance(gate) if self.init == 'layernorm' else torch.sigmoid(gate)

    def _channel_ratios(self, dtype):
        """Per-channel (lambda_mean, 1 - lambda_mean, lambda_var, 1 - lambda_var), shape (4, C)
        (:func:`.gates.channel_ratios`)."""
        d = self.num_features // self.num_heads
        return channel_ratios(*self.gates, d, self.init == 'layernorm', dtype)

    # ------------------------------------------------------------------ checkpoints: gates
    def adapt_gates(self, state_dict, prefix=''):
        """Gates in ``state_dict`` saved by a layer of the other ``init`` become this layer's:
        renamed and converted (logit <-> distance u from LayerNorm; u comes back as |u|), in place.

        Called by ``load_state_dict``; loaders that compare keys before loading call it first."""
        other = 'paper' if self.init == 'layernorm' else 'layernorm'
        convert = logit_to_distance if self.init == 'layernorm' else distance_to_logit
        for theirs, mine in zip(GATE_PARAMETERS[other], self.gate_names):
            if prefix + mine not in state_dict and torch.is_tensor(state_dict.get(prefix + theirs)):
                state_dict[prefix + mine] = convert(state_dict.pop(prefix + theirs))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.adapt_gates(state_dict, prefix)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
