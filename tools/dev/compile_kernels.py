"""Compile DynamicTokenNorm's Triton kernels ahead of time for NVIDIA GPUs, without a GPU, and
report registers, spills, shared memory and resident warps per kernel.

Every kernel specialization that the DTN layers of the given backbones launch (forward and
backward; the tokens' dtypes given; both statistics conventions with ``--reference-compat``) is
compiled by Triton's own compiler for each ``--arch`` (``triton.compile`` with a ``GPUTarget``,
then NVIDIA's ``ptxas``, both shipped with triton). The resource use comes
from the cubin (``cuobjdump --dump-resource-usage``: registers, shared memory, the stack frame,
where spills live) and ``ptxas``'s spill report; a kernel is within limits with neither spills nor a
stack frame and its shared memory within the architecture's limit. From those follow the warps
of its programs that one SM holds at once (:func:`resident_warps`, of at most 32, 48 or 64): a
memory-bound kernel hides the wait on its loads behind the other warps an SM holds. The image
sizes (default
800 x 1344 and mmseg's 512 x 512) are checked to add no specialization: H and W are runtime
arguments of every kernel.

What is compiled is checked against what runs: before compiling, a layer of every kind the models
have runs forward and backward on meta tensors at each grid they see (in every dtype given), its
launches recorded with their arguments, and Triton's own
argument binder (the one a launch on a GPU runs) must give each the signature and attributes of
a specialization compiled here (:func:`check_launches`); otherwise the tool stops, naming it.

Usage::

    python tools/dev/compile_kernels.py --arch 80 90 [--models pvt_tiny pvtv2_b0 swin_t]
        [--dtypes float16 bfloat16 float32] [--json]
"""
import argparse
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

from tqdm import tqdm

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

import mmdtn  # noqa: F401
from mmdtn import DynamicTokenNorm
from mmdtn.models.layers.dtn.module import DTN_INITS
from mmdtn.models.layers.dtn.backends.base import recording_launches
from mmdtn.models.layers.dtn.backends.triton import kernels, parameters

MODELS = {
    'pvt_tiny': ('PyramidVisionTransformerDTN', dict(num_layers=[2, 2, 2, 2])),
    'pvtv2_b0': ('PyramidVisionTransformerV2DTN', dict(embed_dims=32, num_layers=[2, 2, 2, 2])),
    'swin_t': ('SwinTransformerDTN', dict()),
}
DTYPES = {'float16': 'fp16', 'bfloat16': 'bf16', 'float32': 'fp32'}
FLOAT_ARGUMENTS = ('eps', 'n_var')
#: The channel count and head width: integer arguments that the token kernels let Triton
#: specialize (:func:`attributes`).
CHANNEL_ARGUMENTS = ('C', 'd')


def _limits(shared_kib, sm_warps, sm_blocks, reserved_bytes=1024):
    """One architecture's entry of :data:`LIMITS` (255 registers a thread on every one)."""
    return dict(registers=255, shared_bytes=shared_kib * 1024, sm_warps=sm_warps,
                sm_blocks=sm_blocks, reserved_bytes=reserved_bytes)


#: Per architecture (compute capability; T4/RTX 20, A100, A10/A40/RTX 30, L4/L40/RTX 40,
#: H100/H200, B200, RTX 50), from the CUDA C++ Programming Guide's table of compute capabilities:
#: the registers a thread may have and the shared memory a block may have; per SM, the resident
#: warps and blocks, the registers, and the shared memory: a block's limit and, from sm_80 on, 1
#: KiB more that every block takes of it for the system (``reserved_bytes``). Triton supports
#: compute capability 8.0 and above; sm_75 compiles too.
LIMITS = {75: _limits(64, 32, 16, reserved_bytes=0), 80: _limits(163, 64, 32),
          86: _limits(99, 48, 16), 89: _limits(99, 48, 24), 90: _limits(227, 64, 32),
          100: _limits(227, 64, 32), 120: _limits(99, 48, 32)}
#: Registers of an SM (every architecture above), allocated to a warp in units of 256.
SM_REGISTERS, REGISTER_UNIT = 65536, 256


def resident_warps(registers, warps, shared_bytes, arch):
    """The warps of a kernel's programs (blocks of ``warps`` warps, ``registers`` a thread,
    ``shared_bytes`` a block) that one SM of sm_<arch> holds at once: whole programs, as many as
    its registers, shared memory, warps and blocks allow (the occupancy calculator's rules). A
    program whose loads wait on the cache waits alone where this is low."""
    limits = LIMITS[arch]
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
    reserved = limits['reserved_bytes']
    by_shared = ((limits['shared_bytes'] + reserved) // (shared_bytes + reserved)
                 if shared_bytes + reserved else limits['sm_blocks'])
    programs = min(SM_REGISTERS // per_warp // warps, by_shared, limits['sm_warps'] // warps,
                   limits['sm_blocks'])
    return programs * warps


