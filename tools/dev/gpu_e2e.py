"""The end-to-end GPU check of the DTN detectors (docs/dev/gpu_e2e.md), and its CPU dry run.

RetinaNet and Mask R-CNN with DTN backbones and their LayerNorm twins (``PAIRS``) are trained by
``tools/dist_train.sh CONFIG 1 --amp`` on generated COCO-format shapes at the configs' 1333 x 800
scale, once more with ``model.backbone.with_cp=True``, and evaluated by ``tools/dist_test.sh``; one
table a detector compares DTN with LN. ``tools/dev/gpu_e2e.sh`` installs the stack on the GPU
machine and calls the subcommands in this order::

    python tools/dev/gpu_e2e.py fetch --dest DIR      # (with network) the wheels to bring along
    python tools/dev/gpu_e2e.py install --wheels DIR --site DIR   # them, into a target folder
    python tools/dev/gpu_e2e.py prepare --scratch DIR [--dry-run] # data and configs
    python tools/dev/gpu_e2e.py ops-check --out DIR   # mmcv's CUDA ops on the GPU
    python tools/dev/gpu_e2e.py run --scratch DIR --out DIR [--dry-run] [--deadline T]
    python tools/dev/gpu_e2e.py table OUT/results.json  # the tables again

``--dry-run``: on the CPU (gloo), tiny images, two iterations of every run, no ``--amp`` (mmengine's
AmpOptimWrapper needs CUDA); the commands, configs, parsing and tables are the GPU run's.

Only the standard library is imported at the start: ``fetch`` and ``install`` run before the
OpenMMLab stack is installed; ``prepare`` needs mmengine, ``run`` the whole stack.
"""
import argparse
import glob
import hashlib
import importlib.util
import json
import math
import os
import os.path as osp
import pprint
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

REPO = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))

# The detectors: (DTN config, its LN twin, goal for the DTN / LN median iteration time). The one
# list to edit. Each path is tried as written (configs/<family>/<name>) and then as
# configs/<name>, the layout before the configs were sorted into family folders
# (resolve_config), so the list works with either.
PAIRS = (
    ('configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py',
     'configs/pvt/retinanet_pvt-t-ln_fpn_1x_coco.py', 1.10),
    ('configs/pvt/mask-rcnn_pvt-t-dtn_fpn_1x_coco.py',
     'configs/pvt/mask-rcnn_pvt-t-ln_fpn_1x_coco.py', 1.10),
    ('configs/swin/mask-rcnn_swin-t-p4-w7-dtn_fpn_1x_coco.py',
     'configs/swin/mask-rcnn_swin-t-p4-w7-ln_fpn_1x_coco.py', 1.15),
)
#: Goal for the DTN / LN peak GPU memory.
MEMORY_GOAL = 1.05
#: Backbones without a ``with_cp`` argument: their with_cp run is reported as not applicable.
NO_WITH_CP = {
    'PyramidVisionTransformer': "mmdet's PyramidVisionTransformer has no with_cp",
    'PyramidVisionTransformerV2': "mmdet's PyramidVisionTransformerV2 has no with_cp",
}

#: Settings of the GPU run and of the dry run. ``iters`` training iterations, the first ``warmup``
#: left out of the median; the with_cp run is shorter. Images of ``image_size`` (W, H); ``scale``
#: replaces the configs' Resize scale (None: the configs' own 1333 x 800).
SETTINGS = {
    'gpu': dict(iters=40, warmup=10, cp_iters=15, cp_warmup=5, image_size=(1333, 800),
                num_val=8, scale=None, amp=True, jobs=4, objects=(2, 8), sizes=(48, 320)),
    'dry': dict(iters=2, warmup=1, cp_iters=2, cp_warmup=1, image_size=(128, 96), num_val=2,
                scale=(128, 96), amp=False, jobs=2, objects=(1, 3), sizes=(20, 48)),
}
#: Seconds a run needs at least; with less left before the deadline it is not started.
MIN_START_S = 15

WHEELS_LIST = osp.join(REPO, 'requirements', 'gpu_e2e_wheels.txt')
PROVIDED_LIST = osp.join(REPO, 'requirements', 'gpu_e2e_provided.txt')
#: The GPU machine's Python: the wheels fetched are for it.
PLATFORM_KEY = 'cp312-manylinux_x86_64'
PLATFORM_ARGS = ('--python-version', '3.12', '--implementation', 'cp', '--platform',
                 'manylinux2014_x86_64', '--platform', 'manylinux_2_28_x86_64')
#: Requirements met by any of these distributions.
ALIASES = {'opencv-python': ('opencv-python', 'opencv-python-headless', 'opencv-contrib-python',
                             'opencv-contrib-python-headless')}
#: The GPU machine's own PyTorch, checked there with the provided packages; not fetched by the
#: completeness test (its CUDA wheels are gigabytes).
MACHINE = ('torch', 'torchvision')
#: Carried for building and installing, not part of the installed stack.
BUILD_TOOLS = ('setuptools', 'wheel', 'ninja', 'pip')


def normalize(name):
    """A distribution name as wheel file names and pip compare it."""
    return re.sub(r'[-_.]+', '-', name).lower()


def read_list(path):
    """The requirement lines of a list, comments and blank lines dropped."""
    with open(path) as f:
        return [line.split('#')[0].strip() for line in f if line.split('#')[0].strip()]


def read_pins(path=WHEELS_LIST):
    """``[(name, version)]`` of the carried list's ``name==version`` lines."""
    pins = []
    for line in read_list(path):
        name, sep, version = line.partition('==')
        if not sep or not version.strip():
            raise ValueError(f'{path}: {line!r} is not name==version')
        pins.append((name.strip(), version.strip()))
    return pins


