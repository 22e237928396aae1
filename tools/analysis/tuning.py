"""What the tile-tuning tools (``tune_band_tiles.py``, ``tune_fused_tiles.py``) share: their
common arguments, the GPU whose architecture the spill check compiles for, the header and the
rows of each tuned table, and the choice of the fastest candidate."""
import functools

import torch

from benchmark_norm import DTYPES, add_stages_argument
from compile_kernels import attributes, compile_for
from mmdtn.models.layers.dtn.backends.triton import interpreting
from mmdtn.models.layers.dtn.backends.triton_launch import launch_options


def add_tuning_arguments(parser, what):
    """--device, --stages, --dtype, --batch, --candidates, --shrink and --arch; ``what``: the
    things that have candidates (for --candidates' help)."""
    parser.add_argument('--device', default='cuda')
    add_stages_argument(parser)
    parser.add_argument('--dtype', default='float16', choices=sorted(DTYPES))
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--candidates', type=int, default=None,
                        help=f'time only the first N candidates of every {what} not left out '
                        '(those that spill, for one, are named, not timed)')
    parser.add_argument('--shrink', type=int, default=1,
                        help='divide H and W of every grid by this (interpreter checks)')
    parser.add_argument('--arch', type=int, default=None,
                        help='compute capability of the spill check (default: the GPU\'s)')


def target(args):
    """(device, the architecture of the spill check, a header naming both) for parsed
    arguments."""
    device = torch.device(args.device)
    major, minor = torch.cuda.get_device_capability(device) if device.type == 'cuda' else (9, 0)
    arch = args.arch or 10 * major + minor
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type
    checked = 'not checked for spills (interpreter)' if interpreting() else f'sm_{arch}'
    return device, arch, f'{name} ({checked})'


def compiled_resources(spec, dtype, arch, channels=None):
    """(registers a thread, bytes spilled, shared memory) of ``spec`` = (kernel, constexprs, warps
    or launch options) compiled for sm_<arch>, tokens of ``dtype`` (its name), for a layer of C
    and d as in ``channels`` (a dict; none for the band products, which do not specialise on them;
    :func:`.compile_kernels.attributes`); the bytes spilled are ptxas's report, or the stack frame
    of Triton's cubin where that is larger (:func:`.compile_kernels.resources`). None in Triton's
    interpreter, whose kernels do not compile."""
    if interpreting():
        return None
    kernel, constexprs, warps = spec
    return _compiled(kernel, tuple(constexprs.items()), launch_options(warps), dtype, arch,
                     tuple(sorted((channels or {}).items())))


@functools.lru_cache(maxsize=None)
def _compiled(kernel, constexprs, options, dtype, arch, channels):
    """:func:`compiled_resources` of one compilation, once per process: a capped candidate's
    check compiles its tile without the cap too, which is a candidate of its own."""
    constexprs = dict(constexprs)
    registers, spills, shared, stack = compile_for(
        kernel, constexprs, options, dtype, attributes(kernel, constexprs, dict(channels)), arch)
    return registers, max(spills, stack), shared


def spilled_bytes(spec, dtype, arch, channels=None):
    """Bytes spilled by ``spec`` (:func:`compiled_resources`); None in Triton's interpreter."""
    resources = compiled_resources(spec, dtype, arch, channels)
    return None if resources is None else resources[1]


def timed_candidates(candidates, left_out, count):
    """``candidates`` in order, each as (candidate, why it is left out or None) with
    ``left_out(candidate)``, which puts it in the tables and compiles it (a candidate that spills
    is left out), until ``count`` that are not left out have come (all where ``count`` is None):
    a candidate left out does not run, so it does not count."""
    timed = 0
    for candidate in candidates:
        if count is not None and timed >= count:
            return
        reason = left_out(candidate)
        timed += reason is None
        yield candidate, reason


def fastest(rows, tolerance):
    """The candidate of the fastest row (candidate, total us, us per stage, difference; for a
    candidate left out: candidate, None, [], why) whose difference is below ``tolerance``."""
    valid = [r for r in rows if r[1] is not None and r[3] < tolerance]
    return min(valid, key=lambda r: r[1])[0]


def print_rows(title, rows, best, shown, width):
    """A tuned table: ``title``, then a line per row (see :func:`fastest`), the candidate as
    ``shown(candidate)`` in ``width`` columns, the fastest marked."""
    print(f'\n{title}')
    for candidate, total, times, difference in rows:
        text = shown(candidate)
        if total is None:
            print(f'  {text:<{width}} not timed: {difference}')
            continue
        mark = '  <- fastest' if candidate == best else ''
        print(f'  {text:<{width}} {total:9.1f} us = ' + ' + '.join(f'{t:.1f}' for t in times)
              + f'  (difference {difference:.1e}){mark}', flush=True)


def tables_literal(module, tables, entry):
    """The dicts named ``tables`` of ``module`` as Python source, each value as ``entry(value)``."""
    lines = []
    for table in tables:
        lines.append(f'{table} = {{')
        for key, value in getattr(module, table).items():
            lines.append(f'    {key!r}: {entry(value)},')
        lines.append('}')
    return '\n'.join(lines)
