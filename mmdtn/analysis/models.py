"""Build a backbone (or a whole model) from a config, load a checkpoint into it, find its parts.

Configs are read with mmengine's ``Config`` and built with ``MODELS`` in the config's
``default_scope`` (``mmdet`` when unset), exactly as the training tools do. Checkpoints are read
with mmengine's ``CheckpointLoader``, so the safe ``weights_only`` loading that ``import mmdtn``
enables applies. A checkpoint that does not fit the config is refused with the offending keys.
"""
import copy
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

import mmdtn  # noqa: F401  (registers mmdtn's modules and the safe checkpoint loading)
from mmdtn.engine.cli import load_config  # noqa: F401  (the tools' one config reader)
from mmdtn.models.layers import DynamicTokenNorm

__all__ = [
    'load_config', 'build_backbone', 'build_model', 'load_weights', 'dtn_layers', 'require_dtn',
    'transformer_blocks', 'Block', 'norm_labels', 'ln_twin_config', 'is_dtn', 'count_parameters',
    'run', 'call_argument', 'call_grid', 'is_plain_vit'
]


def _scope(cfg):
    from mmengine.registry import init_default_scope
    init_default_scope(cfg.get('default_scope', None) or 'mmdet')


def _model_cfg(cfg, config_path='config'):
    model = cfg.get('model', None)
    if model is None:
        raise ValueError(f'{config_path} has no `model` entry')
    return model


def build_backbone(cfg, device='cpu', config_path='config', pretrained=False):
    """Build ``cfg.model.backbone`` in eval mode on ``device``.

    By default it is randomly initialized as training from scratch starts: ``init_cfg`` (pretrained
    weights) is dropped, weights come from the checkpoint given to the tool. ``pretrained=True``
    keeps ``init_cfg``, so that ``init_weights`` loads e.g. the config's ImageNet checkpoint.
    """
    from mmengine.registry import MODELS
    model_cfg = _model_cfg(cfg, config_path)
    backbone_cfg = model_cfg.get('backbone', None)
    if backbone_cfg is None:
        raise ValueError(f'{config_path} has no `model.backbone` entry to analyze')
    backbone_cfg = copy.deepcopy(backbone_cfg)
    if not pretrained:
        backbone_cfg.pop('init_cfg', None)
        backbone_cfg.pop('pretrained', None)
    _scope(cfg)
    backbone = MODELS.build(backbone_cfg)
    if hasattr(backbone, 'init_weights'):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            _quiet(backbone.init_weights)
    backbone.to(device)
    backbone.eval()  # not chained: mmdet's SwinTransformer.train() returns None
    return backbone


def build_model(cfg, device='cpu', config_path='config'):
    """Build the whole ``cfg.model`` (detector or segmentor) without loading any weights."""
    from mmengine.registry import MODELS
    model_cfg = copy.deepcopy(_model_cfg(cfg, config_path))
    if 'type' not in model_cfg:
        raise ValueError(f'{config_path}: `model` has no `type`; cannot build the whole model')
    if 'backbone' in model_cfg:
        model_cfg.backbone.pop('init_cfg', None)
    _scope(cfg)
    model = MODELS.build(model_cfg)
    model.to(device)
    model.eval()
    return model


def _quiet(fn):
    """Run ``fn`` with mmengine's logger lowered to errors (init_weights warns of scratch init)."""
    from mmengine.logging import MMLogger
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel('ERROR')
    try:
        fn()
    finally:
        logger.setLevel(level)


def load_weights(model, checkpoint_path, config_path='config'):
    """Load a checkpoint into ``model`` (the backbone), checking that it fits the config.

    The checkpoint may be a whole model's (keys ``backbone.*`` are taken) or the backbone's own;
    it is read and loaded by the backbones' own reader in its strict mode
    (:func:`~mmdtn.models.backbones.pretrained.load_state_dict_checked`): unexpected keys,
    missing keys and shape mismatches raise :class:`ValueError` naming them, except DTN-only
    parameters missing from an LN checkpoint, which keep their configured initialization, with a
    warning. Returns the :class:`~mmdtn.models.backbones.pretrained.LoadReport`.
    """
    from mmdtn.models.backbones.pretrained import load_state_dict_checked, read_state_dict
    state = read_state_dict(checkpoint_path)
    try:
        report = load_state_dict_checked(model, state, logger='silent', strict=True)
    except ValueError as e:
        raise ValueError(f'checkpoint {checkpoint_path} does not match the backbone of '
                         f'{config_path}: {e}') from None
    if report.dtn_initialized:
        warnings.warn(f'{checkpoint_path} has no DTN gates/positional coefficients for '
                      f'{len(report.dtn_initialized)} key(s) (e.g. {report.dtn_initialized[0]}); '
                      f'they keep the configured initialization')
    return report