def within_limits(spills, stack, shared_bytes, arch):
    """Whether a kernel compiled for sm_<arch> is within its limits: False with spills or a stack
    frame on any architecture; otherwise whether its shared memory fits a block's, None where
    :data:`LIMITS` does not know the architecture's."""
    if spills or stack:
        return False
    return shared_bytes <= LIMITS[arch]['shared_bytes'] if arch in LIMITS else None


def dtn_layers(model, sizes):
    """{(C, pool, heads)} of the DTN layers of backbone ``model`` and {(C, pool, heads, (H, W))},
    the grids they see: a forward pass on meta tensors at every size records them (and checks that
    every size runs)."""
    from mmdet.registry import MODELS as REGISTRY
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    kind, kwargs = MODELS[model]
    backbone = REGISTRY.build(dict(type=kind, **kwargs)).to('meta')
    layers, grids = set(), set()

    def record(module, args):
        grids.add((module.num_features, module.pool_size, module.num_heads,
                   tuple(int(v) for v in args[1])))

    for m in backbone.modules():
        if isinstance(m, DynamicTokenNorm):
            layers.add((m.num_features, m.pool_size, m.num_heads))
            m.register_forward_pre_hook(record)
    mmdtn.set_dtn_backend('triton')
    with torch.no_grad():
        for H, W in sizes:
            backbone(torch.empty(1, 3, H, W, device='meta'))
    return layers, grids


def pointer_type(name, dtype):
    """Triton's type of the elements of pointer argument ``name`` for tokens of ``dtype``: the
    tokens', or float32."""
    return DTYPES[dtype] if name in kernels.TOKEN_POINTERS else 'fp32'


