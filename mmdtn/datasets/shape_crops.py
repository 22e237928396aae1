"""Shape crops: an image classification set cut from the synthetic shapes.

The embedded stand-in for ImageNet in the CPU demo's pretraining (``tools/demo.py --pretrain``):
every object of a synthetic shapes set (:mod:`.synthetic_shapes`, generated with its own seed, so
none of the detection demo's images) is cut out as a square around its box, with a random margin
of background (and at times part of a neighbouring shape) and a random offset, resized to
``crop_size`` and labelled with its shape. Nothing is downloaded; the same settings always give
the same files, in the folder layout mmpretrain's ``CustomDataset`` (and ``ImageNet``) reads::

    root/
      train/circle/000000_0.png ...   train/square/ ...   (one folder per class)
      val/circle/ ...
      source/                         the synthetic shapes the crops are cut from
      meta.json                       settings and crop counts (written last: the set is complete)
"""
import json
import os
import os.path as osp
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
from PIL import Image

from .synthetic_shapes import SHAPE_CLASSES, ShapesSpec, generate_shapes_dataset

__all__ = ['ShapeCropsSpec', 'generate_shape_crops']

FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShapeCropsSpec:
    """Settings of a shape crops set.

    Args:
        shapes: settings of the synthetic shapes the crops are cut from (a dict of
            :class:`~.synthetic_shapes.ShapesSpec` arguments); ``num_train`` / ``num_val`` count
            images, each of which gives ``min_objects`` to ``max_objects`` crops.
        crop_size: side of the square crops in pixels.
        margin: (min, max) of the context around a box, as a fraction of its longer side.
    """
    shapes: dict = field(default_factory=lambda: dict(num_train=1000, num_val=100, seed=1))
    crop_size: int = 64
    margin: tuple = (0.15, 0.6)

    def __post_init__(self):
        ShapesSpec(**self.shapes)  # checks the source settings
        if self.crop_size < 8:
            raise ValueError(f'crop_size must be >= 8, got {self.crop_size}')
        if not 0 <= self.margin[0] <= self.margin[1]:
            raise ValueError(f'need 0 <= margin[0] <= margin[1], got {tuple(self.margin)}')


def _crop_box(bbox, width, height, rng, margin):
    """A square (left, top, right, bottom) around a COCO ``bbox`` with a random margin and offset,
    moved inside the image where it fits."""
    x, y, w, h = bbox
    side = max(w, h) * (1 + rng.uniform(*margin))
    cx = x + w / 2 + rng.uniform(-0.5, 0.5) * (side - w) / 2
    cy = y + h / 2 + rng.uniform(-0.5, 0.5) * (side - h) / 2
    left = min(max(cx - side / 2, 0), max(width - side, 0))
    top = min(max(cy - side / 2, 0), max(height - side, 0))
    return tuple(int(round(v)) for v in (left, top, left + side, top + side))


def _meta(spec):
    return dict(format_version=FORMAT_VERSION, classes=list(SHAPE_CLASSES),
                **json.loads(json.dumps(asdict(spec))))


def _is_complete(root, spec):
    try:
        with open(osp.join(root, 'meta.json')) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return {k: v for k, v in meta.items() if k != 'crops'} == _meta(spec)


def generate_shape_crops(root, spec=None, progress=True, **kwargs):
    """Write the crops described by ``spec`` (or ``ShapeCropsSpec(**kwargs)``) under ``root``.

    Idempotent: a complete set with the same settings is reused as is. Returns a dict with
    ``root``, ``classes`` (in the order of mmpretrain's labels: its ``CustomDataset`` numbers the
    class folders in sorted order) and the crop folders ``train`` and ``val``.
    """
    if spec is None:
        spec = ShapeCropsSpec(**kwargs)
    elif kwargs:
        raise ValueError(f'pass either spec or keyword settings, not both (got {sorted(kwargs)})')
    root = osp.abspath(root)
    info = dict(root=root, classes=tuple(sorted(SHAPE_CLASSES)),
                **{split: osp.join(root, split) + os.sep for split in ('train', 'val')})
    if _is_complete(root, spec):
        return info
    if osp.exists(osp.join(root, 'meta.json')):
        os.remove(osp.join(root, 'meta.json'))
    source = generate_shapes_dataset(osp.join(root, 'source'), progress=progress, **spec.shapes)
    counts = {}
    for split_idx, split in enumerate(('train', 'val')):
        shutil.rmtree(info[split], ignore_errors=True)
        for name in SHAPE_CLASSES:
            os.makedirs(osp.join(info[split], name))
        with open(source[f'{split}_ann']) as f:
            coco = json.load(f)
        images = {img['id']: img for img in coco['images']}
        rng = np.random.default_rng([ShapesSpec(**spec.shapes).seed, split_idx, 1])
        crop_index = {}
        for ann in coco['annotations']:
            img = images[ann['image_id']]
            with Image.open(osp.join(source[f'{split}_img'], img['file_name'])) as im:
                box = _crop_box(ann['bbox'], img['width'], img['height'], rng, spec.margin)
                crop = im.convert('RGB').crop(box).resize((spec.crop_size, ) * 2,
                                                          Image.BILINEAR)
            k = crop_index[img['id']] = crop_index.get(img['id'], -1) + 1
            name = SHAPE_CLASSES[ann['category_id'] - 1]
            crop.save(osp.join(info[split], name, f'{img["id"]:06d}_{k}.png'))
        counts[split] = len(coco['annotations'])
    with open(osp.join(root, 'meta.json'), 'w') as f:
        json.dump(dict(_meta(spec), crops=counts), f, indent=1)
    return info
