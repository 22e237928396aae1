"""Building the Runner for ``tools/train.py`` and ``tools/test.py``, with errors a user can act on."""
import sys

from mmengine.runner import Runner

from mmdtn.datasets import DatasetFormatError, DatasetNotFoundError, check_datasets
from .distributed import setup_distributed

__all__ = ['build_runner', 'fail']


def fail(message: str) -> None:
    """Stop with a one-paragraph error instead of a traceback."""
    print(f'error: {message}', file=sys.stderr, flush=True)
    sys.exit(1)


def build_runner(cfg, launcher, phases, runners):
    """Check the datasets of ``phases``, prepare a multi-process launch, and build the Runner.

    Args:
        cfg (Config): the full config.
        launcher (str): ``'none'``, ``'pytorch'``, ``'slurm'`` or ``'mpi'``.
        phases (list[str]): dataset phases to check before anything is built (``'train'``,
            ``'val'``, ``'test'``).
        runners (Registry): the ``RUNNERS`` registry of the config's scope, used when the config
            names a ``runner_type``.

    A missing or broken dataset and an impossible launch stop the program through :func:`fail`.
    """
    try:
        check_datasets(cfg, phases)
    except (DatasetNotFoundError, DatasetFormatError) as e:
        fail(str(e))
    try:
        setup_distributed(cfg, launcher)
    except ValueError as e:
        fail(str(e))
    if 'runner_type' in cfg:
        return runners.build(cfg)
    return Runner.from_cfg(cfg)