def signature(kernel, constexprs, dtype):
    """Triton's signature of ``kernel``: pointer and scalar types, 'constexpr' for constexprs."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = 'constexpr'
        elif name.endswith('_ptr'):
            sig[name] = '*' + pointer_type(name, dtype)
        else:
            sig[name] = 'fp32' if name in FLOAT_ARGUMENTS else 'i32'
    return sig


def attributes(kernel, constexprs, channels):
    """What Triton specializes ``kernel`` on at a launch of a layer whose :data:`CHANNEL_ARGUMENTS`
    have the values ``channels`` (a dict; empty for the kernels of no layer's channels): every
    pointer aligned to 16 bytes (as PyTorch allocates), and each channel argument that it
    specializes (not in its ``do_not_specialize``) where it is a multiple of 16, as C and d are in
    every layer of PVT-Tiny and Swin-T (not d in PVTv2-b0's first stage, heads of 8 channels).
    With them Triton reads 8 or 16 bytes of tokens at a time. :func:`check_launches` checks this
    against Triton's own binder."""
    attrs = {}
    for index, param in enumerate(kernel.params):
        if param.name in constexprs:
            continue
        if param.name.endswith('_ptr') or (param.name in CHANNEL_ARGUMENTS
                                           and not param.do_not_specialize
                                           and channels.get(param.name, 1) % 16 == 0):
            attrs[(index, )] = [['tt.divisibility', 16]]
    return attrs


def divisible(kernel, attrs):
    """The integer arguments that ``attrs`` specialize as multiples of 16, by name."""
    return tuple(sorted(kernel.arg_names[i] for (i, ) in attrs
                        if not kernel.arg_names[i].endswith('_ptr')))


def job_key(kernel, constexprs, warps, dtype, attrs):
    """What tells one compilation from another: the kernel's name, its constexprs, its warps, the
    tokens' dtype and the integer arguments specialized as multiples of 16."""
    return (kernel.fn.__name__, tuple(sorted(constexprs.items())), warps, dtype,
            divisible(kernel, attrs))


def layer_launches(grids, conventions, dtypes):
    """(launch, dtype) for every compiled kernel that a DTN layer of each (C, pool, heads, (H, W))
    of ``grids`` launches, forward and backward, on meta tensors of batch 2 and each dtype: for
    each statistics convention (``reference_compat``) and initialization of the gates (``init``).
    Each launch
    (:class:`~mmdtn.models.layers.dtn.backends.base.KernelLaunch`) keeps its kernel, constexprs,
    warps and arguments."""
    from benchmark_norm import TrafficCounter  # runs the custom ops' insides on meta tensors
    for C, pool, heads, (H, W) in sorted(grids):
        for compat, init in itertools.product(conventions, DTN_INITS):
            layer = DynamicTokenNorm(C, heads, pool, init=init, reference_compat=compat).to('meta')
            for dtype in dtypes:
                x = torch.empty(2, H * W, C, device='meta', dtype=getattr(torch, dtype),
                                requires_grad=True)
                with TrafficCounter(), recording_launches() as launches:
                    torch.autograd.grad(layer(x, (H, W)).sum(), x)
                yield from ((launch, dtype) for launch in launches)


@functools.lru_cache(maxsize=None)
def binder(kernel, arch):
    """Triton's own argument binder of ``kernel`` for sm_<arch>: what a launch on that GPU runs to
    find the signature and specialization of its arguments (``JITFunction.run``)."""
    backend = make_backend(GPUTarget('cuda', arch, 32))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def bound(kernel, constexprs, args, arch):
    """Triton's signature and attributes (:func:`attributes`' form) of ``kernel`` launched with
    ``args`` and ``constexprs`` on sm_<arch>."""
    backend, bind = binder(kernel, arch)
    bound_args, specialization, options = bind(*args, **constexprs)
    _, sig, _, attrs = kernel._pack_args(backend, dict(constexprs), bound_args, specialization,
                                         options)
    return sig, {path: value for path, value in attrs.items() if value}


def check_launches(launches, jobs, arch=90):
    """That every launch of the layers (:func:`layer_launches`) runs a specialization compiled
    here: the signature and attributes that Triton's binder for sm_<arch> gives its arguments are
    those of :func:`signature` and :func:`attributes` for one of ``jobs``
    (:func:`architecture_jobs`) with its kernel, constexprs, warps and dtype.
    Returns the keys of ``jobs`` launched; exits naming the first launch that differs."""
    launched = set()
    for launch, dtype in launches:
        kernel, constexprs, warps, args = launch.call
        sig, attrs = bound(kernel, constexprs, args, arch)
        key = job_key(kernel, constexprs, warps, dtype, attrs)
        if key not in jobs:
            values = dict(zip(kernel.arg_names, args))
            sys.exit(f'{launch.name} launches {key} (C, d = {values.get("C")}, '
                     f'{values.get("d")}), which compile_kernels.py does not compile')
        own_sig, own_attrs = signature(kernel, constexprs, dtype), jobs[key][4]
        names = [kernel.arg_names[i] for (i, ) in set(attrs) ^ set(own_attrs)]
        names += [name for name in sig if sig[name] != own_sig.get(name)]
        if names:
            sys.exit(f'{launch.name} ({key}): Triton binds {names} of its launch otherwise than '
                     f'compile_kernels.py compiles them: signature {sig}, attributes {attrs}; '
                     f'compiled with {own_sig}, {own_attrs}')
        launched.add(key)
    return launched


def nvidia_tool(name):
    return os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'bin', name)


def ptxas(arch):
    """The ptxas Triton compiles sm_<arch> with (for sm_100 and above a newer one) and the name of
    that GPU for it (sm_90a, ...)."""
    return get_ptxas(arch).path, sm_arch_from_capability(arch)


def resources(compiled, arch):
    """Registers, spilled bytes, static shared memory and stack frame of a compiled kernel:
    registers, shared memory and stack frame from Triton's own cubin, spills from ptxas's report
    on Triton's PTX (Triton's compile keeps its log to itself). Spills live in the stack frame, so
    a frame where ptxas reports none would say that the report missed them."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, 'kernel.cubin')
        ptx = os.path.join(tmp, 'kernel.ptx')
        with open(cubin, 'wb') as f:
            f.write(compiled.asm['cubin'])
        with open(ptx, 'w') as f:
            f.write(compiled.asm['ptx'])
        usage = subprocess.run([nvidia_tool('cuobjdump'), '--dump-resource-usage', cubin],
                               capture_output=True, text=True, check=True).stdout
        tool, gpu = ptxas(arch)
        report = subprocess.run([tool, '-v', f'--gpu-name={gpu}', ptx, '-o',
                                 os.path.join(tmp, 'check.cubin')],
                                capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r'REG:(\d+)', usage).group(1))
    spills = sum(int(n) for n in re.findall(r'(\d+) bytes spill (?:stores|loads)', report))
    shared = max(int(re.search(r'SHARED:(\d+)', usage).group(1)), compiled.metadata.shared)
    stack = int(re.search(r'STACK:(\d+)', usage).group(1))
    return registers, spills, shared, stack


def compile_for(kernel, constexprs, warps, dtype, attrs, arch):
    """Registers, spilled bytes, shared memory and stack frame (:func:`resources`) of ``kernel``
    with ``constexprs``, ``warps`` and attributes ``attrs`` (:func:`attributes`) compiled for
    sm_<arch>, for tokens of ``dtype``."""
    source = ASTSource(fn=kernel, signature=signature(kernel, constexprs, dtype),
                       constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget('cuda', arch, 32),
                              options=dict(num_warps=warps))
    return resources(compiled, arch)


def architecture_jobs(layers, conventions, dtypes, arch):
    """{:func:`job_key`: (kernel, constexprs, warps, dtype, attributes)}: every specialization the
    DTN ``layers`` (C, pool, heads) launch, once each (the same on every architecture)."""
    specs = [(spec, dict(C=C, d=C // heads)) for C, pool, heads in sorted(layers)
             for square in conventions for spec in kernels.specs(C, pool, square)]
    specs += [(spec, {}) for layernorm in (False, True) for spec in parameters.specs(layernorm)]
    jobs = {}
    for (kernel, constexprs, warps), channels in specs:
        attrs = attributes(kernel, constexprs, channels)
        for dtype in dtypes:
            jobs[job_key(kernel, constexprs, warps, dtype, attrs)] = (kernel, constexprs, warps,
                                                                      dtype, attrs)
    return jobs


def main():
    if os.environ.get('TRITON_INTERPRET') == '1':
        sys.exit('compile_kernels.py compiles for GPUs: unset TRITON_INTERPRET')
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--arch', type=int, nargs='+', default=[80, 90],
                        help='compute capabilities, e.g. 80 (A100) 90 (H100) 100 (B200)')
    parser.add_argument('--models', nargs='+', default=sorted(MODELS), choices=sorted(MODELS))
    parser.add_argument('--dtypes', nargs='+', default=sorted(DTYPES), choices=sorted(DTYPES))
    parser.add_argument('--sizes', nargs='+', default=['800x1344', '512x512'],
                        help='image sizes HxW whose DTN grids are checked')
    parser.add_argument('--reference-compat', action='store_true',
                        help="also the authors' statistics convention")
    parser.add_argument('--json', action='store_true', help='print a JSON list instead')
    args = parser.parse_args()
    sizes = [tuple(int(v) for v in s.split('x')) for s in args.sizes]

    layers, grids = set(), {}
    for model in args.models:
        model_layers, model_grids = dtn_layers(model, sizes)
        layers |= model_layers
        grids[model] = sorted(model_grids)
    conventions = [False, True] if args.reference_compat else [False]
    rows, launched = [], {}
    for arch in args.arch:
        jobs = architecture_jobs(layers, conventions, args.dtypes, arch)
        launched[arch] = len(jobs), check_launches(
            tqdm(layer_launches(set().union(*grids.values()), conventions, args.dtypes),
                 desc=f'launches on sm_{arch}', disable=args.json), jobs, arch)
        for (name, _, warps, dtype, multiples), (kernel, constexprs, _, _, attrs) in tqdm(
                sorted(jobs.items(), key=lambda job: repr(job[0])), desc=f'sm_{arch}',
                disable=args.json):
            registers, spills, shared, stack = compile_for(kernel, constexprs, warps, dtype,
                                                           attrs, arch)
            rows.append(dict(kernel=name, arch=arch, dtype=dtype, num_warps=warps,
                             constexprs=constexprs, multiples_of_16=list(multiples),
                             registers=registers, spills=spills,
                             shared_bytes=shared, stack_bytes=stack,
                             resident_warps=(resident_warps(registers, warps, shared, arch)
                                             if arch in LIMITS else None),
                             within_limits=within_limits(spills, stack, shared, arch)))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f'\nDTN layers (C, pool, heads): {sorted(layers)}')
    for model, model_grids in grids.items():
        print(f'  {model} grids (C, pool, heads, (H, W)) at {args.sizes}: {model_grids}')
    for arch, (compiled, keys) in launched.items():
        print(f'Launched by these layers (on meta tensors, forward and backward, both gate '
              f'initializations), bound as on sm_{arch}: {len(keys)} of the {compiled} '
              'specializations compiled, each bound by Triton as compiled here')
    head = (f"{'kernel':<34}{'arch':>5}{'dtype':>10}{'warps':>6}{'regs':>6}{'spills':>8}"
            f"{'stack':>7}{'shared':>8}{'warps/SM':>9}  multiples of 16, constexprs")
    print('\n' + head + '\n' + '-' * len(head))
    for r in rows:
        print(f"{r['kernel']:<34}{r['arch']:>5}{r['dtype']:>10}{r['num_warps']:>6}"
              f"{r['registers']:>6}{r['spills']:>8}{r['stack_bytes']:>7}{r['shared_bytes']:>8}"
              f"{r['resident_warps'] or '-':>9}  "
              f"{','.join(r['multiples_of_16']) or '-'} {r['constexprs']}")
    bad = [r for r in rows if r['within_limits'] is False]
    unknown = ', '.join(f'sm_{arch}' for arch in args.arch if arch not in LIMITS)
    print(f'\n{len(rows)} compilations, {len(jobs)} specializations per arch; '
          f'{len(bad)} with spills or over the shared-memory limit'
          + (f' (the shared-memory limit of {unknown} unknown here)' if unknown else ''))


if __name__ == '__main__':
    main()
