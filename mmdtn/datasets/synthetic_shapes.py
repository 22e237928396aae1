"""Synthetic shapes: a small, deterministic COCO-format instance-segmentation dataset.

The embedded data of the CPU demo (``tools/demo.py``): images of circles, squares, triangles and
stars with varied sizes, positions, rotations and colours on textured, noisy or gradient
backgrounds, with exact polygon masks. Nothing is downloaded; the same seed and settings always
produce the same files.

Layout written under ``root``::

    root/
      train/000000.png ...            val/000000.png ...
      annotations/instances_train.json, annotations/instances_val.json
      meta.json                       settings and file count (written last: marks the set complete)

Usage from the command line::

    python -m mmdtn.datasets.synthetic_shapes data/synthetic_shapes --num-train 400 --num-val 50
"""
import argparse
import json
import math
import os
import os.path as osp
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

__all__ = ['SHAPE_CLASSES', 'ShapesSpec', 'generate_shapes_dataset']

SHAPE_CLASSES = ('circle', 'square', 'triangle', 'star')
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShapesSpec:
    """Settings of a synthetic shapes dataset; equal settings give byte-identical annotations.

    Args:
        num_train, num_val: number of images in the two splits.
        image_size: (width, height) of every image.
        min_objects, max_objects: objects per image (inclusive range).
        min_size, max_size: object circumscribed diameter in pixels.
        seed: seed of the random generator (the val split uses its own stream).
    """
    num_train: int = 400
    num_val: int = 50
    image_size: tuple = (128, 128)
    min_objects: int = 1
    max_objects: int = 4
    min_size: int = 20
    max_size: int = 60
    seed: int = 0

    def __post_init__(self):
        if self.num_train < 1 or self.num_val < 1:
            raise ValueError(f'num_train and num_val must be >= 1, '
                             f'got {self.num_train}, {self.num_val}')
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(f'need 1 <= min_objects <= max_objects, '
                             f'got {self.min_objects}, {self.max_objects}')
        if not 4 <= self.min_size <= self.max_size < min(self.image_size):
            raise ValueError(f'need 4 <= min_size <= max_size < min(image_size), '
                             f'got {self.min_size}, '
                             f'{self.max_size}, image_size {tuple(self.image_size)}')


def _shape_polygon(cls_name, cx, cy, radius, angle, rng):
    """Vertices (K, 2) of one shape of circumradius ``radius`` centred at (cx, cy)."""
    if cls_name == 'circle':
        k = max(16, int(radius * 1.5))
        t = np.linspace(0, 2 * math.pi, k, endpoint=False)
        r = np.full(k, radius)
    elif cls_name == 'square':
        t = angle + np.arange(4) * math.pi / 2
        r = np.full(4, radius)
    elif cls_name == 'triangle':
        t = angle + np.arange(3) * 2 * math.pi / 3 + rng.uniform(-0.25, 0.25, 3)
        r = np.full(3, radius)
    elif cls_name == 'star':
        t = angle + np.arange(10) * math.pi / 5
        r = np.where(np.arange(10) % 2 == 0, radius, radius * rng.uniform(0.38, 0.5))
    else:
        raise ValueError(f'unknown shape class {cls_name!r}, expected one of {SHAPE_CLASSES}')
    return np.stack([cx + r * np.cos(t), cy + r * np.sin(t)], axis=1)


