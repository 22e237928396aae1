"""Resume and load_from of mmengine checkpoints with torch's weights_only unpickler still on."""
import copy
import json
import os.path as osp
import pickle
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import Runner, load_checkpoint

from mmengine.logging.history_buffer import HistoryBuffer

import mmdtn  # noqa: F401  (installs the allow-list)
from mmdtn.checkpoint import CheckpointSafetyError, restricted_getattr

FRUITS = osp.join(osp.dirname(__file__), '..', '..', 'shared', 'data', 'fruits_nuts')


def _tiny_retinanet_cfg(work_dir, ann_file, max_epochs):
    """RetinaNet with a narrow ResNet-18 on 4 real photographs at 128 px: a real mmdet
    training run."""
    base = osp.join(str(work_dir) + '_cfg.py')
    with open(base, 'w') as f:
        f.write("_base_ = 'mmdet::retinanet/retinanet_r18_fpn_1x_coco.py'\n")
    cfg = Config.fromfile(base)
    cfg.model.backbone.init_cfg = None
    cfg.model.backbone.base_channels = 8
    cfg.model.neck.in_channels = [8, 16, 32, 64]
    cfg.model.neck.out_channels = 16
    cfg.model.bbox_head.in_channels = 16
    cfg.model.bbox_head.feat_channels = 16
    cfg.model.bbox_head.stacked_convs = 1
    cfg.model.bbox_head.num_classes = 3
    pipeline = [
        dict(type='LoadImageFromFile'),
        dict(type='LoadAnnotations', with_bbox=True),
        dict(type='Resize', scale=(128, 128), keep_ratio=True),
        dict(type='PackDetInputs'),
    ]
    cfg.train_dataloader = dict(
        batch_size=2, num_workers=0, persistent_workers=False,
        sampler=dict(type='DefaultSampler', shuffle=True),
        batch_sampler=dict(type='AspectRatioBatchSampler'),
        dataset=dict(type='CocoDataset', data_root=FRUITS, ann_file=ann_file,
                     data_prefix=dict(img='images/'),
                     metainfo=dict(classes=('date', 'fig', 'hazelnut')),
                     filter_cfg=dict(filter_empty_gt=True), pipeline=pipeline))
    cfg.val_dataloader = cfg.val_evaluator = cfg.val_cfg = None
    cfg.test_dataloader = cfg.test_evaluator = cfg.test_cfg = None
    cfg.train_cfg = dict(type='EpochBasedTrainLoop', max_epochs=max_epochs, val_interval=100)
    cfg.param_scheduler = [dict(type='MultiStepLR', by_epoch=True, milestones=[1], gamma=0.1)]
    cfg.optim_wrapper = dict(type='OptimWrapper',
                             optimizer=dict(type='SGD', lr=0.001, momentum=0.9))
    cfg.default_hooks.checkpoint = dict(type='CheckpointHook', interval=1)
    cfg.default_hooks.logger = dict(type='LoggerHook', interval=1)
    cfg.default_hooks.visualization = dict(type='DetVisualizationHook')
    cfg.auto_scale_lr = dict(enable=False, base_batch_size=16)
    cfg.work_dir = str(work_dir)
    cfg.randomness = dict(seed=0)
    cfg.launcher = 'none'
    return cfg


@pytest.fixture
def four_image_ann(tmp_path):
    with open(osp.join(FRUITS, 'trainval.json')) as f:
        coco = json.load(f)
    ids = {img['id'] for img in coco['images'][:4]}
    coco['images'] = [img for img in coco['images'] if img['id'] in ids]
    coco['annotations'] = [a for a in coco['annotations'] if a['image_id'] in ids]
    ann = tmp_path / 'train4.json'
    ann.write_text(json.dumps(coco))
    return str(ann)


def test_resume_second_epoch_with_weights_only(tmp_path, four_image_ann):
    work_dir = tmp_path / 'work'
    runner = Runner.from_cfg(_tiny_retinanet_cfg(work_dir, four_image_ann, max_epochs=1))
    runner.train()
    ckpt = work_dir / 'epoch_1.pth'
    assert ckpt.is_file()
    first_state = copy.deepcopy(runner.model.state_dict())

    # The file really holds what made plain weights_only loading fail: HistoryBuffer and its
    # methods.
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(ckpt))
        with pytest.raises(pickle.UnpicklingError):  # what stock torch + mmengine do
            torch.load(str(ckpt), weights_only=True)
    finally:
        torch.serialization.add_safe_globals(allowed)
    assert any('HistoryBuffer' in g for g in unsafe), unsafe
    assert 'builtins.getattr' in unsafe
    print('globals beyond torch defaults:', unsafe)

    cfg = _tiny_retinanet_cfg(work_dir, four_image_ann, max_epochs=2)
    cfg.resume = True
    resumed = Runner.from_cfg(cfg)
    resumed.train()
    assert resumed.epoch == 2 and resumed.iter == 4
    assert (work_dir / 'epoch_2.pth').is_file()
    # The optimizer moved on from the resumed weights.
    assert any(not torch.equal(first_state[k], v) for k, v in resumed.model.state_dict().items())

    # A fresh interpreter (as tools/test.py or a resumed job) loads it too: nothing from training
    # (such as HistoryBuffer's lazily filled method table) may be needed.
    code = ('import mmdtn\n'
            'from mmengine.runner.checkpoint import _load_checkpoint\n'
            f'ckpt = _load_checkpoint({str(ckpt)!r}, map_location="cpu")\n'
            'print(ckpt["meta"]["epoch"], sorted(ckpt["message_hub"]["log_scalars"])[0])\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1].split()[0] == '1', out.stdout

    # load_from path and a direct mmengine load_checkpoint also work with weights_only on.
    loaded = load_checkpoint(resumed.model, str(work_dir / 'epoch_2.pth'), map_location='cpu')
    assert loaded['meta']['epoch'] == 2
    hub = loaded['message_hub']
    assert 'train/loss' in hub['log_scalars']


class _Payload:
    """An arbitrary class: any global outside the allow-list must be refused."""

    def __reduce__(self):
        return (print, ('this must never run',))


def test_checkpoint_with_foreign_global_is_refused(tmp_path):
    bad = tmp_path / 'crafted.pth'
    torch.save({'state_dict': {'w': torch.zeros(2)}, 'extra': _Payload()}, str(bad))
    with pytest.raises(CheckpointSafetyError, match='crafted.pth'):
        load_checkpoint(torch.nn.Linear(1, 1), str(bad), map_location='cpu')


class _GetattrEscape:
    """Tries to reach a callable through the allow-listed ``getattr``."""

    def __reduce__(self):
        # HistoryBuffer itself is allow-listed; its other attributes must stay out of reach.
        return (getattr, (HistoryBuffer, '__init__'))


def test_getattr_is_limited_to_history_buffer_methods(tmp_path):
    bad = tmp_path / 'getattr.pth'
    torch.save({'x': _GetattrEscape()}, str(bad))
    with pytest.raises(CheckpointSafetyError, match='getattr.pth'):
        load_checkpoint(torch.nn.Linear(1, 1), str(bad), map_location='cpu')
    with pytest.raises(pickle.UnpicklingError):
        restricted_getattr(torch, 'load')


def test_missing_checkpoint_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match='nope.pth'):
        load_checkpoint(torch.nn.Linear(1, 1), str(tmp_path / 'nope.pth'))
