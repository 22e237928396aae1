"""The GPU tools that run without a GPU: ``compile_kernels.py`` compiles every kernel
specialisation for sm_90, and the tile-tuning tools (``tune_band_tiles.py``,
``tune_fused_tiles.py``) run in Triton's interpreter and check spills by compiling. Each test
starts the tool in its own process. ``tools/gpu_checks.sh``, which runs them and the benchmarks
on a GPU node, runs here with a stand-in interpreter that records what it is asked to run."""
import json
import os
import subprocess
import sys
import textwrap

from mmdtn.models.layers.dtn.backends import triton_fused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiling_env():
    """This environment without TRITON_INTERPRET: Triton compiles for GPUs (without one here)."""
    return {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}


def test_kernels_compile_for_sm90_without_spills():
    """Every kernel specialisation PVT-Tiny, PVTv2-b0 and Swin-T use (float16 tokens, as under
    mmdet's AmpOptimWrapper) compiles for sm_90 with Triton's own compiler, without a GPU, with
    no spills and shared memory within the limit."""
    out = subprocess.run([sys.executable, 'tools/analysis/compile_kernels.py', '--arch', '90',
                          '--dtypes', 'float16', '--json'], cwd=ROOT, env=compiling_env(),
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    kernels = {r['kernel'] for r in rows}
    assert kernels == {'_moments_kernel', '_output_kernel', '_token_gradients_kernel',
                       '_parameter_gradients_kernel', '_input_gradient_kernel',
                       '_parameters_kernel', '_parameters_backward_kernel', '_band_matmul_kernel',
                       '_band_outer_kernel', '_fused_output_kernel',
                       '_fused_token_gradients_kernel', '_fused_input_gradient_kernel',
                       '_products_kernel', '_products_backward_kernel'}
    for r in rows:
        assert r['arch'] == 90 and set(r) >= {'kernel', 'registers', 'spills', 'shared_bytes'}
        assert r['spills'] == r['stack_bytes'] == 0 and r['shared_bytes'] <= 227 * 1024, r
        assert 0 < r['registers'] <= 255
        assert 0 < r['resident_warps'] <= 64 and r['resident_warps'] % r['num_warps'] == 0, r


def test_resident_warps():
    """The warps an SM holds of a kernel's programs, by the occupancy calculator's rules: limited
    by registers (allocated 256 a warp), shared memory (from sm_80 on 1 KiB more a block), warps
    and blocks."""
    assert_tool_check(textwrap.dedent('''
        from compile_kernels import resident_warps as warps
        cases = [((80, 8, 9216, 90), 24),  # 20480 registers a program: 3 of 65536
                 ((219, 4, 16512, 90), 8),  # 224 a thread allocated: 9 warps, 2 programs
                 ((32, 4, 64, 80), 64),  # the SM's 64 warps
                 ((32, 4, 100 * 1024, 90), 8),  # 2 programs of 101 KiB in 228 KiB
                 ((32, 1, 0, 86), 16),  # sm_86's 16 blocks
                 ((32, 4, 16 * 1024, 75), 16),  # 4 programs of 16 KiB in sm_75's 64 KiB
                 ((32, 4, 0, 75), 32)]  # sm_75's 32 warps
        print(int(any(warps(*args) != expected for args, expected in cases)))
        '''))


def test_a_kernel_with_spills_is_outside_the_limits_of_any_architecture():
    """Spills and a stack frame count on every architecture, also one whose shared-memory limit
    the tool does not know (its summary counts them); shared memory against the known limits."""
    assert_tool_check(textwrap.dedent('''
        from compile_kernels import within_limits
        cases = [((16, 0, 0, 72), False), ((0, 8, 0, 72), False), ((0, 0, 1024, 72), None),
                 ((0, 0, 64 * 1024, 75), True), ((0, 0, 65 * 1024, 75), False),
                 ((0, 0, 200 * 1024, 90), True), ((16, 0, 0, 90), False)]
        print(int(any(within_limits(*args) is not expected for args, expected in cases)))
        '''))


def test_compiled_as_the_layers_launch_them():
    """compile_kernels.py checks what it compiles against what the layers launch: every launch of
    PVTv2-b0's DTN layers (forward and backward on meta tensors, float16 tokens) binds, through
    Triton's own binder, to a signature and attributes that it compiles: the tensors aligned to 16
    bytes, C and d specialised as multiples of 16 only where they are (the first stage has heads
    of 8 channels), never H and W (no recompilation per resolution). A tool that took d for a
    multiple of 16 there stops, naming the launch."""
    assert_tool_check(textwrap.dedent('''
        import compile_kernels as c
        layers, grids = c.dtn_layers('pvtv2_b0', [(256, 320)])

        def check():
            return c.check_launches(c.layer_launches(grids, [False], ['float16']),
                                    c.architecture_jobs(layers, [False], ['float16'], None))

        launched = check()
        moments = {key[4] for key in launched if key[0] == '_moments_kernel'}
        fine = (moments == {('C', ), ('C', 'd')}
                and not any({'H', 'W'} & set(key[4]) for key in launched))
        own = c.attributes
        c.attributes = lambda kernel, constexprs, channels: own(
            kernel, constexprs, {name: 16 for name in channels})
        try:
            check()
            fine = False
        except SystemExit as stop:
            fine = fine and '(C, d = 32, 8)' in str(stop)
        print(sorted(moments), int(not fine))
        '''))


def assert_tool_check(statement):
    """Runs ``statement`` in tools/analysis without Triton's interpreter (as a tool's spill check,
    which compiles for a GPU without one, runs) and asserts that the last thing it prints is 0."""
    check = subprocess.run([sys.executable, '-c', statement],
                           cwd=os.path.join(ROOT, 'tools', 'analysis'), env=compiling_env(),
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0 and check.stdout.split()[-1] == '0', check.stderr[-3000:]


def test_tile_tuning_tool():
    """tools/analysis/tune_band_tiles.py, in the interpreter on grids 20 times smaller, two
    candidates per operand: every candidate's products equal the current tiles', the fastest of
    each operand is marked, and the tables are printed as Python source; ``--operands`` tunes
    only the operands named; without the interpreter its spill check compiles a candidate for
    sm_90 (no GPU)."""
    def interpreted(*args):
        return subprocess.run([sys.executable, 'tools/analysis/tune_band_tiles.py', '--device',
                               'cpu', '--shrink', '20', '--iters', '1', *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=600,
                              env={**os.environ, 'TRITON_INTERPRET': '1'})

    out = interpreted('--candidates', '2', '--stages', 'pvt_tiny:2', 'pvt_tiny:3')
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert 'not checked for spills (interpreter)' in text
    operands = ('matrices', 'transposed', 'tokens', 'outer matrices', 'outer tokens')
    for operand in operands:
        section = text.split(f'\n{operand}\n')[1].split('\n\n')[0].splitlines()
        assert len(section) == 2 and sum('<- fastest' in line for line in section) == 1, text
        differences = [float(line.split('(difference ')[1].split(')')[0]) for line in section]
        assert max(differences) < 1e-5, section
    namespace = {}
    exec(text[text.index('MATMUL_TILES = {'):], namespace)
    assert set(namespace['MATMUL_TILES']) == {'matrices', 'transposed', 'tokens'}
    assert set(namespace['OUTER_TILES']) == {'matrices', 'tokens'}
    # --operands tunes only those named; the tables still print in full
    out = interpreted('--candidates', '1', '--stages', 'pvt_tiny:3', '--operands', 'outer tokens')
    assert out.returncode == 0, out.stderr[-3000:]
    tuned = [line for line in out.stdout.splitlines() if line in operands]
    assert tuned == ['outer tokens'] and 'OUTER_TILES = {' in out.stdout, out.stdout
    assert_tool_check('import tune_band_tiles as t; '
                      'print(t.spills("tokens", 90, "float16"))')


def test_tuning_times_the_nearest_candidates_worth_timing():
    """``--candidates N`` times the first N candidates not left out (named, not timed: those that
    spill, and those whose register cap lets an SM hold no more of their warps than without it);
    the fused tiles' candidates come after the current tables, the nearest first: the same
    tokens and walk with another register cap or other warps, more warps before fewer. Compiled
    for sm_90, the input gradient for heads of 32 channels with 16 warps (at most 128 registers a
    thread) and the token gradients for heads of 64 channels with 8 warps capped at 128 registers
    (4 capped at 168) do not spill, and an SM holds 16 of their warps (12; 8 with the tables);
    the fused output, 24 warps an SM with 8 warps a program, would hold 16 capped at 128. The
    fused output and token gradients are checked in both their forms (every head in a program,
    and the heads split among programs, as on small grids)."""
    assert_tool_check(textwrap.dedent('''
        import tune_fused_tiles as t
        from compile_kernels import resident_warps
        from tuning import compiled_resources, timed_candidates
        reasons = {'b': 'spills', 'd': 'no more warps'}
        kept = list(timed_candidates('abcdef', reasons.get, 2))
        bad = kept != [('a', None), ('b', 'spills'), ('c', None)]
        bad |= [c for c, _ in timed_candidates('abc', lambda c: None, None)] != list('abc')
        walk = (2, 1)
        t.set_candidate('input_gradient', 32, None, ((16, 8), walk))
        ordered = t.candidates('input_gradient', 32, None)
        bad |= sorted(ordered) != sorted(set(t.CANDIDATES) | {((16, 8), walk)})
        bad |= ordered[:7] != [((16, 8), walk), ((16, 8, 128), walk), ((16, 16), walk),
                               ((16, 4), walk), ((16, 4, 168), walk), ((16, 4, 128), walk),
                               ((16, 2), walk)]

        def occupancy(kernel, d, tiles):
            t.set_candidate(kernel, d, None, (tiles, walk))
            spec = t.specialization(kernel, d, None)
            regs, spilled, shared = compiled_resources(spec, 'float16', 90, dict(C=d, d=d))
            return spilled, resident_warps(regs, spec[2].num_warps, shared, 90)

        def left_out(kernel, d, tiles, walk=walk):
            t.set_candidate(kernel, d, 90, (tiles, walk))
            return t.left_out(kernel, d, 90, 'float16')

        bad |= occupancy('input_gradient', 32, (16, 8)) != (0, 8)
        bad |= occupancy('input_gradient', 32, (16, 16)) != (0, 16)
        bad |= occupancy('token_gradients', 64, (16, 4)) != (0, 8)
        bad |= occupancy('token_gradients', 64, (16, 8, 128)) != (0, 16)
        bad |= occupancy('token_gradients', 64, (16, 4, 168)) != (0, 12)
        bad |= left_out('token_gradients', 64, (16, 8, 128)) is not None
        bad |= not left_out('input_gradient', 32, (16, 8, 128)).startswith('spills')
        bad |= 'an SM holds 16 warps, 24 without the cap' not in left_out(
            'output', 64, (16, 8, 128), (1, 1))
        # the output and the token gradients are checked as they run on every grid
        bad |= [f[1]['SPLIT'] for f in t.forms('token_gradients', 64, 90)] != [False, True]
        bad |= len(t.forms('input_gradient', 64, 90)) != 1
        print(int(bad))
        '''))


def test_fused_tile_tuning_tool():
    """tools/analysis/tune_fused_tiles.py, in the interpreter on grids 25 and 10 times smaller,
    two candidates of the fused token gradients (and of those that read kept products, with the
    layer keeping them) and of the cell products' backward: y and dx equal
    the current tables', the fastest is marked and the tables of the kernel's module are printed
    as Python source; stages that do not run the kernels are refused; without the interpreter its
    spill check compiles a candidate for sm_90, and sm_80's own tiles for sm_80 (no GPU); the
    current tables that spill are named."""
    tool = os.path.join(ROOT, 'tools', 'analysis', 'tune_fused_tiles.py')
    env = {**os.environ, 'TRITON_INTERPRET': '1'}
    out = subprocess.run([sys.executable, tool, '--device', 'cpu', '--shrink', '25', '--batch',
                          '1', '--candidates', '2', '--stages', 'pvt_tiny:3', '--kernels',
                          'token_gradients', 'kept_token_gradients'], capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert 'not checked for spills (interpreter)' in text
    for kernel in ('token_gradients', 'kept_token_gradients'):  # the latter keeping the products
        section = text.split(f'\n{kernel}, heads of 64 channels\n')[1].split('\n\n')[0]
        lines = section.splitlines()
        assert len(lines) == 2 and sum('<- fastest' in line for line in lines) == 1, text
        assert max(float(line.split('(difference ')[1].split(')')[0]) for line in lines) < 2e-3
    assert section.splitlines()[0].strip().startswith('(8, 4), (1, 1)'), section
    namespace = {}
    exec(text[text.index('TILES = {'):], namespace)
    assert set(namespace['TILES']) == set(namespace['WALKS']) == {
        'output', 'token_gradients', 'kept_token_gradients', 'input_gradient'}
    assert namespace['ARCH_TILES'] == triton_fused.ARCH_TILES
    cells = subprocess.run([sys.executable, tool, '--device', 'cpu', '--shrink', '10', '--batch',
                            '1', '--candidates', '2', '--stages', 'pvt_tiny:2', '--kernels',
                            'products_backward'], capture_output=True, text=True, timeout=600,
                           env=env)
    assert cells.returncode == 0, cells.stderr[-3000:]
    section = cells.stdout.split('\nproducts_backward, heads of 32 channels\n')[1]
    lines = section.split('\n\n')[0].splitlines()
    assert len(lines) == 2 and sum('<- fastest' in line for line in lines) == 1, cells.stdout
    assert max(float(line.split('(difference ')[1].split(')')[0]) for line in lines) < 2e-3
    tables = cells.stdout[cells.stdout.index('# triton_cells.py'):]
    namespace = {}
    exec(tables, namespace)
    assert set(namespace['TILES']) == set(namespace['WALKS']) == {'products', 'products_backward'}
    assert 'ARCH_TILES' not in namespace
    pooled = subprocess.run([sys.executable, tool, '--device', 'cpu', '--stages', 'pvt_tiny:1',
                             '--kernels', 'output'], capture_output=True, text=True, timeout=600,
                            env=env)
    assert pooled.returncode == 2 and 'none of these stages runs output' in pooled.stderr
    assert_tool_check('import tune_fused_tiles as t; '
                      'print(t.spills("token_gradients", 64, 90, "float16"))')
    assert_tool_check('import tune_fused_tiles as t; '
                      'print(t.spills("kept_token_gradients", 32, 90, "float16"))')
    assert_tool_check('import tune_fused_tiles as t; '
                      'print(t.spills("products_backward", 32, 90, "float16"))')
    # TILES on sm_80, where the token gradients' tiles for heads of 32 channels once spilled
    assert_tool_check('import tune_fused_tiles as t; '
                      'print(t.spills("token_gradients", 32, 80, "float16"))')
    # the current tables that spill are named before tuning (a stand-in for the spill check)
    assert_tool_check(
        'import tune_fused_tiles as t;'
        ' t.spills = lambda k, d, a, dt: 8 * ((k, d) == ("output", 32));'
        ' found = t.spilling(["output", "token_gradients"], {t.triton_fused: [32, 64]}, 90,'
        ' "float16");'
        ' print(found, int(found != [("output", 32, 8)]))')


STAND_IN = """#!/usr/bin/env bash
# a stand-in for python: CUDA {cuda}; records its arguments and the settings that select passes
if [[ $1 == -c ]]; then exit {status}; fi
settings="$TRITON_INTERPRET $MMDTN_TRITON_FUSED $MMDTN_TRITON_KEEP_PRODUCTS"
echo "$* | $settings $MMDTN_TRITON_SPLIT_HEADS" >> {log}
echo "ran $*"
[[ $* == *tune_fused_tiles* ]] && sleep {sleep}
exit 0
"""


def gpu_checks(tmp_path, *steps, cuda=True, sleep=0, **env):
    """``bash tools/gpu_checks.sh steps`` with the stand-in interpreter: the process and the
    commands it ran, one line each."""
    python, log = tmp_path / 'python', tmp_path / 'commands.txt'
    python.write_text(STAND_IN.format(cuda='seen' if cuda else 'absent', status=int(not cuda),
                                      log=log, sleep=sleep))
    python.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(('MMDTN_TRITON', 'TRITON'))}
    out = subprocess.run(['bash', 'tools/gpu_checks.sh', *steps], cwd=ROOT, capture_output=True,
                         text=True, timeout=60,
                         env=dict(environ, PYTHON=str(python), OUT=str(tmp_path / 'logs'), **env))
    return out, log.read_text().splitlines() if log.exists() else []


def test_gpu_checks_run_their_steps(tmp_path):
    """Every step runs its commands, with the settings its variants take, in order, and keeps
    its output in $OUT/<step>.log; --help lists the steps."""
    out, commands = gpu_checks(tmp_path)
    assert out.returncode == 0, out.stderr
    assert [c.split(' | ')[0].split()[0] for c in commands] == [
        '-m', *['tools/analysis/benchmark_norm.py'] * 4, 'tools/analysis/benchmark_backbones.py',
        'tools/analysis/tune_fused_tiles.py', 'tools/analysis/tune_band_tiles.py']
    assert commands[0].startswith('-m pytest') and commands[0].endswith('| 0   ')
    assert all('--device cuda' in c for c in commands[1:])
    settings = [c.split(' | ')[1] for c in commands[1:5]]
    assert settings == ['   ', ' 0  ', '  1 ', '   0']  # FUSED, KEEP_PRODUCTS, SPLIT_HEADS
    assert '--stages pvt_tiny:4 swin_t:4' in commands[4]
    assert sorted(os.listdir(tmp_path / 'logs')) == [
        'backbones.log', 'layer.log', 'tests.log', 'tiles.log', 'variants.log']
    assert 'ran tools/analysis/tune_band_tiles.py' in (tmp_path / 'logs' / 'tiles.log').read_text()
    helped = subprocess.run(['bash', 'tools/gpu_checks.sh', '--help'], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0
    assert all(f'  {step} ' in helped.stdout
               for step in ('tests', 'layer', 'variants', 'backbones', 'tiles'))


def test_gpu_checks_stop_where_they_cannot_run(tmp_path):
    """An unknown step and a machine without a CUDA GPU stop before any step, saying why; a step
    past STEP_SECONDS is stopped, its log kept, and the run fails naming it."""
    out, commands = gpu_checks(tmp_path, 'layer', 'timing')
    assert out.returncode == 2 and "no step 'timing'" in out.stderr and commands == []
    out, commands = gpu_checks(tmp_path, 'layer', cuda=False)
    assert out.returncode == 1 and 'sees no CUDA GPU' in out.stderr and commands == []
    out, commands = gpu_checks(tmp_path, 'layer', 'tiles', sleep=30, STEP_SECONDS='2')
    assert out.returncode == 1 and 'failed or stopped: tiles' in out.stderr
    assert len(commands) == 2 and 'tune_fused_tiles.py' in commands[1]  # band tiles never ran
    assert (tmp_path / 'logs' / 'layer.log').exists() and '== tiles: exit 124' in out.stdout
