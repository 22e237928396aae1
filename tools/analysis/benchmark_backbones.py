"""Cost of the DTN backbones against mmdet's stock LayerNorm backbones, side by side in one run.

Prints two tables:

1. parameters and FLOPs at 224 x 224 and 800 x 1344 (batch 1), counted as
   ``tools/analysis/complexity.py`` counts them (:func:`mmdtn.analysis.flops.complexity`):
   mmengine's ``FlopAnalyzer`` (one multiply-add = one FLOP, LayerNorm = 5 per element), with
   every DynamicTokenNorm call counted by the one DTN formula,
   ``mmdtn/models/layers/dtn/flops.py``;
2. forward + backward time of one training iteration and peak memory.

   - Time: a fresh process builds both backbones and alternates them iteration by iteration, so
     that both see the same machine load; after the warm-up it times ``--iters`` iterations of
     each and keeps the fastest of each (a shared machine only ever adds time). The table shows
     medians over ``--repeats`` such processes, and the median and range of their DTN/LN ratios.
     Beside it, the host's time to issue an iteration (the fastest of the same iterations): on a
     GPU, where it comes near the iteration's time the GPU waits for the host, and a faster kernel
     saves nothing (a layer's own host time: ``benchmark_norm.py --tables time host``).
     On Linux CPUs these processes run, by default (``--malloc keep``), with glibc's malloc set to
     keep freed memory for reuse (:data:`KEEP_FREED_MEMORY`). With its defaults, every tensor
     above 32 MiB is mapped afresh and first-touch page faults on it cost, on virtual machines,
     more than a second of system time per iteration, varying from one iteration to the next for
     both backbones alike; ``--malloc system`` measures that way.
   - Memory: the peak of one training iteration after the warm-up (CUDA: the allocator's peak;
     CPU: growth of the process's peak resident set size), each backbone in a fresh process of
     its own.

Example::

    python tools/analysis/benchmark_backbones.py                     # 800x1344, batch 1 and 2
    python tools/analysis/benchmark_backbones.py --models pvt_tiny --batches 1 --repeats 2
"""
import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from mmdtn.analysis.cli import torch_device

# name -> (stock type, DTN type, kwargs shared by both)
MODELS = {
    'pvt_tiny': ('PyramidVisionTransformer', 'PyramidVisionTransformerDTN',
                 dict(num_layers=[2, 2, 2, 2])),
    'pvtv2_b0': ('PyramidVisionTransformerV2', 'PyramidVisionTransformerV2DTN',
                 dict(embed_dims=32, num_layers=[2, 2, 2, 2])),
    'pvtv2_b2': ('PyramidVisionTransformerV2', 'PyramidVisionTransformerV2DTN',
                 dict(embed_dims=64, num_layers=[3, 4, 6, 3])),
    'swin_t': ('SwinTransformer', 'SwinTransformerDTN', dict()),
}
VARIANTS = ('ln', 'dtn')  # the stock backbone and its DTN twin
TIMES = (*VARIANTS, *(f'host {v}' for v in VARIANTS))  # a timing process's: time, host's part
PAPER_FLOPS = {'pvt_tiny': (1.90, 2.05), 'swin_t': (4.51, 5.09)}  # DTN paper, Table 2 (224)
#: glibc malloc settings of the timing processes with ``--malloc keep``: no memory is returned to
#: the system, and no allocation gets pages of its own (mapped, and faulted in, afresh each time).
KEEP_FREED_MEMORY = {'MALLOC_MMAP_THRESHOLD_': str(2**32), 'MALLOC_TRIM_THRESHOLD_': str(2**40),
                     'MALLOC_TOP_PAD_': str(2**30)}


def build(name, variant, **extra):
    """The stock ('ln') or DTN ('dtn') backbone ``name``, initialized from scratch."""
    import mmdtn  # noqa: F401  (registers the DTN backbones)
    from mmdet.registry import MODELS as REG
    stock_type, dtn_type, kwargs = MODELS[name]
    cfg = dict(type=dtn_type if variant == 'dtn' else stock_type, **kwargs)
    cfg.update(extra if variant == 'dtn' else {})
    model = REG.build(cfg)
    model.init_weights()
    return model


def count_flops(name, size):
    """``{variant: (params, flops)}`` of the stock backbone ('ln'), its DTN twin ('dtn') and the
    twin with Dual PatchNorm ('dtn+dpn') at ``size`` (batch 1), counted by
    :func:`mmdtn.analysis.flops.complexity` as ``tools/analysis/complexity.py`` counts them."""
    from mmdtn.analysis.flops import complexity
    x = torch.randn(1, 3, *size)
    result = {}
    for variant, base, extra in (('ln', 'ln', {}), ('dtn', 'dtn', {}),
                                 ('dtn+dpn', 'dtn', dict(dual_patchnorm=True))):
        model = build(name, base, **extra)
        model.eval()  # (mmdet's Swin.train() returns None: no chaining)
        counts = complexity(model, x)
        result[variant] = (counts['params'], counts['flops'])
    return result


