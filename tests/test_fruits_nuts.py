"""Mask R-CNN PVT-Tiny-DTN on real photographs: fruits_nuts (18 images, 3 classes, polygons).

The COCO config ``configs/pvt/mask-rcnn_pvt-t-dtn_fpn_1x_coco.py`` is pointed at a split of the
read-only dataset (images 0-13 train, 14-17 val; split files are written to a temporary folder),
trained for one short epoch from scratch with ``tools/train.py`` and evaluated with
``tools/test.py`` (mmdet's CocoMetric, bbox and segm), each as the user would run them.
"""
import glob
import json
import os
import os.path as osp
import re
import subprocess
import sys


ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
FRUITS = osp.normpath(osp.join(ROOT, '..', 'shared', 'data', 'fruits_nuts'))
CLASSES = ('date', 'fig', 'hazelnut')
TRAIN_IDS, VAL_IDS = range(0, 14), range(14, 18)

# The dataset lies beside the repository (shared/data/fruits_nuts); a missing copy fails the test.


def write_split(src, dst, image_ids):
    """A COCO file holding only ``image_ids`` of ``src`` and their annotations."""
    with open(src) as f:
        coco = json.load(f)
    keep = set(image_ids)
    out = dict(coco, images=[i for i in coco['images'] if i['id'] in keep],
               annotations=[a for a in coco['annotations'] if a['image_id'] in keep])
    with open(dst, 'w') as f:
        json.dump(out, f)
    return len(out['images']), len(out['annotations'])


CONFIG = """
_base_ = ['{base}']
data_root = '{data_root}/'
metainfo = dict(classes={classes})
scale = (320, 240)
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
model = dict(
    backbone=dict(init_cfg=None, dtn_init='paper'),
    roi_head=dict(bbox_head=dict(num_classes=3), mask_head=dict(num_classes=3)))
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, ann_file='{train_ann}',
                 data_prefix=dict(img='images/'), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo, ann_file='{val_ann}',
                 data_prefix=dict(img='images/'), pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file='{val_ann}', metric=['bbox', 'segm'])
test_evaluator = val_evaluator
train_cfg = dict(max_epochs=1, val_interval=2)
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end=7)]
default_hooks = dict(logger=dict(interval=1))
randomness = dict(seed=0)
"""


def run(cmd, cwd):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get('OMP_NUM_THREADS', '2'))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f'{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}'
    return proc.stdout + proc.stderr


def test_mask_rcnn_pvt_tiny_dtn_trains_and_evaluates_on_fruits_nuts(tmp_path):
    src = osp.join(FRUITS, 'trainval.json')
    n_train, a_train = write_split(src, tmp_path / 'train.json', TRAIN_IDS)
    n_val, a_val = write_split(src, tmp_path / 'val.json', VAL_IDS)
    assert (n_train, n_val) == (14, 4) and a_train > 0 and a_val > 0
    cfg_file = tmp_path / 'mask_rcnn_fruits_nuts.py'
    cfg_file.write_text(CONFIG.format(
        base=osp.join(ROOT, 'configs', 'pvt', 'mask-rcnn_pvt-t-dtn_fpn_1x_coco.py'),
        data_root=FRUITS, classes=CLASSES, train_ann=tmp_path / 'train.json',
        val_ann=tmp_path / 'val.json'))
    work_dir = tmp_path / 'work'

    out = run([sys.executable, 'tools/train.py', str(cfg_file), '--work-dir', str(work_dir)], ROOT)
    losses = [float(v) for v in re.findall(r'\bloss: ([-+0-9.eEnaif]+)', out)]
    assert len(losses) == 7, out[-3000:]  # 14 images, 2 per iteration, one epoch
    assert all(v == v and abs(v) < 1e4 for v in losses), losses
    ckpt = work_dir / 'epoch_1.pth'
    assert ckpt.is_file()

    out = run([sys.executable, 'tools/test.py', str(cfg_file), str(ckpt),
               '--work-dir', str(work_dir / 'test')], ROOT)
    logs = glob.glob(str(work_dir / 'test' / '*' / '*.json'))
    assert logs, out[-3000:]
    with open(sorted(logs)[-1]) as f:
        metrics = json.loads(f.read().strip().splitlines()[-1])
    for task in ('bbox', 'segm'):
        for key in ('mAP', 'mAP_50', 'mAP_75'):
            value = metrics[f'coco/{task}_{key}']
            assert 0.0 <= value <= 1.0, (task, key, value)
    # the standard COCO tables were printed for both tasks
    assert 'Evaluating bbox...' in out and 'Evaluating segm...' in out
    assert out.count('Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all') >= 2
