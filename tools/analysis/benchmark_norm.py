"""Forward+backward time and peak memory of DynamicTokenNorm against nn.LayerNorm and against the
dense formulation of DTN (an explicit T x T positional matrix P^h, Eq. 6), side by side in one run.

Shapes: the four stages of PVT-Tiny for an 800 x 1344 input (B=2; C = 64/128/320/512;
H x W = 200x336, 100x168, 50x84, 25x42; pool 4/2/1/1; DTN heads 4/4/5/8), then a sweep of square
inputs from 224 to 1344 on the stage-1 and stage-3 settings to show how the cost grows.

Time: median over repeats of forward + backward (input and all parameters require grad), the
three normalisers timed in turn within every repeat; wall-clock time, or with ``--clock cpu`` the
CPU time of the process (``time.process_time``: robust on a machine shared with other jobs, where
wall time mostly measures waiting). Memory: peak of the tensor memory allocated
during forward + backward above what was live before (input, parameters and output gradient
excluded); on CUDA from ``torch.cuda.max_memory_allocated``, on CPU as the maximum of the running
sum of all allocation and free events of PyTorch's CPU allocator recorded by ``torch.profiler``
(``profile_memory=True``). Subnormal floats are flushed to zero for all three (see ``main``).

Floor: the exact inter-token statistics multiply both moments by P_x^h and P_y^h in the forward
pass; the backward pass needs the transposed products of both gradients and the gradients of P_x^h
and P_y^h, each with the same number of multiply-adds: 6 B C T (Hp + Wp) in all on the pooled
Hp x Wp grid, T = Hp Wp. Divided by the device's peak matrix-product rate (a 1024^3 float32
product, measured first), this is a lower bound on DTN's forward + backward time for any
implementation that applies P^h as dense matrices (element-wise work and memory traffic
excluded). DTN's CPU kernels skip the exact zeros of the band matrices P_x^h and P_y^h and can go
below it; a head whose P^h spreads over a whole axis needs the dense products.

Usage::

    python tools/analysis/benchmark_norm.py [--device cpu|cuda] [--threads N] [--repeats 5]
        [--clock wall|cpu] [--sizes 224 448 ...] [--dense-limit-gb 2]
"""
import argparse
import contextlib
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from mmengine.utils import ProgressBar

from mmdtn import DynamicTokenNorm

PVT_TINY_STAGES = [  # (name, C, H, W, pool, heads) at 800 x 1344
    ('stage1', 64, 200, 336, 4, 4),
    ('stage2', 128, 100, 168, 2, 4),
    ('stage3', 320, 50, 84, 1, 5),
    ('stage4', 512, 25, 42, 1, 8),
]
STRIDES = {'stage1': 4, 'stage2': 8, 'stage3': 16, 'stage4': 32}


