"""mmdtn: Dynamic Token Normalization (Shao et al., ICLR 2022) and Dual PatchNorm for OpenMMLab.

The layers (``DynamicTokenNorm``, ``PatchNormConv2d``, ``set_dtn_backend``, ...) import with torch
alone. Where the OpenMMLab stack (mmengine, mmcv, mmdet, mmsegmentation) is installed, ``import
mmdtn`` (or ``custom_imports = dict(imports=['mmdtn'])`` in a config) also registers every module
of the package in mmdet's and mmsegmentation's registries and enables safe loading of mmengine
checkpoints with PyTorch's ``weights_only`` unpickler.
"""
from importlib.util import find_spec

from .version import __version__
from .models.layers import *  # noqa: F401,F403
from .models.layers import __all__ as _layers_all

__all__ = ['__version__', *_layers_all]


def _installed(name):
    try:
        return find_spec(name) is not None
    except (ImportError, ValueError):  # refused by an import hook, or blocked in sys.modules
        return False


#: Whether the OpenMMLab stack is installed (then the backbones, tools and registration load).
WITH_OPENMMLAB = all(_installed(name) for name in ('mmengine', 'mmcv', 'mmdet', 'mmseg'))
#: Whether mmpretrain is installed too (then the backbones also register in its scope and image
#: classifiers can use them; defined before ``registry`` imports it).
WITH_MMPRETRAIN = WITH_OPENMMLAB and _installed('mmpretrain')

if WITH_OPENMMLAB:
    from . import checkpoint, registry  # noqa: F401  (safe checkpoint loading; registries)
    from . import datasets, engine  # noqa: F401  (dataset checks; CPU multi-process model wrapper)
    from .models.backbones import *  # noqa: F401,F403
    from .models.backbones import __all__ as _backbones_all
    __all__ += _backbones_all
if WITH_MMPRETRAIN:
    from .models.necks import StageGlobalAveragePooling  # noqa: F401  (mmpretrain classifiers)
