"""The command line shared by ``tools/train.py``, ``tools/test.py`` and ``tools/demo.py``.

The arguments and rules of mmdet's, mmseg's and mmpretrain's own tools: a config file with
``--cfg-options`` merged into it, the work directory (command line > config >
``work_dirs/<config name>``), the launcher and the local rank that ``torch.distributed.launch``
passes.
"""
import argparse
import os
import os.path as osp
import sys

from mmengine.config import Config, DictAction

__all__ = ['fail', 'tool_parser', 'add_cfg_options', 'parse_args', 'load_config', 'set_work_dir',
           'config_of']

SCOPES = ('mmdet', 'mmseg', 'mmpretrain')


def fail(message: str) -> None:
    """Stop with a one-paragraph error instead of a traceback."""
    print(f'error: {message}', file=sys.stderr, flush=True)
    sys.exit(1)


def add_cfg_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction, metavar='KEY=VALUE',
        help='override settings of the config, key=value pairs, e.g. train_cfg.max_epochs=1; '
        'lists as key="[a,b]" or key=a,b (quotes needed, no white space)')
    return parser


def tool_parser(description: str, config_help: str, work_dir_help: str) -> argparse.ArgumentParser:
    """A parser with the arguments of the training and test tools: CONFIG, ``--work-dir``,
    ``--cfg-options``, ``--launcher`` and ``--local-rank``; the tool adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument('config', help=config_help)
    parser.add_argument('--work-dir', help=work_dir_help)
    add_cfg_options(parser)
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2.0) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse ``argv``; the local rank goes to ``LOCAL_RANK`` unless the launcher set it."""
    args = parser.parse_args(argv)
    if 'LOCAL_RANK' not in os.environ and hasattr(args, 'local_rank'):
        os.environ['LOCAL_RANK'] = str(args.local_rank)
    return args


def load_config(path: str, cfg_options=None) -> Config:
    """Read a config file (importing its ``custom_imports``) and merge ``cfg_options`` into it.

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    if not osp.isfile(path):
        raise FileNotFoundError(f'config file not found: {path}')
    cfg = Config.fromfile(path)
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def set_work_dir(cfg: Config, work_dir=None, default=None) -> str:
    """``cfg.work_dir``: ``work_dir`` (the command line) > the config's > ``default``
    (``./work_dirs/<config name>`` for a config read from a file)."""
    if work_dir is not None:
        cfg.work_dir = work_dir
    elif cfg.get('work_dir', None) is None:
        cfg.work_dir = default or osp.join('./work_dirs',
                                           osp.splitext(osp.basename(cfg.filename))[0])
    return cfg.work_dir


def config_of(args: argparse.Namespace) -> Config:
    """The config of a :func:`tool_parser` command line, with ``--cfg-options`` merged and the
    work directory set; a missing file or a config of none of :data:`SCOPES` stops the tool."""
    try:
        cfg = load_config(args.config, args.cfg_options)
    except FileNotFoundError as e:
        fail(str(e))
    if cfg.get('default_scope') not in SCOPES:
        fail(f"{args.config}: default_scope must be one of {', '.join(map(repr, SCOPES))} "
             f"(got {cfg.get('default_scope')!r})")
    set_work_dir(cfg, args.work_dir)
    return cfg
