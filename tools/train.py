"""Train a detector (mmdet) or a segmentor (mmseg) from a config; its default_scope decides which.

    python tools/train.py configs/retinanet_pvt_tiny_dtn_1x.py [--work-dir DIR] [--resume [CKPT]]
        [--amp] [--auto-scale-lr] [--cfg-options KEY=VALUE ...] [--launcher none|pytorch|slurm]

Multi-process runs: tools/dist_train.sh (torchrun) and tools/slurm_train.sh (srun); on a machine
without CUDA they use the gloo backend (see mmdtn/engine/distributed.py). The datasets the config
uses are checked before anything is built, so a missing dataset stops with a message naming the
expected paths (see mmdtn/datasets/checks.py).
"""
import argparse
import os
import os.path as osp
import sys

import mmdtn  # noqa: F401  (first: registers mmdtn's modules, weights_only checkpoint loading)
import torch
from mmengine.config import Config, DictAction

from mmdtn.engine import close_distributed
from mmdtn.engine.runner import build_runner, fail


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description='Train a detector (mmdet) or segmentor (mmseg) with mmdtn backbones')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='the dir to save logs and models')
    parser.add_argument(
        '--resume', nargs='?', type=str, const='auto',
        help='resume from the given checkpoint, or, without a path, from the latest checkpoint '
        'in the work directory')
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision (CUDA only)')
    parser.add_argument(
        '--auto-scale-lr', action='store_true',
        help="scale the learning rate by (GPUs x batch size) / auto_scale_lr.base_batch_size")
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override settings of the config, key=value pairs, e.g. train_cfg.max_epochs=1; '
        'lists as key="[a,b]" or key=a,b (quotes needed, no white space)')
    parser.add_argument(
        '--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none',
        help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ:
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def main(argv=None):
    args = parse_args(argv)
    if not osp.isfile(args.config):
        fail(f'config file not found: {args.config!r}')
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    scope = cfg.get('default_scope')
    if scope == 'mmdet':
        from mmdet.registry import RUNNERS
        from mmdet.utils import setup_cache_size_limit_of_dynamo
        setup_cache_size_limit_of_dynamo()
    elif scope == 'mmseg':
        from mmseg.registry import RUNNERS
    else:
        fail(f"{args.config}: default_scope must be 'mmdet' or 'mmseg' (got {scope!r})")

    # work_dir: command line > config > ./work_dirs/<config name>
    if args.work_dir is not None:
        cfg.work_dir = args.work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = osp.join('./work_dirs', osp.splitext(osp.basename(args.config))[0])

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
    runner = build_runner(cfg, args.launcher, phases, RUNNERS)
    try:
        runner.train()
    finally:
        close_distributed()


if __name__ == '__main__':
    main()
