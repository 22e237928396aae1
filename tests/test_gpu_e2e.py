"""The end-to-end GPU check (tools/dev/gpu_e2e.sh, tools/dev/gpu_e2e.py) on a CPU.

- Its dry run: every detector of ``PAIRS`` trained through tools/dist_train.sh (gloo, one process,
  tiny images, two iterations), once more with ``with_cp=True``, and evaluated through
  tools/dist_test.sh, by the commands, configs and parsing of the GPU run; a run that fails is
  reported with its error.
- The wheel list the script installs on the GPU machine: complete for mmdet, mmseg, mmengine and
  mmpretrain (``pip install --no-index --target`` into an empty folder succeeds from the listed
  wheels and the GPU machine's own packages, for its CPython 3.12), with the versions of
  requirements/. The wheels are downloaded once (``gpu_e2e.py fetch``, cached under
  ~/.cache/mmdtn/gpu_e2e_wheels/).
- What decides the tables: config paths, errors in logs, losses, ratios.
"""
import importlib.util
import inspect
import json
import os
import os.path as osp
import re
import subprocess
import sys
import tarfile

import pytest

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
SCRIPT = osp.join(REPO, 'tools', 'dev', 'gpu_e2e.sh')
_spec = importlib.util.spec_from_file_location('gpu_e2e', osp.join(REPO, 'tools', 'dev',
                                                                   'gpu_e2e.py'))
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

NAMES = [e2e.stem(c) for dtn, ln, _ in e2e.PAIRS for c in (dtn, ln)]


def script(tmp_path, *args, **env):
    environ = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / 'out'),
                   SCRATCH=str(tmp_path / 'scratch'), **env)
    proc = subprocess.run(['bash', SCRIPT, *args], cwd=tmp_path, env=environ, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=900)
    results = tmp_path / 'out' / 'results.json'
    return proc, json.loads(results.read_text()) if results.is_file() else None


def test_dry_run_trains_and_evaluates_every_config(tmp_path):
    proc, results = script(tmp_path, '--dry-run')
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert results['meta']['dry_run'] and sorted(results['configs']) == sorted(NAMES)
    for name, c in results['configs'].items():
        train = c['train']
        assert train['status'] == 'ok', (name, train)
        assert train['iters'] == train['expected_iters'] == 2 and train['finite'], (name, train)
        assert train['median_time'] > 0 and train['peak_memory_mib'] is None  # no GPU
        log = (tmp_path / 'out' / train['log']).read_text()
        # the command of the GPU run, without --amp (CUDA only), on one gloo process
        assert 'tools/dist_train.sh' in log.splitlines()[0] and '--amp' not in log.splitlines()[0]
        assert 'Distributed training: True' in log and "'backend': 'gloo'" in log
        cp = c['cp']
        if e2e.describe_config(e2e.resolve_config(c['base']))['backbone'] in e2e.NO_WITH_CP:
            assert cp['status'] == 'n/a', (name, cp)
        else:
            assert cp['status'] == 'ok' and cp['finite'] and cp['iters'] == 2, (name, cp)
            cp_log = (tmp_path / 'out' / cp['log']).read_text()
            assert 'model.backbone.with_cp=True' in cp_log.splitlines()[0]
        test = c['test']
        assert test['status'] == 'ok', (name, test)
        assert 'tools/dist_test.sh' in (tmp_path / 'out' / test['log']).read_text()
        for kind in ('bbox', 'segm') if name.startswith('mask-rcnn') else ('bbox', ):
            assert 0 <= test[f'{kind}_mAP'] <= 1, (name, test)
        assert 'segm_mAP' not in test or name.startswith('mask-rcnn')
    table = (tmp_path / 'out' / 'results.md').read_text()
    assert table in proc.stdout
    for dtn, ln, _ in e2e.PAIRS:
        assert f'### {e2e.stem(dtn)} / {e2e.stem(ln)}' in table
    assert table.count('| loss finite at every iteration | yes (2/2)') == 3
    assert table.count('| failed (error) | nothing |') == 3
    # the tables again, from results.json alone
    again = subprocess.run([sys.executable, osp.join(REPO, 'tools', 'dev', 'gpu_e2e.py'),
                            'table', str(tmp_path / 'out' / 'results.json')],
                           capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout.strip() == table.strip()


def test_a_failed_run_is_reported_with_its_error(tmp_path):
    """The run goes on past a failure: the table names the error, the evaluation is skipped."""
    proc, results = script(tmp_path, '--dry-run', '--only', 'retinanet_pvt-t-ln_fpn_1x_coco',
                           '--cfg-options', 'model.backbone.type=NoSuchBackbone')
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert list(results['configs']) == ['retinanet_pvt-t-ln_fpn_1x_coco']
    c = results['configs']['retinanet_pvt-t-ln_fpn_1x_coco']
    assert c['train']['status'] == 'failed'
    assert re.match(r"KeyError: .*NoSuchBackbone is not in the mmdet::model registry",
                    c['train']['error']), c['train']['error']
    assert c['test'] == dict(status='skipped', error='no checkpoint: training failed')
    table = (tmp_path / 'out' / 'results.md').read_text()
    row = next(line for line in table.splitlines() if line.startswith('| failed (error)'))
    assert row.startswith('| failed (error) | not run (not selected) | train failed: KeyError')
    assert 'NoSuchBackbone is not in the mmdet::model registry' in row


def test_wheel_list_is_complete_for_the_gpu_machine(tmp_path):
    """From the carried wheels and the packages the GPU machine brings (downloaded here with
    their dependencies), pip installs the stack into an empty folder for CPython 3.12 without an
    index, every carried wheel is used at its version, and mmcv's own requirements are met."""
    got = e2e.fetch(with_provided=True)
    carried, provided = osp.dirname(got['carried'][0]), got['provided']
    pins = {e2e.normalize(n): v for n, v in e2e.read_pins()}
    runtime = [line for line in e2e.read_list(osp.join(REPO, 'requirements', 'runtime.txt'))
               if e2e.normalize(re.split(r'[<>=]', line)[0]) not in ('timm', )]
    pip_wheel = next(f for f in got['carried'] if osp.basename(f).startswith('pip-'))
    constraints = tmp_path / 'pins.txt'
    constraints.write_text(''.join(f'{n}=={v}\n' for n, v in pins.items()))
    target = tmp_path / 'target'
    cmd = [sys.executable, osp.join(pip_wheel, 'pip'), '--disable-pip-version-check', 'install',
           '-q', '--no-index', '--find-links', carried, '--find-links', provided, '--target',
           str(target), '--only-binary=:all:', *e2e.PLATFORM_ARGS, '-c', str(constraints),
           'mmengine', 'mmdet', 'mmsegmentation', 'mmpretrain', *runtime]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PIP_CONFIG_FILE=os.devnull))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    installed = {}
    for d in os.listdir(target):
        if d.endswith('.dist-info'):
            name, version = d[:-len('.dist-info')].split('-')[:2]
            installed[e2e.normalize(name)] = version
    provided_files = {e2e.normalize(f.split('-')[0]) for f in os.listdir(provided)
                      if f.endswith('.whl')}
    for name, version in installed.items():
        assert name in pins or name in provided_files, name
        assert name not in pins or pins[name] == version, (name, version, pins[name])
    unused = set(pins) - set(installed) - {'mmcv', *e2e.BUILD_TOOLS}
    assert not unused, f'carried but needed by nothing: {sorted(unused)}'
    # mmcv's requirements (its sdist's requirements/runtime.txt), by the carried and the provided
    sdist = next(f for f in got['carried'] if f.endswith('.tar.gz'))
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith('/requirements/runtime.txt'))
        lines = tar.extractfile(member).read().decode().splitlines()
    for line in lines:
        if line.strip() and 'win32' not in line:
            name = e2e.normalize(re.split(r'[<>=;]', line.strip())[0])
            assert name in installed, (line, sorted(installed))