def _background(rng, width, height):
    """A float32 (H, W, 3) background in [0, 255]: noise, gradient, stripes or blurred blobs."""
    kind = rng.integers(4)
    c0 = rng.uniform(0, 255, 3)
    c1 = np.clip(c0 + rng.normal(0, 50, 3), 0, 255)  # second colour of gradients and stripes
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    if kind == 0:  # flat colour with pixel noise
        img = np.broadcast_to(c0, (height, width, 3)) + rng.normal(0, 15, (height, width, 3))
    elif kind == 1:  # linear gradient in a random direction
        a = rng.uniform(0, 2 * math.pi)
        t = (xx * math.cos(a) + yy * math.sin(a))
        t = (t - t.min()) / max(float(t.max() - t.min()), 1e-6)
        img = c0 + (c1 - c0) * t[..., None]
    elif kind == 2:  # soft stripes
        a, period = rng.uniform(0, math.pi), rng.uniform(6, 24)
        t = 0.5 + 0.5 * np.sin(2 * math.pi * (xx * math.cos(a) + yy * math.sin(a)) / period)
        img = c0 + (c1 - c0) * t[..., None]
    else:  # blurred random blobs around c0
        small = rng.uniform(0, 255, (max(2, height // 16), max(2, width // 16), 3)).astype(np.uint8)
        img = np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), np.float32)
        img = 0.3 * img + 0.7 * c0
    return np.asarray(img, np.float32)


def _distinct_colour(rng, bg_mean, min_dist=100.0):
    """A random RGB colour at least ``min_dist`` away from the local background colour."""
    for _ in range(100):
        c = rng.uniform(0, 255, 3)
        if np.linalg.norm(c - bg_mean) >= min_dist:
            return c
    return 255.0 - bg_mean  # the complement is always far enough for the demo's purposes


def _make_image(rng, spec):
    """One image and its objects: list of (class index, polygon (K, 2))."""
    width, height = spec.image_size
    img = _background(rng, width, height)
    num = int(rng.integers(spec.min_objects, spec.max_objects + 1))
    placed = []  # (cx, cy, radius)
    objects = []
    for _ in range(num):
        for _attempt in range(50):
            radius = rng.uniform(spec.min_size, spec.max_size) / 2
            cx = rng.uniform(radius + 1, width - radius - 1)
            cy = rng.uniform(radius + 1, height - radius - 1)
            # occlusion-free: circumscribed circles do not touch
            if all(math.hypot(cx - px, cy - py) > radius + pr + 2 for px, py, pr in placed):
                break
        else:
            continue
        placed.append((cx, cy, radius))
        label = int(rng.integers(len(SHAPE_CLASSES)))
        angle = rng.uniform(0, 2 * math.pi)
        poly = _shape_polygon(SHAPE_CLASSES[label], cx, cy, radius, angle, rng)
        objects.append((label, poly))

    canvas = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    for label, poly in objects:
        mask = Image.new('L', (width, height), 0)
        ImageDraw.Draw(mask).polygon([tuple(p) for p in poly.tolist()], fill=255)
        m = np.asarray(mask) > 0
        colour = _distinct_colour(rng, img[m].mean(axis=0) if m.any() else img.mean(axis=(0, 1)))
        shade = rng.uniform(0.8, 1.0)  # mild brightness variation across objects
        fill = tuple(int(v) for v in np.clip(colour * shade, 0, 255))
        ImageDraw.Draw(canvas).polygon([tuple(p) for p in poly.tolist()], fill=fill)
    canvas = canvas.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0, 0.6))))
    noisy = np.asarray(canvas, np.float32) + rng.normal(0, rng.uniform(2, 8), (height, width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)), objects


def _coco_annotations(objects, image_id, first_ann_id, width, height):
    """COCO annotation dicts (polygon segmentation, xywh bbox, polygon area) of one image."""
    anns = []
    for k, (label, poly) in enumerate(objects):
        poly = np.clip(poly, 0, [width, height])
        x0, y0 = poly.min(axis=0)
        x1, y1 = poly.max(axis=0)
        px, py = poly[:, 0], poly[:, 1]
        area = 0.5 * abs(float(np.dot(px, np.roll(py, 1)) - np.dot(py, np.roll(px, 1))))
        anns.append(dict(
            id=first_ann_id + k, image_id=image_id, category_id=label + 1,
            segmentation=[[round(float(v), 2) for v in poly.reshape(-1)]],
            area=round(area, 2), bbox=[round(float(v), 2) for v in (x0, y0, x1 - x0, y1 - y0)],
            iscrowd=0))
    return anns


def _meta(spec):
    return dict(format_version=FORMAT_VERSION, classes=list(SHAPE_CLASSES), **asdict(spec),
                files={'train': spec.num_train, 'val': spec.num_val})


