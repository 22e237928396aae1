"""CPU demo: train a PVT-Tiny-DTN detector from scratch on generated shapes, evaluate and draw.

Steps, all on CPU and with nothing to download:

1. write (or reuse) the synthetic shapes dataset (``mmdtn.datasets.synthetic_shapes``) with the
   settings of the config's ``shapes_spec``;
2. train Mask R-CNN (default) or RetinaNet with a PVT-Tiny-DTN backbone (``configs/demo/``) with
   mmengine's ``Runner``, exactly as ``tools/train.py`` would;
3. evaluate on the val split with mmdet's ``CocoMetric`` and print the COCO AP table;
4. draw the predicted boxes and masks of a few val images with mmdet's ``DetLocalVisualizer``.

With ``--pretrain``, the ImageNet-to-COCO route in small: the backbone is first pretrained as an
mmpretrain image classifier on crops of other generated shapes
(``configs/demo/classifier_pvt_tiny_dtn_shape_crops.py``, ``mmdtn.datasets.shape_crops``), then
the detector is trained twice for the same iterations, from scratch and from that checkpoint
(``init_cfg=dict(type='Pretrained', checkpoint=...)`` and the config's ``finetune`` recipe), and
the AP tables are printed together (``--pretrain only``: the pretrained start alone).

``--norm ln`` trains the LayerNorm twin (``configs/demo/*_ln_*.py``) instead of DTN, and
``--seed`` sets the seed of the training (the data stay the same);
``tools/demo_compare.py`` runs both over several seeds.

Usage::

    python tools/demo.py                       # Mask R-CNN: bbox and segm AP
    python tools/demo.py --model retinanet     # RetinaNet: bbox AP
    python tools/demo.py --iters 100 --work-dir /tmp/demo   # a shorter run
    python tools/demo.py --pretrain            # pretrained vs from scratch
    python tools/demo.py --norm ln --seed 1    # the LayerNorm twin, another seed

The metrics are also written to ``<work-dir>/metrics.json``. With ``--reuse``, a training whose
work dir holds the result of the same config (``result.json``) is not run again.
"""
import argparse
import copy
import json
import os
import os.path as osp
import time

from mmengine.config import DictAction

from mmdtn.engine.cli import add_cfg_options, load_config, set_work_dir
from mmdtn.engine.compile import prepare_compiled_training

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO_CONFIGS = osp.join(ROOT, 'configs', 'demo')
MODELS = ('mask_rcnn', 'retinanet')
NORMS = {'dtn': 'PVT-Tiny-DTN', 'ln': 'PVT-Tiny (LayerNorm)'}


def detector_config(model, norm='dtn'):
    """The demo config of ``model`` ('mask_rcnn' or 'retinanet') with ``norm`` ('dtn' or 'ln')."""
    return osp.join(DEMO_CONFIGS, f'{model}_pvt_tiny_{norm}_shapes.py')


def classifier_config(norm='dtn'):
    """The config of the backbone's pretraining with ``norm`` ('dtn' or 'ln')."""
    return osp.join(DEMO_CONFIGS, f'classifier_pvt_tiny_{norm}_shape_crops.py')


