"""DynamicTokenNorm as a layer against nn.LayerNorm, for every DTN backend that runs on the device,
side by side in one run: kernel launches and bytes moved, time, and peak memory.

Shapes: the stages of PVT-Tiny and of Swin-T for an 800 x 1344 input (B = 2; PVT-Tiny C = 64, 128,
320, 512 with DTN heads 4, 4, 5, 8; Swin-T C = 96, 192, 384, 768 with heads 3, 6, 12, 24; both on
200 x 336, 100 x 168, 50 x 84 and 25 x 42 tokens, pooling 4, 2, 1, 1).

1. Launches, allocations and bytes, forward and backward of one layer (input and all parameters
   require grad): counted while the layer runs, by a dispatch mode that sees every PyTorch
   operation, inside the backends' custom ops too, and by the backends' records of their compiled
   kernels. A launch is a PyTorch operation that computes (views and allocations excluded) or a
   compiled kernel; its bytes are those of the tensors it reads and writes: what a GPU's memory
   moves if no operand stays in cache between launches. The Triton backend is also counted where
   there is no GPU, on meta tensors (shapes without data; its kernels are then recorded, not
   launched).
2. The traffic model of the Triton backend: bytes per token of every kernel and of the PyTorch
   operations (the positional products, two reductions), forward and backward, beside LayerNorm's,
   for the tokens' dtype; from the same counts, so on any device; beside them the time a cost
   model expects on an H200 (:func:`expected_seconds`) against LayerNorm's time measured there,
   and the ratio last measured there (:data:`MEASURED_H200`).
3. Time and peak memory of forward + backward: median over repeats, the normalizers timed in turn
   within every repeat; wall-clock time, or with ``--clock cpu`` the CPU time of the process.
   On CUDA also the time of the GPU alone, with calls queued back to back, and the host's time to
   issue a call (:func:`gpu_seconds`): one call's wall-clock time is mostly launch overhead at
   these sizes. With ``--compile`` every DTN backend is also timed under ``torch.compile``
   (inductor, a static graph per stage shape, compiled in the warm-up), where the 'torch'
   backend's passes run as generated fused kernels.
   Beside them, how far every DTN's y and dx are from those of the ``torch`` backend on the same
   tokens in float32 (the largest difference over the largest value): on a GPU, a check of the
   compiled kernels at the models' own shapes.
   Memory: the peak of the tensor memory allocated during forward + backward above what was live
   before; on CUDA from ``torch.cuda.max_memory_allocated``, on CPU from the allocation and free
   events of PyTorch's CPU allocator recorded by ``torch.profiler``. The dense formulation of the
   paper (:mod:`mmdtn.models.layers.dtn.reference`, an explicit T x T P^h) is timed where its
   T x T tensors fit ``--dense-limit-gb``.
4. With ``--tables kernels``, the largest kernels of every layer (CUDA: GPU time; CPU: the
   operations' own CPU time); with ``--tables host``, the host's own time to issue one forward +
   backward of the Triton backend's layer with the device's work replaced by next to nothing:
   CPU tensors of each stage's channels on a 2 x 2 grid, every PyTorch operation dispatched and
   run (on a few values), every Triton launch replaced by a no-op (:func:`host_table`; Triton's
   launcher itself is not counted: about 10 us a launch on an H200 node), beside
   ``nn.LayerNorm``'s time measured the same way, side by side in one run.

Usage::

    python tools/dev/benchmark_norm.py [--device cpu|cuda] [--backends cpu torch ...]
        [--tables traffic model time kernels host] [--stages pvt_tiny:1 ...]
        [--dtype float32|float16|bfloat16] [--threads N] [--repeats 5] [--clock wall|cpu]
        [--compile] [--dense-limit-gb 2]
"""
import argparse
import collections
import contextlib
import copy
import math
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

from mmdtn import DynamicTokenNorm, available_backends, set_dtn_backend
from mmdtn.models.layers.dtn.backends.base import recording_launches
from mmdtn.models.layers.dtn.function import CUSTOM_OP_IMPLEMENTATIONS
from mmdtn.models.layers.dtn.grid import pooled_size
from mmdtn.models.layers.dtn.reference import DenseDynamicTokenNorm

