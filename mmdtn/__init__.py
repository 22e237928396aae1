"""mmdtn: Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm for OpenMMLab.

``import mmdtn`` (or ``custom_imports = dict(imports=['mmdtn'])`` in a config) registers every module
of the package in mmdet's and mmsegmentation's registries and enables safe loading of mmengine
checkpoints with PyTorch's ``weights_only`` unpickler.
"""
from .version import __version__
from . import checkpoint, registry  # noqa: F401  (safe checkpoint loading; registries)
from . import datasets, engine  # noqa: F401  (dataset checks; CPU multi-process model wrapper)
from .models import *  # noqa: F401,F403
from .models import __all__ as _models_all

__all__ = ['__version__', *_models_all]
