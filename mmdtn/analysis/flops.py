"""Parameters and FLOPs of a backbone or a whole model, DTN's own operations counted by formula.

mmengine's ``FlopAnalyzer`` (jit tracing, one multiply-add = one FLOP) counts convolutions, linear
layers, matrix products and LayerNorm (5 per element), but not the element-wise and pooling
operations that make up DTN. The FLOPs of every DynamicTokenNorm call are therefore replaced by
:func:`mmdtn.models.layers.dtn.flops.dtn_flops`, the one DTN formula of mmdtn (its module
docstring gives the terms, their equations and the convention), from the shapes each layer sees
in the forward pass. Everything else, Dual PatchNorm included, is mmengine's count.
"""
import math

import torch
from torch import nn

from mmdtn.models.layers import DTN_ONLY_PARAMETERS
from mmdtn.models.layers.dtn.flops import dtn_flops
from .models import call_grid, count_parameters, dtn_layers

__all__ = ['DTNShapeRecorder', 'complexity', 'TensorForward', 'sdpa_flop_handle']


class DTNShapeRecorder:
    """Records, for every DTN layer of ``model``, the arguments of :func:`dtn_flops` of its call."""

    def __init__(self, model, prefix=''):
        self.layers = []
        self._handles = [m.register_forward_pre_hook(self._hook(prefix + name), with_kwargs=True)
                         for name, m in dtn_layers(model)]

    def _hook(self, name):
        def hook(module, args, kwargs):
            x = args[0]
            hw = tuple(int(v) for v in call_grid(module, args, kwargs))
            self.layers.append(dict(name=name, batch=int(x.shape[0]), channels=int(x.shape[-1]),
                                    num_heads=int(module.num_heads), hw_shape=hw,
                                    pool_size=int(module.pool_size),
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


def sdpa_flop_handle(inputs, outputs):
    """``aten::scaled_dot_product_attention`` for mmengine's analyzer, which does not know it:
    Q K^T and A V, 2 * B * heads * Nq * Nk * d multiply-adds."""
    from mmengine.analysis.jit_handles import get_shape
    q, k = get_shape(inputs[0]), get_shape(inputs[1])
    return 2 * math.prod(q[:-1]) * k[-2] * q[-1]


def _dtn_param_count(model):
    return sum(p.numel() for _, m in dtn_layers(model) for name, p in m.named_parameters()
               if name in DTN_ONLY_PARAMETERS)


def _layer_flops(layer, dense=False):
    return dtn_flops(layer['batch'], layer['channels'], layer['num_heads'], layer['hw_shape'],
                     layer['pool_size'], dense=dense)


@torch.no_grad()
def complexity(model, inputs):
    """Parameters and FLOPs of ``model`` on ``inputs`` (a tensor or tuple), DTN by formula.

    Returns a dict with ``params``, ``dtn_params`` (gates and positional coefficients), ``flops``
    (total, DTN by formula), ``dtn_flops`` and ``dtn_flops_dense`` (the paper's dense P^h),
    ``counter_flops`` (mmengine's count as is) and per-layer ``dtn_layers``.
    """
    from mmengine.analysis import FlopAnalyzer
    inputs = inputs if isinstance(inputs, tuple) else (inputs, )
    recorder = DTNShapeRecorder(model)
    try:
        analyzer = FlopAnalyzer(model, inputs)
        analyzer.set_op_handle('aten::scaled_dot_product_attention', sdpa_flop_handle)
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
        layer['flops'] = _layer_flops(layer)
        layer['flops_dense'] = _layer_flops(layer, dense=True)
        layer['counter_flops'] = int(by_module.get(layer['name'], 0))
    dtn_total = sum(layer['flops'] for layer in layers)
    return dict(params=count_parameters(model), dtn_params=_dtn_param_count(model),
                flops=int(counter_total - counted + dtn_total), dtn_flops=int(dtn_total),
                dtn_flops_dense=int(sum(layer['flops_dense'] for layer in layers)),
                counter_flops=int(counter_total), dtn_layers=layers)
