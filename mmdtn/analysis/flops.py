"""Parameters and FLOPs of a backbone or a whole model, DTN's own operations counted by formula.

mmengine's ``FlopAnalyzer`` (jit tracing, one fused multiply-add = one FLOP) counts convolutions,
linear layers, matrix products and LayerNorm (5 per element), but not the element-wise and pooling
operations that make up DTN. The FLOPs of every DynamicTokenNorm layer are therefore replaced by
:func:`dtn_layer_flops`, which depends on the layer's channels C, DTN heads G, token map H x W
(N = H*W tokens) and pooled grid h x w = ceil(H/s) x ceil(W/s) (T = h*w cells), batch 1:

* ``5 N C``: intra-token statistics (Eq. 2), normalisation and affine (Eq. 4), the count mmengine
  gives a LayerNorm of the same size;
* ``N C``: x * x for the second moment;
* ``2 N C`` (only if s > 1): average pooling of x and x^2 onto the grid;
* ``2 C T (h + w)``: P^h applied to the pooled x and x^2 (Eq. 5), factorised as implemented:
  P^h = P_y (kron) P_x, one matrix product along W and one along H per tensor;
* ``2 C T``: the inter-token variance P x^2 - (P x)^2;
* ``4 N C``: mixing the mean and the variance with lambda (Eq. 5);
* ``4 G (h^2 + w^2)``: building the factors of P^h = softmax(R a^h) (Eq. 6).

The paper's dense formulation (a T x T matrix P^h per head, Sec. 3.3 "Complexity analysis",
O(B C T^2)) is reported alongside: its P-terms are ``2 C T^2`` and ``4 G T^2``.
"""
import torch
from torch import nn

from .models import count_parameters, dtn_layers

__all__ = ['dtn_layer_flops', 'DTNShapeRecorder', 'complexity', 'TensorForward']


def dtn_layer_flops(channels, num_heads, hw_shape, pooled_shape, dense=False):
    """FLOPs of one DTN layer (batch 1) by the formula in the module docstring; a dict of terms."""
    n = int(hw_shape[0]) * int(hw_shape[1])
    h, w = (int(v) for v in pooled_shape)
    t, c, g = h * w, int(channels), int(num_heads)
    pooled = (h, w) != (int(hw_shape[0]), int(hw_shape[1]))
    terms = {
        'normalise': 5 * n * c,
        'square': n * c,
        'pool': 2 * n * c if pooled else 0,
        'positional_products': 2 * c * t * t if dense else 2 * c * t * (h + w),
        'inter_variance': 2 * c * t,
        'mix': 4 * n * c,
        'positional_matrix': 4 * g * t * t if dense else 4 * g * (h * h + w * w),
    }
    terms['total'] = sum(terms.values())
    return terms


class DTNShapeRecorder:
    """Records, for every DTN layer of ``model``, the shapes that :func:`dtn_layer_flops` needs."""

    def __init__(self, model, prefix=''):
        self.layers = []
        self._handles = [m.register_forward_pre_hook(self._hook(prefix + name), with_kwargs=True)
                         for name, m in dtn_layers(model)]

    def _hook(self, name):
        def hook(module, args, kwargs):
            x = args[0]
            hw = tuple(int(v) for v in (kwargs['hw_shape'] if 'hw_shape' in kwargs else args[1]))
            self.layers.append(dict(name=name, channels=int(x.shape[-1]),
                                    num_heads=int(module.num_heads), hw_shape=hw,
                                    pooled_shape=tuple(int(v) for v in module.pooled_shape(hw))))
        return hook

    def remove(self):
        for h in self._handles:
            h.remove()


class TensorForward(nn.Module):
    """Wraps a detector/segmentor so that ``forward(inputs)`` runs its ``mode='tensor'`` path."""

    def __init__(self, model, data_samples=None):
        super().__init__()
        self.model = model
        self.data_samples = data_samples

    def forward(self, inputs):
        return self.model(inputs, self.data_samples, mode='tensor')


def _dtn_param_count(model):
    return sum(p.numel() for _, m in dtn_layers(model)
               for n, p in m.named_parameters() if n not in ('weight', 'bias'))


@torch.no_grad()
def complexity(model, inputs):
    """Parameters and FLOPs of ``model`` on ``inputs`` (a tensor or tuple), DTN by formula.

    Returns a dict with ``params``,
    ``dtn_params`` (gates and positional coefficients), ``flops`` (total, DTN by formula),
    ``dtn_flops`` and ``dtn_flops_dense`` (the paper's dense P^h), ``counter_flops`` (mmengine's
    count as is) and per-layer ``dtn_layers``.
    """
    from mmengine.analysis import FlopAnalyzer
    inputs = inputs if isinstance(inputs, tuple) else (inputs, )
    recorder = DTNShapeRecorder(model)
    try:
        analyzer = FlopAnalyzer(model, inputs)
        analyzer.unsupported_ops_warnings(False)
        analyzer.uncalled_modules_warnings(False)
        analyzer.tracer_warnings('none')
        counter_total = analyzer.total()
        by_module = analyzer.by_module()
    finally:
        recorder.remove()
    # jit tracing may run the forward more than once: keep each layer's first record.
    layers = list({layer['name']: layer for layer in reversed(recorder.layers)}.values())[::-1]
    counted = sum(by_module.get(layer['name'], 0) for layer in layers)
    for layer in layers:
        layer['flops'] = dtn_layer_flops(layer['channels'], layer['num_heads'], layer['hw_shape'],
                                         layer['pooled_shape'])['total']
        layer['flops_dense'] = dtn_layer_flops(layer['channels'], layer['num_heads'],
                                               layer['hw_shape'], layer['pooled_shape'],
                                               dense=True)['total']
        layer['counter_flops'] = int(by_module.get(layer['name'], 0))
    dtn_total = sum(layer['flops'] for layer in layers)
    return dict(params=count_parameters(model), dtn_params=_dtn_param_count(model),
                flops=int(counter_total - counted + dtn_total), dtn_flops=int(dtn_total),
                dtn_flops_dense=int(sum(layer['flops_dense'] for layer in layers)),
                counter_flops=int(counter_total), dtn_layers=layers)
