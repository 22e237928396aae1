"""The command line shared by the analysis tools.

``TOOL CONFIG [CHECKPOINT] [--images DIR] [--out DIR] [--device DEVICE]``
"""
import argparse
import csv
import json
import os
import os.path as osp
import sys

import torch
from tqdm import tqdm

from .images import ImageSet
from .models import build_backbone, load_config, load_weights, require_dtn

__all__ = ['IMAGES_HELP', 'parser', 'add_images_args', 'add_compare_arg', 'models_of', 'parse',
           'torch_device', 'load_backbone', 'images_of', 'progress', 'write_csv', 'write_json',
           'write_results', 'main']

IMAGES_HELP = ('folder of images (or one image file) to analyze; without it two deterministic '
               'synthetic images are generated, enough to try the tool but not for conclusions')


def parser(tool, description, checkpoint_help='checkpoint (.pth) of the model, a whole detector/'
           'segmentor or its backbone; without it the backbone is randomly initialized',
           images=False, compare=False):
    """The common arguments; ``images``/``compare`` add :func:`add_images_args` and
    :func:`add_compare_arg`."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('config', help='mmdet/mmseg config whose model.backbone is analyzed')
    p.add_argument('checkpoint', nargs='?', default=None, help=checkpoint_help)
    p.add_argument('--out', default=osp.join('work_dirs', 'analysis', tool),
                   help='output folder for the figures (PNG) and numbers (CSV/JSON) '
                        '(default: %(default)s)')
    p.add_argument('--device', default='cpu',
                   help='torch device, e.g. cpu or cuda:0 (default: cpu)')
    p.add_argument('--pretrained', action='store_true',
                   help="start from the backbone's init_cfg (e.g. the config's ImageNet "
                        'checkpoint) instead of a random initialization; CHECKPOINT, if given, '
                        'is loaded on top')
    if images:
        add_images_args(p)
    if compare:
        add_compare_arg(p)
    return p


def add_images_args(p):
    p.add_argument('--images', default=None, help=IMAGES_HELP)
    p.add_argument('--size', type=int, nargs=2, metavar=('H', 'W'), default=None,
                   help='resize every image to H x W '
                        '(default: keep the aspect ratio, see --max-side)')
    p.add_argument('--max-side', type=int, default=512,
                   help='shrink images whose longer side exceeds this (default: %(default)s)')
    return p


def add_compare_arg(p, what='side by side'):
    p.add_argument('--compare', nargs='+', metavar='ARG', default=None,
                   help=f'a second model shown {what}: CONFIG2 [CHECKPOINT2], e.g. the LN twin of '
                        f'a DTN config')
    return p


def models_of(args):
    """``[(label, config, checkpoint)]`` of the model(s) named on the command line."""
    models = [(args.config, args.checkpoint)]
    compare = getattr(args, 'compare', None)
    if compare:
        if len(compare) > 2:
            raise ValueError(f'--compare takes CONFIG2 [CHECKPOINT2], got {len(compare)} values')
        models.append((compare[0], compare[1] if len(compare) > 1 else None))
    labels = [osp.splitext(osp.basename(c))[0] for c, _ in models]
    if len(labels) == 2 and labels[0] == labels[1]:
        labels = [f'{labels[0]}_a', f'{labels[1]}_b']
    return [(label, c, ck) for label, (c, ck) in zip(labels, models)]


def torch_device(device, threads=None):
    """``torch.device(device)``, refused if it is CUDA on a machine without; ``threads``, if given,
    sets torch's CPU threads."""
    if str(device).startswith('cuda') and not torch.cuda.is_available():
        raise ValueError(f'--device {device}: CUDA is not available on this machine')
    if threads:
        torch.set_num_threads(threads)
    return torch.device(device)


def parse(p, argv=None):
    """``(args, out)``: the parsed command line, with ``--device`` checked and ``--out`` created."""
    args = p.parse_args(argv)
    torch_device(args.device)
    os.makedirs(args.out, exist_ok=True)
    return args, args.out


def load_backbone(config, checkpoint=None, device='cpu', pretrained=False, dtn_for=None):
    """``(cfg, backbone)``: the config's backbone with the checkpoint's weights (if given).

    ``dtn_for`` names an analysis that needs DTN: a backbone without DTN layers is refused.
    """
    cfg = load_config(config)
    model = build_backbone(cfg, device, config_path=config, pretrained=pretrained)
    if dtn_for is not None:
        require_dtn(model, config, dtn_for)
    if checkpoint is not None:
        load_weights(model, checkpoint, config_path=config)
    model.eval()  # not chained: some backbones' train() returns None
    return cfg, model


def images_of(args, cfg):
    """The :class:`ImageSet` selected by ``--images``, ``--size`` and ``--max-side``."""
    return ImageSet(args.images, cfg, size=tuple(args.size) if args.size else None,
                    max_side=args.max_side)


def progress(iterable, desc, total=None):
    """tqdm progress bar on stderr."""
    return tqdm(iterable, desc=desc, total=total, dynamic_ncols=True, leave=False)


def write_csv(path, rows):
    """Write a list of dicts as CSV (columns from the first row)."""
    if not rows:
        raise ValueError(f'nothing to write to {path}')
    with open(path, 'w', newline='') as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path, obj):
    with open(path, 'w') as f:
        json.dump(obj, f, indent=1)
    return path


def write_results(out, name, rows, plot=None):
    """Write ``rows`` (a list of dicts) as ``<out>/<name>.csv`` and ``<out>/<name>.json`` and draw
    ``plot(rows, <out>/<name>.png)`` if given; says so and returns ``rows``."""
    write_csv(osp.join(out, f'{name}.csv'), rows)
    write_json(osp.join(out, f'{name}.json'), rows)
    if plot is not None:
        plot(rows, osp.join(out, f'{name}.png'))
    print(f'{name}: {len(rows)} rows written to {out}')
    return rows


def main(run, argv=None):
    """Run ``run(argv)``; bad input (ValueError, FileNotFoundError) ends with a one-line error."""
    try:
        with torch.no_grad():
            return run(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(2)
