"""Reads from cache of DynamicTokenNorm's Triton kernels, counted in Triton's interpreter, beside
the bytes of their operands (what ``benchmark_norm.py --tables model`` counts).

The traffic model of ``benchmark_norm.py`` counts the bytes of every kernel's operands: what a GPU's
memory moves if every byte is read once and what a kernel reads again comes from cache. This tool
counts what the kernels' loads ask of the caches: it runs one layer forward and backward with the
kernels in Triton's interpreter (on CPU tensors, no GPU) and adds up, for every load instruction of
every program, the bytes at its distinct addresses (a load whose lanes share an address, as the
positional weights shared by a head's channels, counts that address once, as a GPU coalesces it).
Loads of a program that read the same bytes again (the rows of the band every block of the band
products reads) count every time. Per token and against LayerNorm's bytes, for each
kernel.

The interpreter is slow, so the grids are the stages' at 800 x 1344 cropped by ``--crop`` (each
side; batch 1). A block near a border reads a shorter band, so a crop counts somewhat fewer reads
per token than the full grid.

Usage::

    python tools/analysis/kernel_loads.py [--models pvt_tiny swin_t] [--stages 1 3]
        [--crop 0.25] [--dtype float16]
"""
import argparse
import collections
import contextlib
import math
import os
import sys

# before triton is imported: the kernels run interpreted
if os.environ.setdefault('TRITON_INTERPRET', '1') != '1':
    sys.exit('kernel_loads.py counts loads in Triton\'s interpreter: unset TRITON_INTERPRET')

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_norm import DTYPES, STAGES, stage_label  # noqa: E402

from mmdtn import DynamicTokenNorm, set_dtn_backend  # noqa: E402
from mmdtn.models.layers.dtn.backends import base  # noqa: E402


class LoadCounter:
    """Bytes at the distinct addresses of every load of the interpreted kernels, by the name of the
    launch they belong to (the last one :func:`.base.record_launch` recorded: every launch of the
    Triton backend is recorded before it runs)."""

    def __init__(self):
        self.loads = collections.Counter()

    def __enter__(self):
        self._load = interpreter.InterpreterBuilder.create_masked_load
        counter = self

        def counted_load(builder, ptrs, mask, *args):
            size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            launch = base._records[-1][-1].name
            addresses, lanes = np.broadcast_arrays(ptrs.data, mask.data.astype(bool))
            counter.loads[launch] += np.unique(addresses[lanes]).size * size
            return counter._load(builder, ptrs, mask, *args)

        interpreter.InterpreterBuilder.create_masked_load = counted_load
        return self

    def __exit__(self, *exc):
        interpreter.InterpreterBuilder.create_masked_load = self._load


def count(C, heads, pool, H, W, dtype):
    """{pass: {kernel: (operand bytes, bytes loaded)}} of one layer's forward and backward."""
    torch.manual_seed(0)
    norm = DynamicTokenNorm(C, heads, pool_size=pool)
    x = torch.randn(1, H * W, C, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)
    set_dtn_backend('triton')
    with recorded() as forward:
        y = norm(x, (H, W))
    with recorded() as backward:
        torch.autograd.grad(y, [x, *norm.parameters()], grad)
    return {'forward': forward, 'backward': backward}


@contextlib.contextmanager
def recorded():
    """{kernel: (operand bytes, bytes loaded)} of the launches inside, filled in on exit."""
    kernels = {}
    with base.recording_launches() as launches, LoadCounter() as counter:
        yield kernels
    operands = collections.Counter()
    for launch in launches:
        operands[launch.name] += launch.read + launch.written
    kernels.update({k: (operands[k], counter.loads[k]) for k in operands})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    models = sorted({stage[0] for stage in STAGES})
    parser.add_argument('--models', nargs='+', default=models, choices=models)
    parser.add_argument('--stages', nargs='+', type=int, default=[1, 2, 3, 4],
                        choices=[1, 2, 3, 4])
    parser.add_argument('--crop', type=float, default=0.25,
                        help='fraction of each side of the stage grids at 800 x 1344')
    parser.add_argument('--dtype', default='float16', choices=sorted(DTYPES))
    args = parser.parse_args()
    if not 0 < args.crop <= 1:
        parser.error(f'--crop {args.crop}: a fraction in (0, 1]')
    stages = [s for s in STAGES if s[0] in args.models and s[1] in args.stages]
    dtype = DTYPES[args.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    print(f'Triton kernels in the interpreter, {args.dtype} tokens, batch 1, grids cropped to '
          f'{args.crop:g} of each side; per token: operand bytes (read once) and bytes loaded '
          "(from memory or cache), and each against LayerNorm's operand bytes of the pass")
    rows = []
    for model, stage, C, H, W, pool, heads in tqdm(stages, desc='stages'):
        h, w = max(1, math.ceil(H * args.crop)), max(1, math.ceil(W * args.crop))
        rows.append((stage_label(model, stage, C, h, w, pool), C,
                     count(C, heads, pool, h, w, dtype), h * w))
    for label, C, passes, tokens in rows:
        print(f'\n{label}')
        for name, kernels in passes.items():
            ln = C * element * (2 if name == 'forward' else 3)  # x read, y written (+ dL/dy read)
            total_operands = sum(v[0] for v in kernels.values())
            total_loads = sum(v[1] for v in kernels.values())
            print(f'  {name:<9}{"operands":>22}{"x LN":>7}{"loaded":>12}{"x LN":>8}'
                  f'{"loaded / operands":>19}')
            for kernel, (operands, loads) in [*kernels.items(),
                                              ('total', (total_operands, total_loads))]:
                print(f'    {kernel.replace("triton.", ""):<22}{operands / tokens:>9.0f} B/token'
                      f'{operands / tokens / ln:>6.2f}x{loads / tokens:>12.0f}'
                      f'{loads / tokens / ln:>7.1f}x{loads / max(operands, 1):>18.1f}')


if __name__ == '__main__':
    main()