def test_wheel_pins_are_the_versions_of_requirements():
    pins = {e2e.normalize(n): v for n, v in e2e.read_pins()}
    for name in ('runtime.txt', 'mmcv.txt'):
        for line in e2e.read_list(osp.join(REPO, 'requirements', name)):
            dist, sep, version = line.partition('==')
            if sep and e2e.normalize(dist) != 'timm':  # timm: the GPU machine's own
                assert pins.get(e2e.normalize(dist)) == version.strip(), line
    assert set(e2e.BUILD_TOOLS) <= set(pins)


def test_install_stops_before_pip_without_the_wheels_or_packages(tmp_path):
    with pytest.raises(RuntimeError, match=r'no wheel in .* for mmengine==0\.10\.7'):
        e2e.install(str(tmp_path), str(tmp_path / 'site'))
    assert not (tmp_path / 'site').exists()
    assert e2e.missing_provided(['numpy', 'opencv-python', 'no-such-distribution>=1']) == \
        ['no-such-distribution>=1']
    # --build-mmcv: the tools that build mmcv and nothing else, without the provided packages
    with pytest.raises(RuntimeError, match=r'for setuptools==[0-9.]+, wheel==[0-9.]+, '
                                           r'ninja==[0-9.]+: run'):
        e2e.install(str(tmp_path), str(tmp_path / 'site'), build_tools=True)


def test_script_is_bash_clean_and_prints_its_usage():
    assert subprocess.run(['bash', '-n', SCRIPT]).returncode == 0
    usage = subprocess.run(['bash', SCRIPT, '--help'], capture_output=True, text=True)
    assert usage.returncode == 0 and 'Last run on a GPU:' in usage.stdout