# (model, stage, C, H, W, pool, DTN heads) at 800 x 1344
STAGES = [
    ('pvt_tiny', 1, 64, 200, 336, 4, 4),
    ('pvt_tiny', 2, 128, 100, 168, 2, 4),
    ('pvt_tiny', 3, 320, 50, 84, 1, 5),
    ('pvt_tiny', 4, 512, 25, 42, 1, 8),
    ('swin_t', 1, 96, 200, 336, 4, 3),
    ('swin_t', 2, 192, 100, 168, 2, 6),
    ('swin_t', 3, 384, 50, 84, 1, 12),
    ('swin_t', 4, 768, 25, 42, 1, 24),
]
DTYPES = {'float32': torch.float32, 'float16': torch.float16, 'bfloat16': torch.bfloat16}


# ---------------------------------------------------------------------------- launches and bytes
def _storage(t):
    """Identity of a tensor's storage (also on meta tensors)."""
    return t.untyped_storage()._cdata


class TrafficCounter(TorchDispatchMode):
    """Counts the PyTorch operations that compute and the bytes of their tensor operands (inputs
    read, outputs written), the allocations, and the compiled kernels the DTN backends record.
    Custom ops of the DTN backends are counted by what runs inside them. ``operations`` lists
    (name, bytes, FLOPs) of every launch (FLOPs of matrix products only)."""

    ALLOCATIONS = {'empty', 'empty_like', 'new_empty', 'empty_strided', 'zeros_like', 'lift_fresh',
                   '_local_scalar_dense', 'detach', 'alias', 'set_', '_to_copy_meta'}
    NEW = {'empty', 'empty_like', 'new_empty', 'empty_strided', 'zeros_like'}

    def __init__(self):
        super().__init__()
        self.launches, self.bytes, self.allocations = 0, 0, 0
        self.by_kernel = collections.Counter()  # bytes of each compiled kernel, and of 'torch'
        self.operations = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inner = CUSTOM_OP_IMPLEMENTATIONS.get(func._schema.name)
        if inner is not None:  # look inside the custom op
            with self:
                return inner(*args, **kwargs)
        out = func(*args, **kwargs)
        computes = any(torch.is_tensor(t) for t in tree_leaves(out))  # not promote_types
        # an aliasing schema (contiguous, reshape: reached undecomposed inside the custom ops)
        # copies where its output has a storage of its own
        copies = func.is_view and torch.is_tensor(out) and not any(
            _storage(out) == _storage(t) for t in tree_leaves(args) if torch.is_tensor(t))
        if func._opname in self.NEW:
            self.allocations += 1
        if (computes and (copies or not func.is_view)
                and func._opname not in self.ALLOCATIONS):
            inputs = args, {k: v for k, v in kwargs.items() if k != 'out'}  # out: written only
            moved = sum(t.numel() * t.element_size()
                        for t in tree_leaves((inputs, out)) if torch.is_tensor(t))
            self.launches += 1
            self.bytes += moved
            self.by_kernel['torch'] += moved
            flops = 0
            if func._opname == 'bmm':
                (b, m, k), n = args[0].shape, args[1].shape[-1]
                flops = 2 * b * m * n * k
            self.operations.append((f'torch.{func._opname}', moved, flops))
        return out

    @contextlib.contextmanager
    def counting(self):
        with recording_launches() as launches, self:
            yield
        self.launches += len(launches)
        for k in launches:
            self.bytes += k.read + k.written
            self.by_kernel[k.name] += k.read + k.written
            self.operations.append((k.name, k.read + k.written, 0))


def traffic(module, x, hw, grad):
    """The TrafficCounters of the forward and of the backward pass of ``module``."""
    params = list(module.parameters())
    forward, backward = TrafficCounter(), TrafficCounter()
    with forward.counting():
        y = call(module, x, hw)
    with backward.counting():
        torch.autograd.grad(y, [x, *params], grad)
    return forward, backward


# ---------------------------------------------------------------------------- time and memory
def call(module, x, hw):
    return module(x) if isinstance(module, torch.nn.LayerNorm) else module(x, hw)