def is_dtn(module):
    """Whether ``module`` is a :class:`~mmdtn.DynamicTokenNorm`."""
    return isinstance(module, DynamicTokenNorm)


def dtn_layers(model):
    """``[(name, module)]`` of every DynamicTokenNorm in ``model``, in forward order."""
    return [(name, m) for name, m in model.named_modules() if is_dtn(m)]


def require_dtn(model, config_path, analysis):
    """The DTN layers of ``model``, or a :class:`ValueError` if there are none."""
    layers = dtn_layers(model)
    if not layers:
        raise ValueError(
            f'{config_path} builds {type(model).__name__} without DynamicTokenNorm layers, but '
            f'the {analysis} analysis needs DTN: use a DTN backbone (e.g. '
            f'PyramidVisionTransformerDTN, SwinTransformerDTN) with at least one stage in '
            f'`dtn_stages`')
    return layers


@dataclass
class Block:
    """A transformer block (a module with ``norm1``, ``norm2`` and ``attn``) of a backbone."""
    name: str
    module: nn.Module
    stage: int
    index: int

    @property
    def label(self):
        return f'stage{self.stage + 1}.block{self.index + 1}'


def is_plain_vit(model):
    """Whether ``model`` is a plain (single-stage) ViT: mmseg's ``VisionTransformer`` or a
    subclass (``VisionTransformerDTN``)."""
    from mmseg.models.backbones import VisionTransformer
    return isinstance(model, VisionTransformer)


def call_grid(norm, args, kwargs):
    """The (H, W) grid of a block norm's call: its ``hw_shape`` argument, else the grid a norm
    called without it was told (``BlockGridTokenNorm``, e.g. in a ViT), else ``None``."""
    hw = call_argument(args, kwargs, 1, 'hw_shape')
    return hw if hw is not None else getattr(norm, 'hw_shape', None)


def call_argument(args, kwargs, index, name):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def transformer_blocks(model):
    """Every transformer block of ``model`` in forward order, numbered within its stage.

    The stage is the first integer of the block's name (``layers.0.1.2`` -> stage 0 in PVT,
    ``stages.1.blocks.0`` -> stage 1 in Swin); a plain ViT's layers (``layers.5``) are one stage.
    """
    blocks, counts = [], {}
    single_stage = is_plain_vit(model)
    for name, m in model.named_modules():
        if all(hasattr(m, a) for a in ('norm1', 'norm2', 'attn')):
            found = re.search(r'\d+', name)
            stage = int(found.group()) if found and not single_stage else 0
            blocks.append(Block(name, m, stage, counts.get(stage, 0)))
            counts[stage] = counts.get(stage, 0) + 1
    return blocks


def norm_labels(model):
    """``{module name: 'stageS.blockB.normK'}`` for the block norms of ``model``."""
    return {f'{b.name}.{norm}': f'{b.label}.{norm}' for b in transformer_blocks(model)
            for norm in ('norm1', 'norm2')}


def ln_twin_config(cfg):
    """The LayerNorm twin of a DTN config: the stock backbone type without the DTN/DPN settings.

    The stock backbone is the library class the DTN backbone derives from
    (``PyramidVisionTransformerDTN`` -> mmdet's ``PyramidVisionTransformer``,
    ``VisionTransformerDTN`` -> mmseg's ``VisionTransformer``), named with its library's scope
    where the config's scope is another; every setting the stock class does not accept (``dtn_*``,
    ``dual_patchnorm``, ...) is removed. Returns ``None`` when the backbone is not a DTN backbone.
    """
    import inspect

    from mmengine.registry import MODELS
    twin = copy.deepcopy(cfg)
    backbone = twin.get('model', {}).get('backbone', None)
    if backbone is None or not str(backbone.get('type', '')).endswith('DTN'):
        return None
    scope = cfg.get('default_scope', None) or 'mmdet'
    with MODELS.switch_scope_and_registry(scope) as registry:
        dtn_cls = registry.get(str(backbone['type']))
    if dtn_cls is None:
        return None
    stock_cls = dtn_cls.__bases__[-1]  # the DTN backbones: (mixins..., stock backbone)
    library = stock_cls.__module__.split('.')[0]
    backbone['type'] = stock_cls.__name__ if scope == library \
        else f'{library}.{stock_cls.__name__}'
    accepted = set()
    for klass in stock_cls.__mro__:
        if '__init__' in vars(klass):
            accepted |= set(inspect.signature(klass.__init__).parameters)
    for key in list(backbone.keys()):
        dtn_only = key.startswith('dtn_') or key == 'dual_patchnorm'
        if key != 'type' and (dtn_only or key not in accepted):
            backbone.pop(key)
    return twin


def count_parameters(module):
    """Number of parameters of ``module``."""
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def run(model, image):
    """Forward ``image`` (1, 3, H, W) through ``model`` without gradients."""
    return model(image)
