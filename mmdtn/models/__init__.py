"""mmdtn's models: the DTN and DPN layers and the backbones that use them."""
from .backbones import *  # noqa: F401,F403
from .backbones import __all__ as _backbones_all
from .layers import *  # noqa: F401,F403
from .layers import __all__ as _layers_all

__all__ = [*_layers_all, *_backbones_all]