def test_build_mmcv_ahead_of_time_needs_the_architecture(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != 'TORCH_CUDA_ARCH_LIST'}
    proc = subprocess.run(['bash', SCRIPT, '--build-mmcv'], cwd=tmp_path, text=True,
                          env=dict(env, PYTHON=sys.executable, OUT=str(tmp_path / 'out'),
                                   SCRATCH=str(tmp_path / 'scratch')),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert 'needs TORCH_CUDA_ARCH_LIST' in (tmp_path / 'out' / 'setup_failed.txt').read_text()


def test_config_paths_in_family_folders_or_at_the_top(tmp_path):
    (tmp_path / 'configs' / 'pvt').mkdir(parents=True)
    (tmp_path / 'configs' / 'pvt' / 'a.py').write_text('')
    (tmp_path / 'configs' / 'b.py').write_text('')
    assert e2e.resolve_config('configs/pvt/a.py', str(tmp_path)) == \
        str(tmp_path / 'configs' / 'pvt' / 'a.py')
    assert e2e.resolve_config('configs/swin/b.py', str(tmp_path)) == \
        str(tmp_path / 'configs' / 'b.py')
    with pytest.raises(FileNotFoundError):
        e2e.resolve_config('configs/pvt/c.py', str(tmp_path))
    for dtn, ln, _ in e2e.PAIRS:  # every listed config exists in this checkout
        assert osp.isfile(e2e.resolve_config(dtn)) and osp.isfile(e2e.resolve_config(ln))


def test_no_with_cp_names_exactly_the_backbones_without_it():
    from mmdet.registry import MODELS

    import mmdtn  # noqa: F401  (registers the DTN backbones)
    for dtn, ln, _ in e2e.PAIRS:
        for path in (dtn, ln):
            backbone = e2e.describe_config(e2e.resolve_config(path))['backbone']
            cls = MODELS.get(backbone)
            params = set()
            for klass in cls.__mro__:  # the DTN classes take with_cp in a mixin's __init__
                if '__init__' in vars(klass):
                    params |= set(inspect.signature(klass.__init__).parameters)
            assert ('with_cp' in params) == (backbone not in e2e.NO_WITH_CP), backbone


TORCHRUN_LOG = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/repo/tools/train.py", line 80, in <module>
[rank0]:     main()
[rank0]: RuntimeError: CUDA error: no kernel image is available for execution on the device
[rank0]: CUDA kernel errors might be asynchronously reported at some other API call.
E1201 12:00:00.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] failed
Traceback (most recent call last):
  File "/usr/lib/python3.12/runpy.py", line 198, in _run_module_as_main
    return _run_code(code, main_globals, None,
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/repo/tools/train.py FAILED
"""


def test_error_of_names_the_process_error_not_torchrun():
    assert e2e.error_of(TORCHRUN_LOG, 1) == \
        'RuntimeError: CUDA error: no kernel image is available for execution on the device'
    assert e2e.error_of('x\nerror: --amp needs a GPU\n', 1) == 'error: --amp needs a GPU'
    assert e2e.error_of('a\nb\nc\nd\n', 2) == 'exit status 2: b / c / d'
    assert e2e.error_of('', -9) == 'killed by signal 9'
    assert e2e.error_of('', None, timed_out=True, timeout=61) == \
        'stopped at the time limit (61 s)'


def test_train_metrics_median_after_warmup_peak_memory_and_finite_losses():
    records = [dict(iter=i, loss=1.0, loss_cls=0.5, time=t, memory=m)
               for i, t, m in ((1, 9.0, 100), (2, 0.2, 300), (3, 0.4, 200), (4, 0.3, 250))]
    m = e2e.train_metrics(records, 4, 1)
    assert m['median_time'] == pytest.approx(0.3) and m['peak_memory_mib'] == 300
    assert m['finite'] and m['iters'] == 4
    assert not e2e.train_metrics(records[:3], 4, 1)['finite']  # an iteration missing
    records[2]['loss_cls'] = float('nan')
    bad = e2e.train_metrics(records, 4, 1)
    assert not bad['finite'] and bad['nonfinite'] == dict(iter=3, key='loss_cls', value='nan')
    assert e2e._finite_text(bad) == 'non-finite loss_cls nan at iteration 3'


def test_pair_table_ratios_goals_and_errors():
    settings = e2e.settings_of(False)
    results = dict(meta=dict(jobs=1), configs=dict(
        a=dict(metrics=['bbox'], train=dict(status='ok', median_time=0.22, peak_memory_mib=1100,
                                            finite=True, iters=40, expected_iters=40, seconds=30),
               cp=dict(status='failed', error='TypeError: x | y', seconds=5),
               test=dict(status='ok', bbox_mAP=0.012, seconds=9)),
        b=dict(metrics=['bbox'], train=dict(status='ok', median_time=0.2, peak_memory_mib=1000,
                                            finite=True, iters=40, expected_iters=40, seconds=28),
               cp=dict(status='n/a', error='no with_cp'),
               test=dict(status='ok', bbox_mAP=0.01, seconds=8))))
    table = e2e.pair_table(results, 'a', 'b', 1.10, settings)
    assert '| median iteration time (s), iterations 11-40 | 0.220 | 0.200 | 1.10 (meets <= 1.10) |'\
        in table
    assert '| peak GPU memory (MiB) | 1100 | 1000 | 1.10 (misses <= 1.05) |' in table
    assert '| bbox mAP (coco/bbox_mAP) | 0.012 | 0.010 |  |' in table
    assert 'with_cp failed: TypeError: x \\| y' in table and 'with_cp: n/a, no with_cp' in table
    assert 'segm' not in table
