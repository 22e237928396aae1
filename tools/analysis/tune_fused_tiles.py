"""Time candidate tiles of the Triton backend's kernels that form the positional products on chip
on a GPU and print the fastest for each kernel and head width: the fused passes without pooling,
as ``TILES``, ``WALKS`` and ``ARCH_TILES`` of ``mmdtn/models/layers/dtn/backends/triton_fused.py``,
and the products on the cell grid with pooling, as ``TILES`` and ``WALKS`` of ``triton_cells.py``.

The fused passes' tables were chosen on an H200 (docs/gpu.md, "Measured on an H200"; the cell
products' have not been timed); ``ARCH_TILES`` replaces tiles that another architecture's compiler
spills. On another GPU, run this tool and put the printed tables in their place
(``tune_band_tiles.py`` does the same for the band products, which run one factor at a time). A
candidate is written where the GPU's layer reads it: into ``ARCH_TILES`` for the kernels and widths
it has for the GPU's architecture, else into ``TILES``.

For every kernel (the fused output, token gradients and input gradient, and the token gradients
that read the products the fused forward pass keeps with ``MMDTN_TRITON_KEEP_PRODUCTS=1``, timed
with the layers keeping them; the cell products and their backward) and head width (channels per
head, padded to 32 or 64, and for the cell products to 16) of the chosen stages that run it
(without pooling; with pooling), each candidate (tokens or cells of a row per program, warps; rows
of P_y^h's band a step, loads in flight), the current tables first and then the nearest to them
(other warps first: :func:`candidates`), is:

1. compiled for the GPU's architecture without running (as ``compile_kernels.py``); candidates
   that spill registers, or whose register cap lets an SM hold no more of their warps than
   without it, are named and left out, and do not count towards ``--candidates N`` (the first N
   not left out are timed);
2. run as the layer runs it, forward and backward, on the layer benchmark's stages
   (``benchmark_norm.STAGES``) whose heads have that width, batch 2, with a layer at its
   initialisation; y and dx must equal those of the first candidate (the current tables) to
   twice the tokens' dtype resolution (1e-5 for float32) of their largest value;
3. timed: the layer's GPU time per forward + backward (``benchmark_norm.gpu_seconds``, the
   median of 3); only this kernel's tiles differ between candidates.

The fastest by the sum over the stages wins and stays in the tables for the kernels tuned after
it; each kernel's table is printed as soon as it is tuned, and the tables of the modules tuned at
the end. The products run on chip here even with ``MMDTN_TRITON_FUSED=0`` or
``MMDTN_TRITON_CELL_PRODUCTS=0``. Usage::

    python tools/analysis/tune_fused_tiles.py --device cuda [--stages pvt_tiny:3 swin_t:3] \
        [--kernels token_gradients products]

With ``TRITON_INTERPRET=1`` and ``--device cpu --shrink 20 --candidates 2`` it runs in Triton's
interpreter on grids 20 times smaller (a check of the tool; the times mean nothing).
"""
import argparse
import itertools
import math
import statistics
import time

import torch
from tqdm import tqdm

import benchmark_norm as bench
from benchmark_norm import DTYPES, selected_stages, stage_label
from compile_kernels import LIMITS, resident_warps
from tuning import (add_tuning_arguments, compiled_resources, fastest, print_rows, spilled_bytes,
                    tables_literal, target, timed_candidates)
from mmdtn import set_dtn_backend
from mmdtn.models.layers.dtn.backends import triton_cells, triton_fused
from mmdtn.models.layers.dtn.backends.triton_launch import LaunchOptions

#: The kernels in the order the tables list them, with their module and their index in the
#: module's ``specializations``.
KERNELS = {'output': (triton_fused, 0), 'token_gradients': (triton_fused, 1),
           'kept_token_gradients': (triton_fused, 1), 'input_gradient': (triton_fused, 2),
           'products': (triton_cells, 0), 'products_backward': (triton_cells, 1)}
