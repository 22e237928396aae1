"""The GPU tools that run without a GPU: ``tools/dev/compile_kernels.py`` compiles every kernel
specialization for sm_80 and sm_90, and ``tools/dev/gpu_checks.sh``, which runs the checks and
benchmarks on a GPU node, runs here with a stand-in interpreter that records what it is asked to
run. Each test starts the tool in its own process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compiling_env():
    """This environment without TRITON_INTERPRET: Triton compiles for GPUs (without one here)."""
    return {k: v for k, v in os.environ.items() if k != 'TRITON_INTERPRET'}


@pytest.mark.parametrize('arch', [80, 90])
def test_kernels_compile_without_spills(arch):
    """Every kernel specialization PVT-Tiny, PVTv2-b0 and Swin-T use (float16 tokens, as under
    mmdet's AmpOptimWrapper) compiles for sm_80 (A100) and sm_90 (H100, H200) with Triton's own
    compiler, without a GPU, with no spills and shared memory within the limit."""
    out = subprocess.run([sys.executable, 'tools/dev/compile_kernels.py', '--arch', str(arch),
                          '--dtypes', 'float16', '--json'], cwd=ROOT, env=compiling_env(),
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    kernels = {r['kernel'] for r in rows}
    assert kernels == {'_moments_kernel', '_output_kernel', '_token_gradients_kernel',
                       '_input_gradient_kernel', '_parameters_kernel', '_factor_gradients_kernel',
                       '_parameters_backward_kernel'}
    for r in rows:
        assert r['arch'] == arch and set(r) >= {'kernel', 'registers', 'spills', 'shared_bytes'}
        assert r['spills'] == r['stack_bytes'] == 0 and r['within_limits'], r
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
    bytes, C and d specialized as multiples of 16 only where they are (the first stage has heads
    of 8 channels), never H and W (no recompilation per resolution). A tool that took d for a
    multiple of 16 there stops, naming the launch."""
    assert_tool_check(textwrap.dedent('''
        import compile_kernels as c
        layers, grids = c.dtn_layers('pvtv2_b0', [(256, 320)])

        def check():
            return c.check_launches(c.layer_launches(grids, [False], ['float16']),
                                    c.architecture_jobs(layers, [False], ['float16'], 90))

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
    """Runs ``statement`` in tools/dev without Triton's interpreter (as the compile tool, which
    compiles for a GPU without one, runs) and asserts that the last thing it prints is 0."""
    check = subprocess.run([sys.executable, '-c', statement],
                           cwd=os.path.join(ROOT, 'tools', 'dev'), env=compiling_env(),
                           capture_output=True, text=True, timeout=600)
    assert check.returncode == 0 and check.stdout.split()[-1] == '0', check.stderr[-3000:]


STAND_IN = """#!/usr/bin/env bash
# a stand-in for python: CUDA {cuda}; records its arguments and the interpreter setting
if [[ $1 == -c ]]; then exit {status}; fi
echo "$* | $TRITON_INTERPRET" >> {log}
echo "ran $*"
[[ $* == *benchmark_backbones* ]] && sleep {sleep}
exit 0
"""


def gpu_checks(tmp_path, *steps, cuda=True, sleep=0, **env):
    """``bash tools/dev/gpu_checks.sh steps`` with the stand-in interpreter: the process and the
    commands it ran, one line each."""
    python, log = tmp_path / 'python', tmp_path / 'commands.txt'
    python.write_text(STAND_IN.format(cuda='seen' if cuda else 'absent', status=int(not cuda),
                                      log=log, sleep=sleep))
    python.chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(('MMDTN', 'TRITON'))}
    out = subprocess.run(['bash', 'tools/dev/gpu_checks.sh', *steps], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env=dict(environ, PYTHON=str(python), OUT=str(tmp_path / 'logs'), **env))
    return out, log.read_text().splitlines() if log.exists() else []


def test_gpu_checks_run_their_steps(tmp_path):
    """Every step runs its commands in order and keeps its output in $OUT/<step>.log; the probe
    runs where GEMM_PROBE names it; --help lists the steps."""
    out, commands = gpu_checks(tmp_path, GEMM_PROBE='probe.py')
    assert out.returncode == 0, out.stderr
    assert [c.split(' | ')[0].split()[0] for c in commands] == [
        'probe.py', '-m', 'tools/dev/benchmark_norm.py', 'tools/analysis/benchmark_backbones.py']
    assert commands[1].startswith('-m pytest') and commands[1].endswith('| 0')
    assert all('--device cuda' in c for c in commands[2:])
    assert sorted(os.listdir(tmp_path / 'logs')) == [
        'backbones.log', 'layer.log', 'probe.log', 'tests.log']
    (tmp_path / 'again').mkdir()
    out, commands = gpu_checks(tmp_path / 'again', 'probe')
    assert out.returncode == 0 and commands == [] and 'GEMM_PROBE is not set' in out.stdout
    helped = subprocess.run(['bash', 'tools/dev/gpu_checks.sh', '--help'], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0
    assert all(f'  {step} ' in helped.stdout for step in ('probe', 'tests', 'layer', 'backbones'))


def test_gpu_checks_stop_where_they_cannot_run(tmp_path):
    """An unknown step and a machine without a CUDA GPU stop before any step, saying why; a step
    past STEP_SECONDS is stopped, its log kept, and the run fails naming it."""
    out, commands = gpu_checks(tmp_path, 'layer', 'timing')
    assert out.returncode == 2 and "no step 'timing'" in out.stderr and commands == []
    out, commands = gpu_checks(tmp_path, 'layer', cuda=False)
    assert out.returncode == 1 and 'sees no CUDA GPU' in out.stderr and commands == []
    out, commands = gpu_checks(tmp_path, 'layer', 'backbones', 'tests', sleep=30,
                               STEP_SECONDS='2')
    assert out.returncode == 1 and 'failed or stopped: backbones' in out.stderr
    assert len(commands) == 3 and 'benchmark_backbones.py' in commands[1]
    assert (tmp_path / 'logs' / 'layer.log').exists() and '== backbones: exit 124' in out.stdout