AP_KEYS = ('mAP', 'mAP_50', 'mAP_75', 'mAP_s', 'mAP_m', 'mAP_l')


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train and evaluate a PVT-Tiny-DTN detector on generated shapes, on CPU.')
    parser.add_argument('--model', choices=MODELS, default='mask_rcnn',
                        help='detector to train (default: mask_rcnn, which gives bbox and segm AP)')
    parser.add_argument('--norm', choices=sorted(NORMS), default='dtn',
                        help="the backbone's norm: dtn, or ln for its LayerNorm twin "
                        '(default: dtn)')
    parser.add_argument('--seed', type=int, default=None,
                        help="seed of the trainings (default: the config's randomness.seed)")
    parser.add_argument('--work-dir', default=None,
                        help='logs, checkpoint, metrics and drawings '
                        '(default: work_dirs/demo_<model>)')
    parser.add_argument('--data-root', default=osp.join(ROOT, 'data', 'synthetic_shapes'),
                        help='where the generated dataset is written or reused')
    parser.add_argument('--iters', type=int, default=None,
                        help="training iterations (default: the config's max_iters)")
    parser.add_argument('--num-vis', type=int, default=8, help='val images to draw predictions on')
    parser.add_argument('--score-thr', type=float, default=0.4,
                        help='score threshold of the drawings')
    parser.add_argument('--pretrain', nargs='?', const='both', choices=['both', 'only'],
                        help='pretrain the backbone as a classifier on generated shape crops, '
                        'then train the detector from it and from scratch and compare; '
                        '"--pretrain only": from it alone '
                        '(default work dir: work_dirs/demo_<model>_pretrain)')
    parser.add_argument('--pretrain-iters', type=int, default=None,
                        help="classifier iterations (default: the classifier config's max_iters)")
    parser.add_argument('--pretrain-data-root', default=osp.join(ROOT, 'data', 'shape_crops'),
                        help='where the generated classification set is written or reused')
    parser.add_argument('--pretrain-cfg-options', nargs='+', action=DictAction,
                        metavar='KEY=VALUE', help="override settings of the classifier's config")
    parser.add_argument('--reuse', action='store_true',
                        help='do not train again where the work dir holds the result of the '
                        'same config')
    return add_cfg_options(parser).parse_args(argv)


def set_max_iters(cfg, iters):
    """Shorten or lengthen the demo schedule, keeping warm-up, decay and checkpoint consistent."""
    if iters < 1:
        raise ValueError(f'--iters must be >= 1, got {iters}')
    old = cfg.train_cfg.max_iters
    cfg.train_cfg.max_iters = iters
    cfg.train_cfg.val_interval = iters
    cfg.default_hooks.checkpoint.interval = iters
    for sched in cfg.param_scheduler:  # iteration-based: scale begin/end, keep each non-empty
        begin = min(iters - 1, round(sched.get('begin', 0) * iters / old))
        end = min(iters, max(begin + 1, round(sched.get('end', old) * iters / old)))
        sched['begin'], sched['end'] = begin, end


def build_config(args):
    """The demo config with the command-line settings applied."""
    cfg = load_config(detector_config(args.model, args.norm), args.cfg_options)
    if args.seed is not None:
        cfg.randomness.seed = args.seed
    data_root = osp.abspath(args.data_root) + os.sep
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = data_root
    for evaluator in ('val_evaluator', 'test_evaluator'):
        cfg[evaluator].ann_file = osp.join(data_root, 'annotations', 'instances_val.json')
    if args.iters is not None:
        set_max_iters(cfg, args.iters)
    name = (f'demo_{args.model}' + ('_ln' if args.norm == 'ln' else '') +
            ('_pretrain' if args.pretrain else ''))
    cfg.work_dir = osp.abspath(set_work_dir(cfg, args.work_dir,
                                            osp.join(ROOT, 'work_dirs', name)))
    # the final evaluation is run once, by runner.test() below, not also at the end of training
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    return cfg


def build_classifier_config(args, work_dir):
    """The config of the backbone's pretraining, with the command-line settings applied."""
    cfg = load_config(classifier_config(args.norm), args.pretrain_cfg_options)
    if args.seed is not None:
        cfg.randomness.seed = args.seed
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        cfg[loader].dataset.data_root = osp.abspath(args.pretrain_data_root)
    if args.pretrain_iters is not None:
        set_max_iters(cfg, args.pretrain_iters)
    cfg.work_dir = work_dir
    return cfg


def start_from(cfg, checkpoint, backbone_lr_mult):
    """A copy of the detector config whose backbone starts from a classifier ``checkpoint``
    (``init_cfg`` Pretrained: the backbone's weights, DTN's included; the head is dropped) and
    learns at ``backbone_lr_mult`` times the learning rate (the config's ``finetune`` recipe)."""
    cfg = copy.deepcopy(cfg)
    cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=checkpoint)
    # mmengine applies one matching key, the longest (ties: the first in sorted order). DTN's
    # no-decay keys (backbone parameters only) get the multiplier too and a leading '.', which
    # makes '.var_gate' and '.pos_coef' longer than 'backbone'.
    paramwise = cfg.optim_wrapper.setdefault('paramwise_cfg', {})
    keys = {'.' + key: dict(value, lr_mult=backbone_lr_mult)
            for key, value in paramwise.get('custom_keys', {}).items()}
    paramwise.custom_keys = dict(keys, backbone=dict(lr_mult=backbone_lr_mult))
    return cfg