#: dtype of the forward pass under autocast (``--autocast``), None for none
AUTOCAST = {'dtype': None}


def step(model, x):
    dtype = AUTOCAST['dtype']
    with torch.autocast(x.device.type, dtype=dtype, enabled=dtype is not None):
        outs = model(x)
    sum(o.float().mean() for o in outs).backward()


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _rss_bytes():
    with open('/proc/self/statm') as f:
        return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')


def timed_step(model, x, device):
    """Seconds of one fwd+bwd iteration and of the host's part of it, until the last kernel is
    issued (the same on a CPU); gradients dropped afterwards."""
    sync(device)
    t0 = time.perf_counter()
    step(model, x)
    issued = time.perf_counter() - t0
    sync(device)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds, issued


def memory_worker(name, variant, batch, size, device, warmup):
    """Peak memory (bytes) of one fwd+bwd iteration after the warm-up, in this fresh process."""
    model = build(name, variant).to(device)
    model.train()
    x = torch.randn(batch, 3, *size, device=device)
    base = _rss_bytes()
    for _ in range(warmup):
        timed_step(model, x, device)
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    timed_step(model, x, device)
    if device.type == 'cuda':
        return {'peak': torch.cuda.max_memory_allocated(device) - base}
    return {'peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base}


def time_worker(name, batch, size, device, warmup, iters):
    """Seconds per fwd+bwd iteration of the stock and the DTN backbone, both in this process and
    alternating iteration by iteration: the fastest of ``iters`` timed iterations of each, and as
    ``host <variant>`` the host's part of it (:func:`timed_step`), the least of the same
    iterations."""
    models = {}
    for variant in VARIANTS:
        models[variant] = build(name, variant).to(device)
        models[variant].train()
    x = torch.randn(batch, 3, *size, device=device)
    for _ in range(warmup):
        for model in models.values():
            timed_step(model, x, device)
    seconds = dict.fromkeys(TIMES, math.inf)
    for _ in range(iters):
        for variant, model in models.items():
            total, issued = timed_step(model, x, device)
            seconds[variant] = min(seconds[variant], total)
            seconds[f'host {variant}'] = min(seconds[f'host {variant}'], issued)
    return seconds


def measure(name, variant, batch, size, device, warmup, iters, malloc='system'):
    """Run :func:`time_worker` (``variant='both'``) or :func:`memory_worker` in a fresh process
    (so that peak memory is this run's); ``malloc='keep'`` runs it with
    :data:`KEEP_FREED_MEMORY`."""
    cmd = [sys.executable, os.path.abspath(__file__), '--worker', name, variant, str(batch),
           f'{size[0]}x{size[1]}', '--device', str(device), '--warmup', str(warmup),
           '--iters', str(iters),
           '--threads', str(torch.get_num_threads()), '--autocast', AUTOCAST['name']]
    env = dict(os.environ, **KEEP_FREED_MEMORY) if malloc == 'keep' else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f'benchmark worker {cmd} failed:\n{proc.stderr[-3000:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_size(text):
    h, _, w = text.partition('x')
    return (int(h), int(w or h))


def table(title, header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = '  '.join(f'{{:>{w}}}' for w in widths)
    print(f'\n{title}')
    print(line.format(*header))
    print('  '.join('-' * w for w in widths))
    for r in rows:
        print(line.format(*r))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', nargs='+', default=['pvt_tiny', 'pvtv2_b0', 'swin_t'],
                        choices=list(MODELS))
    parser.add_argument('--size', default='800x1344', help='HxW of time/memory runs')
    parser.add_argument('--batches', nargs='+', type=int, default=[1, 2])
    parser.add_argument('--flops-sizes', nargs='+', default=['224x224', '800x1344'])
    parser.add_argument('--repeats', type=int, default=3,
                        help='timing processes per model and batch (the table shows medians)')
    parser.add_argument('--iters', type=int, default=3,
                        help='timed iterations of each backbone per timing process after the '
                        'warm-up; the fastest counts')
    parser.add_argument('--warmup', type=int, default=1,
                        help='untimed iterations before the measured one (first-touch memory '
                        'allocation and kernel set-up)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=None,
                        help='torch CPU threads; on a machine shared with other jobs use 1: '
                        'with more, every parallel op can stall on a descheduled thread, which '
                        'penalises many small ops (DTN) far more than few large ones')
    parser.add_argument('--malloc', default='keep', choices=['keep', 'system'],
                        help="timing processes on Linux CPUs: 'keep' sets glibc's malloc to keep "
                        "freed memory (no page faults on reused memory), 'system' leaves its "
                        "defaults; memory is always measured with the defaults")
    parser.add_argument('--autocast', default='none', choices=['none', 'float16', 'bfloat16'],
                        help='forward passes under autocast to this dtype (mmdet\'s '
                        'AmpOptimWrapper: float16)')
    parser.add_argument('--skip', nargs='*', default=[], choices=['flops', 'time'],
                        help="'time' skips the time and memory measurements")
    parser.add_argument('--worker', nargs=4, metavar=('MODEL', 'VARIANT', 'BATCH', 'SIZE'),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch_device(args.device, args.threads)
    AUTOCAST.update(name=args.autocast, dtype=None if args.autocast == 'none' else
                    getattr(torch, args.autocast))
    torch.manual_seed(0)
    if args.worker:
        name, variant, batch, size = args.worker
        batch, size = int(batch), parse_size(size)
        result = (time_worker(name, batch, size, device, args.warmup, args.iters)
                  if variant == 'both' else
                  memory_worker(name, variant, batch, size, device, args.warmup))
        print(json.dumps(result))
        return

    size = parse_size(args.size)
    malloc = 'keep' if args.malloc == 'keep' and device.type == 'cpu' and sys.platform.startswith(
        'linux') else 'system'
    print(f'device={device}, autocast={args.autocast}, torch threads={torch.get_num_threads()}, '
          f'time/memory input {size[0]}x{size[1]}, batches {args.batches}, {args.repeats} '
          f'processes x {args.iters} timed iterations per model, malloc of the timing processes: '
          f'{malloc}')
    if 'flops' not in args.skip:
        rows = []
        for name in tqdm(args.models, desc='FLOPs'):
            for fs in args.flops_sizes:
                r = count_flops(name, parse_size(fs))
                (p_ln, f_ln), (p_dtn, f_dtn), (_, f_dpn) = r['ln'], r['dtn'], r['dtn+dpn']
                paper = PAPER_FLOPS.get(name)
                paper_txt = (f'{paper[0]:.2f}G->{paper[1]:.2f}G '
                             f'(+{100 * (paper[1] / paper[0] - 1):.1f}%)'
                             if paper and fs == '224x224' else '')
                rows.append([name, fs, f'{p_ln / 1e6:.3f}M', f'{p_dtn / 1e6:.3f}M',
                             f'{f_ln / 1e9:.3f}G', f'{f_dtn / 1e9:.3f}G',
                             f'+{100 * (f_dtn / f_ln - 1):.2f}%',
                             f'+{100 * (f_dpn / f_ln - 1):.2f}%', paper_txt])
        table('Parameters and FLOPs (batch 1; FLOPs = multiply-adds)',
              ['model', 'input', 'params LN', 'params DTN', 'FLOPs LN', 'FLOPs DTN', 'DTN',
               'DTN+DPN', 'paper LN->DTN'], rows)

    if 'time' not in args.skip:
        rows = []
        cases = [(n, b) for n in args.models for b in args.batches]
        jobs = [(n, b, v) for n, b in cases for v in ('both', ) * args.repeats + VARIANTS]
        results = {}
        for name, batch, variant in tqdm(jobs, desc='fwd+bwd time and memory'):
            results.setdefault((name, batch, variant), []).append(
                measure(name, variant, batch, size, device, args.warmup, args.iters,
                        malloc if variant == 'both' else 'system'))
        for name, batch in cases:
            timed = results[(name, batch, 'both')]
            t = {v: statistics.median(r[v] for r in timed) for v in TIMES}
            ratios = [r['dtn'] / r['ln'] for r in timed]
            m = {v: results[(name, batch, v)][0]['peak'] for v in VARIANTS}
            rows.append([name, batch, f'{t["ln"]:.3g}', f'{t["dtn"]:.3g}',  # GPUs: tens of ms
                         f'{statistics.median(ratios):.3f}x',
                         f'{min(ratios):.3f}-{max(ratios):.3f}', f'{m["ln"] / 2**20:.0f}',
                         f'{m["dtn"] / 2**20:.0f}', f'{m["dtn"] / m["ln"]:.3f}x',
                         f'{t["host ln"]:.3g}', f'{t["host dtn"]:.3g}'])
        table(f'Forward+backward at {size[0]}x{size[1]}: time per iteration (s; {args.repeats} '
              f'processes, each alternating both backbones and keeping the fastest of '
              f'{args.iters} iterations of each: medians, and the range of the DTN/LN ratios) '
              f'and peak memory (MiB above the built model, one process per backbone); host: '
              f'the host\'s time to issue an iteration (s, medians; on a GPU, near the time where '
              f'the GPU waits for the host)',
              ['model', 'batch', 'time LN', 'time DTN', 'DTN/LN', 'range', 'mem LN', 'mem DTN',
               'DTN/LN', 'host LN', 'host DTN'], rows)


if __name__ == '__main__':
    main()
