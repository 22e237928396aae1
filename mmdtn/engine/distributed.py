"""Multi-process training and testing on machines without a GPU (the ``gloo`` backend).

mmengine 0.10.7 assumes an accelerator in two places: its ``init_dist`` calls
``torch.cuda.set_device`` before creating the process group, and its Runner wraps the model in
DistributedDataParallel with ``device_ids=[LOCAL_RANK]``. Both fail on a CPU-only machine, so
``tools/dist_train.sh CONFIG 2`` would not start there. Without forking or patching mmengine,
:func:`setup_distributed` handles it when the launcher is not ``'none'`` and CUDA is unavailable:

1. it creates the default process group itself, with ``gloo``, from the launcher's environment
   (``torchrun``: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; slurm: SLURM_PROCID, SLURM_NTASKS,
   SLURM_LOCALID, SLURM_NODELIST, as mmengine derives them); the Runner's ``setup_env`` then sees an
   initialized group and skips ``init_dist``;
2. it sets ``model_wrapper_cfg`` to :class:`CPUDistributedDataParallel`, mmengine's
   ``MMDistributedDataParallel`` without device ids and with SyncBN layers reverted to BatchNorm
   (SyncBatchNorm has no CPU implementation; batch statistics stay per process).

With CUDA available nothing changes: mmengine's own path (nccl by default) is used.

mmengine never destroys the process group. :func:`close_distributed` does, at the end of
``tools/train.py`` and ``tools/test.py``, on every backend. That alone does not make a gloo run
end safely: gloo's worker threads outlive ``destroy_process_group`` (it has no shutdown for them),
and a worker releases the tensors of a finished collective only after the caller has been woken.
Releasing a tensor Python also holds takes the GIL, and a thread that takes the GIL once the
interpreter is finalizing is ended by ``pthread_exit`` inside that destructor: the process aborts
(SIGABRT, "terminate called without an active exception") after it finished its work, failing the
whole launch (rarely, and more often on a busy machine; such a core dump shows
``~AsyncBroadcastWork`` in a gloo worker while the main thread is in ``Py_FinalizeEx``). The tools
therefore end with :func:`exit_process`, which after a gloo group runs the exit functions and
leaves without the finalization, as :mod:`multiprocessing` ends its child processes.
"""
import atexit
import datetime
import os
import subprocess
import sys
from typing import NoReturn, Optional

import torch
import torch.distributed as dist
from mmengine.model import MMDistributedDataParallel, revert_sync_batchnorm
from mmengine.registry import MODEL_WRAPPERS

__all__ = ['CPUDistributedDataParallel', 'init_cpu_process_group', 'setup_distributed',
           'needs_cpu_distributed', 'close_distributed', 'exit_process']

# Whether this process destroyed a gloo group, whose worker threads may still be running.
_closed_gloo = False


@MODEL_WRAPPERS.register_module()
class CPUDistributedDataParallel(MMDistributedDataParallel):
    """mmengine's ``MMDistributedDataParallel`` for processes on CPU (gloo).

    Ignores ``device_ids`` (the Runner passes ``[LOCAL_RANK]``, meaningless on CPU) and reverts
    SyncBN layers to BatchNorm before wrapping. Arguments are those of
    ``torch.nn.parallel.DistributedDataParallel``.
    """

    def __init__(self, module, device_ids=None, **kwargs):
        super().__init__(module=revert_sync_batchnorm(module), device_ids=None, **kwargs)


def needs_cpu_distributed(launcher: str) -> bool:
    """True when a multi-process launch has no CUDA to use, i.e. must run on CPU with gloo."""
    return launcher != 'none' and not torch.cuda.is_available()


def _slurm_env(port: Optional[int] = None) -> None:
    """Set torch's rendezvous variables from slurm's, as mmengine's ``_init_dist_slurm`` does."""
    node_list = os.environ['SLURM_NODELIST']
    os.environ['RANK'] = os.environ['SLURM_PROCID']
    os.environ['WORLD_SIZE'] = os.environ['SLURM_NTASKS']
    os.environ['LOCAL_RANK'] = os.environ.get('SLURM_LOCALID', '0')
    if port is not None:
        os.environ['MASTER_PORT'] = str(port)
    os.environ.setdefault('MASTER_PORT', '29500')
    if 'MASTER_ADDR' not in os.environ:
        os.environ['MASTER_ADDR'] = subprocess.getoutput(
            f'scontrol show hostname {node_list} | head -n1')


