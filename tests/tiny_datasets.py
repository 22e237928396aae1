"""Tiny deterministic datasets written into a test's tmp directory, and configs that use them.

- :func:`make_coco`: COCO-format instance segmentation (squares and discs with polygon masks),
  optionally with an image without annotations and a crowd annotation in uncompressed RLE (as in
  COCO's own files).
- :func:`make_seg`: an mmseg-style semantic segmentation set (images/ and annotations/ folders).
- :func:`write_config`: a config file inheriting one of ``configs/`` with small inputs, a few
  iterations, no pretrained download and single-process data loading.
"""
import json
import os
import os.path as osp
from typing import Dict, List, Optional, Sequence

import numpy as np
from PIL import Image

CONFIGS = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs')
CLASSES = ('square', 'disc')


def _disc_polygon(cx, cy, r, n=16) -> List[float]:
    t = np.linspace(0, 2 * np.pi, n, endpoint=False)
    return [float(v) for xy in zip(cx + r * np.cos(t), cy + r * np.sin(t)) for v in xy]


def _rle_uncompressed(mask: np.ndarray) -> Dict:
    """COCO's uncompressed RLE (column-major run lengths starting with a run of zeros)."""
    flat = mask.T.reshape(-1).astype(np.uint8)
    counts, value, run = [], 0, 0
    for v in flat:
        if v == value:
            run += 1
        else:
            counts.append(run)
            value, run = v, 1
    counts.append(run)
    return {'counts': counts, 'size': [int(mask.shape[0]), int(mask.shape[1])]}


