"""Loading ImageNet checkpoints into the DTN backbones.

Accepted checkpoints (``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=None)``):

- official PVT v1 / PVTv2 and Swin releases, converted with mmdet's own ``pvt_convert`` /
  ``swin_converter`` when ``convert_weights=True``, exactly as mmdet's backbones do;
- timm ``pvt_v2_*`` and ``swin_*`` state dicts (always converted: timm's names -> the official
  release's names -> mmdet's), those of mmdtn's timm DTN models (``pvt_v2_b0_dtn``, ...) included:
  their DTN parameters keep their names under the block norms and load one to one;
- mmdet-format weights (a backbone's ``state_dict()``, or a detector / classifier checkpoint whose
  backbone keys start with ``backbone.``, or with ``prefix``), such as an mmpretrain image
  classifier trained on a DTN backbone (``configs/imagenet/``): taken as they are whatever
  ``convert_weights`` says, and the keys outside the backbone (the classifier's head) are reported.

DTN layers saved by the authors' reference code (``mean_norm_weight``, ``var_norm_weight``,
``pos_proj.weight``) are converted with :func:`convert_reference_state_dict`; a backbone built with
``dtn_reference_compat=True`` then reproduces that code's outputs (without it, loading warns).

The block LayerNorms' ``weight``/``bias`` load into DTN's ``weight``/``bias`` (same names). DTN-only
parameters (``mean_gate``, ``var_gate``, ``pos_coef``) and a Dual PatchNorm patch LayerNorm absent
from the checkpoint keep their configured initialization; this is logged, as is every other key
that was not loaded or not used. A classifier's head (``head.*``) is dropped and reported. An
absolute position embedding of another grid (PVT v1's ``pos_embed``, Swin's ``absolute_pos_embed``)
is resampled to the model's grid, as timm does, and reported. Any other shape mismatch raises
``ValueError`` naming the key and both shapes.
"""
import logging
import math
import os.path as osp
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmdet.models.backbones.pvt import AbsolutePositionEmbedding, pvt_convert
from mmdet.models.backbones.swin import swin_converter
from mmengine.logging import MMLogger, print_log
from mmengine.runner.checkpoint import CheckpointLoader

from ..layers import DTN_ONLY_PARAMETERS, DynamicTokenNorm, PatchNormConv2d
from ..layers.reference_compat import convert_reference_state_dict
from ..vit_dtn import convert_reference_vit_state_dict

__all__ = [
    'LoadReport', 'load_pretrained', 'read_state_dict', 'load_state_dict_checked',
    'resample_position_embeddings',
    'pvt_checkpoint_to_mmdet', 'swin_checkpoint_to_mmdet', 'timm_pvt_v2_to_official',
    'timm_swin_to_official', 'vit_checkpoint_to_mmseg'
]

# Buffers a model computes from its own configuration (timm does not save them).
DERIVED_BUFFERS = ('relative_position_index', )

StateDict = Dict[str, torch.Tensor]


@dataclass
class LoadReport:
    """What :func:`load_state_dict_checked` did, key by key."""
    loaded: List[str] = field(default_factory=list)
    dtn_initialized: List[str] = field(default_factory=list)  # DTN-only params, as configured
    dpn_initialized: List[str] = field(default_factory=list)  # new Dual PatchNorm LayerNorm
    derived: List[str] = field(default_factory=list)  # buffers the model computes itself
    missing: List[str] = field(default_factory=list)  # other model keys not in the checkpoint
    unused: List[str] = field(default_factory=list)  # checkpoint keys the model does not have
    classifier_head: List[str] = field(default_factory=list)  # dropped by load_pretrained
    resampled: List[str] = field(default_factory=list)  # position embeddings of another grid


# ---------------------------------------------------------------------------------- reading
def _strip(state_dict: Mapping, prefix: str) -> StateDict:
    return OrderedDict((k[len(prefix):], v) for k, v in state_dict.items() if k.startswith(prefix))