def cache_dir():
    """Where fetched wheels are kept (as tools/setup_env.sh keeps the mmcv wheels)."""
    root = os.environ.get('MMDTN_CACHE') or osp.join(
        os.environ.get('XDG_CACHE_HOME') or osp.expanduser('~/.cache'), 'mmdtn')
    return osp.join(root, 'gpu_e2e_wheels', PLATFORM_KEY)


def find_file(folder, name, version):
    """The wheel (or, for mmcv, the sdist) of ``name==version`` in ``folder``, or None."""
    for path in sorted(glob.glob(osp.join(folder, '*'))):
        base = osp.basename(path)
        if base.endswith('.whl'):
            parts = base[:-len('.whl')].split('-')
            dist, ver = (parts[0], parts[1]) if len(parts) >= 5 else ('', '')
        elif base.endswith('.tar.gz'):
            dist, _, ver = base[:-len('.tar.gz')].rpartition('-')
        else:
            continue
        if normalize(dist) == normalize(name) and ver == version:
            return path
    return None


def _pip_download(python, folder, args):
    cmd = [python, '-m', 'pip', '--disable-pip-version-check', 'download', '-q', '-d', folder,
           *args]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode:
        out = '\n'.join(line for line in proc.stdout.splitlines()
                        if not line.startswith("WARNING: Location '"))
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out[-3000:]}")


def fetch(dest=None, with_provided=False, python=sys.executable, cache=None):
    """Download the carried wheels (and the mmcv sdist) for the GPU machine into the cache.

    ``dest``: copy them there too (the folder to bring along). ``with_provided``: also the
    packages the GPU machine is expected to have, with their dependencies, into their own cache
    folder (for the completeness test). The mmcv sdist is fetched with ``python``, which needs
    torch: pip prepares its metadata without build isolation, as tools/setup_env.sh does.
    Returns ``dict(carried=[files], provided=folder or None)``.
    """
    cache = cache or cache_dir()
    carried = osp.join(cache, 'carried')
    os.makedirs(carried, exist_ok=True)
    pins = read_pins()
    missing = [(n, v) for n, v in pins if find_file(carried, n, v) is None]
    binary = [f'{n}=={v}' for n, v in missing if normalize(n) != 'mmcv']
    if binary:
        _pip_download(python, carried, ['--no-deps', '--only-binary=:all:', *PLATFORM_ARGS,
                                        *binary])
    if any(normalize(n) == 'mmcv' for n, _ in missing):
        version = dict((normalize(n), v) for n, v in pins)['mmcv']
        _pip_download(python, carried, ['--no-deps', '--no-binary=:all:', '--no-build-isolation',
                                        f'mmcv=={version}'])
    files = []
    for n, v in pins:
        path = find_file(carried, n, v)
        if path is None:
            raise RuntimeError(f'pip download gave no file for {n}=={v} in {carried}')
        files.append(path)
    provided = None
    if with_provided:
        provided = osp.join(cache, 'provided')
        stamp = osp.join(provided, '.list-sha256')
        with open(PROVIDED_LIST, 'rb') as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if not (osp.isfile(stamp) and open(stamp).read() == digest):
            os.makedirs(provided, exist_ok=True)
            _pip_download(python, provided, ['--only-binary=:all:', *PLATFORM_ARGS,
                                             *read_list(PROVIDED_LIST)])
            with open(stamp, 'w') as f:
                f.write(digest)
    if dest:
        os.makedirs(dest, exist_ok=True)
        for path in files:
            target = osp.join(dest, osp.basename(path))
            if not osp.isfile(target) or osp.getsize(target) != osp.getsize(path):
                shutil.copy2(path, target)
    return dict(carried=files, provided=provided)


def missing_provided(names=None):
    """The requirements of requirements/gpu_e2e_provided.txt that this Python lacks."""
    from importlib.metadata import PackageNotFoundError, distribution
    missing = []
    for req in names if names is not None else read_list(PROVIDED_LIST):
        name = re.split(r'[<>=!~ ;\[]', req, maxsplit=1)[0]
        found = False
        for alias in ALIASES.get(normalize(name), (name, )):
            try:
                distribution(alias)
                found = True
                break
            except PackageNotFoundError:
                pass
        if not found:
            missing.append(req)
    return missing


def pip_command(python, wheels):
    """``python -m pip``, or pip run from its carried wheel where that Python has none."""
    if subprocess.run([python, '-c', 'import pip'], capture_output=True).returncode == 0:
        return [python, '-m', 'pip', '--disable-pip-version-check']
    wheel = next((f for f in sorted(glob.glob(osp.join(wheels, 'pip-*.whl')))), None)
    if wheel is None:
        raise RuntimeError(f'{python} has no pip and {wheels} no pip wheel')
    return [python, osp.join(wheel, 'pip'), '--disable-pip-version-check']


def install(wheels, site, python=sys.executable, build_tools=False):
    """Install the carried wheels (not mmcv: built or brought along separately) into ``site``.

    Stops before installing anything when a provided package is missing or a wheel is not in
    ``wheels``. ``--no-deps``: the list is the complete set (tests/test_gpu_e2e.py), and the
    provided packages stay the machine's own. ``build_tools``: only those that build mmcv
    (``BUILD_TOOLS``), for building its wheel ahead of time on a machine without a GPU.
    """
    lacking = [] if build_tools else missing_provided() + missing_provided(MACHINE)
    if lacking:
        raise RuntimeError(f"this Python ({sys.executable}) lacks {', '.join(lacking)} "
                           f'(requirements/gpu_e2e_provided.txt): install them or bring their '
                           f'wheels along and add them to requirements/gpu_e2e_wheels.txt')
    files, absent = [], []
    for name, version in read_pins():
        if normalize(name) in ('mmcv', 'pip') or build_tools and normalize(name) not in BUILD_TOOLS:
            continue
        path = find_file(wheels, name, version)
        (files if path else absent).append(path or f'{name}=={version}')
    if absent:
        raise RuntimeError(f"no wheel in {wheels} for {', '.join(absent)}: run "
                           f'`python tools/dev/gpu_e2e.py fetch --dest {wheels}` where there is '
                           f'network')
    cmd = pip_command(python, wheels) + ['install', '-q', '--no-index', '--no-deps', '--upgrade',
                                         '--target', site, *files]
    subprocess.run(cmd, check=True)
    return files