def _is_complete(root, spec):
    meta_file = osp.join(root, 'meta.json')
    if not osp.isfile(meta_file):
        return False
    try:
        with open(meta_file) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    if json.loads(json.dumps(_meta(spec))) != meta:
        return False
    for split, n in (('train', spec.num_train), ('val', spec.num_val)):
        if not osp.isfile(osp.join(root, 'annotations', f'instances_{split}.json')):
            return False
        if any(not osp.isfile(osp.join(root, split, f'{i:06d}.png')) for i in range(n)):
            return False
    return True


def generate_shapes_dataset(root, spec=None, progress=True, **kwargs):
    """Write the dataset described by ``spec`` (or ``ShapesSpec(**kwargs)``) under ``root``.

    Idempotent: if ``root`` already holds a complete dataset with the same settings it is reused
    as is; otherwise it is (re)written. Returns a dict with ``root``, ``classes`` and, per split,
    the annotation file and image folder (``train_ann``, ``train_img``, ``val_ann``, ``val_img``).
    """
    if spec is None:
        spec = ShapesSpec(**kwargs)
    elif kwargs:
        raise ValueError(f'pass either spec or keyword settings, not both (got {sorted(kwargs)})')
    root = osp.abspath(root)
    info = dict(root=root, classes=SHAPE_CLASSES)
    for split in ('train', 'val'):
        info[f'{split}_ann'] = osp.join(root, 'annotations', f'instances_{split}.json')
        info[f'{split}_img'] = osp.join(root, split) + os.sep
    if _is_complete(root, spec):
        return info

    if osp.exists(osp.join(root, 'meta.json')):
        os.remove(osp.join(root, 'meta.json'))  # settings changed or incomplete: rewrite
    os.makedirs(osp.join(root, 'annotations'), exist_ok=True)
    width, height = spec.image_size
    categories = [dict(id=i + 1, name=n, supercategory='shape')
                  for i, n in enumerate(SHAPE_CLASSES)]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=spec.num_train + spec.num_val, desc=f'generating shapes in {root}',
                   unit='img', leave=False)
    for split_idx, (split, n) in enumerate((('train', spec.num_train), ('val', spec.num_val))):
        rng = np.random.default_rng([spec.seed, split_idx])
        os.makedirs(osp.join(root, split), exist_ok=True)
        images, annotations = [], []
        for i in range(n):
            img, objects = _make_image(rng, spec)
            file_name = f'{i:06d}.png'
            img.save(osp.join(root, split, file_name))
            images.append(dict(id=i, file_name=file_name, width=width, height=height))
            annotations += _coco_annotations(objects, i, len(annotations) + 1, width, height)
            if bar is not None:
                bar.update()
        coco = dict(info=dict(description=f'mmdtn synthetic shapes ({split})'), images=images,
                    annotations=annotations, categories=categories)
        tmp = info[f'{split}_ann'] + '.tmp'
        with open(tmp, 'w') as f:
            json.dump(coco, f)
        os.replace(tmp, info[f'{split}_ann'])
    if bar is not None:
        bar.close()
    with open(osp.join(root, 'meta.json'), 'w') as f:
        json.dump(_meta(spec), f, indent=1)
    return info


def main(argv=None):
    """Command-line entry: write (or reuse) a synthetic shapes dataset."""
    default = ShapesSpec()
    parser = argparse.ArgumentParser(description='Generate the synthetic shapes COCO dataset.')
    parser.add_argument('root', help='output folder')
    parser.add_argument('--num-train', type=int, default=default.num_train)
    parser.add_argument('--num-val', type=int, default=default.num_val)
    parser.add_argument('--image-size', type=int, nargs=2, default=list(default.image_size),
                        metavar=('W', 'H'))
    parser.add_argument('--seed', type=int, default=default.seed)
    args = parser.parse_args(argv)
    info = generate_shapes_dataset(args.root, num_train=args.num_train, num_val=args.num_val,
                                   image_size=tuple(args.image_size), seed=args.seed)
    print(json.dumps(info, indent=1))


if __name__ == '__main__':
    main()
