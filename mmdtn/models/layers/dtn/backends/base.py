"""The contract between DynamicTokenNorm and its backends.

A backend runs DTN for the inputs it supports (:meth:`Backend.apply`). The CPU and portable
backends run the passes of :mod:`..function` (statistics, output, token gradients, input gradient,
and the products with the positional factors) and make them differentiable with
:func:`..function.define_traced_function` (passes PyTorch can trace) or
:func:`..function.define_custom_ops` (compiled kernels); the Triton backend runs passes of its own
(:mod:`.triton`).
"""
import contextlib
from typing import Optional

import torch

from ..function import Saved, TokenStatistics, moments, parameter_gradients
from ..gates import channel_ratios
from ..positional import axis_factors

__all__ = ['Backend', 'DenseFactor', 'per_head', 'KernelLaunch', 'recording_launches',
           'recording', 'record_launch', 'tensor_bytes', 'RecordedKernels']


class Backend:
    """Base class of the DTN backends; see :mod:`mmdtn.models.layers.dtn.backends`."""

    #: the name used by ``set_dtn_backend`` and ``MMDTN_DTN_BACKEND``
    name = None
    #: device types whose inputs ``auto`` hands to this backend, before the portable one
    devices = ()
    #: dtypes of x read as they are; x of another dtype is first converted to the computation
    #: dtype (float32 or float64)
    input_dtypes = (torch.float32, torch.float64)
    #: whether the backend runs the passes of :mod:`..function` (and so the layer's
    #: ``statistics`` for analysis); otherwise those run on the portable backend
    runs_passes = True

    def supports(self, x, grid, dtype) -> Optional[str]:
        """Why this backend cannot run tokens ``x`` on ``grid`` with statistics in ``dtype``
        (float32 or float64), or None if it can. The layer converts x of a dtype not in
        :attr:`input_dtypes` to ``dtype`` before the call."""
        raise NotImplementedError

    def apply(self, x, pos_coef, gates, weight, bias, grid, eps, convention, layernorm):
        """DTN of x from the layer's parameters: the coefficients a^h (heads, 3), the ``gates``
        (mean, variance; logits, or with ``layernorm`` distances from LayerNorm), the weight and
        the bias, all in the computation dtype; differentiable with respect to every tensor.
        Unless the backend forms them itself, P_y, P_x and the ratios come from
        :meth:`axis_factors` and :meth:`channel_ratios` and the passes run in :attr:`normalize`."""
        p_y, p_x = self.axis_factors(pos_coef, grid.Hp, grid.Wp)
        ratios = self.channel_ratios(*gates, grid.d, layernorm, weight.dtype)
        return self.normalize(x, p_y, p_x, ratios, weight, bias, grid, eps, convention)

    #: ``normalize(x, p_y, p_x, ratios, weight, bias, grid, eps, convention) -> y``, the passes
    #: made differentiable (:func:`..function.define_traced_function` or
    #: :func:`..function.define_custom_ops`), set by each backend
    normalize = None

    # the passes of function.dtn_forward and function.dtn_backward
    def statistics(self, x, grid, convention):
        """Eq. 2 per token and the cell moments: a TokenStatistics."""
        raise NotImplementedError

    def axis_factors(self, pos_coef, rows, cols):
        """The positional factors (P_y, P_x) of Eq. 6 from the coefficients a^h (heads, 3), in the
        computation dtype: :func:`..positional.axis_factors` unless the backend forms them
        itself."""
        return axis_factors(pos_coef, rows, cols)

    def channel_ratios(self, mean_gate, var_gate, d, layernorm, dtype):
        """The per-channel ratios (4, C) from the gate parameters: :func:`..gates.channel_ratios`
        unless the backend forms them itself."""
        return channel_ratios(mean_gate, var_gate, d, layernorm, dtype)

    def token_moments(self, x, centre, grid):
        """Without pooling, the moments T of :func:`..function.moments` (x - centre and its
        square, column-major) from the tokens and the centre (backward recomputes them)."""
        return moments(TokenStatistics(None, None, centre, grid.cell_means(x), None), grid)

    def factor(self, p, axis):
        """The products with one positional factor p (heads, L, L), P_y (``axis`` 'y') or P_x
        ('x'): an object with ``matmul(x, transpose=False, inner=None)`` and ``outer(a, x)`` (see
        :class:`DenseFactor`)."""
        return DenseFactor(p, axis)

    def output(self, x, stats, m, ratios, weight, bias, eps, n_var, grid):
        """Eqs. 4-5: y from x, the statistics and the head-major products m (n_var: the divisor of
        Eq. 2's variance, for a backend that forms Eq. 2 again)."""
        raise NotImplementedError

    def token_gradients(self, g, x, saved, m, ratios, weight, eps, n_var, grid):
        """Backward pass 1: (what pass 2 takes from it, the sums for the parameters (see
        :meth:`parameter_gradients`), dL/dm head-major); see dtn_backward."""
        raise NotImplementedError

    def parameter_gradients(self, sums):
        """The gradients of the ratios (4, C), weight and bias from pass 1's sums for the
        parameters: :func:`..function.parameter_gradients` of the sums (6, C) unless the backend
        gives them in another form and adds them up itself."""
        return parameter_gradients(sums)

    def input_gradient(self, tokens, g, x, saved, m, ratios, weight, eps, n_var, d_first,
                       d_second, grid):
        """Backward pass 2: dx from pass 1's ``tokens``, the gradient of Eq. 2 and the
        column-major dL/dT (d_second may be None)."""
        raise NotImplementedError

    def fuses_products(self, x, grid, p_x):
        """Whether the positional products are fused with the passes over the tokens (then
        :meth:`fused_forward` and ``fused_backward(g, x, saved, p_y, p_x, ratios, weight, eps,
        n_var, grid)``, returning the :class:`..function.Gradients`, replace the staged
        passes)."""
        return False

    def fused_forward(self, x, p_y, p_x, ratios, weight, bias, eps, grid, convention):
        """y and the :class:`..function.Saved` of the forward pass with the products fused: the
        statistics pass, then ``fused_output(x, stats, p_y, p_x, ratios, weight, bias, eps,
        grid)``, unless the backend replaces both."""
        stats = self.statistics(x, grid, convention)
        y = self.fused_output(x, stats, p_y, p_x, ratios, weight, bias, eps, grid)
        return y, Saved(stats.mean_ln, stats.var_ln, stats.centre)


