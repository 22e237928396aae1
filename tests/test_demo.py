"""The CPU demo: the synthetic shapes generator and a shortened ``tools/demo.py`` run.

The short run trains Mask R-CNN PVT-Tiny-DTN from scratch for 150 of the demo's 500 iterations
and must reach a bbox and segm AP that an untrained model cannot reach.
"""
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
from pycocotools.coco import COCO

from mmdtn.datasets.synthetic_shapes import SHAPE_CLASSES, ShapesSpec, generate_shapes_dataset

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SMALL = dict(num_train=6, num_val=3, image_size=(96, 64), seed=3)

# Measured on the demo's data (val split, 50 images), single thread:
#   untrained (1 iteration):  bbox AP 0.000, AP50 0.000; segm AP 0.000
#   150 iterations:           bbox AP 0.027, AP50 0.084; segm AP 0.051
# The floors leave a factor of about 2.5 for run-to-run (thread count, platform) differences.
SHORT_ITERS = 150
FLOORS = {'coco/bbox_mAP': 0.01, 'coco/bbox_mAP_50': 0.03, 'coco/segm_mAP': 0.02}


def read(path):
    with open(path, 'rb') as f:
        return f.read()


def test_generator_is_deterministic_and_idempotent(tmp_path):
    a = generate_shapes_dataset(tmp_path / 'a', progress=False, **SMALL)
    b = generate_shapes_dataset(tmp_path / 'b', progress=False, **SMALL)
    for split in ('train', 'val'):
        assert read(a[f'{split}_ann']) == read(b[f'{split}_ann'])
        n = SMALL[f'num_{split}']
        for i in range(n):
            name = f'{i:06d}.png'
            image_a, image_b = osp.join(a[f'{split}_img'], name), osp.join(b[f'{split}_img'], name)
            assert read(image_a) == read(image_b)
    # a second call with the same settings reuses the files untouched
    mtime = os.stat(a['train_ann']).st_mtime_ns
    generate_shapes_dataset(tmp_path / 'a', progress=False, **SMALL)
    assert os.stat(a['train_ann']).st_mtime_ns == mtime
    # other settings rewrite the set; a different seed gives different data
    generate_shapes_dataset(tmp_path / 'a', progress=False, **dict(SMALL, seed=4))
    assert read(a['train_ann']) != read(b['train_ann'])
    # an incomplete set (a missing image) is regenerated
    os.remove(osp.join(b['val_img'], '000001.png'))
    generate_shapes_dataset(tmp_path / 'b', progress=False, **SMALL)
    assert osp.isfile(osp.join(b['val_img'], '000001.png'))


def test_generator_writes_valid_coco_with_masks_matching_boxes(tmp_path):
    info = generate_shapes_dataset(tmp_path, progress=False, **SMALL)
    coco = COCO(info['train_ann'])
    assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(SHAPE_CLASSES)
    assert len(coco.getImgIds()) == SMALL['num_train']
    spec = ShapesSpec(**SMALL)
    for img_id in coco.getImgIds():
        img = coco.loadImgs(img_id)[0]
        assert (img['width'], img['height']) == spec.image_size
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        assert spec.min_objects <= len(anns) <= spec.max_objects
        union = np.zeros((img['height'], img['width']), np.int32)
        for ann in anns:
            mask = coco.annToMask(ann)
            ys, xs = np.nonzero(mask)
            x, y, w, h = ann['bbox']
            # the rasterised mask lies within its box (pixel tolerance) and fills a fair part of it
            assert xs.min() >= x - 1 and xs.max() <= x + w + 1
            assert ys.min() >= y - 1 and ys.max() <= y + h + 1
            assert abs(mask.sum() - ann['area']) <= 0.25 * ann['area'] + 20
            union += mask
        assert union.max() <= 1  # occlusion-free: masks do not overlap


def test_generator_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match='max_size'):
        generate_shapes_dataset(tmp_path, progress=False, image_size=(32, 32), max_size=40)
    with pytest.raises(ValueError, match='min_objects'):
        generate_shapes_dataset(tmp_path, progress=False, min_objects=3, max_objects=2)


def test_short_demo_run_learns(tmp_path):
    work_dir = tmp_path / 'work'
    cmd = [sys.executable, 'tools/demo.py', '--iters', str(SHORT_ITERS),
           '--work-dir', str(work_dir),
           '--data-root', str(tmp_path / 'data'), '--num-vis', '2']
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(work_dir / 'metrics.json') as f:
        result = json.load(f)
    metrics = result['metrics']
    assert result['iters'] == SHORT_ITERS
    for key, floor in FLOORS.items():
        assert metrics[key] >= floor, (key, metrics)
    assert 'bbox' in proc.stdout and 'AP50' in proc.stdout  # the printed AP table
    drawn = sorted(os.listdir(work_dir / 'predictions'))
    assert len(drawn) == 2 and all(name.endswith('.png') for name in drawn)
    assert (work_dir / 'predictions.png').is_file() and (work_dir / 'losses.png').is_file()