def config_text(cfg):
    """The config as text without its work dir: what decides whether a result can be reused."""
    cfg = copy.deepcopy(cfg)
    cfg.work_dir = None
    return cfg.pretty_text


def reused_result(cfg, reuse):
    """The result stored in ``<work_dir>/result.json`` by a training of the same config, if
    ``reuse`` and there is one; else None."""
    path = osp.join(cfg.work_dir, 'result.json')
    if not reuse or not osp.isfile(path):
        return None
    with open(path) as f:
        stored = json.load(f)
    if stored.get('config') != config_text(cfg):
        return None
    print(f'reusing the result of the same config in {path}', flush=True)
    return stored['result']


def store_result(cfg, result):
    """Write ``result`` with the config it came from to ``<work_dir>/result.json``."""
    with open(osp.join(cfg.work_dir, 'result.json'), 'w') as f:
        json.dump(dict(result=result, config=config_text(cfg)), f, indent=1)


def format_table(results):
    """The COCO AP table (rows bbox / segm, columns AP, AP50, AP75, APs, APm, APl) as text.

    ``results``: the metrics of one run, or ``{run name: metrics}`` of runs shown together.
    """
    if not all(isinstance(v, dict) for v in results.values()):
        results = {'': results}
    header = ['', 'AP', 'AP50', 'AP75', 'APs', 'APm', 'APl']
    rows = []
    for task in ('bbox', 'segm'):
        for run, metrics in results.items():
            if f'coco/{task}_mAP' in metrics:
                values = [metrics[f'coco/{task}_{k}'] for k in AP_KEYS]  # -1: no such objects
                rows.append([f'{task}, {run}' if run else task] +
                            [f'{100 * v:.1f}' if v >= 0 else '-' for v in values])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = '+' + '+'.join('-' * (w + 2) for w in widths) + '+'
    fmt = lambda r: '| ' + ' | '.join(  # noqa: E731  (run names left, numbers right)
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + ' |'
    return '\n'.join([line, fmt(header), line, *map(fmt, rows), line])


def draw_predictions(runner, cfg, num_images, score_thr, upscale=4):
    """Draw predicted boxes and masks of the first ``num_images`` val images, enlarged ``upscale``x.

    Writes ``<work_dir>/predictions/<image>.png`` and an overview of all of them,
    ``<work_dir>/predictions.png``; returns the folder.
    """
    import mmcv
    import numpy as np
    import torch
    import torch.nn.functional as F
    from mmdet.apis import inference_detector
    from mmdet.visualization import DetLocalVisualizer
    from tqdm import tqdm

    out_dir = osp.join(cfg.work_dir, 'predictions')
    os.makedirs(out_dir, exist_ok=True)
    model = runner.model
    model.cfg = cfg
    model.eval()
    dataset = runner.test_dataloader.dataset
    visualizer = DetLocalVisualizer(name=f'demo_vis_{time.time_ns()}', line_width=2, alpha=0.5)
    visualizer.dataset_meta = dataset.metainfo
    n = min(num_images, len(dataset))
    drawn = []
    for idx in tqdm(range(n), desc='drawing predictions', unit='img'):
        info = dataset.get_data_info(idx)
        img = mmcv.imread(info['img_path'], channel_order='rgb')
        with torch.no_grad():
            sample = inference_detector(model, info['img_path'])
        big = mmcv.imrescale(img, upscale, interpolation='nearest')
        pred = sample.pred_instances
        pred = pred[pred.scores >= score_thr]
        pred.bboxes = pred.bboxes * upscale
        if 'masks' in pred:  # boolean (N, h, w) at the image's size: enlarge like the image
            size = big.shape[:2]
            pred.masks = (F.interpolate(pred.masks[:, None].float(), size=size)[:, 0] > 0.5
                          if len(pred) else pred.masks.new_zeros((0, *size)))
        sample.pred_instances = pred
        visualizer.add_datasample(
            osp.basename(info['img_path']), big, data_sample=sample, draw_gt=False, show=False,
            pred_score_thr=score_thr,
            out_file=osp.join(out_dir, osp.splitext(osp.basename(info['img_path']))[0] + '.png'))
        drawn.append(visualizer.get_image())
    if drawn:  # overview: up to 4 drawings per row
        cols = min(4, len(drawn))
        rows = [drawn[i:i + cols] for i in range(0, len(drawn), cols)]
        rows[-1] += [np.full_like(drawn[0], 255)] * (cols - len(rows[-1]))
        grid = np.concatenate([np.concatenate(r, axis=1) for r in rows], axis=0)
        mmcv.imwrite(mmcv.rgb2bgr(grid), osp.join(cfg.work_dir, 'predictions.png'))
    return out_dir


def plot_losses(runner, out_file):
    """Plot the logged training losses (``vis_data/scalars.json``) to a PNG; returns its path."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    scalars = osp.join(runner.log_dir, 'vis_data', 'scalars.json')
    if not osp.isfile(scalars):
        return None
    with open(scalars) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if 'loss' in r and 'iter' in r]
    if not records:
        return None
    keys = ['loss'] + sorted(k for k in records[0] if k.startswith('loss_'))
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in keys:
        ax.plot([r['iter'] for r in records], [r.get(key, float('nan')) for r in records],
                label=key, linewidth=2.0 if key == 'loss' else 1.0)
    ax.set_xlabel('iteration')
    ax.set_ylabel('loss')
    ax.set_yscale('log')
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title('training losses')
    fig.tight_layout()
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file


def train(cfg):
    """Build mmengine's Runner from ``cfg`` (as tools/train.py does) and train; returns it."""
    from mmengine.runner import Runner

    runner = Runner.from_cfg(cfg)
    # one line per DTN gate and positional coefficient (no weight decay) would flood the console
    runner.logger.addFilter(
        lambda record: not str(record.msg).startswith('paramwise_options -- '))
    prepare_compiled_training(runner)  # for compile=True (--cfg-options compile=True)
    runner.train()
    return runner


def pretrain_backbone(args, work_dir):
    """Pretrain the demo backbone as an image classifier on generated shape crops.

    Returns the classifier's ``checkpoint``, its training ``iters`` and its ``top1`` accuracy (%)
    on the crops' val split.
    """
    from mmdtn.datasets import check_datasets, generate_shape_crops

    cfg = build_classifier_config(args, work_dir)
    iters = cfg.train_cfg.max_iters
    checkpoint = osp.join(cfg.work_dir, f'iter_{iters}.pth')
    result = reused_result(cfg, args.reuse and osp.isfile(checkpoint))
    if result is None:
        generate_shape_crops(args.pretrain_data_root, **cfg.shape_crops_spec)
        check_datasets(cfg, ['train', 'val'])
        runner = train(cfg)
        result = dict(checkpoint=checkpoint, iters=iters,
                      top1=float(runner.message_hub.get_scalar('val/accuracy/top1').current()))
        store_result(cfg, result)
    return result


def train_and_test(cfg, reuse):
    """Train the detector of ``cfg`` and evaluate it on the val split, or reuse the stored result
    of the same config. Returns the COCO metrics and the runner (None where reused)."""
    metrics = reused_result(cfg, reuse)
    if metrics is not None:
        return metrics, None
    runner = train(cfg)
    plot_losses(runner, osp.join(cfg.work_dir, 'losses.png'))
    metrics = {k: float(v) for k, v in runner.test().items() if isinstance(v, (int, float))}
    store_result(cfg, metrics)
    return metrics, runner


def main(argv=None):
    args = parse_args(argv)
    start = time.time()
    import mmdtn  # noqa: F401  (registers mmdtn's modules; the configs also import it)
    from mmdtn.datasets import check_datasets, generate_shapes_dataset

    cfg = build_config(args)
    # the recipe of a pretrained start, for start_from(); not a setting of the training itself
    finetune = cfg.pop('finetune')
    iters, work_dir = cfg.train_cfg.max_iters, cfg.work_dir
    backbone = NORMS[args.norm]
    runs, minutes = {'from scratch': cfg}, {}
    starts = {None: 1, 'both': 2, 'only': 1}[args.pretrain]
    steps = 1 + bool(args.pretrain) + 2 * starts  # data, (pretraining), training, evaluation
    print(f'[1/{steps}] synthetic shapes dataset in {args.data_root}', flush=True)
    generate_shapes_dataset(args.data_root, **cfg.shapes_spec)
    check_datasets(cfg, ['train', 'test'])  # as tools/train.py and tools/test.py do
    if args.pretrain:
        print(f'[2/{steps}] pretraining the {backbone} backbone as an image classifier on '
              f'shape crops in {args.pretrain_data_root}', flush=True)
        phase_start = time.time()
        classifier = pretrain_backbone(args, osp.join(work_dir, 'classifier'))
        minutes['pretraining'] = (time.time() - phase_start) / 60
        runs = {'pretrained': start_from(cfg, classifier['checkpoint'], finetune.backbone_lr_mult)}
        if args.pretrain == 'both':
            runs = {'from scratch': cfg, **runs}
        for name, run_cfg in runs.items():
            run_cfg.work_dir = osp.join(work_dir, name.replace(' ', '_'))
    results, step, runner = {}, 2 + bool(args.pretrain), None
    for name, run_cfg in runs.items():
        print(f'[{step}/{steps}] training {args.model} with {backbone} {name} for {iters} '
              f'iterations (logs in {run_cfg.work_dir})', flush=True)
        phase_start = time.time()
        results[name], runner = train_and_test(run_cfg, args.reuse)
        print(f'[{step + 1}/{steps}] COCO evaluation on the val split', flush=True)
        minutes[name] = (time.time() - phase_start) / 60
        step += 2
    vis_dir = None
    if args.num_vis > 0 and runner is not None:
        print(f'drawing predictions of {args.num_vis} val images', flush=True)
        vis_dir = draw_predictions(runner, run_cfg, args.num_vis, args.score_thr)
    elapsed = time.time() - start
    record = dict(model=args.model, norm=args.norm, seed=cfg.randomness.seed, iters=iters,
                  seconds=round(elapsed, 1))
    if args.pretrain:
        record.update(pretrain_iters=classifier['iters'], pretrain_top1=classifier['top1'],
                      runs=results, minutes={k: round(v, 2) for k, v in minutes.items()})
    else:
        record.update(metrics=results['from scratch'])
    with open(osp.join(work_dir, 'metrics.json'), 'w') as f:
        json.dump(record, f, indent=1)
    if args.pretrain:
        print(f'\nbackbone pretrained as a classifier for {classifier["iters"]} iterations: '
              f'top-1 {classifier["top1"]:.1f}% on the shape crops val split')
    print(f'\nCOCO AP (%) of {args.model} {backbone} on synthetic shapes val, {iters} '
          f'iterations {" and ".join(runs)}:')
    if all(results.values()):
        print(format_table(results))
    else:  # CocoMetric found no detection above the model's test score threshold
        print(f'no detections in {[k for k, v in results.items() if not v]}: the model is not '
              'trained enough (try more --iters)')
    print(f'total time {elapsed / 60:.1f} min' +
          (' (' + ', '.join(f'{k} {v:.1f}' for k, v in minutes.items()) + ')'
           if args.pretrain else '') + f'; work dir {work_dir}')
    if vis_dir:
        print(f'predictions drawn in {vis_dir}')
    loss_png = osp.join(run_cfg.work_dir, 'losses.png')
    if osp.isfile(loss_png):
        print(f'loss curves plotted in {loss_png}')
    return results if args.pretrain else results['from scratch']


if __name__ == '__main__':
    main()
