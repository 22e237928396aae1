"""Build a backbone (or a whole model) from a config, load a checkpoint into it, find its parts.

Configs are read with mmengine's ``Config`` and built with ``MODELS`` in the config's
``default_scope`` (``mmdet`` when unset), exactly as the training tools do. Checkpoints are read
with mmengine's ``CheckpointLoader``, so the safe ``weights_only`` loading that ``import mmdtn``
enables applies. A checkpoint that does not fit the config is refused with the offending keys.
"""
import copy
import os.path as osp
import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

import mmdtn  # noqa: F401  (registers mmdtn's modules and the safe checkpoint loading)

__all__ = [
    'load_config', 'build_backbone', 'build_model', 'load_weights', 'dtn_layers', 'require_dtn',
    'transformer_blocks', 'Block', 'norm_labels', 'ln_twin_config', 'is_dtn', 'count_parameters',
    'run',
    'DTN_ONLY_PARAMETERS'
]

#: Parameters that only DTN has; an LN checkpoint loaded into a DTN backbone lacks them and they
#: keep the initialisation the config asks for (``dtn_init``).
DTN_ONLY_PARAMETERS = ('mean_gate', 'var_gate', 'pos_coef')


def load_config(path):
    """Read an mmengine config (``.py``), importing its ``custom_imports``."""
    from mmengine.config import Config
    if not osp.isfile(path):
        raise FileNotFoundError(f'config file not found: {path}')
    return Config.fromfile(path)


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

    By default it is randomly initialised as training from scratch starts: ``init_cfg`` (pretrained
    weights) is dropped, weights come from the checkpoint given to the tool. ``pretrained=True``
    keeps ``init_cfg``, so that ``init_weights`` loads e.g. the config's ImageNet checkpoint.
    """
    from mmengine.registry import MODELS
    model_cfg = _model_cfg(cfg, config_path)
    backbone_cfg = model_cfg.get('backbone', None)
    if backbone_cfg is None:
        raise ValueError(f'{config_path} has no `model.backbone` entry to analyse')
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


def _state_dict_of(checkpoint):
    for key in ('state_dict', 'model'):
        if isinstance(checkpoint, dict) and isinstance(checkpoint.get(key), dict):
            return checkpoint[key]
    return checkpoint


def _fmt(keys, limit=12):
    keys = sorted(keys)
    more = f' ... and {len(keys) - limit} more' if len(keys) > limit else ''
    return ', '.join(keys[:limit]) + more


def load_weights(model, checkpoint_path, prefix='backbone.', config_path='config'):
    """Load a checkpoint into ``model`` (the backbone), checking that it fits the config.

    The checkpoint may be a whole model's (keys ``backbone.*`` are taken) or the backbone's own.
    Unexpected keys, missing keys and shape mismatches raise :class:`ValueError` naming them, with
    one exception: DTN-only parameters (:data:`DTN_ONLY_PARAMETERS`) missing from an LN checkpoint
    keep their configured initialisation, with a warning. Returns the list of such keys.
    """
    from mmengine.runner import CheckpointLoader
    if not osp.isfile(checkpoint_path):
        raise FileNotFoundError(f'checkpoint file not found: {checkpoint_path}')
    state = _state_dict_of(CheckpointLoader.load_checkpoint(checkpoint_path, map_location='cpu'))
    if not isinstance(state, dict) or not state:
        raise ValueError(f'{checkpoint_path} holds no state dict')
    state = {re.sub(r'^module\.', '', k): v for k, v in state.items()}
    if prefix and any(k.startswith(prefix) for k in state):
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    own = model.state_dict()
    unexpected = [k for k in state if k not in own]
    missing = [k for k in own if k not in state]
    tolerated = [k for k in missing if k.rsplit('.', 1)[-1] in DTN_ONLY_PARAMETERS]
    missing = [k for k in missing if k not in tolerated]
    shapes = [f'{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}'
              for k in state if k in own and hasattr(state[k], 'shape')
              and tuple(state[k].shape) != tuple(own[k].shape)]
    problems = []
    if unexpected:
        problems.append(f'{len(unexpected)} key(s) not in the model: {_fmt(unexpected)}')
    if missing:
        problems.append(f'{len(missing)} model key(s) missing from the checkpoint: {_fmt(missing)}')
    if shapes:
        problems.append(f'{len(shapes)} shape mismatch(es): {_fmt(shapes)}')
    if problems:
        raise ValueError(f'checkpoint {checkpoint_path} does not match the backbone of '
                         f'{config_path}:\n  ' + '\n  '.join(problems))
    if tolerated:
        warnings.warn(f'{checkpoint_path} has no DTN gates/positional coefficients for '
                      f'{len(tolerated)} key(s) ({_fmt(tolerated, 4)}); they keep the configured '
                      f'initialisation')
    model.load_state_dict(state, strict=False)
    return tolerated


def _dtn_class():
    try:
        from mmdtn.models.layers.dtn import DynamicTokenNorm
    except ImportError:  # pragma: no cover - only while the layer is missing
        return None
    return DynamicTokenNorm


def is_dtn(module):
    """Whether ``module`` is a :class:`~mmdtn.DynamicTokenNorm`."""
    cls = _dtn_class()
    return cls is not None and isinstance(module, cls)


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


def transformer_blocks(model):
    """Every transformer block of ``model`` in forward order, numbered within its stage.

    The stage is the first integer of the block's name (``layers.0.1.2`` -> stage 0 in PVT,
    ``stages.1.blocks.0`` -> stage 1 in Swin).
    """
    blocks, counts = [], {}
    for name, m in model.named_modules():
        if all(hasattr(m, a) for a in ('norm1', 'norm2', 'attn')):
            found = re.search(r'\d+', name)
            stage = int(found.group()) if found else 0
            blocks.append(Block(name, m, stage, counts.get(stage, 0)))
            counts[stage] = counts.get(stage, 0) + 1
    return blocks


def norm_labels(model):
    """``{module name: 'stageS.blockB.normK'}`` for the block norms of ``model``."""
    return {f'{b.name}.{norm}': f'{b.label}.{norm}' for b in transformer_blocks(model)
            for norm in ('norm1', 'norm2')}


def ln_twin_config(cfg):
    """The LayerNorm twin of a DTN config: the stock backbone type without the DTN/DPN settings.

    ``PyramidVisionTransformerDTN`` -> ``PyramidVisionTransformer`` and so on; every setting the
    stock class does not accept (``dtn_*``, ``dual_patchnorm``, ...) is removed. Returns ``None``
    when the backbone is not a DTN backbone.
    """
    import inspect

    from mmdet.registry import MODELS
    twin = copy.deepcopy(cfg)
    backbone = twin.get('model', {}).get('backbone', None)
    if backbone is None or not str(backbone.get('type', '')).endswith('DTN'):
        return None
    stock = str(backbone['type'])[:-len('DTN')].split('.')[-1]  # mmdet's class, from any scope
    stock_cls = MODELS.get(stock)
    if stock_cls is None:
        return None
    scope = cfg.get('default_scope', None) or 'mmdet'
    backbone['type'] = stock if scope == 'mmdet' else f'mmdet.{stock}'
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
