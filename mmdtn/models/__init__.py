"""mmdtn's models: the DTN and DPN layers (torch alone) and, in :mod:`.backbones`, the mmdet
backbones that use them."""
from .layers import *  # noqa: F401,F403
from .layers import __all__ as _layers_all

__all__ = list(_layers_all)
