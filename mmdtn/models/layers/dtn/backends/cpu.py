"""The CPU backend: DTN's passes in fused C++ kernels (``../csrc``, built by ``pip install``).

Supports float32 and float64 tensors on CPUs where mmdtn was installed with its kernels
(``MMDTN_WITH_OPS=0`` installs without them). Each pass over the tokens is one trip through memory,
with AVX-512 variants chosen at run time. The positional products visit only the nonzero band of
P_x and P_y (far from its peak a row is exact zeros: 11 of a row's weights are nonzero in float32
at the paper's initialization), unless a head's band spans most of its axis. Without pooling, and
with whole 64-byte vectors per head, the products are fused with the passes over the tokens: per
(image, head) the token rows are walked in order and u = P_x T, m = P_y u, their gradients and the
output are formed row by row in cache, never stored.

The kernels run inside the ``torch.library`` custom ops ``mmdtn::dtn_cpu_forward`` and
``mmdtn::dtn_cpu_backward``, which ``torch.compile``, ``torch.export`` and ``torch.jit.trace``
record as single operations.
"""
import torch

from ..function import Gradients, TokenStatistics, define_custom_ops
from .base import Backend, DenseFactor, RecordedKernels, per_head

try:  # built by setup.py
    from .. import _cpu_kernels
except ImportError:  # pragma: no cover - installs without a C++ compiler or MMDTN_WITH_OPS=0
    _cpu_kernels = None

#: The C++ kernels (None where mmdtn was installed without them), each call recorded while
#: benchmarks count launches (:func:`.base.recording_launches`).
kernels = None if _cpu_kernels is None else RecordedKernels(
    _cpu_kernels, 'cpu', in_place={'input_gradient': ('dx', )}, out={'band_matmul': ('out', )})

__all__ = ['CpuBackend', 'BandedFactor']

#: A factor's products are banded when the union of the nonzero spans of BAND_ROWS consecutive rows
#: covers at most this fraction of a row; beyond it the dense products are as fast.
BAND_MAX_FILL = 0.7
BAND_ROWS = 4  # rows per block of the banded kernels (kRows in csrc/band.h)


