"""Reads from cache and arithmetic of DynamicTokenNorm's Triton kernels, counted in Triton's
interpreter, beside the bytes of their operands (what ``benchmark_norm.py --tables model`` counts).

The traffic model of ``benchmark_norm.py`` counts the bytes of every kernel's operands: what a GPU's
memory moves if every byte is read once and what a kernel reads again comes from cache. This tool
counts what the kernels' loads ask of the caches: it runs one layer forward and backward with the
kernels in Triton's interpreter (on CPU tensors, no GPU) and adds up, for every load instruction of
every program, the bytes at its distinct addresses (a load whose lanes share an address, as the
positional weights shared by a head's channels, counts that address once, as a GPU coalesces it).
Loads of a program that read the same bytes again (the rows of the band every block of the band
products reads) count every time. Per token and against LayerNorm's bytes, for each
kernel.

It also counts their floating-point operations, as the interpreter runs them on whole tiles (masked
lanes included, as a GPU's threads compute them): an add, subtract, multiply, divide or square root
one each, a fused multiply-add two, ``tl.dot`` 2 M N K (``input_precision='ieee'``: float32
multiply-adds, no tensor cores), a float sum one per value summed. Compiled, multiplies and adds
fuse into FMAs, which a GPU issues at its FP32 rate in FLOPs, so FLOPs / that rate is a floor on a
kernel's time, as operand bytes / memory bandwidth is another (``--gpu``: both for the stage's
whole grid at batch 2; the higher is the roofline's). A kernel far above both waits on something
else: on loads from the cache, where an SM holds few warps (``compile_kernels.py``: warps/SM).

The interpreter is slow, so the grids are the stages' at 800 x 1344 cropped by ``--crop`` (each
side; batch 1). A block near a border reads a shorter band, so a crop counts somewhat fewer reads
and operations per token than the full grid.

Usage::

    python tools/analysis/kernel_loads.py [--models pvt_tiny swin_t] [--stages 1 3]
        [--crop 0.25] [--dtype float16] [--gpu h200]
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


def _launch():
    """The name of the launch that the interpreter runs now (the last one
    :func:`.base.record_launch` recorded: every launch of the Triton backend is recorded before it
    runs)."""
    return base._records[-1][-1].name


class LoadCounter:
    """Bytes at the distinct addresses of every load of the interpreted kernels, by launch."""

    def __init__(self):
        self.loads = collections.Counter()

    def __enter__(self):
        self._load = interpreter.InterpreterBuilder.create_masked_load
        counter = self

        def counted_load(builder, ptrs, mask, *args):
            size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
            addresses, lanes = np.broadcast_arrays(ptrs.data, mask.data.astype(bool))
            counter.loads[_launch()] += np.unique(addresses[lanes]).size * size
            return counter._load(builder, ptrs, mask, *args)

        interpreter.InterpreterBuilder.create_masked_load = counted_load
        return self

    def __exit__(self, *exc):
        interpreter.InterpreterBuilder.create_masked_load = self._load


#: The interpreter's float operations by FLOPs per value of their result (see the module
#: docstring); tl.dot and float sums are counted apart.
FLOPS = {**dict.fromkeys(('create_fadd', 'create_fsub', 'create_fmul', 'create_fdiv',
                          'create_precise_divf', 'create_sqrt', 'create_precise_sqrt',
                          'create_rsqrt', 'create_exp', 'create_exp2'), 1),
         'create_fma': 2}


class ArithmeticCounter:
    """Floating-point operations of the interpreted kernels, by launch: all (``flops``) and those
    of ``tl.dot`` (``dot_flops``)."""

    def __init__(self):
        self.flops, self.dot_flops = collections.Counter(), collections.Counter()

    def __enter__(self):
        builder, reduce = interpreter.InterpreterBuilder, interpreter.ReduceOps
        self._own = {name: getattr(builder, name) for name in (*FLOPS, 'create_dot')}
        self._sum = reduce.sum
        counter = self

        def counted(name, operation):
            def run(*args):
                result = operation(*args)
                counter.flops[_launch()] += FLOPS[name] * result.data.size
                return result
            return run

        def dot(builder, a, *args):
            result = self._own['create_dot'](builder, a, *args)
            flops = 2 * result.data.size * a.data.shape[-1]
            counter.flops[_launch()] += flops
            counter.dot_flops[_launch()] += flops
            return result

        def summed(ops, tensor):
            result = self._sum(ops, tensor)
            values = tensor.handle.data
            if np.issubdtype(values.dtype, np.floating):
                counter.flops[_launch()] += values.size - np.size(result.handle.data)
            return result

        for name in FLOPS:
            setattr(builder, name, counted(name, self._own[name]))
        builder.create_dot, reduce.sum = dot, summed
        return self

    def __exit__(self, *exc):
        for name, operation in self._own.items():
            setattr(interpreter.InterpreterBuilder, name, operation)
        interpreter.ReduceOps.sum = self._sum


#: What one kernel of a pass moves and computes: operand bytes (read once), bytes its loads ask
#: for, FLOPs and those of tl.dot.
Counts = collections.namedtuple('Counts', 'operands loaded flops dot_flops')

#: Peak rates of GPUs (NVIDIA's data sheets, SXM): FP32 without tensor cores in FLOP/s, memory
#: bandwidth in bytes/s.
GPUS = {'a100': (19.5e12, 2.039e12), 'h100': (67e12, 3.35e12), 'h200': (67e12, 4.8e12)}


def count(C, heads, pool, H, W, dtype):
    """{pass: {kernel: :data:`Counts`}} of one layer's forward and backward."""
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
    """{kernel: :data:`Counts`} of the launches inside, filled in on exit."""
    kernels = {}
    with (base.recording_launches() as launches, LoadCounter() as loads,
          ArithmeticCounter() as arithmetic):
        yield kernels
    operands = collections.Counter()
    for launch in launches:
        operands[launch.name] += launch.read + launch.written
    kernels.update({k: Counts(operands[k], loads.loads[k], arithmetic.flops[k],
                              arithmetic.dot_flops[k]) for k in operands})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    models = sorted({stage[0] for stage in STAGES})
    parser.add_argument('--models', nargs='+', default=models, choices=models)
    parser.add_argument('--stages', nargs='+', type=int, default=[1, 2, 3, 4],
                        choices=[1, 2, 3, 4])
    parser.add_argument('--crop', type=float, default=0.25,
                        help='fraction of each side of the stage grids at 800 x 1344')
    parser.add_argument('--dtype', default='float16', choices=sorted(DTYPES))
    parser.add_argument('--gpu', default='h200', choices=sorted(GPUS),
                        help='whose FP32 rate and memory bandwidth give the floors')
    args = parser.parse_args()
    if not 0 < args.crop <= 1:
        parser.error(f'--crop {args.crop}: a fraction in (0, 1]')
    stages = [s for s in STAGES if s[0] in args.models and s[1] in args.stages]
    dtype = DTYPES[args.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    flop_rate, bandwidth = GPUS[args.gpu]
    print(f'Triton kernels in the interpreter, {args.dtype} tokens, batch 1, grids cropped to '
          f'{args.crop:g} of each side; per token: operand bytes (read once), bytes loaded '
          "(from memory or cache), each against LayerNorm's operand bytes of the pass, and FLOPs "
          f'(of them tl.dot\'s); floors for the whole grid at batch 2 on an {args.gpu.upper()} '
          f'({flop_rate / 1e12:g} TFLOP/s FP32, {bandwidth / 1e12:g} TB/s): FLOPs and operand '
          'bytes at those rates')
    rows = []
    for model, stage, C, H, W, pool, heads in tqdm(stages, desc='stages'):
        h, w = max(1, math.ceil(H * args.crop)), max(1, math.ceil(W * args.crop))
        rows.append((stage_label(model, stage, C, h, w, pool), C,
                     count(C, heads, pool, h, w, dtype), h * w, 2 * H * W))
    for label, C, passes, tokens, grid_tokens in rows:
        print(f'\n{label}')
        for name, kernels in passes.items():
            ln = C * element * (2 if name == 'forward' else 3)  # x read, y written (+ dL/dy read)
            total = Counts(*map(sum, zip(*kernels.values())))
            print(f'  {name:<9}{"operands":>22}{"x LN":>7}{"loaded":>12}{"x LN":>8}'
                  f'{"FLOP/token":>12}{"tl.dot":>8}{"FP32 us":>9}{"memory us":>10}')
            for kernel, counts in [*kernels.items(), ('total', total)]:
                operands, loads, flops, dot_flops = (v / tokens for v in counts)
                print(f'    {kernel.replace("triton.", ""):<22}{operands:>9.0f} B/token'
                      f'{operands / ln:>6.2f}x{loads:>12.0f}{loads / ln:>7.1f}x{flops:>12.0f}'
                      f'{dot_flops / max(flops, 1):>8.0%}'
                      f'{flops * grid_tokens / flop_rate * 1e6:>9.1f}'
                      f'{operands * grid_tokens / bandwidth * 1e6:>10.1f}')


if __name__ == '__main__':
    main()
