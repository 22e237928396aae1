"""End-to-end runs of tools/train.py, tools/test.py and the launch scripts on CPU.

Each run is a subprocess of this interpreter on a tiny dataset made here: a few iterations of
Mask R-CNN with PVT-Tiny-DTN followed by COCO bbox and segm evaluation, Semantic FPN with mIoU, a
2-process gloo run through dist_train.sh (with distributed COCO validation) and dist_test.sh, an
mmpretrain image classifier on PVT-Tiny-DTN trained by dist_train.sh and evaluated (top-1) by
tools/test.py, the slurm scripts through a stand-in srun, and RetinaNet PVT-Tiny-DTN killed
mid-epoch, resumed, then evaluated with tools/test.py.
"""
import json
import math
import os
import os.path as osp
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from mmengine.config import Config

import mmdtn  # noqa: F401
from mmdtn.datasets import generate_shape_crops
from mmdtn.engine import (CPUDistributedDataParallel, close_distributed, init_cpu_process_group,
                          setup_distributed)
from tiny_datasets import (det_overrides, env_for_subprocess, make_coco, make_seg,
                           write_config)

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
TRAIN = osp.join(REPO, 'tools', 'train.py')
TEST = osp.join(REPO, 'tools', 'test.py')
COCO_AP_LINE = 'Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]'
RETINANET = "dict(backbone=dict(init_cfg=None), bbox_head=dict(num_classes=2), " \
            "test_cfg=dict(score_thr=0.0))"
MASK_RCNN = "dict(backbone=dict(init_cfg=None), roi_head=dict(bbox_head=dict(num_classes=2), " \
            "mask_head=dict(num_classes=2)))"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def run(cmd, cwd, timeout=240, **env):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env_for_subprocess(env, REPO),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout


def losses(log: str):
    return [float(v) for v in re.findall(r'\bloss: ([-+0-9.eEnaif]+)', log)]


def assert_ok(rc, out):
    assert rc == 0, out[-4000:]
    ls = losses(out)
    assert ls and all(math.isfinite(v) for v in ls), out[-3000:]


def last_scalars(work_dir):
    """The last training record mmengine wrote to <work_dir>/<timestamp>/vis_data/scalars.json."""
    records = []
    for d in sorted(os.listdir(work_dir)):
        path = osp.join(work_dir, d, 'vis_data', 'scalars.json')
        if osp.isfile(path):
            with open(path) as f:
                records += [json.loads(line) for line in f if line.strip()]
    return [r for r in records if 'loss' in r][-1]


@pytest.fixture(scope='module')
def coco_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('tiny_coco'))
    # An image without annotations and a crowd (RLE) object in each split: both must just work.
    make_coco(root, {'train': 4, 'val': 2}, empty_image=True, crowd=True)
    return root


def test_mask_rcnn_pvt_tiny_dtn_train_then_coco_bbox_segm_eval(tmp_path, coco_root):
    cfg = write_config(tmp_path / 'mask_rcnn.py', 'pvt/mask-rcnn_pvt-t-dtn_fpn_1x_coco.py',
                       det_overrides(coco_root, with_mask=True, validate=False), MASK_RCNN)
    work = tmp_path / 'work'
    assert_ok(*run([sys.executable, TRAIN, cfg, '--work-dir', work], tmp_path))
    rc, out = run([sys.executable, TEST, cfg, work / 'epoch_1.pth', '--work-dir',
                   tmp_path / 'test'], tmp_path)
    assert rc == 0, out[-4000:]
    assert 'Evaluating bbox...' in out and 'Evaluating segm...' in out
    assert out.count(COCO_AP_LINE) == 2
    assert 'coco/bbox_mAP:' in out and 'coco/segm_mAP:' in out


SEG_OVERRIDES = """
data_root = {root!r}
crop_size = (64, 64)
metainfo = dict(classes=('background', 'square', 'disc'),
                palette=[[0, 0, 0], [220, 60, 60], [60, 60, 220]])
train_pipeline = [
    dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
    dict(type='RandomResize', scale=(80, 64), ratio_range=(0.9, 1.1), keep_ratio=True),
    dict(type='RandomCrop', crop_size=crop_size), dict(type='RandomFlip', prob=0.5),
    dict(type='PackSegInputs')]
test_pipeline = [
    dict(type='LoadImageFromFile'), dict(type='Resize', scale=(80, 64), keep_ratio=True),
    dict(type='LoadAnnotations'), dict(type='PackSegInputs')]
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(type='BaseSegDataset', data_root=data_root, metainfo=metainfo,
                 data_prefix=dict(img_path='images/training',
                                  seg_map_path='annotations/training'),
                 pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(type='BaseSegDataset', data_root=data_root, metainfo=metainfo,
                 data_prefix=dict(img_path='images/validation',
                                  seg_map_path='annotations/validation'),
                 pipeline=test_pipeline))
test_dataloader = val_dataloader
val_dataloader = None  # no validation during training: tools/test.py evaluates
val_cfg = None
val_evaluator = None
model = dict(data_preprocessor=dict(size=crop_size), backbone=dict(init_cfg=None),
             decode_head=dict(num_classes=3))
train_cfg = dict(max_iters=3, val_interval=1000)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=3))
log_processor = dict(window_size=1)
env_cfg = dict(cudnn_benchmark=False, mp_cfg=dict(opencv_num_threads=1))
"""