def read_state_dict(checkpoint: str, prefix: Optional[str] = None, logger=None) -> StateDict:
    """Read the weights of ``checkpoint`` (path or URL) as a flat state dict.

    Unwraps ``state_dict`` / ``model`` entries, strips a DataParallel ``module.`` prefix, and keeps
    only the keys under ``prefix`` (stripped) if given, else under ``backbone.`` if there are any.
    """
    if not isinstance(checkpoint, str):
        raise ValueError(f'checkpoint must be a path or URL string, got {checkpoint!r}')
    if '://' not in checkpoint and not osp.isfile(osp.expanduser(checkpoint)):
        raise FileNotFoundError(f'checkpoint file not found: {checkpoint}')
    ckpt = CheckpointLoader.load_checkpoint(checkpoint, map_location='cpu', logger=logger)
    if isinstance(ckpt, Mapping) and 'state_dict' in ckpt:
        ckpt = ckpt['state_dict']
    elif isinstance(ckpt, Mapping) and 'model' in ckpt:
        ckpt = ckpt['model']
    if not isinstance(ckpt, Mapping) or not all(torch.is_tensor(v) for v in ckpt.values()):
        raise ValueError(f'{checkpoint} does not hold a state dict of tensors')
    state_dict = OrderedDict(ckpt)
    if state_dict and all(k.startswith('module.') for k in state_dict):
        state_dict = _strip(state_dict, 'module.')
    if prefix:
        prefix = prefix if prefix.endswith('.') else prefix + '.'
        if not any(k.startswith(prefix) for k in state_dict):
            raise ValueError(f'no key of {checkpoint} starts with prefix {prefix!r}')
        return _select(state_dict, prefix, checkpoint, logger)
    if any(k.startswith('backbone.') for k in state_dict):
        return _select(state_dict, 'backbone.', checkpoint, logger)
    return state_dict


def _select(state_dict: Mapping, prefix: str, checkpoint: str, logger) -> StateDict:
    """The keys under ``prefix`` (stripped); the others (a classifier's head, a detector's neck
    and heads) are reported by name."""
    dropped = [k for k in state_dict if not k.startswith(prefix)]
    if dropped:
        print_log(f'{checkpoint}: {len(dropped)} tensors outside {prefix!r} are not loaded: '
                  + _listed(dropped), logger=logger)
    return _strip(state_dict, prefix)


# ---------------------------------------------------------------------------------- PVT
def timm_pvt_v2_to_official(state_dict: Mapping) -> StateDict:
    """Rename a timm ``pvt_v2_*`` state dict to the official PVTv2 release's names.

    timm: ``patch_embed.*``, ``stages.{i}.downsample.*`` (stages 2-4), ``stages.{i}.blocks.{j}.*``
    with ``mlp.dwconv``, ``stages.{i}.norm.*``; official: ``patch_embed{i+1}.*``,
    ``block{i+1}.{j}.*`` with ``mlp.dwconv.dwconv``, ``norm{i+1}.*``.
    """
    out = OrderedDict()
    for k, v in state_dict.items():
        if k.startswith('patch_embed.'):
            k = 'patch_embed1.' + k[len('patch_embed.'):]
        elif k.startswith('stages.'):
            m = re.match(r'stages\.(\d+)\.(downsample|blocks\.(\d+)|norm)\.(.*)', k)
            if m is None:
                raise ValueError(f'unknown key in a timm pvt_v2 state dict: {k}')
            i, part, j, rest = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            if part == 'downsample':
                k = f'patch_embed{i + 1}.{rest}'
            elif part == 'norm':
                k = f'norm{i + 1}.{rest}'
            else:
                rest = rest.replace('mlp.dwconv.', 'mlp.dwconv.dwconv.')
                k = f'block{i + 1}.{j}.{rest}'
        out[k] = v
    return out


def _is_timm_pvt_v2(state_dict: Mapping) -> bool:
    return 'patch_embed.proj.weight' in state_dict and any(
        k.startswith('stages.') for k in state_dict)


def pvt_checkpoint_to_mmdet(state_dict: Mapping, convert_weights: bool) -> StateDict:
    """PVT/PVTv2 weights in mmdet's names: timm always converted, official ones as mmdet does
    (``pvt_convert`` if ``convert_weights``), mmdet-format ones unchanged."""
    if _is_timm_pvt_v2(state_dict):
        return pvt_convert(timm_pvt_v2_to_official(state_dict))
    if convert_weights and 'layers.0.0.projection.weight' not in state_dict:  # not mmdet's names
        return pvt_convert(state_dict)
    return OrderedDict(state_dict)


