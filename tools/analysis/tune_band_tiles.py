"""Time candidate tiles of the Triton backend's band products on a GPU and print the fastest for
each operand, as ``MATMUL_TILES`` and ``OUTER_TILES`` of
``mmdtn/models/layers/dtn/backends/triton_band.py``.

The tiles there were chosen with this tool on an H200 (docs/gpu.md, "Measured on an H200"). On
another GPU, run it and put the printed tables in their place. The band products run where a layer's
products go one factor at a time: with ``MMDTN_TRITON_FUSED=0``, or for heads wider than 64
channels; by default the layers of PVT and Swin form them on chip (``triton_fused.py`` without
pooling, ``triton_cells.py`` with pooling, whose tiles ``tune_fused_tiles.py`` tunes).

For every operand (``matrices``: P X, ``transposed``: P^T X, ``tokens``: P_x T read from the tokens,
and the outer products of both kinds), each candidate is:

1. compiled for the GPU's architecture without running (as ``compile_kernels.py``); candidates
   that spill registers are named and left out, and do not count towards ``--candidates N``
   (the first N that do not spill are timed);
2. run on the DTN grids of the layer benchmark's stages (``benchmark_norm.STAGES``, batch 2), with
   the positional factors of a layer at its initialisation; its products must equal those of the
   first candidate (the current tiles) to 1e-4 of their largest value;
3. timed: the best of 3 blocks of ``--iters`` calls, CUDA events.

The fastest by the sum over the stages wins; each operand's table is printed as soon as it is
tuned, and the tile tables at the end. Usage::

    python tools/analysis/tune_band_tiles.py --device cuda [--stages pvt_tiny:3 swin_t:3] \
        [--operands 'outer matrices' 'outer tokens']

With ``TRITON_INTERPRET=1`` and ``--device cpu --shrink 20 --candidates 2`` it runs in Triton's
interpreter on grids 20 times smaller (a check of the tool; the times mean nothing).
"""
import argparse
import time

import torch
from tqdm import tqdm

from benchmark_norm import DTYPES, selected_stages, stage_label
from tuning import (add_tuning_arguments, fastest, print_rows, spilled_bytes, tables_literal,
                    target, timed_candidates)
from mmdtn import DynamicTokenNorm
from mmdtn.models.layers.dtn import function
from mmdtn.models.layers.dtn.backends import triton_band, triton_kernels
from mmdtn.models.layers.dtn.grid import TokenGrid


def matmul_tiles(rows, band, block_n, stages, warps):
    return dict(ROWS=rows, BAND=band, BLOCK_N=block_n, STAGES=stages, warps=warps)


def outer_tiles(rows, block_k, warps):
    return dict(ROWS=rows, BLOCK_K=block_k, warps=warps)


MATMUL_CANDIDATES = [
    matmul_tiles(*t) for t in [
        (16, 32, 128, 1, 4), (16, 32, 128, 3, 4), (16, 16, 128, 3, 4), (16, 32, 256, 3, 8),
        (16, 32, 64, 3, 4), (32, 16, 128, 3, 4), (16, 16, 256, 2, 8), (16, 16, 128, 1, 4),
        (16, 32, 64, 1, 4), (16, 16, 256, 1, 8), (8, 32, 128, 1, 4), (8, 16, 256, 2, 4)]]
TOKENS_CANDIDATES = [
    matmul_tiles(*t) for t in [
        (16, 16, 64, 1, 4), (16, 32, 64, 1, 4), (32, 32, 64, 1, 4), (16, 32, 128, 1, 8),
        (16, 32, 32, 1, 4), (32, 16, 64, 1, 4), (16, 16, 128, 1, 4), (8, 16, 64, 1, 4),
        (16, 16, 32, 1, 4), (8, 16, 128, 1, 4), (8, 32, 64, 1, 4), (16, 16, 64, 2, 4)]]
OUTER_CANDIDATES = [
    outer_tiles(*t) for t in [
        (8, 256, 4), (16, 256, 4), (16, 512, 4), (8, 512, 4), (8, 128, 4), (4, 256, 4),
        (8, 512, 8), (16, 1024, 8), (4, 512, 4), (8, 1024, 8), (32, 256, 4), (16, 128, 4)]]
#: Operand: (tile table, its key, candidates).
OPERANDS = {
    'matrices': ('MATMUL_TILES', 'matrices', MATMUL_CANDIDATES),
    'transposed': ('MATMUL_TILES', 'transposed', MATMUL_CANDIDATES),
    'tokens': ('MATMUL_TILES', 'tokens', TOKENS_CANDIDATES),
    'outer matrices': ('OUTER_TILES', 'matrices', OUTER_CANDIDATES),
    'outer tokens': ('OUTER_TILES', 'tokens', OUTER_CANDIDATES),
}


def set_tiles(operand, tiles):
    table, key, _ = OPERANDS[operand]
    getattr(triton_band, table)[key] = dict(tiles)


def spec(operand):
    """(kernel, constexprs, num_warps) of ``operand`` with the tiles now in the tables."""
    if operand.startswith('outer'):
        return triton_band._outer_spec(operand == 'outer tokens')
    return triton_band._matmul_spec(operand == 'transposed', operand == 'tokens')


def spills(operand, arch, dtype):
    """Bytes spilled by ``operand``'s kernel with the current tiles
    (:func:`.tuning.spilled_bytes`)."""
    return spilled_bytes(spec(operand), dtype, arch)