class DenseDTN(torch.nn.Module):
    """DTN with the T x T positional matrix built explicitly from R (Eq. 6), as in the paper's
    Algorithm 1; pooling and nearest broadcasting as DynamicTokenNorm. Shares its parameters."""

    def __init__(self, dtn):
        super().__init__()
        self.dtn = dtn

    def forward(self, x, hw_shape):
        dtn = self.dtn
        B, N, C = x.shape
        H, W = hw_shape
        s, nh = dtn.pool_size, dtn.num_heads
        Hp, Wp = dtn.pooled_shape(hw_shape)
        ys, xs = torch.meshgrid(
            torch.arange(Hp, device=x.device, dtype=x.dtype),
            torch.arange(Wp, device=x.device, dtype=x.dtype), indexing='ij')
        ys, xs = ys.flatten(), xs.flatten()
        dx, dy = xs[None] - xs[:, None], ys[None] - ys[:, None]
        R = torch.stack([dx * dx + dy * dy, dx, dy], dim=-1)  # (T, T, 3)
        P = torch.softmax(R @ dtn.pos_coef.t(), dim=1).permute(2, 0, 1)  # Eq. 6, (heads, T, T)
        image = x.view(B, H, W, C).permute(0, 3, 1, 2)
        pooled = F.avg_pool2d(image, s, s, ceil_mode=True) if s > 1 else image
        second = F.avg_pool2d(image * image, s, s, ceil_mode=True) if s > 1 else image * image
        pooled = pooled.reshape(B, nh, C // nh, Hp * Wp)
        second = second.reshape(B, nh, C // nh, Hp * Wp)
        mean_it = pooled @ P.unsqueeze(0).transpose(-1, -2)  # Eq. 5: P^h x^h
        var_it = (second @ P.unsqueeze(0).transpose(-1, -2) - mean_it**2).clamp_min(0)

        def to_tokens(t):
            t = t.reshape(B, C, Hp, 1, Wp, 1).expand(B, C, Hp, s, Wp, s)
            return t.reshape(B, C, Hp * s, Wp * s)[:, :, :H, :W].flatten(2).transpose(1, 2)

        var_ln, mean_ln = torch.var_mean(x, dim=-1, keepdim=True, correction=0)
        d = C // nh
        lm = torch.sigmoid(dtn.mean_gate).repeat_interleave(d)
        lv = torch.sigmoid(dtn.var_gate).repeat_interleave(d)
        mean = lm * mean_ln + (1 - lm) * to_tokens(mean_it)
        var = lv * var_ln + (1 - lv) * to_tokens(var_it)
        return dtn.weight * (x - mean) / torch.sqrt(var + dtn.eps) + dtn.bias  # Eq. 4


def matmul_rate(device, clock, repeats=5, n=1024):
    """Multiply-adds per second of this device's float32 matrix product (n x n by n x n, best of
    ``repeats``): the rate no implementation of the positional products can exceed."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty_like(a)
    best = math.inf
    for _ in range(repeats + 1):
        sync(device)
        start = clock()
        torch.mm(a, b, out=out)
        sync(device)
        best = min(best, clock() - start)
    return n**3 / best


def product_macs(C, H, W, pool, batch):
    """Multiply-adds of DTN's positional products as dense matrix products, forward + backward:
    6 B C T (Hp + Wp) on the pooled Hp x Wp grid (T = Hp Wp)."""
    Hp, Wp = -(-H // pool), -(-W // pool)
    return 6 * batch * C * Hp * Wp * (Hp + Wp)


def fwd_bwd(module, x, hw_shape, grad):
    y = module(x) if isinstance(module, torch.nn.LayerNorm) else module(x, hw_shape)
    y.backward(grad)


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def quiet_stderr():
    """Silence the profiler back end's start/stop messages written to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, 'w') as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_memory(fn, device):
    """Peak bytes allocated by ``fn`` above the memory live before it."""
    if device.type == 'cuda':
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with quiet_stderr(), torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # every allocation (+bytes) and free (-bytes) of the CPU allocator, in time order
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == '[memory]')
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def measure(shapes, batch, device, repeats, warmup, dense_repeats, dense_limit_gb, clock,
            progress, rate):
    """Rows of (label, tokens, {'ln'|'dtn'|'dense': (seconds, bytes) or None})."""
    rows = []
    for label, C, H, W, pool, heads in shapes:
        torch.manual_seed(0)
        x = torch.randn(batch, H * W, C, device=device, requires_grad=True)
        grad = torch.randn_like(x)
        dtn = DynamicTokenNorm(C, heads, pool_size=pool).to(device)
        modules = {'ln': torch.nn.LayerNorm(C, eps=1e-6).to(device), 'dtn': dtn}
        Hp, Wp = dtn.pooled_shape((H, W))
        dense_bytes = 4 * heads * (Hp * Wp)**2 * 4  # P, R-logits and their gradients, float32
        if dense_bytes <= dense_limit_gb * 2**30:
            modules['dense'] = DenseDTN(dtn)
        times = {k: [] for k in modules}
        for it in range(warmup + repeats):
            for key, module in modules.items():  # side by side: every repeat times all of them
                if key == 'dense' and not warmup <= it < warmup + dense_repeats:
                    continue  # tens of times slower: fewer repeats
                x.grad = None
                for p in module.parameters():
                    p.grad = None
                sync(device)
                start = clock()
                fwd_bwd(module, x, (H, W), grad)
                sync(device)
                if it >= warmup:
                    times[key].append(clock() - start)
        result = {}
        for key, module in modules.items():
            x.grad = None
            for p in module.parameters():
                p.grad = None
            mem = peak_memory(lambda: fwd_bwd(module, x, (H, W), grad), device)
            result[key] = (statistics.median(times[key]), mem)
        result.setdefault('dense', None)
        result['floor'] = product_macs(C, H, W, pool, batch) / rate
        rows.append((label, (C, H, W, pool, heads), result))
        progress.update()
    return rows


def print_table(title, rows):
    print(f'\n{title}')
    head = (f"{'shape':<24}{'LN ms':>9}{'DTN ms':>9}{'dense ms':>10}{'DTN/LN':>8}{'dense/DTN':>10}"
            f"{'LN MB':>8}{'DTN MB':>8}{'dense MB':>9}{'mem DTN/LN':>11}{'floor ms':>9}"
            f"{'floor/LN':>9}")
    print(head)
    print('-' * len(head))
    for label, (C, H, W, pool, heads), r in rows:
        ln_t, ln_m = r['ln']
        dtn_t, dtn_m = r['dtn']
        shape = f'{label} {H}x{W}x{C} s{pool}'
        if r['dense'] is None:
            dense_t = dense_ratio = dense_m = '-'
        else:
            dense_t = f"{r['dense'][0] * 1e3:.1f}"
            dense_ratio = f"{r['dense'][0] / dtn_t:.1f}x"
            dense_m = f"{r['dense'][1] / 2**20:.0f}"
        print(f'{shape:<24}{ln_t * 1e3:>9.1f}{dtn_t * 1e3:>9.1f}{dense_t:>10}'
              f'{dtn_t / ln_t:>7.2f}x{dense_ratio:>10}{ln_m / 2**20:>8.0f}{dtn_m / 2**20:>8.0f}'
              f'{dense_m:>9}{dtn_m / max(ln_m, 1):>10.2f}x{r["floor"] * 1e3:>9.1f}'
              f'{r["floor"] / ln_t:>8.1f}x')


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--clock', choices=['wall', 'cpu'], default='wall',
                        help='wall-clock time or CPU time of the process')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--dense-repeats', type=int, default=1,
                        help='repeats of the (much slower) dense formulation, after the warm-up')
    parser.add_argument('--sizes', type=int, nargs='+', default=[224, 448, 672, 896, 1120, 1344])
    parser.add_argument('--dense-limit-gb', type=float, default=2.0,
                        help='skip the dense formulation when its T x T tensors exceed this')
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    # subnormal floats (tiny softmax weights of the dense P) slow CPU matrix products down by
    # orders of magnitude; flushing them to zero keeps the comparison about the formulation
    torch.set_flush_denormal(True)

    sweep = []
    for size in args.sizes:
        for label, C, _, _, pool, heads in (PVT_TINY_STAGES[0], PVT_TINY_STAGES[2]):
            side = math.ceil(size / STRIDES[label])
            sweep.append((f'{size}px {label}', C, side, side, pool, heads))
    progress = ProgressBar(len(PVT_TINY_STAGES) + len(sweep))
    clock = time.process_time if args.clock == 'cpu' else time.perf_counter
    if args.clock == 'cpu' and device.type == 'cuda':
        parser.error('--clock cpu measures host CPU time; use the wall clock on CUDA')
    rate = matmul_rate(device, clock)
    stages = measure(PVT_TINY_STAGES, args.batch, device, args.repeats, args.warmup,
                     args.dense_repeats, args.dense_limit_gb, clock, progress, rate)
    sizes = measure(sweep, args.batch, device, args.repeats, args.warmup, args.dense_repeats,
                    args.dense_limit_gb, clock, progress, rate)
    print(f'\ndevice={device} threads={torch.get_num_threads()} batch={args.batch} '
          f'repeats={args.repeats} (dense {args.dense_repeats}), median {args.clock} time, '
          f'torch {torch.__version__}, peak matrix product {rate / 1e9:.0f} G multiply-adds/s')
    print_table('PVT-Tiny stages at 800 x 1344 (forward + backward)', stages)
    print_table('Input-size sweep, square inputs (forward + backward)', sizes)

    print('\nTargets')
    for label, _, r in stages:
        ratio = r['dtn'][0] / r['ln'][0]
        floor = r['floor'] / r['ln'][0]
        print(f"  {label}: DTN/LN time {ratio:.2f}x (target <= 3x): "
              f"{'met' if ratio <= 3 else 'NOT met'}; the positional products alone need "
              f">= {floor:.1f}x LN's time on this device"
              + (' (target out of reach with dense products)' if floor > 3 else ''))
    r = stages[0][2]
    if r['dense'] is not None:
        ratio = r['dense'][0] / r['dtn'][0]
        print(f"  stage1: dense/DTN time {ratio:.1f}x (target >= 10x): "
              f"{'met' if ratio >= 10 else 'NOT met'}")
    for label in ('stage1', 'stage3'):
        rows = [(s, row[2]['dtn'][1], row[1][1] * row[1][2]) for s, row in zip(
            [n for n in args.sizes], [row for row in sizes if row[0].endswith(label)])]
        per_token = ', '.join(f'{s}px {m / t / args.batch / 1024:.2f}' for s, m, t in rows)
        print(f'  {label} DTN peak memory per token and image (KiB): {per_token}')


if __name__ == '__main__':
    main()