# ---------------------------------------------------------------------------------- Swin
def timm_swin_to_official(state_dict: Mapping) -> StateDict:
    """Rename a timm ``swin_*`` state dict to the official Swin release's names.

    timm (>= 0.9) puts patch merging at the start of stages 2-4 (``layers.{i}.downsample``) where
    the official code has it at the end of stages 1-3 (``layers.{i-1}.downsample``), with the same
    channel order; its classifier is ``head.fc``. Everything else has the official names.
    """
    out = OrderedDict()
    for k, v in state_dict.items():
        m = re.match(r'layers\.(\d+)\.downsample\.(.*)', k)
        if m is not None:
            k = f'layers.{int(m.group(1)) - 1}.downsample.{m.group(2)}'
        elif k.startswith('head.fc.'):
            k = 'head.' + k[len('head.fc.'):]
        out[k] = v
    return out


def _is_timm_swin(state_dict: Mapping) -> bool:
    return ('layers.0.downsample.reduction.weight' not in state_dict
            and any(re.match(r'layers\.\d+\.downsample\.reduction\.weight', k)
                    for k in state_dict))


def _resize_relative_position_tables(state_dict: StateDict, model: nn.Module) -> StateDict:
    """Bicubic resize of Swin's relative position bias tables to the model's window size (as
    mmdet's Swin does); ``relative_position_index`` buffers of another window size are dropped,
    the model's own are derived from its window size."""
    model_state = model.state_dict()
    for key in list(state_dict):
        if key not in model_state or state_dict[key].shape == model_state[key].shape:
            continue
        if key.endswith('relative_position_bias_table'):
            table = state_dict[key]
            (l1, nh1), (l2, nh2) = table.shape, model_state[key].shape
            if nh1 != nh2:
                continue  # reported as a shape mismatch
            s1, s2 = int(l1**0.5), int(l2**0.5)
            resized = F.interpolate(
                table.permute(1, 0).reshape(1, nh1, s1, s1).float(), size=(s2, s2),
                mode='bicubic')
            state_dict[key] = resized.reshape(nh2, l2).permute(1, 0).contiguous().to(table.dtype)
        elif key.endswith('relative_position_index'):
            del state_dict[key]
    return state_dict


def swin_checkpoint_to_mmdet(state_dict: Mapping, convert_weights: bool,
                             model: Optional[nn.Module] = None) -> StateDict:
    """Swin weights in mmdet's names: timm always converted, official ones as mmdet does
    (``swin_converter`` if ``convert_weights``), mmdet-format ones unchanged; relative position
    tables resized to ``model``'s window size."""
    if _is_timm_swin(state_dict):
        state_dict = _strip(swin_converter(timm_swin_to_official(state_dict)), 'backbone.')
    elif convert_weights and 'patch_embed.projection.weight' not in state_dict:  # not mmdet's
        state_dict = _strip(swin_converter(state_dict), 'backbone.')
    else:
        state_dict = OrderedDict(state_dict)
    if model is not None:
        state_dict = _resize_relative_position_tables(state_dict, model)
    return state_dict


# ---------------------------------------------------------------------------------- ViT
#: timm's (and DeiT's) ViT names -> mmseg's, by regular expression (mmseg's vit2mmseg converter).
_TIMM_VIT_TO_MMSEG = (
    (r'^patch_embed\.proj\.', 'patch_embed.projection.'),
    (r'^norm_pre\.', 'ln_pre.'),
    (r'^norm\.', 'ln1.'),  # the final norm (final_norm=True)
    (r'^blocks\.(\d+)\.norm1\.', r'layers.\1.ln1.'),
    (r'^blocks\.(\d+)\.norm2\.', r'layers.\1.ln2.'),
    (r'^blocks\.(\d+)\.attn\.qkv\.(weight|bias)$', r'layers.\1.attn.attn.in_proj_\2'),
    (r'^blocks\.(\d+)\.attn\.proj\.', r'layers.\1.attn.attn.out_proj.'),
    (r'^blocks\.(\d+)\.mlp\.fc1\.', r'layers.\1.ffn.layers.0.0.'),
    (r'^blocks\.(\d+)\.mlp\.fc2\.', r'layers.\1.ffn.layers.1.'),
)
#: mmpretrain's ViT names -> mmseg's (the encoder layers differ in the attention only).
_MMPRETRAIN_VIT_TO_MMSEG = (
    (r'^pre_norm\.', 'ln_pre.'),
    (r'^layers\.(\d+)\.attn\.qkv\.(weight|bias)$', r'layers.\1.attn.attn.in_proj_\2'),
    (r'^layers\.(\d+)\.attn\.proj\.', r'layers.\1.attn.attn.out_proj.'),
)