#: The kernels that run where the fused passes keep their products
#: (``MMDTN_TRITON_KEEP_PRODUCTS=1``): tuned, and timed, with the layers keeping them.
KEPT = {'kept_token_gradients'}
#: Candidates: (tokens, warps[, registers a thread]) of TILES and (rows a step, loads in flight)
#: of WALKS. ptxas gives a thread what it is allowed (255 registers for programs of up to 8 warps,
#: 128 for 16) and often needs far less: on sm_90 (``compile_kernels.py``) the input gradient for
#: heads of 32 channels takes 225-251 registers with 8 warps but 102 with 16 (16-bit tokens), and
#: the token gradients for heads of 64 channels 188 with 8 warps but 108-114 capped at 128, without
#: spills; so that an SM holds 16 of their warps instead of 8 (12 with 4 warps capped at 168, where
#: they take 235 uncapped). The caps are where an SM holds one more program: 168 and 128 registers
#: a thread for 4 warps, 128 for 8. Not yet timed.
CANDIDATES = [(tile, walk) for tile, walk in itertools.product(
    [(16, 4), (16, 4, 168), (16, 4, 128), (16, 8), (16, 8, 128), (16, 16), (16, 2),
     (32, 4), (32, 4, 168), (32, 4, 128), (32, 8), (32, 8, 128), (32, 16), (32, 2)],
    [(1, 1), (2, 1), (2, 2)])]
#: Candidates of the kernels of :data:`KEPT`, which walk no band (and form no matrix product: 8
#: tokens a program are allowed).
KEPT_CANDIDATES = [(tile, (1, 1)) for tile in
                   [(8, 4), (8, 2), (8, 8), (16, 4), (16, 8), (16, 2), (32, 4), (32, 8)]]


def module(kernel):
    """The module whose tables hold ``kernel``'s tiles (its home)."""
    return KERNELS[kernel][0]


def specialization(kernel, d, arch, split=False):
    """(kernel, constexprs, launch options) of ``kernel`` for heads of d channels on compute
    capability ``arch``, with the tables as they are; with ``split`` as the fused output and token
    gradients run on small grids, their heads split among programs."""
    home, index = KERNELS[kernel]
    if home is triton_fused:
        return home.specializations(d, arch, kernel in KEPT, split)[index]
    return home.specializations(d, arch)[index]


def forms(kernel, d, arch):
    """The specialisations ``kernel`` runs as for heads of d channels (:func:`specialization`):
    the fused output and token gradients with every head in a program and with the heads split
    (the tile serves both), the others one."""
    home, index = KERNELS[kernel]
    splits = (False, True) if home is triton_fused and index < 2 else (False, )
    return [specialization(kernel, d, arch, split) for split in splits]


def current(kernel, d_block, arch):
    home = module(kernel)
    return home.tiles_table(kernel, d_block, arch)[d_block], home.WALKS[kernel][d_block]


def set_candidate(kernel, d_block, arch, candidate):
    home = module(kernel)
    home.tiles_table(kernel, d_block, arch)[d_block], home.WALKS[kernel][d_block] = candidate
    home.specializations.cache_clear()


def spills(kernel, d, arch, dtype):
    """Bytes spilled by ``kernel`` for heads of d channels with the tables as they are, compiled
    for sm_<arch>, tokens of ``dtype`` (its name, e.g. 'float16'; :func:`.tuning.spilled_bytes`),
    specialised on C and d as a layer of such heads is (C, a multiple of d, is a multiple of 16
    where d is); the most of its :func:`forms`."""
    spilled = [spilled_bytes(spec, dtype, arch, dict(C=d, d=d)) for spec in forms(kernel, d, arch)]
    return None if None in spilled else max(spilled)


def left_out(kernel, d, arch, dtype):
    """Why ``kernel`` for heads of d channels with the tables as they are is not worth timing on
    sm_<arch> (tokens of ``dtype``, compiled as :func:`spills`): it spills in one of its
    :func:`forms`, or its register cap lets an SM hold no more of its warps than the same tile
    without it (ptxas takes up to the cap where it would take fewer; checked with every head in a
    program); None otherwise, and always in the interpreter."""
    spilled = spills(kernel, d, arch, dtype)
    if spilled is None:
        return None
    if spilled:
        return f'spills {spilled} bytes on sm_{arch}'
    spec = specialization(kernel, d, arch)
    registers, _, shared = compiled_resources(spec, dtype, arch, dict(C=d, d=d))
    options = spec[2]
    if options.maxnreg is None or arch not in LIMITS:
        return None
    uncapped, _, uncapped_shared = compiled_resources(
        (*spec[:2], LaunchOptions(options.num_warps)), dtype, arch, dict(C=d, d=d))
    held = resident_warps(registers, options.num_warps, shared, arch)
    held_uncapped = resident_warps(uncapped, options.num_warps, uncapped_shared, arch)
    if held <= held_uncapped:
        return (f'{registers} registers: an SM holds {held} warps, {held_uncapped} without the '
                'cap')
    return None