def test_semantic_fpn_pvt_tiny_dtn_train_then_miou(tmp_path):
    root = str(tmp_path / 'seg')
    make_seg(root)
    cfg = write_config(tmp_path / 'semfpn.py', 'pvt/fpn_pvt-t-dtn_8xb4-40k_ade20k-512x512.py',
                       SEG_OVERRIDES.format(root=root))
    work = tmp_path / 'work'
    assert_ok(*run([sys.executable, TRAIN, cfg, '--work-dir', work], tmp_path))
    rc, out = run([sys.executable, TEST, cfg, work / 'iter_3.pth', '--work-dir', tmp_path / 'test',
                   '--out', tmp_path / 'pred_maps', '--show-dir', tmp_path / 'painted'], tmp_path)
    assert rc == 0, out[-4000:]
    assert 'per class results:' in out and 'mIoU' in out
    for name in ('background', 'square', 'disc'):
        assert re.search(rf'\|\s+{name}\s+\|\s+[0-9.]+\s+\|', out), out[-3000:]
    miou = float(re.search(r'mIoU: ([0-9.]+)', out).group(1))
    assert 0 <= miou <= 100
    assert len(os.listdir(tmp_path / 'pred_maps')) == 2
    assert len(os.listdir(tmp_path / 'painted' / 'vis_data' / 'vis_image')) == 2


def test_dist_train_then_dist_test_two_cpu_processes_gloo(tmp_path, coco_root):
    cfg = write_config(tmp_path / 'retinanet.py', 'pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py',
                       det_overrides(coco_root, batch_size=1), RETINANET)
    work = tmp_path / 'work'
    rc, out = run(['bash', osp.join(REPO, 'tools', 'dist_train.sh'), cfg, 2, '--work-dir', work,
                   '--cfg-options', 'train_cfg.val_interval=1'], tmp_path, timeout=300,
                  PYTHON=sys.executable, PORT=str(_free_port()))
    assert_ok(rc, out)
    assert 'Distributed training: True' in out
    # 4 annotated training images over 2 processes, 1 image each per step: 2 iterations.
    assert re.search(r'Epoch\(train\) \[1\]\[2/2\]', out), out[-3000:]
    # Validation ran distributed too (results gathered over gloo) and printed COCO's table.
    assert COCO_AP_LINE in out
    assert (work / 'epoch_1.pth').is_file()
    assert last_scalars(work)['iter'] == 2
    # the checkpoint evaluated by 2 processes through dist_test.sh
    rc, out = run(['bash', osp.join(REPO, 'tools', 'dist_test.sh'), cfg, work / 'epoch_1.pth', 2,
                   '--work-dir', tmp_path / 'test'], tmp_path, timeout=300,
                  PYTHON=sys.executable, PORT=str(_free_port()))
    assert rc == 0, out[-4000:]
    assert COCO_AP_LINE in out


CLASSIFIER_OVERRIDES = """
data_root = {root!r}
train_dataloader = dict(batch_size=2, num_workers=0, persistent_workers=False,
                        dataset=dict(data_root=data_root))
val_dataloader = dict(batch_size=4, num_workers=0, dataset=dict(data_root=data_root))
test_dataloader = val_dataloader
train_cfg = dict(max_iters=2, val_interval=2)
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=2))
log_processor = dict(window_size=1)
"""