class DenseFactor:
    """Products with one positional factor P (heads, L, L), P_y (``axis`` 'y') or P_x ('x'), as
    batched dense matrix products. Batches x (heads * group, L, N) use P[k // group] for matrix
    k."""

    def __init__(self, p, axis):
        self.p, self.axis = p, axis

    def _factors(self, x):
        heads, L = self.p.shape[0], self.p.shape[-1]
        group = x.shape[0] // heads
        return self.p[:, None].expand(heads, group, L, L).reshape(-1, L, L)

    def matmul(self, x, transpose=False, inner=None):
        """P X, or P^T X with ``transpose``, for x (heads * group, L, N). With ``inner``, N is
        (N / inner, inner) and the product comes as (heads, N / inner, group, L, inner),
        contiguous: its blocks of ``inner`` columns moved ahead of the rows, which turns the
        products' column-major layout into their head-major one and back (:mod:`..function`)."""
        y = self._product(x, transpose)
        if inner is None:
            return y
        heads, _, L, N = self.p.shape[0], *y.shape
        return y.view(heads, -1, L, N // inner, inner).permute(0, 3, 1, 2, 4).contiguous()

    def _product(self, x, transpose):
        p = self._factors(x)
        return torch.bmm(p.transpose(1, 2) if transpose else p, x)

    def outer(self, a, x):
        """The gradient of P for u = P x and dL/du = a: a x^T summed over the matrices of each
        head (heads, L, L)."""
        return per_head(torch.bmm(a, x.transpose(1, 2)), self.p.shape[0])


def per_head(grads, heads):
    """Gradients of P per matrix (heads * group, L, L) summed over each head's group."""
    L = grads.shape[-1]
    return grads if grads.shape[0] == heads else grads.view(heads, -1, L, L).sum(1)


# ---------------------------------------------------------------------------- launch records
class KernelLaunch:
    """One launch of a compiled kernel: its name, the bytes it reads and writes and, where its
    tensors are meta tensors (recorded, never launched), ``call``: (kernel, constexprs,
    warps or launch options, args), from which Triton's own binder tells what it would compile
    (``compile_kernels.py``); None otherwise, so that no record keeps a real tensor alive."""

    __slots__ = ('name', 'read', 'written', 'call')

    def __init__(self, name, read, written, call=None):
        self.name, self.read, self.written, self.call = name, read, written, call


_records = []  # the lists that recording_launches is filling, innermost last


@contextlib.contextmanager
def recording_launches():
    """Collects a :class:`KernelLaunch` for every compiled kernel launched inside (benchmarks);
    PyTorch's own operations are not included."""
    launches = []
    _records.append(launches)
    try:
        yield launches
    finally:
        _records.remove(launches)


def recording():
    """Whether launches are being recorded (count the bytes of a launch only then)."""
    return bool(_records)


def record_launch(name, read, written, call=None):
    """Notes a launch of ``name`` reading and writing the given numbers of bytes (and its ``call``
    on meta tensors, :class:`KernelLaunch`), if recording."""
    if _records:
        _records[-1].append(KernelLaunch(name, read, written, call))


def tensor_bytes(values):
    """Bytes of the tensors among ``values`` (anything else, None too, counts nothing)."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


class RecordedKernels:
    """The functions of a compiled extension module, each call recorded by
    :func:`recording_launches` with the bytes of its tensor operands: arguments read, results
    written, the arguments named in ``in_place`` both read and written, and those named in
    ``out`` (destinations the function also returns) written only."""

    def __init__(self, module, prefix, in_place=None, out=None):
        self._module, self._prefix, self._in_place = module, prefix, in_place or {}
        self._out = out or {}
        self._functions = {}

    def __getattr__(self, name):
        if name not in self._functions:
            self._functions[name] = self._recorded(name, getattr(self._module, name))
        return self._functions[name]

    def _recorded(self, name, fn):
        label, in_place = f'{self._prefix}.{name}', self._in_place.get(name, ())
        destinations = self._out.get(name, ())

        def call(**kwargs):
            out = fn(**kwargs)
            if recording():
                results = out if isinstance(out, (list, tuple)) else [out]
                written = tensor_bytes(results) + tensor_bytes(kwargs[k] for k in in_place)
                read = tensor_bytes(v for k, v in kwargs.items() if k not in destinations)
                record_launch(label, read, written)
            return out

        return call