def spilling(kernels, widths, arch, dtype):
    """[(kernel, width, bytes)]: the current tables of ``kernels`` for heads of each of their
    ``widths`` (by module) that spill on sm_<arch> (none in the interpreter). A candidate's time
    is the whole layer's, so such a kernel adds the same spilled time to every candidate of the
    others: their order holds, their totals do not."""
    found = []
    for kernel in kernels:
        for width in widths[module(kernel)]:
            spilled = spills(kernel, width, arch, dtype)
            if spilled:
                found.append((kernel, width, spilled))
    return found


class StageLayer:
    """A DTN layer of one stage at its initialisation, with tokens and an upstream gradient
    (batch ``batch``, ``dtype``)."""

    def __init__(self, C, H, W, pool, heads, batch, dtype, device):
        self.d = C // heads
        self.hw = (H, W)
        self.x, self.grad = bench.inputs(C, H, W, batch, device, dtype)
        self.layer = bench.layers(C, heads, pool, device, [('triton', device)], False,
                                  dtype)['DTN triton'][0]

    def outputs(self):
        return bench.outputs(self.layer, 'triton', self.x, self.hw, self.grad)

    def microseconds(self, device):
        """GPU microseconds per forward + backward (on the CPU, the interpreter: wall clock)."""
        set_dtn_backend('triton')
        if device.type != 'cuda':
            start = time.perf_counter()
            bench.forward_backward(self.layer, self.x, self.hw, self.grad)
            return (time.perf_counter() - start) * 1e6
        bench.forward_backward(self.layer, self.x, self.hw, self.grad)  # compiles
        return statistics.median(bench.gpu_seconds(self.layer, self.x, self.hw, self.grad)[0]
                                 for _ in range(3)) * 1e6


def tolerance(dtype):
    return max(1e-5, 2 * torch.finfo(dtype).eps)


def candidates(kernel, d_block, arch):
    """The current tiles of ``kernel`` for heads of ``d_block`` on ``arch``, then the others, the
    nearest first: other warps and register caps (the nearest count of warps, more before fewer,
    the current cap before another), then other walks, then other tokens; so that a few
    candidates (``--candidates``) try the warps an SM holds first."""
    now = (tokens, warps, *cap), walk = current(kernel, d_block, arch)

    def distance(candidate):
        (other_tokens, other_warps, *other_cap), other_walk = candidate
        return (other_tokens != tokens, other_walk != walk,
                abs(math.log2(other_warps / warps)), -other_warps, other_cap != cap)

    pool = KEPT_CANDIDATES if kernel in KEPT else CANDIDATES
    return [now] + sorted((c for c in pool if c != now), key=distance)


def tune(kernel, d_block, stages, device, arch, count, progress):
    """Rows (candidate, total us, us per stage, difference; or candidate, None, [], why it is
    left out: :func:`left_out`) of the candidates of ``kernel`` for heads of ``d_block`` on
    compute capability ``arch`` (the GPU's; None in the interpreter), ``count`` of them timed
    (:func:`.tuning.timed_candidates`), and the fastest; it is left in the tables. The layers
    keep the fused passes' products while a kernel of :data:`KEPT` is tuned."""
    triton_fused.KEEP_PRODUCTS = kernel in KEPT
    references = [stage.outputs() for stage in stages]
    dtype = str(stages[0].x.dtype).split('.')[-1]

    def set_and_check(candidate):
        set_candidate(kernel, d_block, arch, candidate)
        return left_out(kernel, stages[0].d, arch, dtype)

    rows = []
    for candidate, reason in timed_candidates(candidates(kernel, d_block, arch), set_and_check,
                                              count):
        if reason:
            rows.append((candidate, None, [], reason))
            continue
        progress.update()
        difference = max(bench.relative_error(stage.outputs(), reference)
                         for stage, reference in zip(stages, references))
        times = [stage.microseconds(device) for stage in stages]
        rows.append((candidate, sum(times), times, difference))
    best = fastest(rows, tolerance(stages[0].x.dtype))
    set_candidate(kernel, d_block, arch, best)
    return rows, best