class StageProducts:
    """The band products of one DTN stage grid (batch ``batch``, tokens of ``dtype``), as the
    layer runs them, with the factors of a layer at its initialisation."""

    def __init__(self, C, H, W, pool, heads, batch, dtype, device):
        torch.manual_seed(0)
        norm = DynamicTokenNorm(C, heads, pool_size=pool).to(device)
        with torch.no_grad():
            p_y, p_x = (p.contiguous() for p in norm.axis_matrices((H, W)))
        self.grid = grid = TokenGrid(batch, H, W, C, heads, pool)
        x = torch.randn(batch, H * W, C, device=device).to(dtype)
        centre = triton_kernels.sample_centre(x)
        self.pooled = grid.pooled
        self.T = (triton_kernels.moments(x, centre, grid) if grid.pooled
                  else function.TokenMoments(x, centre, grid))
        self.factor_y = triton_band.BandFactor(p_y, 'y')
        self.factor_x = triton_band.BandFactor(p_x, 'x')
        self.u, m = function.positional_products(self.T, self.factor_y, self.factor_x, grid,
                                                 variance=False)
        self.dm = torch.randn_like(m)
        self.du = function.rows_backward(self.dm, self.factor_y, grid)

    def calls(self, operand):
        """The products of this grid that run on ``operand``'s kernel."""
        grid, T = self.grid, self.T
        row_products = lambda: function.row_products(T, self.factor_x, grid)  # noqa: E731
        if operand == 'tokens':
            return [] if self.pooled else [row_products]
        if operand == 'matrices':
            rows = [lambda: self.factor_y.matmul(function.by_rows(self.u, grid))]
            return rows + ([row_products] if self.pooled else [])
        if operand == 'transposed':
            return [lambda: function.rows_backward(self.dm, self.factor_y, grid),
                    lambda: self.factor_x.matmul(self.du, transpose=True)]
        # the outer products' shares of the gradient of a^h, as many as the tiles make programs,
        # added up for the comparison
        outer_x = lambda: self.factor_x.outer(self.du, function.by_columns(T, grid)).sum(0)  # noqa
        if operand == 'outer tokens':
            return [] if self.pooled else [outer_x]
        outer_y = lambda: self.factor_y.outer(function.by_rows(self.dm, grid),  # noqa: E731
                                              function.by_rows(self.u, grid)).sum(0)
        return [outer_y] + ([outer_x] if self.pooled else [])


def run(calls):
    return [call() for call in calls]


def timed(calls, device, iters):
    """Microseconds per call of all ``calls``: the best of 3 blocks of ``iters``."""
    run(calls)
    if device.type != 'cuda':
        start = time.perf_counter()
        run(calls)
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float('inf')
    for _ in range(3):
        start.record()
        for _ in range(iters):
            run(calls)
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) * 1000 / iters)
    return best


def largest_difference(results, references):
    return max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
               for a, b in zip(results, references))


def candidates(operand):
    """The current tiles of ``operand``, then the other candidates."""
    table, key, listed = OPERANDS[operand]
    current = dict(getattr(triton_band, table)[key])
    return [current] + [c for c in listed if c != current]


def tune(operand, stages, device, arch, dtype, iters, count, progress):
    """Rows (tiles, total us, us per stage, difference; or tiles, None, [], why they are left
    out) of the candidates of ``operand``, ``count`` of them timed
    (:func:`.tuning.timed_candidates`), and the fastest; its tiles are left in the table."""
    references = {label: [t.clone() for t in run(s.calls(operand))] for label, s in stages.items()}

    def left_out(tiles):
        set_tiles(operand, tiles)
        spilled = spills(operand, arch, dtype)
        return f'spills {spilled} bytes on sm_{arch}' if spilled else None

    rows = []
    for tiles, reason in timed_candidates(candidates(operand), left_out, count):
        if reason:
            rows.append((tiles, None, [], reason))
            continue
        progress.update()
        times, difference = [], 0.0
        for label, s in stages.items():
            calls = s.calls(operand)
            if calls:
                difference = max(difference, largest_difference(run(calls), references[label]))
                times.append(timed(calls, device, iters))
        rows.append((tiles, sum(times), times, difference))
    best = fastest(rows, 1e-4)
    set_tiles(operand, best)
    return rows, best


def tables():
    """MATMUL_TILES and OUTER_TILES as Python source."""
    return tables_literal(triton_band, ('MATMUL_TILES', 'OUTER_TILES'), lambda tiles: (
        'dict(' + ', '.join(f'{k}={v}' for k, v in tiles.items()) + ')'))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    add_tuning_arguments(parser, 'operand')
    parser.add_argument('--iters', type=int, default=10)
    parser.add_argument('--operands', nargs='+', choices=list(OPERANDS), default=None,
                        help='tune only these operands (default: all)')
    args = parser.parse_args()
    device, arch, header = target(args)
    stages = {}
    for model, stage, C, H, W, pool, heads in selected_stages(parser, args.stages):
        H, W = max(1, H // args.shrink), max(1, W // args.shrink)
        stages[stage_label(model, stage, C, H, W, pool)] = StageProducts(
            C, H, W, pool, heads, args.batch, DTYPES[args.dtype], device)
    count, operands = args.candidates, args.operands or list(OPERANDS)
    print(f'Band products on {header}, {args.dtype} tokens, batch {args.batch}: '
          f'us per call of each stage\'s products, best of 3 x {args.iters}')
    print('stages: ' + ', '.join(stages), flush=True)
    progress = tqdm(total=sum(len(candidates(operand)[:count]) for operand in operands),
                    desc='candidates timed')
    for operand in operands:
        rows, best = tune(operand, stages, device, arch, args.dtype, args.iters, count, progress)
        progress.clear()
        print_rows(operand, rows, best,
                   lambda tiles: ', '.join(f'{k}={v}' for k, v in tiles.items()), 54)
    progress.close()
    print('\n' + tables())


if __name__ == '__main__':
    main()