class BandedFactor:
    """Products with one positional factor P (heads, L, L) over the nonzero span of every row of P
    (exact: outside it P contributes nothing, and the softmax passes no gradient through a zero
    weight). ``axis``: as :class:`.base.DenseFactor`'s."""

    contracts = False

    def __init__(self, p, axis):
        self.p, self.axis = p.detach().contiguous(), axis

    @staticmethod
    def is_banded(p):
        L = p.shape[-1]
        if L < 2 * BAND_ROWS:
            return False
        # in NumPy: a handful of serial passes over the small factor, where PyTorch would run
        # several operations, each a parallel region of its own
        rows, cols = (p.detach().reshape(-1, L, L).numpy() != 0).any(0).nonzero()
        offsets = cols - rows  # j - i of the nonzero weights
        width = int(offsets.max()) - int(offsets.min()) + 1
        return width + BAND_ROWS - 1 <= BAND_MAX_FILL * L

    def matmul(self, x, transpose=False, inner=None):
        heads, L = self.p.shape[0], self.p.shape[-1]
        group = x.shape[0] // heads
        if inner is None:
            return kernels.band_matmul(p=self.p, x=x, group=group, transpose=transpose)
        # the kernel writes the product straight into (heads, N / inner, group, L, inner),
        # given as a view (heads, group, L, N / inner, inner): two leading dims index the matrices
        out = x.new_empty(heads, x.shape[-1] // inner, group, L, inner)
        kernels.band_matmul(p=self.p, x=x, group=group, transpose=transpose,
                            out=out.permute(0, 2, 3, 1, 4), lead=2)
        return out

    def outer(self, a, x):
        heads = self.p.shape[0]
        return per_head(kernels.band_outer(p=self.p, a=a, x=x, group=x.shape[0] // heads), heads)


class CpuBackend(Backend):
    """DTN in fused C++ kernels on CPUs (see the module docstring)."""

    name = 'cpu'
    devices = ('cpu', )

    def __init__(self):
        self.normalize = define_custom_ops(self, 'cpu')

    def supports(self, x, grid, dtype):
        if kernels is None:
            return ('mmdtn was installed without its CPU kernels (`pip install -e .` builds them '
                    'with a C++ compiler)')
        if x.device.type != 'cpu':
            return f'x is on {x.device}, not on the CPU'
        return None

    def factor(self, p, axis):
        return BandedFactor(p, axis) if BandedFactor.is_banded(p) else DenseFactor(p, axis)

    @staticmethod
    def _geometry(grid):
        return dict(H=grid.H, W=grid.W, pool=grid.pool, num_heads=grid.heads)

    def statistics(self, x, grid, convention):
        n_var = convention.ln_divisor(grid.C)
        mean_ln, var_ln, cells = kernels.statistics(x=x, n_var=float(n_var), H=grid.H, W=grid.W,
                                                    pool=grid.pool)
        if grid.pooled:  # cells: the cell means
            cell_mean, centre = cells, cells.mean(dim=(1, 2), keepdim=True)
        else:  # cells: sums over the token rows
            cell_mean = grid.cell_means(x)
            centre = (cells.sum(1) / grid.N).view(grid.B, 1, 1, grid.C)
        cell_second = None
        if grid.pooled and not convention.square_of_pooled:
            cell_second = kernels.second_moment(x=x, centre=centre, H=grid.H, W=grid.W,
                                                pool=grid.pool)
        return TokenStatistics(mean_ln, var_ln, centre, cell_mean, cell_second)

    def output(self, x, stats, m, ratios, weight, bias, eps, n_var, grid):
        first, second = (grid.from_head_major(t) for t in m.unbind(1))
        return kernels.output(x=x, mean_ln=stats.mean_ln, var_ln=stats.var_ln, first=first,
                              second=second, centre=stats.centre, ratios=ratios.contiguous(),
                              weight=weight.contiguous(), bias=bias.contiguous(), eps=eps,
                              **self._geometry(grid))

    def token_gradients(self, g, x, saved, m, ratios, weight, eps, n_var, grid):
        dm = torch.empty_like(m)
        first, second = (grid.from_head_major(t) for t in m.unbind(1))
        dm_first, dm_second = (grid.from_head_major(t) for t in dm.unbind(1))
        d1, tok1, tok2, sums = kernels.token_gradients(
            grad=g, x=x, mean_ln=saved.mean_ln, var_ln=saved.var_ln, first=first, second=second,
            centre=saved.centre, ratios=ratios.contiguous(), weight=weight.contiguous(), eps=eps,
            dm_first=dm_first, dm_second=dm_second, **self._geometry(grid))
        return (d1, tok1, tok2), sums, dm

    def input_gradient(self, tokens, g, x, saved, m, ratios, weight, eps, n_var, d_first,
                       d_second, grid):
        d1, tok1, tok2 = tokens  # the kernel forms beta and alpha of ln_gradient per token
        kernels.input_gradient(
            dx=d1, x=x, tok1=tok1, tok2=tok2, mean_ln=saved.mean_ln, n_var=float(n_var),
            d_first=grid.from_column_major(d_first),
            d_second=None if d_second is None else grid.from_column_major(d_second),
            centre=saved.centre, **self._geometry(grid))
        return d1

    def fuses_products(self, x, grid, p_x):
        return (not grid.pooled and grid.d % (64 // x.element_size()) == 0
                and BandedFactor.is_banded(p_x))

    def fused_output(self, x, stats, p_y, p_x, ratios, weight, bias, eps, grid):
        return kernels.fused_forward(
            x=x, mean_ln=stats.mean_ln, var_ln=stats.var_ln, centre=stats.centre,
            p_y=p_y.detach().contiguous(), p_x=p_x.detach().contiguous(),
            ratios=ratios.contiguous(), weight=weight.contiguous(), bias=bias.contiguous(),
            eps=eps, H=grid.H, W=grid.W, num_heads=grid.heads)

    def fused_backward(self, g, x, saved, p_y, p_x, ratios, weight, eps, n_var, grid):
        dx, grad_p_y, grad_p_x, sums = kernels.fused_backward(
            grad=g, x=x, mean_ln=saved.mean_ln, var_ln=saved.var_ln, centre=saved.centre,
            p_y=p_y.detach().contiguous(), p_x=p_x.detach().contiguous(),
            ratios=ratios.contiguous(), weight=weight.contiguous(), eps=eps, n_var=float(n_var),
            H=grid.H, W=grid.W, num_heads=grid.heads)
        return Gradients(dx, grad_p_y, grad_p_x, *self.parameter_gradients(sums))