def test_classifier_dist_train_then_top1_with_test_tool(tmp_path):
    """An mmpretrain ImageClassifier on PVT-Tiny-DTN (the demo's pretraining config, default_scope
    mmpretrain): 2 iterations on 2 gloo processes through dist_train.sh, then tools/test.py
    reports mmpretrain's top-1 accuracy and dumps the predictions."""
    root = generate_shape_crops(tmp_path / 'crops', shapes=dict(num_train=4, num_val=2, seed=5),
                                crop_size=32, progress=False)['root']
    cfg = write_config(tmp_path / 'classifier.py', 'demo/classifier_pvt_tiny_dtn_shape_crops.py',
                       CLASSIFIER_OVERRIDES.format(root=root))
    work = tmp_path / 'work'
    rc, out = run(['bash', osp.join(REPO, 'tools', 'dist_train.sh'), cfg, 2, '--work-dir', work],
                  tmp_path, timeout=300, PYTHON=sys.executable, PORT=str(_free_port()))
    assert_ok(rc, out)
    assert 'Distributed training: True' in out and 'Iter(train) [2/2]' in out
    assert re.search(r'Iter\(val\) .*accuracy/top1: [0-9.]+', out), out[-3000:]
    rc, out = run([sys.executable, TEST, cfg, work / 'iter_2.pth', '--work-dir',
                   tmp_path / 'test', '--out', tmp_path / 'preds.pkl'], tmp_path)
    assert rc == 0, out[-4000:]
    top1 = float(re.search(r'Iter\(test\) .*accuracy/top1: ([0-9.]+)', out).group(1))
    assert 0 <= top1 <= 100
    assert (tmp_path / 'preds.pkl').is_file()


FAKE_SRUN = """#!{python}
# Stand-in for slurm's srun: records its options, then starts --ntasks copies of the command with
# the variables slurm sets for every task, and exits with the worst return code.
import json, os, subprocess, sys
argv, options, partition = sys.argv[1:], [], None
while argv[0].startswith('-'):  # srun's options end at the command
    if argv[0] == '-p':
        partition, argv = argv[1], argv[2:]
    else:
        options, argv = options + [argv[0]], argv[1:]
ntasks = int(next(o for o in options if o.startswith('--ntasks=')).split('=')[1])
with open(os.environ['FAKE_SRUN_LOG'], 'w') as f:
    json.dump(dict(partition=partition, ntasks=ntasks, options=options, command=argv), f)
procs = [subprocess.Popen(argv, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i),
                                         SLURM_NTASKS=str(ntasks), SLURM_NODELIST='node1'))
         for i in range(ntasks)]
sys.exit(max(p.wait() for p in procs))
"""


