"""Evaluate a checkpoint with the config's test evaluator: detection (mmdet), segmentation (mmseg),
image classification (mmpretrain).

    python tools/test.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py CHECKPOINT [--work-dir DIR]
        [--out FILE_OR_DIR] [--show] [--show-dir DIR] [--cfg-options KEY=VALUE ...]
        [--launcher none|pytorch|slurm] [--tta]

The config's evaluator prints the standard tables: COCO bbox / segm AP from mmdet's CocoMetric,
per-class IoU / Acc and mIoU from mmseg's IoUMetric, top-1 / top-5 accuracy from mmpretrain's
Accuracy. ``--out``: detection predictions are dumped to a .pkl file (mmdet's DumpDetResults),
classification predictions too (mmengine's DumpResults, as mmpretrain's tool); segmentation
predictions are written as PNG label maps into that directory (IoUMetric's output_dir).
``--show-dir``: painted predictions (detection: under work_dir/<timestamp>/, as mmdet;
segmentation: under that directory's vis_data/vis_image/; classification: in that directory, by
mmpretrain's VisualizationHook). ``--tta`` is for detection and segmentation.
"""
import os.path as osp
import warnings
from copy import deepcopy

import mmdtn  # noqa: F401  (first: registers mmdtn's modules, weights_only checkpoint loading)
from mmengine.config import ConfigDict

from mmdtn.engine import exit_process
from mmdtn.engine.cli import config_of, fail, parse_args, tool_parser
from mmdtn.engine.runner import build_runner, run


def parse_test_args(argv=None):
    parser = tool_parser('Test (and evaluate) a detector (mmdet), segmentor (mmseg) or image '
                         'classifier (mmpretrain)',
                         'test config file path', 'the directory to save the evaluation metrics')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument(
        '--out', type=str,
        help='detection, classification: dump predictions to this .pkl file; segmentation: '
        'write predicted label maps into this directory')
    parser.add_argument('--show', action='store_true', help='show prediction results')
    parser.add_argument('--show-dir', help='directory where painted images will be saved')
    parser.add_argument('--wait-time', type=float, default=2, help='the interval of show (s)')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation')
    return parse_args(parser, argv)


def _seg_visualization(cfg, args):
    """mmseg's way of turning on painted predictions (mmseg's tools/test.py), for every image.

    mmseg's SegVisualizationHook paints every 50th image by default; here every test image is
    painted, as mmdet's hook does.
    """
    hook = cfg.default_hooks.get('visualization')
    if hook is None:
        fail("--show/--show-dir need default_hooks.visualization (e.g. SegVisualizationHook)")
    hook['draw'] = True
    hook['interval'] = 1
    if args.show:
        hook['show'] = True
        hook['wait_time'] = args.wait_time
    if args.show_dir:
        cfg.visualizer['save_dir'] = args.show_dir
    return cfg


def _det_tta(cfg):
    """mmdet's default flip test-time augmentation, as in mmdet's tools/test.py."""
    if 'tta_model' not in cfg:
        warnings.warn('no tta_model in the config: using DetTTAModel with NMS 0.5')
        cfg.tta_model = dict(type='DetTTAModel',
                             tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5), max_per_img=100))
    if 'tta_pipeline' not in cfg:
        warnings.warn('no tta_pipeline in the config: using horizontal flip')
        test_data_cfg = cfg.test_dataloader.dataset
        while 'dataset' in test_data_cfg:
            test_data_cfg = test_data_cfg['dataset']
        cfg.tta_pipeline = deepcopy(test_data_cfg.pipeline)
        cfg.tta_pipeline[-1] = dict(
            type='TestTimeAug',
            transforms=[[dict(type='RandomFlip', prob=1.), dict(type='RandomFlip', prob=0.)],
                        [dict(type='PackDetInputs',
                              meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                         'scale_factor', 'flip', 'flip_direction'))]])
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
    return cfg


def _cls_options(cfg, args):
    """mmpretrain's --show/--show-dir (its VisualizationHook, every image) and --out check."""
    if args.tta:
        fail('--tta: test-time augmentation is offered for detection and segmentation configs')
    if args.out is not None and not args.out.endswith(('.pkl', '.pickle')):
        fail(f'--out must be a .pkl file for classification (got {args.out!r})')
    if args.show or args.show_dir:
        hook = cfg.default_hooks.get('visualization')
        if hook is None:
            fail('--show/--show-dir need default_hooks.visualization (VisualizationHook)')
        hook.update(enable=True, interval=1)
        if args.show:
            hook.update(show=True, wait_time=args.wait_time)
        if args.show_dir:
            hook['out_dir'] = args.show_dir
    return cfg


def main(argv=None):
    args = parse_test_args(argv)
    cfg = config_of(args)
    if '://' not in args.checkpoint and not osp.isfile(args.checkpoint):
        fail(f'checkpoint not found: {args.checkpoint!r}')
    cfg.load_from = args.checkpoint
    scope = cfg.default_scope

    if scope == 'mmdet':
        from mmdet.engine.hooks.utils import trigger_visualization_hook
        if args.show or args.show_dir:
            cfg = trigger_visualization_hook(cfg, args)
        if args.tta:
            cfg = _det_tta(cfg)
        if args.out is not None and not args.out.endswith(('.pkl', '.pickle')):
            fail(f'--out must be a .pkl file for detection (got {args.out!r})')
    elif scope == 'mmpretrain':
        cfg = _cls_options(cfg, args)
    else:
        if args.show or args.show_dir:
            cfg = _seg_visualization(cfg, args)
        if args.tta:
            cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline
            cfg.tta_model.module = cfg.model
            cfg.model = cfg.tta_model
        if args.out is not None:
            cfg.test_evaluator['output_dir'] = args.out
            cfg.test_evaluator['keep_results'] = True

    runner = build_runner(cfg, args.launcher, ['test'])
    if scope == 'mmdet' and args.out is not None:
        from mmdet.evaluation import DumpDetResults
        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    elif scope == 'mmpretrain' and args.out is not None:
        from mmengine.evaluator import DumpResults
        runner.test_evaluator.metrics.append(DumpResults(out_file_path=args.out))
    run(runner, 'test')


if __name__ == '__main__':
    main()
    exit_process(0)