def init_cpu_process_group(launcher: str, timeout: Optional[float] = None,
                           port: Optional[int] = None) -> None:
    """Initialize the default process group with ``gloo`` for ``launcher`` 'pytorch' or 'slurm'.

    Args:
        launcher: ``'pytorch'`` (torchrun / torch.distributed.launch set the environment) or
            ``'slurm'`` (srun; the rendezvous variables are derived from slurm's).
        timeout: seconds, as mmengine's ``env_cfg.dist_cfg.timeout``.
        port: master port for slurm (default: MASTER_PORT or 29500).
    """
    if dist.is_initialized():
        return
    if launcher == 'slurm':
        _slurm_env(port)
    elif launcher != 'pytorch':
        raise ValueError(f"launcher {launcher!r} is not supported on CPU; use 'pytorch' "
                         "(tools/dist_train.sh, torchrun) or 'slurm'")
    required = ('RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')
    missing = [k for k in required if k not in os.environ]
    if missing:
        raise ValueError(f'--launcher {launcher} needs the environment variables {missing}; start '
                         'the processes with torchrun (tools/dist_train.sh CONFIG NPROC) or srun')
    kwargs = {}
    if timeout is not None:
        kwargs['timeout'] = datetime.timedelta(seconds=timeout)
    dist.init_process_group(backend='gloo', **kwargs)


def setup_distributed(cfg, launcher: str) -> None:
    """Prepare ``cfg`` (an mmengine Config, modified in place) for ``launcher`` on this machine.

    Sets ``cfg.launcher``. On a CPU-only machine with a multi-process launcher, also creates the
    gloo process group and selects :class:`CPUDistributedDataParallel` (keeping the options of an
    existing ``model_wrapper_cfg`` or ``find_unused_parameters``). Otherwise mmengine's default
    distributed set-up applies unchanged.
    """
    cfg.launcher = launcher
    if not needs_cpu_distributed(launcher):
        return
    dist_cfg = dict(cfg.get('env_cfg', {}).get('dist_cfg', {}) or {})
    init_cpu_process_group(launcher, timeout=dist_cfg.get('timeout'), port=dist_cfg.get('port'))
    if 'env_cfg' in cfg:
        cfg.env_cfg.setdefault('dist_cfg', {})['backend'] = 'gloo'  # what the run actually uses
    wrapper = dict(cfg.get('model_wrapper_cfg') or {})
    wrapper_type = wrapper.get('type', 'MMDistributedDataParallel')
    if wrapper_type not in ('MMDistributedDataParallel', 'CPUDistributedDataParallel'):
        raise ValueError(f'model_wrapper_cfg type {wrapper_type!r} is not supported on CPU; use '
                         'MMDistributedDataParallel (or a machine with CUDA)')
    wrapper['type'] = 'CPUDistributedDataParallel'
    wrapper.setdefault('broadcast_buffers', False)
    wrapper.setdefault('find_unused_parameters', cfg.get('find_unused_parameters', False))
    cfg.model_wrapper_cfg = wrapper


def close_distributed() -> None:
    """Destroy the default process group, if one exists (see the module docstring)."""
    global _closed_gloo
    if dist.is_available() and dist.is_initialized():
        _closed_gloo = _closed_gloo or dist.get_backend() == 'gloo'
        dist.destroy_process_group()


def exit_process(code: int = 0) -> NoReturn:
    """End a tool's process with exit status ``code``.

    After a gloo process group (see the module docstring) the exit functions run (logging's among
    them), the standard streams are flushed and the process leaves with ``os._exit``, without the
    interpreter's finalization; otherwise this is ``sys.exit(code)``.
    """
    if not _closed_gloo:
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
