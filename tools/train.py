"""Train a detector (mmdet), a segmentor (mmseg) or an image classifier (mmpretrain) from a config;
its default_scope decides which.

    python tools/train.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py [--work-dir DIR]
        [--resume [CKPT]] [--amp] [--auto-scale-lr] [--cfg-options KEY=VALUE ...]
        [--launcher none|pytorch|slurm]

Multi-process runs: tools/dist_train.sh (torchrun) and tools/slurm_train.sh (srun); on a machine
without CUDA they use the gloo backend (see mmdtn/engine/distributed.py). The datasets the config
uses are checked before anything is built, so a missing dataset stops with a message naming the
expected paths (see mmdtn/datasets/checks.py).
"""
import os.path as osp
import sys

import mmdtn  # noqa: F401  (first: registers mmdtn's modules, weights_only checkpoint loading)
import torch

from mmdtn.engine import exit_process
from mmdtn.engine.cli import config_of, fail, parse_args, tool_parser
from mmdtn.engine.runner import build_runner, run


def parse_train_args(argv=None):
    parser = tool_parser('Train a detector (mmdet), segmentor (mmseg) or image classifier '
                         '(mmpretrain) with mmdtn backbones',
                         'train config file path', 'the dir to save logs and models')
    parser.add_argument(
        '--resume', nargs='?', type=str, const='auto',
        help='resume from the given checkpoint, or, without a path, from the latest checkpoint '
        'in the work directory')
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision (CUDA only)')
    parser.add_argument(
        '--auto-scale-lr', action='store_true',
        help="scale the learning rate by (GPUs x batch size) / auto_scale_lr.base_batch_size")
    return parse_args(parser, argv)


def main(argv=None):
    args = parse_train_args(argv)
    cfg = config_of(args)

    if args.amp:
        if not torch.cuda.is_available():
            fail('--amp needs a GPU: mmengine\'s AmpOptimWrapper only runs on CUDA (or NPU/MLU); '
                 'train without --amp on this machine')
        if cfg.optim_wrapper.get('type', 'OptimWrapper') == 'AmpOptimWrapper':
            print('AMP training is already enabled in the config', file=sys.stderr)
        else:
            cfg.optim_wrapper.type = 'AmpOptimWrapper'
            cfg.optim_wrapper.loss_scale = 'dynamic'

    if args.auto_scale_lr:
        scale = cfg.get('auto_scale_lr')
        if not scale or 'base_batch_size' not in scale:
            fail('--auto-scale-lr: the config has no auto_scale_lr.base_batch_size')
        cfg.auto_scale_lr.enable = True

    # resume: a given checkpoint > the latest one in work_dir
    if args.resume == 'auto':
        cfg.resume = True
        cfg.load_from = None
    elif args.resume is not None:
        if '://' not in args.resume and not osp.isfile(args.resume):
            fail(f'--resume: checkpoint not found: {args.resume!r}')
        cfg.resume = True
        cfg.load_from = args.resume

    phases = ['train']
    if cfg.get('val_cfg') and cfg.get('val_dataloader') and cfg.get('val_evaluator'):
        phases.append('val')
    run(build_runner(cfg, args.launcher, phases), 'train')


if __name__ == '__main__':
    main()
    exit_process(0)