# --- configs and data ------------------------------------------------------------------------

def resolve_config(path, root=REPO):
    """The config file of ``path`` (configs/<family>/<name>): that file, or configs/<name> where
    the configs are not sorted into family folders."""
    for candidate in (path, osp.join('configs', osp.basename(path))):
        full = osp.join(root, candidate)
        if osp.isfile(full):
            return full
    raise FileNotFoundError(f'config {path} not found (nor configs/{osp.basename(path)})')


def stem(path):
    return osp.splitext(osp.basename(path))[0]


def _plain(obj):
    """A config value as plain dicts, lists and tuples (ConfigDict has a repr of its own)."""
    if hasattr(obj, 'items'):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _scaled(pipeline, scale):
    """``pipeline`` with every resize step at ``scale``."""
    out = []
    for step in _plain(pipeline):
        if 'scale' in step:
            step['scale'] = tuple(scale)
        if 'scales' in step:
            step['scales'] = [tuple(scale)]
        out.append(step)
    return out


def describe_config(path):
    """What the run needs to know of a config: model kind, metrics, batch size, pipelines."""
    from mmengine.config import Config
    cfg = Config.fromfile(path, import_custom_modules=False)
    model = cfg.model
    metric = cfg.test_evaluator.get('metric', 'bbox')
    metrics = [metric] if isinstance(metric, str) else list(metric)
    backbone = model.backbone.get('type', '')
    return dict(
        model_type=model.get('type', ''), backbone=backbone,
        with_cp=None if backbone not in NO_WITH_CP else NO_WITH_CP[backbone],
        metrics=metrics, batch_size=int(cfg.train_dataloader.batch_size),
        bbox_head='bbox_head' in model, roi_head='roi_head' in model,
        mask_head='roi_head' in model and 'mask_head' in model.roi_head,
        rcnn_test='rcnn' in model.get('test_cfg', {}),
        train_pipeline=_plain(cfg.train_dataloader.dataset.pipeline),
        test_pipeline=_plain(cfg.test_dataloader.dataset.pipeline))


def override_config(base, info, data_root, classes, settings, batches):
    """The text of a config that inherits ``base`` and trains ``batches`` batches of the generated
    shapes, evaluates on their val split, and loads no pretrained weights (no network)."""
    n = len(classes)
    model = dict(backbone=dict(init_cfg=None))
    if info['bbox_head']:
        model['bbox_head'] = dict(num_classes=n)
    if info['roi_head']:
        model['roi_head'] = dict(bbox_head=dict(num_classes=n))
        if info['mask_head']:
            model['roi_head']['mask_head'] = dict(num_classes=n)
    # Score threshold 0: a detector trained for 40 iterations still gives detections to
    # evaluate (NMS, RoIAlign and the mask head's test path run).
    model['test_cfg'] = dict(rcnn=dict(score_thr=0.0)) if info['rcnn_test'] \
        else dict(score_thr=0.0)
    train_ds = dict(data_root=data_root, metainfo=dict(classes=classes),
                    ann_file='annotations/instances_train.json', data_prefix=dict(img='train/'),
                    indices=batches * info['batch_size'])
    test_ds = dict(data_root=data_root, metainfo=dict(classes=classes),
                   ann_file='annotations/instances_val.json', data_prefix=dict(img='val/'))
    train_dl, test_dl = dict(dataset=train_ds), dict(dataset=test_ds)
    if settings['scale'] is not None:
        train_ds['pipeline'] = _scaled(info['train_pipeline'], settings['scale'])
        test_ds['pipeline'] = _scaled(info['test_pipeline'], settings['scale'])
    if settings['name'] == 'dry':  # single-process data loading on a CPU machine
        train_dl.update(num_workers=0, persistent_workers=False)
        test_dl.update(num_workers=0, persistent_workers=False)
    values = dict(
        model=model, train_dataloader=train_dl, test_dataloader=test_dl,
        test_evaluator=dict(ann_file=osp.join(data_root, 'annotations', 'instances_val.json')),
        val_dataloader=None, val_cfg=None, val_evaluator=None,
        train_cfg=dict(max_epochs=1, val_interval=1), default_hooks=dict(logger=dict(interval=1)),
        log_processor=dict(window_size=1), randomness=dict(seed=0))
    lines = ['# Written by tools/dev/gpu_e2e.py: the config below on generated shapes, one epoch',
             f'# of {batches} batches, evaluated by tools/dist_test.sh (no validation in',
             '# training).', f'_base_ = {base!r}']
    for key, value in values.items():
        text = pprint.pformat(value, width=96 - len(key), sort_dicts=False)
        lines.append(f'{key} = ' + text.replace('\n', '\n' + ' ' * (len(key) + 3)))
    return '\n'.join(lines) + '\n'