def _renamed(state_dict: Mapping, rules) -> StateDict:
    out = OrderedDict()
    for k, v in state_dict.items():
        for pattern, replacement in rules:
            k, n = re.subn(pattern, replacement, k)
            if n:
                break
        out[k] = v
    return out


def vit_checkpoint_to_mmseg(state_dict: Mapping, model: nn.Module, logger=None) -> StateDict:
    """ViT weights in the names of mmseg's ``VisionTransformer`` (and ``VisionTransformerDTN``).

    timm's and DeiT's ViTs (mmdtn's ``vit_*_dtn`` included: DTN's parameters follow their norms)
    and mmpretrain's are renamed; mmseg-format ones (an mmseg backbone, or an mmpretrain classifier
    on it) are taken as they are. The authors' reference-code DTN layers are converted
    (:func:`~mmdtn.models.vit_dtn.convert_reference_vit_state_dict`), and a position embedding of
    another grid is resized to ``model.img_size`` with mmseg's ``resize_pos_embed`` and the
    model's ``interpolate_mode``, as mmseg's ``VisionTransformer.init_weights`` does.

    Raises:
        ValueError: a position embedding whose patch tokens are not a square grid.
    """
    logger = MMLogger.get_current_instance() if logger is None else logger
    if any(k.endswith('.var_norm_weight') for k in state_dict):
        state_dict = convert_reference_vit_state_dict(
            _from_reference_format(model, OrderedDict(state_dict), logger))
    if 'patch_embed.proj.weight' in state_dict:
        state_dict = _renamed(state_dict, _TIMM_VIT_TO_MMSEG)
    elif 'layers.0.attn.qkv.weight' in state_dict:
        state_dict = _renamed(state_dict, _MMPRETRAIN_VIT_TO_MMSEG)
    else:
        state_dict = OrderedDict(state_dict)
    pos, target = state_dict.get('pos_embed'), model.pos_embed
    if pos is not None and pos.shape != target.shape and pos.dim() == 3 \
            and pos.shape[2] == target.shape[2]:
        side = math.isqrt(pos.shape[1] - 1)
        if side * side != pos.shape[1] - 1:
            raise ValueError(f'pos_embed: the checkpoint\'s position embedding '
                             f'{tuple(pos.shape)} is not a class token and a square grid; the '
                             f'model\'s is {tuple(target.shape)}')
        grid = (model.img_size[0] // model.patch_size, model.img_size[1] // model.patch_size)
        state_dict['pos_embed'] = model.resize_pos_embed(pos, grid, (side, side),
                                                         model.interpolate_mode)
        print_log(f'{type(model).__name__}: pos_embed: position embedding resized from the '
                  f'checkpoint\'s {side}x{side} grid to the model\'s {grid[0]}x{grid[1]} '
                  f'({model.interpolate_mode}, as mmseg)', logger=logger)
    return state_dict


# ---------------------------------------------------------------------------------- loading
def _listed(keys, limit=12):
    more = f' ... and {len(keys) - limit} more' if len(keys) > limit else ''
    return ', '.join(keys[:limit]) + more


def load_state_dict_checked(model: nn.Module, state_dict: Mapping, logger=None,
                            strict: bool = False) -> LoadReport:
    """Load ``state_dict`` (mmdet names) into ``model`` and report every key.

    DTN-only parameters (:data:`~mmdtn.models.layers.DTN_ONLY_PARAMETERS`) missing from the
    checkpoint keep their configured initialization, and buffers the model derives from its
    configuration need not be there. The report goes to ``logger`` (``'silent'``: nowhere).

    Args:
        strict: also refuse checkpoint keys the model does not have and any other model key
            the checkpoint lacks (a Dual PatchNorm patch LayerNorm included), as the analysis
            tools need: weights that only partly fit would give silently wrong results.

    Raises:
        ValueError: nothing is loaded if a key is present in both with different shapes (each is
            named with both shapes), or, with ``strict``, if any key is missing or unused.
    """
    model_state = model.state_dict()
    state_dict = dict(state_dict)
    dtn_keys, dpn_keys = set(), set()
    for name, module in model.named_modules():
        prefix = name + '.' if name else ''
        if isinstance(module, DynamicTokenNorm):
            module.adapt_gates(state_dict, prefix)  # gates saved by a layer of the other init
            dtn_keys.update(prefix + p for p in DTN_ONLY_PARAMETERS)
        elif isinstance(module, PatchNormConv2d):
            dpn_keys.update(prefix + 'patch_norm.' + k for k in module.patch_norm.state_dict())
    report = LoadReport(loaded=[k for k in state_dict if k in model_state],
                        unused=[k for k in state_dict if k not in model_state])
    for key in model_state:
        if key in state_dict:
            continue
        if key in dtn_keys:
            report.dtn_initialized.append(key)
        elif key in dpn_keys:
            report.dpn_initialized.append(key)
        elif key.rsplit('.', 1)[-1] in DERIVED_BUFFERS:
            report.derived.append(key)
        else:
            report.missing.append(key)

    name = type(model).__name__
    mismatched = [f'{k}: checkpoint {tuple(v.shape)} vs model {tuple(model_state[k].shape)}'
                  for k, v in state_dict.items()
                  if k in model_state and v.shape != model_state[k].shape]
    problems = [f'{len(mismatched)} shape mismatch(es): ' + '; '.join(mismatched)] \
        if mismatched else []
    if strict and report.unused:
        problems.append(f'{len(report.unused)} checkpoint key(s) not in the model: '
                        + _listed(report.unused))
    if strict and (report.missing or report.dpn_initialized):
        absent = report.missing + report.dpn_initialized
        problems.append(f'{len(absent)} model key(s) missing from the checkpoint: '
                        + _listed(absent))
    if problems:
        raise ValueError(f'the weights do not fit {name}:\n  ' + '\n  '.join(problems))
    model.load_state_dict(state_dict, strict=False)

    print_log(f'{name}: loaded {len(report.loaded)} of {len(model_state)} tensors',
              logger=logger)
    if report.dtn_initialized:
        inits = sorted({m.init for m in model.modules() if isinstance(m, DynamicTokenNorm)})
        print_log(f'{name}: {len(report.dtn_initialized)} DTN-only parameters are not in the '
                  f'checkpoint and keep their init={"/".join(inits)} values: ' +
                  ', '.join(report.dtn_initialized), logger=logger)
    if report.dpn_initialized:
        print_log(f'{name}: the checkpoint has no Dual PatchNorm patch LayerNorm; freshly '
                  'initialized (weight 1, bias 0): ' + ', '.join(report.dpn_initialized),
                  logger=logger, level=30)
    if report.derived:
        print_log(f'{name}: {len(report.derived)} buffers not in the checkpoint are derived from '
                  'the configuration: ' + ', '.join(report.derived), logger=logger)
    if report.missing:
        print_log(f'{name}: {len(report.missing)} model tensors not in the checkpoint (left at '
                  'their initialization): ' + ', '.join(report.missing), logger=logger, level=30)
    if report.unused:
        print_log(f'{name}: {len(report.unused)} checkpoint tensors not used: ' +
                  ', '.join(report.unused), logger=logger, level=30)
    return report


def load_pretrained(model: nn.Module, init_cfg: Mapping,
                    to_mmdet: Callable[[StateDict], StateDict], logger=None) -> LoadReport:
    """Load ``init_cfg=dict(type='Pretrained', checkpoint=..., prefix=None)`` into ``model``.

    Args:
        model: the backbone.
        init_cfg: a ``Pretrained`` init config.
        to_mmdet: converts the checkpoint's state dict into the backbone's (mmdet) names.
        logger: where the report goes (default: the current ``MMLogger``).
    """
    if logger is None:
        logger = MMLogger.get_current_instance()
    if not isinstance(init_cfg, Mapping) or init_cfg.get('type', 'Pretrained') != 'Pretrained' \
            or not init_cfg.get('checkpoint'):
        raise ValueError(f'{type(model).__name__} supports init_cfg=dict(type="Pretrained", '
                         f'checkpoint=...) only, got {init_cfg!r}')
    state_dict = read_state_dict(init_cfg['checkpoint'], init_cfg.get('prefix'), logger)
    print_log(f'{type(model).__name__}: loading {init_cfg["checkpoint"]}', logger=logger)
    state_dict, head = _without_classifier_head(model, state_dict, logger)
    state_dict = _from_reference_format(model, to_mmdet(state_dict), logger)
    resampled = resample_position_embeddings(model, state_dict, logger)
    report = load_state_dict_checked(model, state_dict, logger)
    report.classifier_head, report.resampled = head, resampled
    return report


def _without_classifier_head(model: nn.Module, state_dict: StateDict, logger):
    """The state dict without an image classifier's head (``head.*``: timm's, the official PVT and
    Swin releases'), and the keys dropped, which are logged."""
    head = [k for k in state_dict if k.startswith('head.')]
    if head:
        print_log(f'{type(model).__name__}: dropped the classifier head of the checkpoint: '
                  + ', '.join(head), logger=logger)
    return OrderedDict((k, v) for k, v in state_dict.items() if k not in head), head


def _position_embedding_grids(model: nn.Module) -> Dict[str, tuple]:
    """{key: (rows, columns)} of the model's absolute position embeddings: PVT v1's per stage
    (mmdet's ``AbsolutePositionEmbedding``, its ``pos_shape``) and Swin's ``absolute_pos_embed``
    (square: mmdet's Swin keeps no other shape)."""
    grids = {f'{name}.pos_embed': tuple(int(s) for s in module.pos_shape)
             for name, module in model.named_modules()
             if isinstance(module, AbsolutePositionEmbedding)}
    swin = getattr(model, 'absolute_pos_embed', None)
    if isinstance(swin, torch.Tensor):
        side = math.isqrt(swin.shape[1])
        grids['absolute_pos_embed'] = (side, side)
    return grids


def resample_position_embeddings(model: nn.Module, state_dict: StateDict, logger=None
                                 ) -> List[str]:
    """Resample (in place) the absolute position embeddings of ``state_dict`` whose grid differs
    from the model's, e.g. PVT's pretrained at 224 into a model with another
    ``pretrain_img_size``: bicubic with antialiasing, timm's ``resample_abs_pos_embed``, which
    timm applies when it loads weights into a model of another image size. Returns their keys.

    A checkpoint grid is square (as every released PVT and Swin checkpoint's). Embeddings that
    differ in anything but the number of tokens are left to the shape check, which names them.

    Raises:
        ValueError: a checkpoint embedding whose token count is not a square grid.
    """
    from timm.layers import resample_abs_pos_embed

    resampled, model_state = [], model.state_dict()
    for key, grid in _position_embedding_grids(model).items():
        pos, target = state_dict.get(key), model_state[key]
        if pos is None or pos.shape == target.shape or pos.dim() != 3 \
                or (pos.shape[0], pos.shape[2]) != (target.shape[0], target.shape[2]):
            continue
        side = math.isqrt(pos.shape[1])
        if side * side != pos.shape[1]:
            raise ValueError(f'{key}: the checkpoint\'s position embedding {tuple(pos.shape)} '
                             f'is not on a square grid; the model\'s is {grid[0]}x{grid[1]} '
                             f'{tuple(target.shape)}')
        state_dict[key] = resample_abs_pos_embed(pos, list(grid), [side, side],
                                                 num_prefix_tokens=0)
        resampled.append(key)
        print_log(f'{type(model).__name__}: {key}: position embedding resampled from the '
                  f'checkpoint\'s {side}x{side} grid to the model\'s {grid[0]}x{grid[1]} '
                  '(bicubic, as timm)', logger=logger)
    return resampled


def _from_reference_format(model: nn.Module, state_dict: StateDict, logger) -> StateDict:
    """Convert DTN layers saved by the authors' reference code, if there are any."""
    layers = [k[:-len('var_norm_weight')] for k in state_dict if k.endswith('.var_norm_weight')]
    if not layers:
        return state_dict
    name = type(model).__name__
    print_log(f"{name}: converting {len(layers)} DTN layers from the reference code's format",
              logger=logger)
    plain = [n for n, m in model.named_modules()
             if isinstance(m, DynamicTokenNorm) and not m.reference_compat]
    if plain:
        print_log(f'{name}: the checkpoint holds DTN layers of the reference code, but '
                  f'{len(plain)} DTN layers (e.g. {plain[0]}) compute the paper\'s statistics; '
                  'build the backbone with dtn_reference_compat=True to reproduce that code\'s '
                  'outputs', logger=logger, level=logging.WARNING)
    return convert_reference_state_dict(state_dict)