def test_slurm_scripts_train_then_test_on_cpu_tasks(tmp_path, coco_root):
    """tools/slurm_train.sh and tools/slurm_test.sh through a stand-in srun (and scontrol) that
    starts the tasks as slurm would: 2 CPU tasks train with gloo, then evaluate the checkpoint."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    (bin_dir / 'srun').write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / 'scontrol').write_text('#!/bin/sh\necho 127.0.0.1\n')
    for name in ('srun', 'scontrol'):
        os.chmod(bin_dir / name, 0o755)
    env = dict(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", GPUS='2', GPUS_PER_NODE='0',
               CPUS_PER_TASK='1', PYTHON=sys.executable, FAKE_SRUN_LOG=str(tmp_path / 'srun.json'))
    cfg = write_config(tmp_path / 'retinanet.py', 'pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py',
                       det_overrides(coco_root, batch_size=1), RETINANET)
    work = tmp_path / 'work'
    rc, out = run(['bash', osp.join(REPO, 'tools', 'slurm_train.sh'), 'debug', 'dtn', cfg, work,
                   '--cfg-options', 'train_cfg.val_interval=1'], tmp_path, timeout=300,
                  MASTER_PORT=str(_free_port()), **env)
    assert_ok(rc, out)
    with open(tmp_path / 'srun.json') as f:
        call = json.load(f)
    assert call['partition'] == 'debug' and call['ntasks'] == 2
    assert '--job-name=dtn' in call['options'] and '--cpus-per-task=1' in call['options']
    assert not any(o.startswith('--gres') for o in call['options'])  # GPUS_PER_NODE=0: no GPU
    assert '--launcher=slurm' in call['command']
    assert 'Distributed training: True' in out
    # 4 annotated training images over 2 tasks, 1 image each per step: 2 iterations.
    assert re.search(r'Epoch\(train\) \[1\]\[2/2\]', out), out[-3000:]
    assert (work / 'epoch_1.pth').is_file()

    rc, out = run(['bash', osp.join(REPO, 'tools', 'slurm_test.sh'), 'debug', 'dtn-test', cfg,
                   work / 'epoch_1.pth', '--work-dir', tmp_path / 'test'], tmp_path, timeout=300,
                  MASTER_PORT=str(_free_port()), **env)
    assert rc == 0, out[-4000:]
    assert COCO_AP_LINE in out


def test_retinanet_killed_mid_epoch_resumes_then_coco_eval(tmp_path, coco_root):
    """RetinaNet PVT-Tiny-DTN: a training process killed mid-epoch resumes to the same iteration
    count with finite losses; tools/test.py then evaluates the final checkpoint with CocoMetric."""
    cfg = write_config(tmp_path / 'retinanet.py', 'pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py',
                       det_overrides(coco_root, batch_size=1, max_epochs=3, validate=False),
                       RETINANET)
    work = tmp_path / 'work'
    cmd = [sys.executable, TRAIN, str(cfg), '--work-dir', str(work)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env_for_subprocess(None, REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            # 4 iterations per epoch: stop the process in the middle of epoch 2.
            if re.search(r'Epoch\(train\) \[2\]\[2/4\]', line):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.wait(timeout=60)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, ''.join(seen)[-3000:]
    assert (work / 'epoch_1.pth').is_file() and not (work / 'epoch_2.pth').exists()

    rc, out = run(cmd + ['--resume'], tmp_path)
    assert_ok(rc, out)
    assert 'resumed epoch: 1, iter: 4' in out, out[-3000:]
    assert re.search(r'Epoch\(train\) \[3\]\[4/4\]', out)
    # The same iteration count as an uninterrupted run: 3 epochs x 4 iterations.
    assert last_scalars(work)['iter'] == 12
    ckpt = work / 'epoch_3.pth'
    assert ckpt.is_file()

    rc, out = run([sys.executable, TEST, cfg, ckpt, '--work-dir', tmp_path / 'test',
                   '--out', tmp_path / 'preds.pkl', '--show-dir', 'painted'], tmp_path)
    assert rc == 0, out[-4000:]
    assert COCO_AP_LINE in out and 'coco/bbox_mAP:' in out
    assert (tmp_path / 'preds.pkl').is_file()
    painted = [f for d, _, fs in os.walk(tmp_path / 'test') for f in fs if f.endswith('.jpg')]
    assert len(painted) == 3  # every val image, the one without annotations included


def test_setup_distributed_cpu_gloo(monkeypatch):
    """On CPU, a 'pytorch' launch gets a gloo group and the device-free DDP wrapper."""
    cfg = Config(dict(env_cfg=dict(dist_cfg=dict(backend='nccl')), find_unused_parameters=True))
    setup_distributed(cfg, 'none')
    assert cfg.launcher == 'none' and 'model_wrapper_cfg' not in cfg
    if torch.cuda.is_available():
        pytest.skip('the CPU path is only taken without CUDA')
    for k, v in dict(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',
                     MASTER_PORT=str(_free_port())).items():
        monkeypatch.setenv(k, v)
    try:
        setup_distributed(cfg, 'pytorch')
        assert torch.distributed.get_backend() == 'gloo'
        assert cfg.env_cfg.dist_cfg.backend == 'gloo'
        assert cfg.model_wrapper_cfg == dict(type='CPUDistributedDataParallel',
                                             broadcast_buffers=False, find_unused_parameters=True)
        init_cpu_process_group('pytorch')  # idempotent
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.SyncBatchNorm(4), nn.ReLU())
        ddp = CPUDistributedDataParallel(model, device_ids=[0])
        assert not any(isinstance(m, nn.SyncBatchNorm) for m in ddp.modules())
        ddp(torch.randn(2, 3, 8, 8)).sum().backward()
        assert all(p.grad is not None for p in ddp.parameters())
    finally:
        close_distributed()
    assert not torch.distributed.is_initialized()
    close_distributed()  # without a group: nothing to do


EXIT_SCRIPT = """
import atexit, sys
import torch, torch.distributed as dist
from mmdtn.engine import close_distributed, exit_process, init_cpu_process_group

class Finalized:
    def __del__(self):
        print('finalized')

finalized = Finalized()
atexit.register(print, 'exit functions ran')
if sys.argv[1] == 'gloo':
    init_cpu_process_group('pytorch')
    t = torch.ones(3)
    dist.broadcast(t, 0)
    dist.all_reduce(t)
    close_distributed()
sys.stdout.write('buffered output')
exit_process(3)
"""


@pytest.mark.parametrize('group', ['gloo', 'none'])
def test_exit_process_after_gloo_skips_only_the_finalization(tmp_path, group):
    """The tools end with exit_process: after a gloo group, the exit status, buffered output and
    exit functions are kept but the interpreter's finalization (where a gloo worker releasing a
    tensor aborts the process) is skipped; without one it is sys.exit."""
    script = tmp_path / 'exit.py'
    script.write_text(EXIT_SCRIPT)
    rc, out = run([sys.executable, script, group], tmp_path, RANK='0', WORLD_SIZE='1',
                  LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(_free_port()))
    assert rc == 3, out
    assert 'buffered output' in out and 'exit functions ran' in out, out
    assert ('finalized' in out) == (group == 'none'), out
