"""Safe loading of mmengine / mmdet / mmseg checkpoints with PyTorch's ``weights_only`` unpickler.

Since PyTorch 2.6, ``torch.load`` defaults to ``weights_only=True``: it refuses every global that is
not allow-listed, so mmengine 0.10.7 fails to ``--resume`` (or ``load_from``) its own checkpoints
with "Weights only load failed". Importing :mod:`mmdtn` allow-lists exactly the types those
checkpoints hold and nothing else, keeping ``weights_only`` on:

* the message hub's ``HistoryBuffer`` and the numpy arrays and scalars logged in it;
* ``HistoryBuffer``'s statistics methods, which pickle as ``getattr(HistoryBuffer, 'min')``.
  Allowing the builtin ``getattr`` would let a crafted file reach arbitrary attributes, so
  ``builtins.getattr`` is mapped to :func:`restricted_getattr`, which resolves only those methods;
* ``argparse.Namespace``, the command line that timm's train.py saves in its checkpoints (``args``),
  so that they load into the backbones as they are. A namespace is rebuilt from its attribute dict,
  whose values the unpickler restricts like any other.

Checkpoints are also read through mmengine's ``CheckpointLoader`` with errors that name the file,
and URL checkpoints (``http(s)://``, ``torchvision://``, ``open-mmlab://`` ...) are downloaded and
then read by the same safe path instead of ``torch.hub``'s default unrestricted load.
"""
import argparse
import os
import os.path as osp
import pickle
from urllib.parse import urlparse

import numpy as np
import torch
from mmengine.logging.history_buffer import HistoryBuffer
from mmengine.runner import checkpoint as mmengine_checkpoint
from mmengine.runner.checkpoint import CheckpointLoader

__all__ = ['restricted_getattr', 'safe_globals', 'safe_torch_load', 'CheckpointSafetyError']


class CheckpointSafetyError(pickle.UnpicklingError):
    """A checkpoint holds a global that is not allow-listed; it was not loaded."""


#: HistoryBuffer's built-in statistics. mmengine adds them to ``_statistics_methods`` only when the
#: first buffer is created, so a fresh process that loads a checkpoint must know them itself.
_HISTORY_BUFFER_STATISTICS = frozenset({'min', 'max', 'current', 'mean'})


def restricted_getattr(obj, name):
    """``getattr`` limited to the statistics methods of mmengine's ``HistoryBuffer``.

    Stands in for ``builtins.getattr`` inside the ``weights_only`` unpickler. Allowed names are the
    built-in statistics and those registered with ``HistoryBuffer.register_statistics``.
    """
    allowed = _HISTORY_BUFFER_STATISTICS | set(HistoryBuffer._statistics_methods)
    if obj is HistoryBuffer and isinstance(name, str) and name in allowed:
        return getattr(obj, name)
    raise pickle.UnpicklingError(
        f'refusing getattr({obj!r}, {name!r}): only HistoryBuffer statistics methods '
        f'({sorted(allowed)}) may be resolved while loading a checkpoint')


def _numpy_globals():
    """numpy's array/scalar reconstruction, under its numpy 2 and numpy 1 module names.

    The message hub logs numpy scalars; files written under numpy 1 name ``numpy.core``.
    """
    core = np._core if hasattr(np, '_core') else np.core
    entries = [np.ndarray, np.dtype]
    # Unpickling a dtype builds an instance of its class (numpy.dtypes.Float64DType, ...): numeric
    # only.
    entries += sorted({type(np.dtype(code)) for code in '?bBhHiIlLqQefdgFDG'},
                      key=lambda t: t.__name__)
    for mod in ('numpy._core', 'numpy.core'):
        entries += [(core.multiarray._reconstruct, f'{mod}.multiarray._reconstruct'),
                    (core.multiarray.scalar, f'{mod}.multiarray.scalar')]
    return entries


def safe_globals():
    """The globals allow-listed for mmengine checkpoints, as ``torch.serialization`` entries."""
    return [HistoryBuffer, (restricted_getattr, 'builtins.getattr'), argparse.Namespace,
            *_numpy_globals()]


def safe_torch_load(filename, map_location=None):
    """``torch.load(weights_only=True)`` of a file, with the file named in any refusal."""
    try:
        return torch.load(filename, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointSafetyError(
            f'refused to load checkpoint {filename!r}: it holds objects outside the types allowed '
            f'for weights-only loading, so loading it could run arbitrary code. Only load files '
            f'you trust; the unpickler said: {err}') from err


def _load_from_local(filename, map_location):
    filename = osp.expanduser(filename)
    if not osp.isfile(filename):
        raise FileNotFoundError(f'checkpoint file {filename!r} does not exist')
    return safe_torch_load(filename, map_location)


def _load_url(url, model_dir=None, map_location=None, **kwargs):
    """Download ``url`` into the torch hub cache (once) and load it with :func:`safe_torch_load`."""
    if model_dir is None:
        model_dir = osp.join(torch.hub.get_dir(), 'checkpoints')
    os.makedirs(model_dir, exist_ok=True)
    cached = osp.join(model_dir, osp.basename(urlparse(url).path))
    if not osp.exists(cached):
        torch.hub.download_url_to_file(url, cached, progress=kwargs.get('progress', True))
    return safe_torch_load(cached, map_location)


def _install():
    torch.serialization.add_safe_globals(safe_globals())
    CheckpointLoader.register_scheme(prefixes='', loader=_load_from_local, force=True)
    # mmengine's http, torchvision:// and open-mmlab:// loaders all download through this name.
    mmengine_checkpoint.load_url = _load_url


_install()
