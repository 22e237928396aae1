"""Building the Runner for the training and test tools, with errors a user can act on."""
from mmengine.runner import Runner

from mmdtn.datasets import DatasetFormatError, DatasetNotFoundError, check_datasets
from .cli import fail
from .compile import prepare_compiled_training
from .distributed import close_distributed, setup_distributed

__all__ = ['build_runner', 'run']


def _runners(scope):
    """The ``RUNNERS`` registry of mmdet, mmseg or mmpretrain (mmdet's tools also set dynamo's
    cache limit)."""
    if scope == 'mmdet':
        from mmdet.registry import RUNNERS
        from mmdet.utils import setup_cache_size_limit_of_dynamo
        setup_cache_size_limit_of_dynamo()
        return RUNNERS
    if scope == 'mmpretrain':
        from mmpretrain.registry import RUNNERS
        return RUNNERS
    from mmseg.registry import RUNNERS
    return RUNNERS


def build_runner(cfg, launcher, phases):
    """Check the datasets of ``phases``, prepare a multi-process launch, and build the Runner.

    Args:
        cfg (Config): the full config (``default_scope`` 'mmdet', 'mmseg' or 'mmpretrain').
        launcher (str): ``'none'``, ``'pytorch'``, ``'slurm'`` or ``'mpi'``.
        phases (list[str]): dataset phases to check before anything is built (``'train'``,
            ``'val'``, ``'test'``).

    A config naming a ``runner_type`` is built by the ``RUNNERS`` registry of its scope. A missing
    or broken dataset and an impossible launch stop the program through :func:`~.cli.fail`.
    """
    try:
        check_datasets(cfg, phases)
    except (DatasetNotFoundError, DatasetFormatError) as e:
        fail(str(e))
    try:
        setup_distributed(cfg, launcher)
    except ValueError as e:
        fail(str(e))
    runners = _runners(cfg.default_scope)
    if 'runner_type' in cfg:
        return runners.build(cfg)
    return Runner.from_cfg(cfg)


def run(runner, phase):
    """``runner.train()`` or ``runner.test()`` (``phase``), then close the process group, also
    when the phase fails (see :func:`~.distributed.close_distributed`).

    Training with ``compile`` in the config first gives the optimizer plain-dict parameter groups,
    without which dynamo cannot compile its step (see :mod:`~.compile`).
    """
    try:
        if phase == 'train':
            prepare_compiled_training(runner)
        return getattr(runner, phase)()
    finally:
        close_distributed()