def make_coco(root: str, splits: Dict[str, int] = None, size=(96, 128), empty_image=False,
              crowd=False, seed=0) -> Dict[str, str]:
    """Write ``root/<split>/*.jpg`` and ``root/annotations/instances_<split>.json``.

    Each image holds 1-2 objects (a square and/or a disc) with polygon masks. ``empty_image`` adds
    one image per split without annotations; ``crowd`` adds an ``iscrowd=1`` object with an
    uncompressed-RLE mask to the first image of every split. Returns the annotation file paths.
    """
    splits = splits or {'train': 4, 'val': 2}
    rng = np.random.RandomState(seed)
    h, w = size
    os.makedirs(osp.join(root, 'annotations'), exist_ok=True)
    ann_files = {}
    for split, num in splits.items():
        os.makedirs(osp.join(root, split), exist_ok=True)
        images, anns = [], []
        for i in range(num + int(empty_image)):
            img = np.full((h, w, 3), rng.randint(0, 80, 3), np.uint8)
            name = f'{split}_{i:03d}.jpg'
            images.append(dict(id=i + 1, file_name=name, height=h, width=w))
            objects = [] if (empty_image and i == num) else ['square', 'disc'][:1 + i % 2]
            for k, kind in enumerate(objects):
                s = int(rng.randint(20, 34))
                x0 = int(rng.randint(2, w // 2 - s - 1)) + k * (w // 2)
                y0 = int(rng.randint(2, h - s - 16))  # the bottom strip is for the crowd
                colour = rng.randint(150, 256, 3)
                if kind == 'square':
                    img[y0:y0 + s, x0:x0 + s] = colour
                    poly = [x0, y0, x0 + s, y0, x0 + s, y0 + s, x0, y0 + s]
                    area = float(s * s)
                else:
                    r = s / 2
                    yy, xx = np.mgrid[:h, :w]
                    img[(xx - x0 - r) ** 2 + (yy - y0 - r) ** 2 <= r * r] = colour
                    poly = _disc_polygon(x0 + r, y0 + r, r)
                    area = float(np.pi * r * r)
                anns.append(dict(id=len(anns) + 1, image_id=i + 1,
                                 category_id=CLASSES.index(kind) + 1, bbox=[x0, y0, s, s],
                                 area=area, segmentation=[poly], iscrowd=0))
            if crowd and i == 0:
                mask = np.zeros((h, w), np.uint8)
                mask[h - 14:h - 2, 4:w - 4] = 1  # a strip of small 'squares' along the bottom
                img[mask.astype(bool)] = (200, 200, 60)
                anns.append(dict(id=len(anns) + 1, image_id=i + 1, category_id=1,
                                 bbox=[4, h - 14, w - 8, 12], area=float(mask.sum()),
                                 segmentation=_rle_uncompressed(mask), iscrowd=1))
            Image.fromarray(img).save(osp.join(root, split, name), quality=95)
        data = dict(images=images, annotations=anns,
                    categories=[dict(id=j + 1, name=c, supercategory='shape')
                                for j, c in enumerate(CLASSES)])
        ann_files[split] = osp.join(root, 'annotations', f'instances_{split}.json')
        with open(ann_files[split], 'w') as f:
            json.dump(data, f)
    return ann_files


def make_seg(root: str, splits: Dict[str, int] = None, size=(64, 80), seed=0) -> None:
    """Write ``root/images/<split>/*.jpg`` and label maps ``root/annotations/<split>/*.png``.

    Labels: 0 background, 1 square, 2 disc (mmseg's BaseSegDataset, reduce_zero_label=False).
    """
    splits = splits or {'training': 4, 'validation': 2}
    rng = np.random.RandomState(seed)
    h, w = size
    for split, num in splits.items():
        os.makedirs(osp.join(root, 'images', split), exist_ok=True)
        os.makedirs(osp.join(root, 'annotations', split), exist_ok=True)
        for i in range(num):
            img = np.full((h, w, 3), rng.randint(0, 80, 3), np.uint8)
            label = np.zeros((h, w), np.uint8)
            s = int(rng.randint(16, 26))
            x0, y0 = int(rng.randint(0, w // 2 - s)), int(rng.randint(0, h - s))
            img[y0:y0 + s, x0:x0 + s] = (220, 60, 60)
            label[y0:y0 + s, x0:x0 + s] = 1
            yy, xx = np.mgrid[:h, :w]
            cx, cy, r = int(rng.randint(w // 2 + 12, w - 12)), int(rng.randint(12, h - 12)), 10
            disc = (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
            img[disc] = (60, 60, 220)
            label[disc] = 2
            Image.fromarray(img).save(osp.join(root, 'images', split, f'{i:03d}.jpg'), quality=95)
            Image.fromarray(label).save(osp.join(root, 'annotations', split, f'{i:03d}.png'))


def det_overrides(data_root: str, img_scale=(128, 96), with_mask=False, max_epochs=1,
                  batch_size=2, train_split='train', val_split='val', validate=True) -> str:
    """Config text that points a detection config at a :func:`make_coco` set, small and short.

    ``validate=False`` turns off validation during training (the test loader stays).
    """
    data_root = osp.join(data_root, '')
    no_val = 'val_dataloader = None\nval_cfg = None\nval_evaluator = None\n' if not validate else ''
    ld = f"dict(type='LoadAnnotations', with_bbox=True, with_mask={with_mask})"
    return f"""
data_root = {data_root!r}
metainfo = dict(classes={CLASSES!r})
train_pipeline = [
    dict(type='LoadImageFromFile'), {ld},
    dict(type='Resize', scale={img_scale!r}, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5), dict(type='PackDetInputs')]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale={img_scale!r}, keep_ratio=True), {ld},
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                          'scale_factor'))]
train_dataloader = dict(
    batch_size={batch_size}, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_{train_split}.json',
                 data_prefix=dict(img='{train_split}/'), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_{val_split}.json',
                 data_prefix=dict(img='{val_split}/'), pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_{val_split}.json')
test_evaluator = val_evaluator
train_cfg = dict(max_epochs={max_epochs}, val_interval=1000)
default_hooks = dict(logger=dict(interval=1), visualization=dict(draw=False))
log_processor = dict(window_size=1)
env_cfg = dict(mp_cfg=dict(mp_start_method='fork', opencv_num_threads=1))
randomness = dict(seed=0)
""" + no_val


def write_config(path: str, base: str, overrides: str, model: Optional[str] = None) -> str:
    """Write a config inheriting ``configs/<base>`` plus ``overrides`` and a ``model`` override."""
    text = f"_base_ = {osp.join(CONFIGS, base)!r}\n" + overrides
    if model:
        text += f'model = {model}\n'
    with open(path, 'w') as f:
        f.write(text)
    return path


def first_lines_with(text: str, needle: str) -> List[str]:
    return [line for line in text.splitlines() if needle in line]


def env_for_subprocess(extra: Optional[Dict[str, str]] = None, repo: Optional[str] = None
                       ) -> Dict[str, str]:
    """The current environment with one CPU thread per process (the machine is shared)."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS='1', MKL_NUM_THREADS='1', CUDA_VISIBLE_DEVICES='')
    if repo:
        env['PYTHONPATH'] = repo + (os.pathsep + env['PYTHONPATH'] if env.get('PYTHONPATH') else '')
    env.update(extra or {})
    return env


def iter_config_files(root: str = CONFIGS) -> Sequence[str]:
    """Every config under ``configs/`` (recursively), except the ``_base_`` fragments."""
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != '_base_' and not x.startswith(('.', '__')))
        out += [osp.join(d, f) for f in sorted(files) if f.endswith('.py')]
    return sorted(out)
