"""FLOPs of one DynamicTokenNorm call (Shao et al., ICLR 2022, Eqs. 2 and 4-7, App. B.1).

Plain arithmetic on shapes, without torch: the analysis tools count DTN with it, and counters of
the standard kind (``torch.utils.flop_counter``, mmengine's ``FlopAnalyzer``) can be given it for
the layer's operators.

Convention (mmengine's, in which the rest of a model is counted): one FLOP is one multiply-add of a
matrix product, or one arithmetic operation on one element, a fused multiply-add ``a * b + c``
counting once; a reduction costs one per element it reads; comparisons (the clamp of the variance
at 0) and data movement are free. Under it mmengine gives a LayerNorm 5 per element.
``torch.utils.flop_counter`` counts a multiply-add as 2 FLOPs: a formula registered there returns
twice :func:`dtn_flops`.

For B images of N = H * W tokens with C channels in G heads, pooling size s and the pooled grid
h x w = ceil(H / s) x ceil(W / s) of T = h * w cells:

* ``intra_token`` (Eq. 2), B (3 N C + 3 N): x^2, the means of x and x^2 over the C channels and
  var = E[x^2] - mu^2 of every token;
* ``pooling`` (App. B.1), B (2 N C + 2 T C) if s > 1, else 0: average pooling of x and x^2 (a
  sum, then one division per cell);
* ``positional_factors`` (Eq. 6), 6 G (h^2 + w^2): the logits a1 d^2 + a2 d along each axis
  (2 per entry) and their softmax (4: shift, exp, sum, divide);
* ``positional_products`` (Eq. 5), 2 B C T (h + w): P^h x and P^h x^2 with P^h applied as
  P_y (kron) P_x, one matrix product along W and one along H, C T (h + w) multiply-adds each;
* ``inter_token_variance`` (Eq. 5), B T C: P x^2 - (P x)^2;
* ``mixing`` (Eq. 5), 4 B N C + 2 G: lambda = sigmoid(gate) per head, then
  lambda mu_ln + (1 - lambda) P x for the mean and the variance (2 per element each);
* ``normalization`` (Eq. 4), 5 B N C: x - mu, sigma^2 + eps, its inverse square root, the
  product, gamma y + beta.

Without pooling (s = 1, T = N) that is 13 FLOPs per token and channel plus the positional products,
2 (H + W) per token and channel; with pooling 14 per token and channel plus O(C T (h + w)).

``dense=True`` counts the formulation of the paper's complexity analysis (Sec. 3.3), which builds
the T x T matrix P^h = softmax(R a^h) and multiplies by it: ``positional_factors`` become 7 G T^2
(3 multiply-adds for R_ij . a^h and 4 for the softmax, per entry) and ``positional_products``
2 B C T^2. They grow with the square of the number of cells instead of T (h + w): on the stride-16
grid of an 800 x 1344 detection input (T = 4200) the dense products alone cost 2 C T^2 = 8400 C T,
the factorized ones 2 C T (h + w) = 268 C T.

The count is that of the paper's statistics; ``reference_compat=True`` (the authors' code) adds a
per-head RMS pre-normalization of x that is not counted.
"""
from .grid import pooled_size

__all__ = ['dtn_flop_terms', 'dtn_flops']


def dtn_flop_terms(batch, channels, num_heads, hw_shape, pool_size=1, *, dense=False):
    """FLOPs of one DynamicTokenNorm call by term (listed in the module docstring).

    Args:
        batch (int): images B.
        channels (int): channels C (the layer's ``num_features``).
        num_heads (int): DTN heads G.
        hw_shape (tuple[int, int]): token grid (H, W).
        pool_size (int): the layer's ``pool_size`` s.
        dense (bool): count the paper's dense T x T P^h instead of the factorized one.

    Returns:
        dict[str, int]: FLOPs per term (multiply-add = 1), in the table's order.
    """
    b, c, g, s = (int(v) for v in (batch, channels, num_heads, pool_size))
    H, W = (int(v) for v in hw_shape)
    if min(c, g, s, H, W) < 1 or b < 0:
        raise ValueError(f'dtn_flop_terms needs batch >= 0 and positive channels, num_heads, '
                         f'pool_size and hw_shape, got batch={batch}, channels={channels}, '
                         f'num_heads={num_heads}, hw_shape={hw_shape}, pool_size={pool_size}')
    n = H * W
    h, w = pooled_size((H, W), s)
    t = h * w
    return {
        'intra_token': b * (3 * n * c + 3 * n),
        'pooling': b * (2 * n * c + 2 * t * c) if s > 1 else 0,
        'positional_factors': 7 * g * t * t if dense else 6 * g * (h * h + w * w),
        'positional_products': 2 * b * c * t * (t if dense else h + w),
        'inter_token_variance': b * t * c,
        'mixing': b * 4 * n * c + 2 * g,
        'normalization': b * 5 * n * c,
    }


def dtn_flops(batch, channels, num_heads, hw_shape, pool_size=1, *, dense=False):
    """FLOPs of one DynamicTokenNorm call (multiply-add = 1): the sum of :func:`dtn_flop_terms`."""
    return sum(dtn_flop_terms(batch, channels, num_heads, hw_shape, pool_size,
                              dense=dense).values())
