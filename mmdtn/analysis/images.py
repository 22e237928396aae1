"""Images for the analyses: a folder (or one file) of photographs, or synthetic images.

Each image becomes a (1, 3, H, W) float tensor normalized with the config's
``model.data_preprocessor`` mean and std (ImageNet's when the config has none), in the channel order
the model was trained with.
"""
import os
import os.path as osp

import numpy as np
import torch
from PIL import Image

__all__ = ['IMAGE_EXTENSIONS', 'list_images', 'normalization', 'synthetic_images', 'to_tensor',
           'ImageSet']

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.tif', '.tiff', '.webp')
_IMAGENET_MEAN = (123.675, 116.28, 103.53)
_IMAGENET_STD = (58.395, 57.12, 57.375)


def list_images(path):
    """Sorted image files in the folder ``path`` (or ``[path]`` for one image file)."""
    if not osp.exists(path):
        raise FileNotFoundError(f'image folder or file not found: {path}')
    if osp.isfile(path):
        if not path.lower().endswith(IMAGE_EXTENSIONS):
            raise ValueError(f'{path} is not an image ({", ".join(IMAGE_EXTENSIONS)})')
        return [path]
    files = sorted(osp.join(path, f) for f in os.listdir(path)
                   if f.lower().endswith(IMAGE_EXTENSIONS))
    if not files:
        raise ValueError(f'no images ({", ".join(IMAGE_EXTENSIONS)}) in folder {path}')
    return files


def normalization(cfg):
    """``(mean, std, to_bgr)`` of the config's data preprocessor (RGB images are read)."""
    pre = (cfg.get('model', None) or {}).get('data_preprocessor', None) or {}
    mean = tuple(pre.get('mean', None) or _IMAGENET_MEAN)
    std = tuple(pre.get('std', None) or _IMAGENET_STD)
    # mmdet/mmseg read images as BGR and flip them to RGB only when bgr_to_rgb is set (mmengine's
    # default is False): without it the model was trained on BGR, with mean/std in BGR order.
    to_bgr = bool(pre) and not pre.get('bgr_to_rgb', False)
    return mean, std, to_bgr


def _resize(img, size, max_side):
    if size is not None:
        h, w = size
        return img.resize((int(w), int(h)), Image.BILINEAR)
    if max_side and max(img.size) > max_side:
        scale = max_side / max(img.size)
        return img.resize((max(1, round(img.size[0] * scale)), max(1, round(img.size[1] * scale))),
                          Image.BILINEAR)
    return img


def to_tensor(img, cfg, size=None, max_side=None):
    """PIL image -> normalized (1, 3, H, W) float tensor (optionally resized)."""
    mean, std, to_bgr = normalization(cfg)
    arr = np.asarray(_resize(img.convert('RGB'), size, max_side), dtype=np.float32)
    if to_bgr:
        arr = arr[..., ::-1]
    arr = (arr - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))[None]


def synthetic_images(num=2, size=(224, 224), seed=0):
    """Deterministic synthetic RGB images: smooth gradients with a few coloured shapes."""
    rng = np.random.default_rng(seed)
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    images = []
    for _ in range(num):
        c0, c1 = rng.uniform(0, 255, (2, 3))
        img = (c0 * (1 - xx[..., None]) + c1 * yy[..., None]).clip(0, 255)
        for _ in range(4):
            cy, cx = rng.uniform(0.15, 0.85, 2) * (h, w)
            r = rng.uniform(0.08, 0.2) * min(h, w)
            color = rng.uniform(0, 255, 3)
            if rng.uniform() < 0.5:
                inside = (yy * max(h, w) - cy) ** 2 + (xx * max(h, w) - cx) ** 2 < r ** 2
            else:
                inside = (abs(yy * max(h, w) - cy) < r) & (abs(xx * max(h, w) - cx) < r)
            img[inside] = color
        images.append(Image.fromarray(img.astype(np.uint8)))
    return images


class ImageSet:
    """The images at ``path`` (a folder or one file), read lazily; synthetic ones if it is None.

    Iterating yields ``(name, tensor)`` with a normalized (1, 3, H, W) tensor. ``size=(H, W)``
    resizes every image to that size; otherwise images keep their aspect ratio and are shrunk so
    that their longer side is at most ``max_side`` (None: original size).
    """

    def __init__(self, path, cfg, size=None, max_side=512, num_synthetic=2):
        self.cfg, self.size, self.max_side = cfg, size, max_side
        self.files = list_images(path) if path is not None else None
        self.synthetic = (None if path is not None else
                          synthetic_images(num_synthetic, size or (224, 224)))

    def __len__(self):
        return len(self.files) if self.files is not None else len(self.synthetic)

    def __iter__(self):
        if self.files is None:
            for i, img in enumerate(self.synthetic):
                yield f'synthetic_{i}', to_tensor(img, self.cfg, self.size, self.max_side)
            return
        for file in self.files:
            try:
                img = Image.open(file)
                img.load()
            except OSError as e:
                raise ValueError(f'cannot read image {file}: {e}') from e
            name = osp.splitext(osp.basename(file))[0]
            yield name, to_tensor(img, self.cfg, self.size, self.max_side)