def forward_backward(module, x, hw, grad):
    params = list(module.parameters())
    torch.autograd.grad(call(module, x, hw), [x, *params], grad)


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


def outputs(module, backend, x, hw, grad):
    """y and dx of ``module`` on DTN backend ``backend``."""
    set_dtn_backend(backend)
    x = x.detach().requires_grad_()
    y = call(module, x, hw)
    return y.detach(), torch.autograd.grad(y, [x], grad)[0]


def relative_error(results, reference):
    """The largest difference of ``results`` from ``reference`` over the largest reference value,
    the worst of y and dx."""
    return max(((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
               for a, b in zip(results, reference))


def timed(modules, x, hw, grad, device, repeats, warmup, clock):
    """Median forward + backward time of every module, timed in turn within every repeat:
    ``{name: seconds}`` of one call from the host, synchronized before and after (what a lone
    call costs, launches included), and on CUDA also ``{name: (GPU seconds, host seconds)}`` of
    :func:`gpu_seconds`; ``None`` elsewhere."""
    times = {name: [] for name in modules}
    gpu_times = {name: [] for name in modules} if device.type == 'cuda' else None
    for it in range(warmup + repeats):
        for name, (module, backend) in modules.items():
            set_dtn_backend(backend)
            sync(device)
            start = clock()
            forward_backward(module, x, hw, grad)
            sync(device)
            if it >= warmup:
                times[name].append(clock() - start)
                if gpu_times is not None:
                    gpu_times[name].append(gpu_seconds(module, x, hw, grad))
    median = {name: statistics.median(t) for name, t in times.items()}
    return median, gpu_times and {name: tuple(map(statistics.median, zip(*t)))
                                  for name, t in gpu_times.items()}


#: forward + backward calls per GPU timing, queued behind one GPU sleep of this many cycles
GPU_CALLS, GPU_SLEEP_CYCLES = 5, 2 * 10**8


def gpu_seconds(module, x, hw, grad):
    """Seconds of the GPU per forward + backward, launch overhead excluded, and seconds of the
    host to issue one: the GPU first sleeps (100 ms at 2 GHz) while the host queues
    :data:`GPU_CALLS` calls (timed on the host); CUDA events around the queued calls then time
    their kernels back to back. A call that waits for the GPU on the host, or a host slower than
    the sleep, would show here as the GPU idle, so the GPU time never under-counts."""
    sync(x.device)
    torch.cuda._sleep(GPU_SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = time.perf_counter()
    for _ in range(GPU_CALLS):
        forward_backward(module, x, hw, grad)
    host = time.perf_counter() - host
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / GPU_CALLS, host / GPU_CALLS


# ---------------------------------------------------------------------------- the tables
def layers(C, heads, pool, device, backends, dense, dtype=torch.float32):
    """{name: (module, backend, device)}: LayerNorm, DTN on every backend (each on its device),
    and the dense formulation. LayerNorm's parameters take the tokens' ``dtype``, as in a model
    cast to it (CUDA's LayerNorm refuses float32 parameters with 16-bit tokens); DTN's stay
    float32."""
    torch.manual_seed(0)
    dtn = DynamicTokenNorm(C, heads, pool_size=pool)
    modules = {'LN': (torch.nn.LayerNorm(C, eps=1e-6).to(device, dtype), 'auto', device)}
    for backend, where in backends:
        modules[f'DTN {backend}'] = (copy.deepcopy(dtn).to(where), backend, where)
    if dense:
        modules['dense'] = (DenseDynamicTokenNorm(dtn.to(device)), 'auto', device)
    return modules


def inputs(C, H, W, batch, device, dtype):
    torch.manual_seed(0)
    x = torch.randn(batch, H * W, C, device=device, dtype=dtype, requires_grad=True)
    return x, torch.randn_like(x)


def stage_label(model, stage, C, H, W, pool):
    return f'{model} s{stage} {H}x{W}x{C} p{pool}'


def traffic_table(args, device, backends, progress):
    """Prints the launches, allocations and bytes of every layer; returns the counters by (stage,
    layer)."""
    counts = {}
    for model, stage, C, H, W, pool, heads in args.stages:
        label = stage_label(model, stage, C, H, W, pool)
        for name, (module, backend, where) in layers(C, heads, pool, device, backends, False,
                                                     DTYPES[args.dtype]).items():
            x, grad = inputs(C, H, W, args.batch, where, DTYPES[args.dtype])
            set_dtn_backend(backend)
            counts[label, name] = traffic(module, x, (H, W), grad)
        progress.update()
    print(f'\nLaunches, allocations and bytes per layer, batch {args.batch}, {args.dtype} tokens, '
          f'{device.type} (PyTorch operations and compiled kernels, bytes of their operands; '
          '"on meta": counted on meta tensors)')
    head = (f"{'stage':<28}{'layer':<20}{'fwd launches':>13}{'allocs':>7}{'fwd MB':>9}"
            f"{'x LN':>9}{'bwd launches':>13}{'allocs':>7}{'bwd MB':>9}{'x LN':>9}")
    print(head + '\n' + '-' * len(head))
    for (label, name), (fwd, bwd) in counts.items():
        ln_fwd, ln_bwd = counts[label, 'LN']
        where = dict(backends).get(name[4:]) if name.startswith('DTN ') else device
        shown = name + (' (on meta)' if str(where) == 'meta' else '')
        print(f'{label:<28}{shown:<20}{fwd.launches:>13}{fwd.allocations:>7}'
              f'{fwd.bytes / 2**20:>9.1f}{fwd.bytes / ln_fwd.bytes:>8.2f}x{bwd.launches:>13}'
              f'{bwd.allocations:>7}{bwd.bytes / 2**20:>9.1f}{bwd.bytes / ln_bwd.bytes:>8.2f}x')
    return counts


#: The H200's measured ceilings (device-to-device copy, counting bytes read and written) and its
#: float32 rate on the CUDA cores (datasheet), and what :func:`expected_seconds` assumes of them:
#: 70% of the bandwidth for matrix products, 60% of the float32 rate, 35% of the bandwidth for
#: the passes over the tokens and the reductions, and 2 us between launches.
H200 = dict(bandwidth=4.3e12, fp32=67e12, products=0.70, rate=0.60, passes=0.35, gap=2e-6)

#: Measured on an H200 (docs/benchmarks.md, batch 2, float16 tokens, forward + backward; the
#: previous Triton kernels, of commit 22166b7: band walks fused with the passes): LayerNorm's GPU
#: time (seconds) and the Triton layer's as a multiple of it, by stage label.
MEASURED_H200 = {
    'pvt_tiny s1 200x336x64 p4': (278e-6, 1.16), 'pvt_tiny s2 100x168x128 p2': (163e-6, 1.66),
    'pvt_tiny s3 50x84x320 p1': (52e-6, 13.7), 'pvt_tiny s4 25x42x512 p1': (21e-6, 18.0),
    'swin_t s1 200x336x96 p4': (298e-6, 1.39), 'swin_t s2 100x168x192 p2': (187e-6, 2.01),
    'swin_t s3 50x84x384 p1': (52e-6, 17.9), 'swin_t s4 25x42x768 p1': (22e-6, 31.7),
}


def expected_seconds(operations, ceilings=H200):
    """The GPU time a cost model expects for launches (name, bytes, FLOPs): a matrix product takes
    the longer of its bytes and FLOPs at their assumed shares of the ceilings, any other launch
    its bytes at the passes' share, and every launch a gap."""
    total = 0.0
    for name, moved, flops in operations:
        if flops:
            total += max(moved / (ceilings['products'] * ceilings['bandwidth']),
                         flops / (ceilings['rate'] * ceilings['fp32']))
        else:
            total += moved / (ceilings['passes'] * ceilings['bandwidth'])
        total += ceilings['gap']
    return total


def model_table(args, counts):
    """Bytes per token of every Triton kernel and of the PyTorch operations beside LayerNorm's,
    and the time :func:`expected_seconds` expects on an H200 beside the last measured."""
    print(f'\nTraffic of the Triton backend per token, batch {args.batch}, {args.dtype} tokens '
          '(statistics in float32), bytes read + written; expected: the cost model on an H200 '
          "(tools/dev/benchmark_norm.py: H200), against LayerNorm's time measured there; "
          'measured: the previous kernels of 22166b7 (band walks)')
    for model, stage, C, H, W, pool, heads in args.stages:
        label = stage_label(model, stage, C, H, W, pool)
        if (label, 'DTN triton') not in counts:
            return
        tokens = args.batch * H * W
        dtn, ln = counts[label, 'DTN triton'], counts[label, 'LN']
        print(f'  {label}')
        for pass_, dtn_pass, ln_pass in zip(('forward', 'backward'), dtn, ln):
            parts = ', '.join(f'{k.replace("triton.", "")} {v / tokens:.0f}'
                              for k, v in sorted(dtn_pass.by_kernel.items()))
            print(f'    {pass_:<9} {dtn_pass.bytes / tokens:>7.0f} B/token = {parts}; LayerNorm '
                  f'{ln_pass.bytes / tokens:.0f}: {dtn_pass.bytes / ln_pass.bytes:.2f}x')
        measured = MEASURED_H200.get(label) if args.batch == 2 else None
        if measured:
            expected = expected_seconds(dtn[0].operations + dtn[1].operations)
            print(f'    H200, forward + backward: expected {expected * 1e6:.0f} us = '
                  f'{expected / measured[0]:.1f}x LayerNorm\'s {measured[0] * 1e6:.0f} us '
                  f'(measured); previous kernels measured {measured[1]:.2f}x')


def host_table(args, progress):
    """The host's own time per forward + backward of the Triton layer and of ``nn.LayerNorm``
    with the device's work replaced by next to nothing (see the module docstring): the median of
    ``--repeats`` rounds of 100 calls each, the two in turn."""
    from unittest import mock
    from mmdtn.models.layers.dtn.backends.triton import kernels, parameters
    print(f'\nHost time per forward + backward, device work replaced by next to nothing (CPU '
          f'tensors on a 2 x 2 grid, Triton launches no-ops), batch {args.batch}, float32 '
          f'tokens, median of {args.repeats} rounds of 100 calls, side by side')
    head = f"{'stage':<28}{'LN us':>9}{'DTN triton us':>15}{'x LN':>8}"
    print(head + '\n' + '-' * len(head))
    cpu = torch.device('cpu')
    for model, stage, C, H, W, pool, heads in args.stages:
        modules = layers(C, heads, pool, cpu, [('triton', cpu)], False)
        x, grad = inputs(C, 2, 2, args.batch, cpu, torch.float32)
        timings = {name: [] for name in ('LN', 'DTN triton')}
        with mock.patch.dict(os.environ, TRITON_INTERPRET='1'), \
                mock.patch.object(kernels, 'launch', lambda *args: None), \
                mock.patch.object(parameters, 'launch', lambda *args: None):
            for it in range(args.warmup + args.repeats):
                for name in timings:
                    module, backend, _ = modules[name]
                    set_dtn_backend(backend)
                    start = time.perf_counter()
                    for _ in range(100):
                        forward_backward(module, x, (2, 2), grad)
                    if it >= args.warmup:
                        timings[name].append((time.perf_counter() - start) / 100)
        ln, dtn = (statistics.median(timings[name]) for name in ('LN', 'DTN triton'))
        print(f'{stage_label(model, stage, C, H, W, pool):<28}{ln * 1e6:>9.0f}{dtn * 1e6:>15.0f}'
              f'{dtn / ln:>7.2f}x')
        progress.update()


LAYER_WIDTH = 20  # 'DTN triton compiled'


def time_table(args, device, names, progress):
    clock = time.process_time if args.clock == 'cpu' else time.perf_counter
    print(f'\nForward + backward, batch {args.batch}, {args.dtype}, {device.type}, median of '
          f'{args.repeats} ({args.clock} clock; memory: peak above the inputs; error: largest '
          "difference of y and dx from the torch backend's on the tokens in float32)")
    gpu = device.type == 'cuda'
    if gpu:
        print(f'GPU ms: the GPU alone per forward + backward, {GPU_CALLS} calls queued back to '
              'back (no launch gaps); host ms: the host issuing one of them (launches, Python); '
              'ms: one call from the host, synchronized')
    head = (f"{'stage':<28}{'layer':<{LAYER_WIDTH}}"
            + (f"{'GPU ms':>9}{'x LN':>9}{'host ms':>9}" if gpu else '')
            + f"{'ms':>9}{'x LN':>9}{'MB':>9}{'x LN':>9}{'error':>10}")
    print(head + '\n' + '-' * len(head))
    for model, stage, C, H, W, pool, heads in args.stages:
        x, grad = inputs(C, H, W, args.batch, device, DTYPES[args.dtype])
        T = math.prod(pooled_size((H, W), pool))**2
        dense = 4 * heads * T * x.element_size() <= args.dense_limit_gb * 2**30  # P, logits, grads
        modules = {name: m[:2] for name, m in layers(C, heads, pool, device,
                                                     [(n, device) for n in names], dense,
                                                     x.dtype).items()}
        if args.compile:  # every DTN backend also under torch.compile (inductor)
            modules.update({f'{name} compiled': (torch.compile(module, dynamic=False), backend)
                            for name, (module, backend) in list(modules.items())
                            if name.startswith('DTN ')})
        times, gpu_times = timed(modules, x, (H, W), grad, device, args.repeats, args.warmup,
                                 clock)
        label = stage_label(model, stage, C, H, W, pool)
        dtn = next(module for name, (module, _) in modules.items() if name.startswith('DTN '))
        reference = outputs(dtn, 'torch', x.float(), (H, W), grad.float())
        for name, (module, backend) in modules.items():
            set_dtn_backend(backend)
            mem = peak_memory(lambda: forward_backward(module, x, (H, W), grad), device)
            if name == 'LN':
                base = times[name], mem, gpu_times and gpu_times[name]
                error = ''
            else:
                results = outputs(module, backend, x, (H, W), grad)
                error = f'{relative_error(results, reference):.1e}'
            on_gpu = (f'{gpu_times[name][0] * 1e3:>9.3f}{gpu_times[name][0] / base[2][0]:>8.2f}x'
                      f'{gpu_times[name][1] * 1e3:>9.2f}' if gpu else '')
            print(f'{label:<28}{name:<{LAYER_WIDTH}}{on_gpu}{times[name] * 1e3:>9.2f}'
                  f'{times[name] / base[0]:>8.2f}x'
                  f'{mem / 2**20:>9.0f}{mem / max(base[1], 1):>8.2f}x{error:>10}')
        progress.update()


#: forward + backward calls per profile of the kernels table
PROFILED_CALLS, KERNELS_SHOWN = 5, 12


def kernels_table(args, device, names, progress):
    """The kernels (CUDA: GPU time of each) or operations (CPU: their own CPU time) that take most
    of one forward + backward of every DTN backend and of LayerNorm, from ``torch.profiler``:
    microseconds and launches per call, largest first."""
    from torch.profiler import ProfilerActivity, profile
    gpu = device.type == 'cuda'
    print(f'\nKernels of one forward + backward, batch {args.batch}, {args.dtype}, {device.type}'
          f' (torch.profiler, {PROFILED_CALLS} calls; {"GPU" if gpu else "own CPU"} time)')
    for model, stage, C, H, W, pool, heads in args.stages:
        x, grad = inputs(C, H, W, args.batch, device, DTYPES[args.dtype])
        for name, (module, backend, _) in layers(C, heads, pool, device,
                                                 [(n, device) for n in names], False,
                                                 x.dtype).items():
            set_dtn_backend(backend)
            for _ in range(args.warmup):
                forward_backward(module, x, (H, W), grad)
            sync(device)
            activity = ProfilerActivity.CUDA if gpu else ProfilerActivity.CPU
            with profile(activities=[activity]) as prof:
                for _ in range(PROFILED_CALLS):
                    forward_backward(module, x, (H, W), grad)
                sync(device)
            spent = {e.key: ((e.self_device_time_total if gpu else e.self_cpu_time_total)
                             / PROFILED_CALLS, e.count / PROFILED_CALLS)
                     for e in prof.key_averages()}
            spent = {k: v for k, v in spent.items() if v[0] > 0}
            total = sum(us for us, _ in spent.values())
            launches = sum(n for _, n in spent.values())
            print(f'  {stage_label(model, stage, C, H, W, pool)}, {name}: {total:.0f} us, '
                  f'{launches:.0f} kernels or operations per call')
            for key, (us, n) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:KERNELS_SHOWN]:
                print(f'    {us:>10.1f} us {100 * us / total:>5.1f}%  x{n:<4.0f} {key[:80]}')
        progress.update()


def add_stages_argument(parser):
    """``--stages MODEL:STAGE ...``, the rows of STAGES to run (:func:`selected_stages`)."""
    parser.add_argument('--stages', nargs='+', default=None, metavar='MODEL:STAGE',
                        help='only these stages, e.g. pvt_tiny:1 swin_t:3 (default: all)')


def selected_stages(parser, chosen):
    """The rows of STAGES named ``model:stage`` in ``chosen`` (all if None)."""
    if chosen is None:
        return STAGES
    by_name = {f'{model}:{stage}': row for row in STAGES for model, stage in [row[:2]]}
    unknown = sorted(set(chosen) - set(by_name))
    if unknown:
        parser.error(f'unknown stages {unknown}; known: {sorted(by_name)}')
    return [row for name, row in by_name.items() if name in chosen]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--backends', nargs='+', default=None,
                        help='DTN backends to measure (default: all that run on the device, and '
                        'triton, counted on meta tensors where no GPU runs it)')
    parser.add_argument('--tables', nargs='+', default=['traffic', 'model', 'time'],
                        choices=['traffic', 'model', 'time', 'kernels', 'host'],
                        help='kernels: the largest kernels (CUDA) or operations (CPU) of every '
                        'layer, from torch.profiler; host: the host\'s time of a Triton layer '
                        'call beside LayerNorm\'s, device work replaced by nothing (meta '
                        'tensors); neither in the default')
    add_stages_argument(parser)
    parser.add_argument('--dtype', default='float32', choices=sorted(DTYPES),
                        help='dtype of the tokens (the parameters stay float32)')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--clock', choices=['wall', 'cpu'], default='wall',
                        help='wall-clock time or CPU time of the process')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--compile', action='store_true',
                        help='time every DTN backend also under torch.compile (inductor; the '
                        "'torch' backend's passes then run fused)")
    parser.add_argument('--dense-limit-gb', type=float, default=2.0,
                        help='time the dense formulation only where its T x T tensors fit this')
    args = parser.parse_args()
    args.stages = selected_stages(parser, args.stages)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == 'cpu' and device.type == 'cuda':
        parser.error('--clock cpu measures host CPU time; use the wall clock on CUDA')
    names = args.backends or [*available_backends(device), 'triton']
    names = list(dict.fromkeys(names))
    unknown = set(names) - set(available_backends(device)) - {'triton'}
    if unknown:
        parser.error(f'backends {sorted(unknown)} cannot run on {device}; '
                     f'available: {available_backends(device)}')
    backends = [(name, device) for name in names if name in available_backends(device)]
    counted = [(name, torch.device('meta')) for name in names
               if name not in available_backends(device)]  # triton without a GPU: counted only
    # subnormal floats (tiny softmax weights of the dense P) slow CPU matrix products down by
    # orders of magnitude; flushing them to zero keeps the comparison about the formulation
    torch.set_flush_denormal(True)
    if args.compile:  # one compilation per stage shape and layer; none may fall back to eager
        torch._dynamo.config.recompile_limit = 8 * len(args.stages)
    print(f'device={device} threads={torch.get_num_threads()} torch {torch.__version__} '
          f'backends {backends}')
    steps = len(args.stages) * (bool({'traffic', 'model'} & set(args.tables))
                                + ('time' in args.tables) + ('kernels' in args.tables)
                                + ('host' in args.tables))
    with tqdm(total=steps, desc='stages') as progress:
        if {'traffic', 'model'} & set(args.tables):
            counts = traffic_table(args, device, backends + counted, progress)
            if 'model' in args.tables:
                model_table(args, counts)
        if 'time' in args.tables:
            time_table(args, device, [name for name, _ in backends], progress)
        if 'kernels' in args.tables:
            kernels_table(args, device, [name for name, _ in backends], progress)
        if 'host' in args.tables:
            host_table(args, progress)


if __name__ == '__main__':
    main()