def tables(modules):
    """The tables of ``modules`` as Python source, each under a comment naming its file: TILES and
    WALKS, and triton_fused's ARCH_TILES."""
    text = []
    for home in modules:
        text += [f'# {home.__name__.split(".")[-1]}.py',
                 tables_literal(home, ('TILES', 'WALKS'), lambda by_width: '{' + ', '.join(
                     f'{d_block}: {value}' for d_block, value in sorted(by_width.items())) + '}')]
        if home is triton_fused:
            text.append(tables_literal(triton_fused, ('ARCH_TILES', ), repr))
    return '\n'.join(text)


def runs(home, C, pool, heads):
    """Whether a layer of C channels in ``heads`` heads with pooling ``pool`` runs the kernels of
    module ``home``."""
    if home is triton_fused:
        return triton_fused.can_fuse(pool, C // heads)
    return triton_cells.can_form_products(pool, C // heads)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_tuning_arguments(parser, 'kernel and head width')
    parser.add_argument('--kernels', nargs='+', choices=list(KERNELS), default=list(KERNELS),
                        help='tune only these kernels (default: all)')
    args = parser.parse_args()
    triton_fused.ENABLED = triton_cells.ENABLED = True
    device, arch, header = target(args)
    # the layer runs its GPU's tiles (triton_fused.tiles; in the interpreter TILES, unchecked)
    layout = triton_fused.architecture(device)
    if layout is not None and layout != arch:
        parser.error(f'--arch {arch}: the layer on this GPU runs the tiles of sm_{layout}')
    dtype = DTYPES[args.dtype]
    modules = list(dict.fromkeys(module(kernel) for kernel in args.kernels))
    by_width = {home: {} for home in modules}  # module: {head width: {stage: StageLayer}}
    for model, stage, C, H, W, pool, heads in selected_stages(parser, args.stages):
        H, W = max(1, H // args.shrink), max(1, W // args.shrink)
        label = stage_label(model, stage, C, H, W, pool)
        for home in modules:
            if runs(home, C, pool, heads):
                by_width[home].setdefault(home.head_block(C // heads), {})[label] = \
                    StageLayer(C, H, W, pool, heads, args.batch, dtype, device)
    if not any(by_width.values()):
        parser.error(f'none of these stages runs {" or ".join(args.kernels)} (the fused passes: '
                     'no pooling; the cell products: pooling; heads of at most '
                     f'{triton_fused.MAX_HEAD_CHANNELS} channels)')
    print(f'Products on chip on {header}, {args.dtype} tokens, batch {args.batch}: GPU us per '
          f'forward + backward of each stage\'s layer, the median of 3; candidates as (tokens or '
          f'cells, warps), (band rows a step, loads in flight)')
    for home in modules:
        for d_block, stages in sorted(by_width[home].items()):
            print(f'{home.__name__.split(".")[-1]}, heads of {d_block} channels: '
                  + ', '.join(stages), flush=True)
    widths = {home: sorted(by_width[home]) for home in modules}
    for kernel, d_block, spilled in spilling(args.kernels, widths, arch, args.dtype):
        print(f'the current tables of {kernel} for heads of {d_block} channels spill {spilled} '
              f'bytes on sm_{arch}: every candidate\'s time includes that kernel\'s (their order '
              'holds); tune it too', flush=True)
    jobs = [(kernel, d_block) for kernel in args.kernels for d_block in widths[module(kernel)]]
    progress = tqdm(total=sum(len(candidates(kernel, d_block, layout)[:args.candidates])
                              for kernel, d_block in jobs), desc='candidates timed')
    for kernel, d_block in jobs:
        rows, best = tune(kernel, d_block, list(by_width[module(kernel)][d_block].values()),
                          device, layout, args.candidates, progress)
        progress.clear()
        print_rows(f'{kernel}, heads of {d_block} channels', rows, best,
                   lambda candidate: f'{candidate[0]}, {candidate[1]}', 22)
    progress.close()
    print('\n' + tables(modules))


if __name__ == '__main__':
    main()