def _shapes_module():
    """mmdtn/datasets/synthetic_shapes.py (numpy and PIL only), without importing mmdtn."""
    path = osp.join(REPO, 'mmdtn', 'datasets', 'synthetic_shapes.py')
    spec = importlib.util.spec_from_file_location('mmdtn_synthetic_shapes', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def settings_of(dry_run):
    settings = dict(SETTINGS['dry' if dry_run else 'gpu'])
    settings['name'] = 'dry' if dry_run else 'gpu'
    return settings


def selection(only=None):
    """The pairs of PAIRS to report and the names (without .py) of the configs to run: every
    one, or those in ``only`` (a pair is reported where one of its configs runs)."""
    known = [stem(c) for dtn, ln, _ in PAIRS for c in (dtn, ln)]
    names = {stem(n) for n in only} if only else set(known)
    unknown = names - set(known)
    if unknown:
        raise ValueError(f"--only: no config {', '.join(sorted(unknown))} in PAIRS")
    pairs = [p for p in PAIRS if names & {stem(p[0]), stem(p[1])}]
    return pairs, [n for n in known if n in names]


def prepare(scratch, dry_run=False, only=None):
    """Generate the shapes and write one config a detector; returns (and writes) the plan."""
    started = time.time()
    settings = settings_of(dry_run)
    os.makedirs(scratch, exist_ok=True)
    pairs, names = selection(only)
    configs = {}
    for path in (c for dtn, ln, _ in pairs for c in (dtn, ln) if stem(c) in names):
        base = resolve_config(path)
        configs[stem(path)] = dict(base=base, listed=path, **describe_config(base))
    batch = max(c['batch_size'] for c in configs.values())
    shapes = _shapes_module()
    w, h = settings['image_size']
    spec = shapes.ShapesSpec(num_train=settings['iters'] * batch, num_val=settings['num_val'],
                             image_size=(w, h), min_objects=settings['objects'][0],
                             max_objects=settings['objects'][1], min_size=settings['sizes'][0],
                             max_size=settings['sizes'][1], seed=0)
    data = shapes.generate_shapes_dataset(osp.join(scratch, 'data', f'shapes_{w}x{h}'), spec,
                                          progress=False)
    classes = tuple(data['classes'])
    for name, c in configs.items():
        for run, batches in (('train', settings['iters']), ('cp', settings['cp_iters'])):
            c[f'{run}_config'] = osp.join(scratch, 'configs', f'{name}_{run}.py')
            os.makedirs(osp.dirname(c[f'{run}_config']), exist_ok=True)
            with open(c[f'{run}_config'], 'w') as f:
                f.write(override_config(c['base'], c, osp.join(data['root'], ''), classes,
                                        settings, batches))
        del c['train_pipeline'], c['test_pipeline']
    plan = dict(settings=settings, configs=configs, data=data['root'], num_train=spec.num_train,
                pairs=[[stem(d), stem(n), g] for d, n, g in pairs],
                prepare_s=round(time.time() - started, 1))
    with open(osp.join(scratch, 'plan.json'), 'w') as f:
        json.dump(plan, f, indent=1)
    return plan


# --- runs --------------------------------------------------------------------------------------

def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _kill_group(proc):
    """Stop a launch (torchrun and the processes it started: their own process group)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def launch(cmd, log_file, env, timeout):
    """Run ``cmd`` with its output in ``log_file``; returns (exit status, timed out, seconds)."""
    start = time.monotonic()
    with open(log_file, 'w') as log:
        log.write('$ ' + ' '.join(cmd) + '\n')
        log.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=max(1.0, timeout)), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.returncode, True
    return rc, timed_out, time.monotonic() - start


_RANK_PREFIX = re.compile(r'^\[(?:rank|default)\d+\]:\s?')
_LAUNCHER_ERRORS = ('ChildFailedError', 'torch.distributed.elastic')


def error_of(log, rc, timed_out=False, timeout=None):
    """The error a failed run's log ends with, in one line: the last exception raised in the
    training or test process (not torchrun's report of it), a tool's ``error:`` line, or the
    exit status and the last lines."""
    if timed_out:
        return f'stopped at the time limit ({timeout:.0f} s)' if timeout else 'stopped'
    lines = [_RANK_PREFIX.sub('', line.rstrip()) for line in log.splitlines()]
    found = []
    for i, line in enumerate(lines):
        if not line.startswith('Traceback (most recent call last)'):
            continue
        j = i + 1  # the frames are indented; the exception's line is the first that is not
        while j < len(lines) and (not lines[j] or lines[j][0] in ' \t'):
            j += 1
        if j < len(lines):
            message = lines[j]
            if message.endswith(':') and j + 1 < len(lines) and lines[j + 1].strip():
                message += ' ' + lines[j + 1].strip()
            found.append(message)
    own = [e for e in found if not any(s in e for s in _LAUNCHER_ERRORS)]
    tool = [line for line in lines if line.startswith('error: ')]
    for candidates in (own, tool, found):
        if candidates:
            return candidates[-1][:1000]
    if rc is not None and rc < 0:
        return f'killed by signal {-rc}'
    tail = [line for line in lines if line.strip()][-3:]
    return f"exit status {rc}: {' / '.join(tail)}"[:1000]


def read_scalars(work_dir):
    """The training records mmengine wrote (``<work_dir>/<timestamp>/vis_data/scalars.json``)."""
    records = []
    for path in sorted(glob.glob(osp.join(work_dir, '*', 'vis_data', 'scalars.json'))):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return [r for r in records if 'loss' in r]


def train_metrics(records, expected, warmup):
    """Median iteration time after ``warmup``, peak memory (MiB), and whether every one of the
    ``expected`` iterations logged finite losses."""
    nonfinite = None
    for r in records:
        for key, value in r.items():
            if key.startswith('loss') and not math.isfinite(float(value)):
                nonfinite = nonfinite or dict(iter=r.get('iter'), key=key, value=str(value))
    times = [float(r['time']) for r in records if r.get('iter', 0) > warmup and 'time' in r]
    memory = [float(r['memory']) for r in records if 'memory' in r]
    return dict(iters=len(records), expected_iters=expected,
                finite=nonfinite is None and len(records) == expected, nonfinite=nonfinite,
                median_time=statistics.median(times) if times else None,
                peak_memory_mib=max(memory) if memory else None,
                loss_first=records[0]['loss'] if records else None,
                loss_last=records[-1]['loss'] if records else None)


_AP = re.compile(r'coco/(bbox|segm)_mAP: (-?\d+(?:\.\d+)?)')


def test_metrics(log):
    return {f'{kind}_mAP': float(v) for kind, v in _AP.findall(log)}


class Runner:
    """Runs the plan's launches before a deadline and keeps their records in results.json."""

    def __init__(self, plan, scratch, out, deadline=None, jobs=None, cfg_options=(),
                 python=sys.executable):
        self.plan, self.scratch, self.out = plan, scratch, out
        self.settings = plan['settings']
        self.deadline = deadline
        self.jobs = jobs or self.settings['jobs']
        self.cfg_options = list(cfg_options)
        self.python = python
        self.results = dict(configs={name: {} for name in plan['configs']})

    def remaining(self):
        return math.inf if self.deadline is None else self.deadline - time.time()

    def env(self):
        env = dict(os.environ, PYTHON=self.python, PORT=str(free_port()))
        if self.settings['name'] == 'dry':  # the CPU, one thread a process (a shared machine)
            env.update(CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1', MKL_NUM_THREADS='1')
        return env

    def _launch(self, name, run, cmd):
        """Run ``cmd`` unless the deadline is near; returns its record and its log (None when
        it did not start)."""
        if self.remaining() < MIN_START_S:
            return dict(status='skipped', error='not started: the time budget was spent'), None
        logs = osp.join(self.out, 'logs', name)
        os.makedirs(logs, exist_ok=True)
        log_file = osp.join(logs, f'{run}.log')
        timeout = min(self.remaining(), 3600)
        rc, timed_out, seconds = launch(cmd, log_file, self.env(), timeout)
        with open(log_file, errors='replace') as f:
            log = f.read()
        record = dict(status='ok' if rc == 0 else 'timed out' if timed_out else 'failed',
                      seconds=round(seconds, 1), log=osp.relpath(log_file, self.out), rc=rc)
        if rc != 0:
            record['error'] = error_of(log, rc, timed_out, timeout)
        return record, log

    def train(self, name, run):
        c = self.plan['configs'][name]
        work = osp.join(self.scratch, 'work', name, run)
        shutil.rmtree(work, ignore_errors=True)
        if run == 'cp' and c['with_cp']:
            return dict(status='n/a', error=c['with_cp'])
        cmd = ['bash', osp.join(REPO, 'tools', 'dist_train.sh'), c[f'{run}_config'], '1']
        if self.settings['amp']:
            cmd.append('--amp')
        cmd += ['--work-dir', work]
        options = list(self.cfg_options)
        if run == 'cp':
            options += ['model.backbone.with_cp=True', 'default_hooks.checkpoint=None']
        if options:
            cmd += ['--cfg-options', *options]
        record, log = self._launch(name, run, cmd)
        if log is None:
            return record
        records = read_scalars(work)
        iters = self.settings['iters' if run == 'train' else 'cp_iters']
        warmup = self.settings['warmup' if run == 'train' else 'cp_warmup']
        record.update(train_metrics(records, iters, warmup))
        if records:
            with open(osp.join(self.out, 'logs', name, f'{run}_scalars.json'), 'w') as f:
                f.write('\n'.join(json.dumps(r) for r in records) + '\n')
        if run == 'train':
            ckpt = osp.join(work, 'epoch_1.pth')
            record['checkpoint'] = ckpt if osp.isfile(ckpt) else None
            if record['status'] == 'ok' and not record['checkpoint']:
                record.update(status='failed', error=f'no checkpoint {ckpt} after training')
        if record['status'] == 'ok' and not record['finite']:
            record.update(status='failed', error=_finite_text(record))
        return record

    def test(self, name):
        c = self.plan['configs'][name]
        ckpt = self.results['configs'][name].get('train', {}).get('checkpoint')
        if not ckpt:
            return dict(status='skipped', error='no checkpoint: training failed')
        cmd = ['bash', osp.join(REPO, 'tools', 'dist_test.sh'), c['train_config'], ckpt, '1',
               '--work-dir', osp.join(self.scratch, 'work', name, 'test')]
        if self.cfg_options:
            cmd += ['--cfg-options', *self.cfg_options]
        record, log = self._launch(name, 'test', cmd)
        if log is None:
            return record
        record.update(test_metrics(log))
        absent = [m for m in c['metrics'] if f'{m}_mAP' not in record]
        if record['status'] == 'ok' and absent:
            empty = 'The testing results of the whole dataset is empty' in log
            record.update(status='failed', error=(
                'no detections to evaluate' if empty else
                f"the evaluation printed no coco/{'_mAP, coco/'.join(absent)}_mAP"))
        return record

    def record(self, name, run, record):
        self.results['configs'][name][run] = record
        self.save()

    def save(self):
        os.makedirs(self.out, exist_ok=True)
        tmp = osp.join(self.out, 'results.json.tmp')
        with open(tmp, 'w') as f:
            json.dump(self.results, f, indent=1)
        os.replace(tmp, osp.join(self.out, 'results.json'))

    def run(self, meta):
        """Per detector: the timed trainings of DTN then LN, one after the other; then their
        evaluations and with_cp runs, ``jobs`` at a time (these share the GPU)."""
        self.results['meta'] = meta
        started = time.time()
        for dtn, ln, _ in self.plan['pairs']:
            names = [n for n in (dtn, ln) if n in self.plan['configs']]
            for name in names:
                print(f'[gpu_e2e] train {name}', flush=True)
                self.record(name, 'train', self.train(name, 'train'))
                _print_record(name, 'train', self.results['configs'][name]['train'])
            tasks = [(n, 'test') for n in names] + [(n, 'cp') for n in names]
            with ThreadPoolExecutor(max_workers=self.jobs) as pool:
                futures = [(n, r, pool.submit(self.test, n) if r == 'test' else
                            pool.submit(self.train, n, 'cp')) for n, r in tasks]
                for n, r, future in futures:
                    self.record(n, r, future.result())
                    _print_record(n, r, self.results['configs'][n][r])
        self.results['meta']['runs_s'] = round(time.time() - started, 1)
        self.save()
        return self.results


def _print_record(name, run, r):
    extra = ''
    if r.get('median_time') is not None:
        extra = f", median iteration {r['median_time']:.3f} s"
    if r.get('peak_memory_mib') is not None:
        extra += f", peak memory {r['peak_memory_mib']:.0f} MiB"
    for key in ('bbox_mAP', 'segm_mAP'):
        if key in r:
            extra += f', {key} {r[key]:.3f}'
    if r.get('error'):
        extra += f": {r['error']}"
    seconds = f" in {r['seconds']} s" if 'seconds' in r else ''
    print(f"[gpu_e2e] {run} {name}: {r['status']}{seconds}{extra}", flush=True)


def _finite_text(r):
    if r.get('nonfinite'):
        bad = r['nonfinite']
        return f"non-finite {bad['key']} {bad['value']} at iteration {bad['iter']}"
    return f"{r.get('iters', 0)} of {r.get('expected_iters')} iterations logged"


# --- report ------------------------------------------------------------------------------------

def commit():
    if os.environ.get('E2E_COMMIT'):
        return os.environ['E2E_COMMIT']
    try:
        head = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + (' (with uncommitted changes)' if dirty else '')
    except (OSError, subprocess.CalledProcessError):
        return 'unknown (no git checkout; set E2E_COMMIT)'


VERSIONS = r"""
import json, platform, sys
import torch
out = dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    out.update(gpu=p.name, capability='sm_%d%d' % (p.major, p.minor),
               gpu_memory_gib=round(p.total_memory / 2**30, 1))
for name in ('triton', 'numpy', 'mmengine', 'mmcv', 'mmdet', 'mmseg', 'mmpretrain', 'mmdtn'):
    try:
        out[name] = __import__(name).__version__
    except Exception as e:
        out[name] = 'not importable: %s' % e
try:
    from mmcv.ops import get_compiling_cuda_version
    out['mmcv_ops_cuda'] = get_compiling_cuda_version()
except Exception as e:
    out['mmcv_ops_cuda'] = 'no compiled ops: %s' % e
print(json.dumps(out))
"""


def versions(python=sys.executable):
    proc = subprocess.run([python, '-c', VERSIONS], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        return dict(error=error_of(proc.stdout + proc.stderr, proc.returncode))
    return json.loads(proc.stdout.strip().splitlines()[-1])


OPS_CHECK = r"""
import json, torch
from mmcv.ops import get_compiling_cuda_version, nms, roi_align, sigmoid_focal_loss
out = dict(compiled_cuda=get_compiling_cuda_version())
boxes = torch.tensor([[0., 0., 10., 10.], [1., 1., 11., 11.], [50., 50., 60., 60.]], device='cuda')
scores = torch.tensor([0.9, 0.8, 0.7], device='cuda')
out['nms_kept'] = nms(boxes, scores, 0.5)[1].tolist()
feat = torch.randn(1, 8, 32, 32, device='cuda', requires_grad=True)
rois = torch.tensor([[0., 2., 2., 20., 20.]], device='cuda')
roi_align(feat, rois, (7, 7), 1.0, 2, 'avg', True).sum().backward()
out['roi_align_grad'] = bool(torch.isfinite(feat.grad).all())
logits = torch.randn(16, 4, device='cuda', requires_grad=True)
sigmoid_focal_loss(logits, torch.randint(0, 4, (16,), device='cuda'), 2.0, 0.25, None,
                   'mean').backward()
out['focal_loss_grad'] = bool(torch.isfinite(logits.grad).all())
torch.cuda.synchronize()
print(json.dumps(out))
"""


def ops_check(out, python=sys.executable):
    """mmcv's CUDA ops of the detectors (NMS, RoIAlign, sigmoid focal loss) once on the GPU."""
    proc = subprocess.run([python, '-c', OPS_CHECK], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode:
        result = dict(ok=False, error=error_of(proc.stdout + proc.stderr, proc.returncode))
    else:
        result = dict(ok=True, **json.loads(proc.stdout.strip().splitlines()[-1]))
    os.makedirs(out, exist_ok=True)
    with open(osp.join(out, 'ops_check.json'), 'w') as f:
        json.dump(result, f, indent=1)
    return result


def _cell(x, fmt):
    return '-' if x is None else fmt.format(x)


def _ratio(a, b, goal=None):
    if a is None or b is None or not b:
        return ''
    r = a / b
    if goal is None:
        return f'{r:.2f}'
    return f"{r:.2f} ({'meets' if round(r, 2) <= goal else 'misses'} <= {goal:.2f})"


def _span(first, last):
    return f'iteration {last}' if first == last else f'iterations {first}-{last}'


def _ops_text(ops):
    if ops == 'not available':
        return 'CPU ops only'
    return f'CUDA {ops} ops' if ops and ops[0].isdigit() else str(ops)


def _esc(text):
    return str(text).replace('|', '\\|').replace('\n', ' ')


def pair_table(results, dtn, ln, goal, settings):
    """The markdown table of one detector: DTN, LN and DTN / LN."""
    cfgs = results['configs']
    d, n = cfgs.get(dtn, {}), cfgs.get(ln, {})
    jobs = results.get('meta', {}).get('jobs', 1)
    shared = f', {jobs} runs sharing the device' if jobs > 1 else ''
    rows = []

    def metric_row(label, run, key, fmt, goal=None, ratio=True):
        a, b = d.get(run, {}).get(key), n.get(run, {}).get(key)
        rows.append((label, _cell(a, fmt), _cell(b, fmt), _ratio(a, b, goal) if ratio else ''))

    w, i = settings['warmup'], settings['iters']
    cw, ci = settings['cp_warmup'], settings['cp_iters']
    metric_row(f'median iteration time (s), {_span(w + 1, i)}', 'train', 'median_time',
               '{:.3f}', goal)
    metric_row('peak GPU memory (MiB)', 'train', 'peak_memory_mib', '{:.0f}', MEMORY_GOAL)
    metric_row(f'with_cp=True: median iteration time (s), {_span(cw + 1, ci)}{shared}', 'cp',
               'median_time', '{:.3f}')
    metric_row('with_cp=True: peak GPU memory (MiB)', 'cp', 'peak_memory_mib', '{:.0f}')

    def finite(c):
        parts = []
        for run, label in (('train', ''), ('cp', 'with_cp: ')):
            r = c.get(run, {})
            if 'finite' in r:
                ok = 'yes' if r['finite'] else 'no, ' + _finite_text(r)
                parts.append(f"{label}{ok} ({r['iters']}/{r['expected_iters']})")
            elif r.get('status') == 'n/a':
                parts.append(f'{label}n/a')
            else:
                parts.append(f'{label}not run')
        return '; '.join(parts)

    rows.append(('loss finite at every iteration', finite(d), finite(n), ''))
    kinds = [k for k in ('bbox', 'segm') if any(
        k in cfgs.get(name, {}).get('metrics', ['bbox']) or f'{k}_mAP' in cfgs.get(name, {}).get(
            'test', {}) for name in (dtn, ln))]
    for kind in kinds:
        metric_row(f'{kind} mAP (coco/{kind}_mAP)', 'test', f'{kind}_mAP', '{:.3f}', ratio=False)

    def failures(c):
        if not c:
            return 'not run (not selected)'
        out = []
        for run, label in (('train', 'train'), ('cp', 'with_cp'), ('test', 'test')):
            r = c.get(run)
            if r is None:
                out.append(f'{label}: not run')
            elif r['status'] == 'n/a':
                out.append(f"{label}: n/a, {r['error']}")
            elif r['status'] != 'ok':
                out.append(f"{label} {r['status']}: {r.get('error', '')}")
        return '; '.join(out) or 'nothing'

    rows.append(('failed (error)', failures(d), failures(n), ''))

    def seconds(c):
        return ', '.join(f"{label} {c[run]['seconds']:.0f} s" for run, label in (
            ('train', 'train'), ('cp', 'with_cp'), ('test', 'test')) if 'seconds' in c.get(run, {}))

    rows.append(('wall time of the runs', seconds(d) or '-', seconds(n) or '-', ''))
    lines = [f'### {dtn} / {ln}', '', '| | DTN | LN | DTN / LN |', '| --- | --- | --- | --- |']
    lines += ['| ' + ' | '.join(_esc(x) for x in row) + ' |' for row in rows]
    return '\n'.join(lines)


def report(results, plan):
    """The results as markdown: what ran where, how long each part took, one table a detector."""
    meta, settings = results.get('meta', {}), plan['settings']
    v = meta.get('versions', {})
    gpu = f"{v.get('gpu')} ({v.get('capability')})" if v.get('gpu') else 'no GPU (CPU, gloo)'
    lines = [f"## DTN detectors end to end: {meta.get('date', '?')}", '',
             f"- machine: {gpu}; Python {v.get('python')}, torch {v.get('torch')} (CUDA "
             f"{v.get('cuda')}), triton {v.get('triton')}, numpy {v.get('numpy')}",
             f"- stack: mmcv {v.get('mmcv')} ({_ops_text(v.get('mmcv_ops_cuda'))}), "
             f"mmengine {v.get('mmengine')}, mmdet {v.get('mmdet')}, mmdtn {v.get('mmdtn')}; "
             f"commit {meta.get('commit')}",
             f"- runs: tools/dist_train.sh CONFIG 1{' --amp' if settings['amp'] else ''} "
             f"({'NCCL' if v.get('gpu') else 'gloo'}, one process), {settings['iters']} "
             f"iterations (median of {_span(settings['warmup'] + 1, settings['iters'])}), then "
             f"{settings['cp_iters']} with model.backbone.with_cp=True; tools/dist_test.sh on "
             f"{settings['num_val']} images; generated shapes of "
             f"{settings['image_size'][0]}x{settings['image_size'][1]}"
             + (f", resized to {settings['scale'][0]}x{settings['scale'][1]}"
                if settings['scale'] else ', the configs\' 1333x800 scale')]
    ops = meta.get('ops_check')
    if ops:
        lines.append('- mmcv CUDA ops (NMS, RoIAlign, sigmoid focal loss) once on the GPU: ' + (
            'ok' if ops.get('ok') else f"failed: {ops.get('error')}"))
    times = [f'{k[:-2]} {v} s' for k, v in meta.get('setup', {}).items() if k.endswith('_s')]
    route = meta.get('setup', {}).get('mmcv_route')
    if route:
        times.append(f'mmcv: {route}')
    if plan.get('prepare_s') is not None:
        times.append(f"data and configs {plan['prepare_s']} s"
                     + (' (beside the mmcv step)' if meta.get('setup') else ''))
    if meta.get('runs_s') is not None:
        times.append(f"training and evaluation {meta['runs_s']} s")
    if times:
        lines.append('- time: ' + '; '.join(times))
    for dtn, ln, goal in plan['pairs']:
        lines += ['', pair_table(results, dtn, ln, goal, settings)]
    return '\n'.join(lines) + '\n'


def run(scratch, out, dry_run=False, deadline=None, jobs=None, only=None, cfg_options=()):
    plan_file = osp.join(scratch, 'plan.json')
    plan = None
    if osp.isfile(plan_file):
        with open(plan_file) as f:
            plan = json.load(f)
        pairs, names = selection(only)
        if (plan['settings'] != json.loads(json.dumps(settings_of(dry_run)))
                or plan['pairs'] != [[stem(d), stem(n), g] for d, n, g in pairs]
                or sorted(plan['configs']) != sorted(names)):
            plan = None
    if plan is None:
        plan = prepare(scratch, dry_run, only)
    runner = Runner(plan, scratch, out, deadline, jobs, cfg_options)
    setup = {}
    if osp.isfile(osp.join(out, 'setup.json')):
        with open(osp.join(out, 'setup.json')) as f:
            setup = json.load(f)
    meta = dict(date=datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'), commit=commit(),
                versions=versions(), dry_run=dry_run, jobs=runner.jobs, setup=setup)
    if osp.isfile(osp.join(out, 'ops_check.json')):
        with open(osp.join(out, 'ops_check.json')) as f:
            meta['ops_check'] = json.load(f)
    for name, c in plan['configs'].items():
        runner.results['configs'][name].update(metrics=c['metrics'], base=c['listed'])
    runner.results['plan'] = plan
    results = runner.run(meta)
    text = report(results, plan)
    with open(osp.join(out, 'results.md'), 'w') as f:
        f.write(text)
    print('\n' + text, flush=True)
    return results


def ok(results):
    """Whether every run that applies trained, logged finite losses and evaluated."""
    return all(r.get('status') in ('ok', 'n/a') for c in results['configs'].values()
               for k, r in c.items() if k in ('train', 'cp', 'test')) and all(
        {'train', 'cp', 'test'} <= set(c) for c in results['configs'].values())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    sub = parser.add_subparsers(dest='command', required=True)
    p = sub.add_parser('fetch', help='download the wheels to bring along (needs network)')
    p.add_argument('--dest', help='also copy them into this folder')
    p.add_argument('--with-provided', action='store_true',
                   help="also the GPU machine's own packages (for the completeness test)")
    p = sub.add_parser('install', help='install the wheels brought along into a target folder')
    p.add_argument('--wheels', required=True)
    p.add_argument('--site', required=True)
    p.add_argument('--build-tools', action='store_true',
                   help='only those that build mmcv (' +
                   ', '.join(t for t in BUILD_TOOLS if t != 'pip') + ')')
    for name in ('prepare', 'run'):
        # the same options for both (prepare uses --dry-run and --only), so that one command
        # line serves the two steps of gpu_e2e.sh
        p = sub.add_parser(name, help='generate data and configs' if name == 'prepare' else
                           'train, evaluate, print the tables')
        p.add_argument('--scratch', required=True, help='data, configs, work directories')
        p.add_argument('--dry-run', action='store_true', help='CPU, tiny images, 2 iterations')
        p.add_argument('--only', nargs='+', metavar='CONFIG',
                       help='only the detectors of these configs (names as in PAIRS)')
        p.add_argument('--out', required=name == 'run', help='results.json, results.md, logs')
        p.add_argument('--deadline', type=float,
                       help='Unix time after which no run starts and running ones stop')
        p.add_argument('--jobs', type=int, help='evaluations and with_cp runs at a time')
        p.add_argument('--cfg-options', nargs='+', default=[], metavar='KEY=VALUE',
                       help='passed to every dist_train.sh and dist_test.sh')
    p = sub.add_parser('ops-check', help="mmcv's CUDA ops once on the GPU")
    p.add_argument('--out', required=True)
    p = sub.add_parser('table', help='print the tables of a results.json again')
    p.add_argument('results')
    args = parser.parse_args(argv)

    if args.command == 'fetch':
        got = fetch(args.dest, args.with_provided)
        size = sum(osp.getsize(f) for f in got['carried']) / 2**20
        print(f"{len(got['carried'])} files, {size:.1f} MiB" +
              (f" in {args.dest}" if args.dest else f' in {cache_dir()}'))
    elif args.command == 'install':
        try:
            files = install(args.wheels, args.site, build_tools=args.build_tools)
        except (RuntimeError, subprocess.CalledProcessError) as e:
            print(f'gpu_e2e.py install: {e}', file=sys.stderr)
            return 1
        print(f'{len(files)} wheels installed into {args.site}')
    elif args.command == 'prepare':
        plan = prepare(args.scratch, args.dry_run, args.only)
        print(f"prepared in {plan['prepare_s']} s: {len(plan['configs'])} configs, "
              f"{plan['num_train']} training images in {plan['data']}")
    elif args.command == 'run':
        results = run(args.scratch, args.out, args.dry_run, args.deadline, args.jobs, args.only,
                      args.cfg_options)
        return 0 if ok(results) else 1
    elif args.command == 'ops-check':
        result = ops_check(args.out)
        print(json.dumps(result))
        return 0 if result['ok'] else 1
    elif args.command == 'table':
        with open(args.results) as f:
            results = json.load(f)
        print(report(results, results['plan']))
    return 0


if __name__ == '__main__':
    sys.exit(main())
