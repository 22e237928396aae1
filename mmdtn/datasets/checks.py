"""Up-front checks of the datasets a config points to, with errors that name paths and layouts.

mmdet and mmseg notice a missing or broken dataset late: inside a data-loader worker, when the
Runner first builds a loader, or mid-epoch when an image listed in the annotations cannot be read;
the message is then a long traceback from deep inside a library. ``check_datasets(cfg, phases)``
runs before the Runner is built (``tools/train.py`` and ``tools/test.py`` call it) and raises

- :class:`DatasetNotFoundError` (a ``FileNotFoundError``) when the data root, an annotation file,
  an image folder or images listed in the annotations are missing; the message names the missing
  path and the layout the config expects (e.g. ``data/coco/annotations/instances_train2017.json``
  and ``data/coco/train2017/``);
- :class:`DatasetFormatError` (a ``ValueError``) when an annotation file is not valid JSON, is
  truncated, lacks COCO's fields, or does not contain the classes the config trains on, or when an
  image classification folder (mmpretrain's ImageNet layout) has another number of class folders
  than the config has classes, or the folders of the config's classes, which mmpretrain numbers in
  sorted order, in another order.

Images without annotations and crowd (RLE) annotations are valid COCO and pass; mmdet handles them
(the former are skipped in training by ``filter_empty_gt``, the latter become ignored instances).
Only local paths are checked; datasets behind a file backend (``backend_args``, URLs) are left to
mmengine's file I/O.
"""
import inspect
import json
import os
import os.path as osp
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

__all__ = ['DatasetNotFoundError', 'DatasetFormatError', 'check_datasets', 'check_dataset_cfg',
           'check_coco_annotations', 'dataset_cfgs']

# Where to get the datasets the configs use, by dataset type.
_DOWNLOAD_HINTS = {
    'CocoDataset': ('COCO 2017 is at https://cocodataset.org/#download (train2017.zip, '
                    'val2017.zip, annotations_trainval2017.zip); mmdet\'s '
                    'tools/misc/download_dataset.py --dataset-name coco2017 fetches it.'),
    'ADE20KDataset': ('ADE20K (SceneParsing, ADEChallengeData2016.zip) is at '
                      'http://data.csail.mit.edu/places/ADEchallenge/ADEChallengeData2016.zip; '
                      'unzip it under data/ade/.'),
    'ImageNet': ('ImageNet-1k (ILSVRC 2012: ILSVRC2012_img_train.tar, ILSVRC2012_img_val.tar) is '
                 'at https://image-net.org/download-images.php (sign-in required). mmpretrain '
                 'reads train/ and val/ with one folder per class (n01440764/ ...; the val '
                 'images sorted into class folders too), or flat folders with '
                 "meta/train.txt and meta/val.txt listing '<image path> <class index>' per line."),
}
_MAX_LISTED = 5  # missing files named in a message


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's root, annotation file, image folder or listed images do not exist."""


class DatasetFormatError(ValueError):
    """An annotation file exists but cannot be used (not JSON, truncated, missing COCO fields)."""


def _is_remote(path: str, backend_args: Optional[dict]) -> bool:
    remote_backend = bool(backend_args) and backend_args.get('backend', 'local') != 'local'
    return '://' in str(path) or remote_backend


def _join(root: Optional[str], path: Optional[str]) -> Optional[str]:
    """mmengine's BaseDataset rule: relative paths are joined to ``data_root``."""
    if path is None:
        return None
    if root and not osp.isabs(path):
        return osp.join(root, path)
    return path


def dataset_cfgs(cfg, phase: str) -> Iterator[dict]:
    """The dataset configs of ``cfg.<phase>_dataloader``, wrappers (Repeat, Concat...) unwrapped."""
    loader = cfg.get(f'{phase}_dataloader')
    if not loader or not loader.get('dataset'):
        return

    def unwrap(ds):
        if 'datasets' in ds:
            for d in ds['datasets']:
                yield from unwrap(d)
        elif 'dataset' in ds and isinstance(ds['dataset'], dict):
            yield from unwrap(ds['dataset'])
        else:
            yield ds

    yield from unwrap(loader['dataset'])


def _dataset_class(type_name, scope: Optional[str]):
    """The registered dataset class for ``type_name`` (class objects pass through), or None."""
    if not isinstance(type_name, str):
        return type_name
    from mmengine.registry import DATASETS, DefaultScope
    registry = DATASETS
    if scope == 'mmdet':
        from mmdet.registry import DATASETS as registry
    elif scope == 'mmseg':
        from mmseg.registry import DATASETS as registry
    elif scope == 'mmpretrain':
        from mmpretrain.registry import DATASETS as registry
    try:
        with DefaultScope.overwrite_default_scope(scope):
            return registry.get(type_name)
    except Exception:  # an unknown type is reported by the Runner itself
        return None


def _class_default(cls, name: str, fallback):
    if cls is None:
        return fallback
    try:
        param = inspect.signature(cls.__init__).parameters.get(name)
    except (TypeError, ValueError):
        return fallback
    if param is None or param.default is inspect.Parameter.empty:
        return fallback
    return param.default


def _is_seg_dataset(cls) -> bool:
    try:
        from mmseg.datasets import BaseSegDataset
    except ImportError:  # pragma: no cover
        return False
    return inspect.isclass(cls) and issubclass(cls, BaseSegDataset)


def _is_cls_dataset(cls) -> bool:
    """An mmpretrain folder dataset (``CustomDataset``: ImageNet and the like)."""
    try:
        from mmpretrain.datasets import CustomDataset
    except ImportError:
        return False
    return inspect.isclass(cls) and issubclass(cls, CustomDataset)


def _data_prefix(ds: dict) -> dict:
    """``data_prefix`` as a dict: mmpretrain's datasets also take a string, and its ImageNet
    defaults to the ``split`` folder."""
    prefix = ds.get('data_prefix') or ds.get('split') or {}
    return {'img_path': prefix} if isinstance(prefix, str) else prefix


def _layout_lines(cfg, data_root: Optional[str]) -> List[str]:
    """The files and folders every phase of ``cfg`` expects under ``data_root``."""
    entries: Dict[str, Tuple[str, List[str]]] = {}

    def add(path, what, phase):
        _, phases = entries.setdefault(path, (what, []))
        if phase not in phases:
            phases.append(phase)

    for phase in ('train', 'val', 'test'):
        for ds in dataset_cfgs(cfg, phase):
            if ds.get('data_root') != data_root:
                continue
            ann = _join(data_root, ds.get('ann_file') or None)
            if ann:
                add(ann, 'annotations', phase)
            for key, value in _data_prefix(ds).items():
                if isinstance(value, str):
                    what = {'img': 'images', 'img_path': 'images',
                            'seg_map_path': 'label maps', 'seg': 'label maps'}.get(key, key)
                    add(osp.join(_join(data_root, value) or '', ''), what, phase)
    return [f'{path}  ({"/".join(phases)} {what})' for path, (what, phases) in entries.items()]


def _not_found(what: str, path: str, cfg, ds: dict) -> DatasetNotFoundError:
    root = ds.get('data_root')
    layout = _layout_lines(cfg, root) if cfg is not None else []
    msg = [f'{what} not found: {path!r} (resolved from {os.getcwd()!r}: {osp.abspath(path)}).']
    if layout:
        msg.append(f'The config expects this layout under data root {root!r}:')
        msg += [f'  {line}' for line in layout]
    type_name = ds.get('type')
    type_name = type_name.split('.')[-1] if isinstance(type_name, str) else None
    if type_name in _DOWNLOAD_HINTS:
        msg.append(_DOWNLOAD_HINTS[type_name])
    msg.append('Put (or link) the dataset there, or point the config to it, e.g. '
               '--cfg-options train_dataloader.dataset.data_root=/path/to/data/ (and the same for '
               'val/test loaders and evaluator ann_file).')
    return DatasetNotFoundError('\n'.join(msg))


def _load_json(path: str) -> dict:
    try:
        with open(path, 'rb') as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        size = osp.getsize(path)
        raise DatasetFormatError(
            f'annotation file {path!r} ({size} bytes) is not valid JSON: {e.msg} at line '
            f'{e.lineno} column {e.colno} (character {e.pos}). The file is corrupt or truncated; '
            'download or generate it again.') from None
    except UnicodeDecodeError as e:
        raise DatasetFormatError(f'annotation file {path!r} is not UTF-8 JSON text: {e}') from None


def _require(entries, kind: str, keys: Tuple[str, ...], path: str):
    if not isinstance(entries, list):
        raise DatasetFormatError(
            f'annotation file {path!r}: "{kind}" must be a list, got {type(entries).__name__}')
    for i, entry in enumerate(entries):
        missing = [k for k in keys if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise DatasetFormatError(
                f'annotation file {path!r}: {kind}[{i}] lacks {missing} (COCO format needs '
                f'{list(keys)} in every entry of "{kind}"); entry: {str(entry)[:200]}')


def check_coco_annotations(path: str, classes: Optional[Iterable[str]] = None,
                           _cache: Optional[Dict[str, dict]] = None) -> dict:
    """Load a COCO-format annotation file and check the fields mmdet reads; return its content.

    Raises :class:`DatasetNotFoundError` if ``path`` does not exist and :class:`DatasetFormatError`
    if it is not JSON, lacks ``images``/``categories`` or the per-entry fields mmdet's CocoDataset
    and pycocotools read, or lacks one of ``classes`` among its category names (mmdet would then
    silently shift the labels of the remaining classes).
    """
    if _cache is not None and path in _cache:
        data = _cache[path]
    else:
        if not osp.isfile(path):
            raise DatasetNotFoundError(f'annotation file not found: {path!r} '
                                       f'(resolved from {os.getcwd()!r}: {osp.abspath(path)})')
        data = _load_json(path)
        if not isinstance(data, dict):
            raise DatasetFormatError(
                f'annotation file {path!r} holds a JSON {type(data).__name__}, not a COCO-format '
                'object with "images" and "categories"')
        for key in ('images', 'categories'):
            if key not in data:
                raise DatasetFormatError(
                    f'annotation file {path!r} has no "{key}" (keys: {sorted(data)}); '
                    'it is not in COCO format')
        _require(data['images'], 'images', ('id', 'file_name', 'height', 'width'), path)
        _require(data['categories'], 'categories', ('id', 'name'), path)
        # Test-set files (image_info_*.json) have no annotations at all; that is valid.
        _require(data.get('annotations', []), 'annotations',
                 ('id', 'image_id', 'category_id', 'bbox', 'area'), path)
        for i, ann in enumerate(data.get('annotations', [])):
            if not (isinstance(ann['bbox'], (list, tuple)) and len(ann['bbox']) == 4):
                raise DatasetFormatError(f'annotation file {path!r}: annotations[{i}]["bbox"] must '
                                         f'be [x, y, w, h], got {ann["bbox"]!r}')
        if _cache is not None:
            _cache[path] = data
    if classes is not None:
        names = {c['name'] for c in data['categories']}
        missing = [c for c in classes if c not in names]
        if missing:
            raise DatasetFormatError(
                f'annotation file {path!r} has no categories named {missing[:10]}'
                f'{" ..." if len(missing) > 10 else ""} ({len(missing)} of the config\'s '
                f'{len(list(classes))} classes); its categories are '
                f'{sorted(names)[:10]}{" ..." if len(names) > 10 else ""}. Set the dataset\'s '
                'metainfo=dict(classes=...) to the names in the file.')
    return data


def _missing_files(folder: str, names: Iterable[str]) -> List[str]:
    """The names (relative paths) that are not files in ``folder``; one listdir for flat names."""
    try:
        flat = set(os.listdir(folder))
    except OSError:
        flat = set()
    return [n for n in names
            if not (n in flat if '/' not in n else osp.isfile(osp.join(folder, n)))]


def _report_missing(kind: str, missing: List[str], total: int, folder: str, source: str):
    if missing:
        shown = ', '.join(repr(m) for m in missing[:_MAX_LISTED])
        more = f' and {len(missing) - _MAX_LISTED} more' if len(missing) > _MAX_LISTED else ''
        raise DatasetNotFoundError(
            f'{len(missing)} of {total} {kind} listed in {source} are missing from '
            f'{osp.join(folder, "")}: {shown}{more}')


def _check_coco_dataset(ds: dict, cls, cfg, cache) -> None:
    root = ds.get('data_root')
    ann_file = _join(root, ds.get('ann_file'))
    if not osp.isfile(ann_file):
        raise _not_found('annotation file', ann_file, cfg, ds)
    classes = (ds.get('metainfo') or {}).get('classes') or \
        (getattr(cls, 'METAINFO', None) or {}).get('classes')
    data = check_coco_annotations(ann_file, classes, cache)
    img_dir = _join(root, (ds.get('data_prefix') or {}).get('img', '')) or '.'
    if not osp.isdir(img_dir):
        raise _not_found('image folder', img_dir, cfg, ds)
    names = [img['file_name'] for img in data['images']]
    _report_missing('images', _missing_files(img_dir, names), len(names), img_dir,
                    f'{ann_file!r} ("file_name" of "images")')


def _check_seg_dataset(ds: dict, cls, cfg) -> None:
    root = ds.get('data_root')
    prefix = ds.get('data_prefix') or {}
    img_dir = _join(root, prefix.get('img_path', '')) or '.'
    seg_dir = _join(root, prefix.get('seg_map_path'))
    img_suffix = ds.get('img_suffix', _class_default(cls, 'img_suffix', '.jpg'))
    seg_suffix = ds.get('seg_map_suffix', _class_default(cls, 'seg_map_suffix', '.png'))
    for what, folder in (('image folder', img_dir), ('label map folder', seg_dir)):
        if folder is not None and not osp.isdir(folder):
            raise _not_found(what, folder, cfg, ds)
    ann_file = _join(root, ds.get('ann_file') or None)
    if ann_file and not osp.isdir(ann_file):
        if not osp.isfile(ann_file):
            raise _not_found('split file', ann_file, cfg, ds)
        with open(ann_file) as f:
            stems = [line.strip() for line in f if line.strip()]
        source = repr(ann_file)
        _report_missing('images', _missing_files(img_dir, [s + img_suffix for s in stems]),
                        len(stems), img_dir, source)
    else:
        stems = sorted(osp.relpath(osp.join(d, n), img_dir)[:-len(img_suffix)]
                       for d, _, files in os.walk(img_dir, followlinks=True)
                       for n in files if n.endswith(img_suffix))
        if not stems:
            raise DatasetNotFoundError(
                f'no images (*{img_suffix}) found in {osp.join(img_dir, "")}; '
                f'expected layout: {_layout_lines(cfg, root) if cfg is not None else img_dir}')
        source = f'{osp.join(img_dir, "")} (one *{seg_suffix} per *{img_suffix})'
    if seg_dir is not None:
        _report_missing('label maps', _missing_files(seg_dir, [s + seg_suffix for s in stems]),
                        len(stems), seg_dir, source)


def _check_cls_dataset(ds: dict, cls, cfg) -> None:
    """An mmpretrain folder dataset: the image folder, and either the annotation list (given, or
    ImageNet's ``meta/<split>.txt``) or one folder per class of the config."""
    root = ds.get('data_root')
    img_dir = _join(root, _data_prefix(ds).get('img_path', '')) or '.'
    if not osp.isdir(img_dir):
        raise _not_found('image folder', img_dir, cfg, ds)
    ann_file = _join(root, ds.get('ann_file') or None)
    split_list = _join(root, osp.join('meta', f'{ds["split"]}.txt')) if ds.get('split') else None
    if ann_file is None and split_list and osp.isfile(split_list):
        ann_file = split_list  # ImageNet's flat layout
    if ann_file is not None:
        if not osp.isfile(ann_file):
            raise _not_found('annotation file', ann_file, cfg, ds)
        return
    if not ds.get('with_label', True) or ds.get('split') == 'test':
        return
    folders = [d for d in os.listdir(img_dir) if osp.isdir(osp.join(img_dir, d))]
    classes = (ds.get('metainfo') or {}).get('classes') or \
        (getattr(cls, 'METAINFO', None) or {}).get('classes')
    if classes and set(folders) == set(classes) and sorted(folders) != list(classes):
        raise DatasetFormatError(  # the labels would be right, the class names not
            f'{osp.join(img_dir, "")}: mmpretrain numbers the class folders in sorted order '
            f'({", ".join(sorted(folders))}); list the classes in that order, not '
            f'{", ".join(classes)}.')
    if not folders or (classes and len(folders) != len(classes)):
        expected = f'{len(classes)} (one per class)' if classes else 'one per class'
        raise DatasetFormatError(
            f'{osp.join(img_dir, "")} holds {len(folders)} class folders, expected {expected}'
            + (f'; or list the images in {split_list}' if split_list else '') + '.'
            + (f' {_DOWNLOAD_HINTS[cls.__name__]}' if cls.__name__ in _DOWNLOAD_HINTS else ''))


def check_dataset_cfg(ds: dict, cfg=None, scope: Optional[str] = None,
                      cache: Optional[Dict[str, dict]] = None) -> None:
    """Check one dataset config (``type``, ``data_root``, ``ann_file``, ``data_prefix``).

    COCO-format datasets (a ``.json`` ``ann_file``): the file, its fields and classes, the image
    folder and every listed image. mmseg datasets: the image and label-map folders and a label map
    for every image. mmpretrain folder datasets (ImageNet): the image folder and its annotation
    list or class folders. Other datasets: the data root, annotation file and folders exist.
    ``cfg`` (the whole config) is used to describe the expected layout in messages.
    """
    if _is_remote(ds.get('data_root') or '', ds.get('backend_args')):
        return
    scope = scope or (cfg.get('default_scope') if cfg is not None else None)
    root = ds.get('data_root')
    if root and not osp.isdir(root):
        raise _not_found('dataset (data root)', root, cfg, ds)
    cls = _dataset_class(ds.get('type'), scope)
    ann_file = ds.get('ann_file') or ''
    if _is_seg_dataset(cls):
        _check_seg_dataset(ds, cls, cfg)
    elif _is_cls_dataset(cls):
        _check_cls_dataset(ds, cls, cfg)
    elif isinstance(ann_file, str) and ann_file.endswith('.json'):
        _check_coco_dataset(ds, cls, cfg, cache if cache is not None else {})
    else:
        path = _join(root, ann_file or None)
        if path and not osp.exists(path):
            raise _not_found('annotation file', path, cfg, ds)
        for value in _data_prefix(ds).values():
            folder = _join(root, value) if isinstance(value, str) else None
            if folder and not osp.isdir(folder):
                raise _not_found('data folder', folder, cfg, ds)


def check_datasets(cfg, phases: Iterable[str] = ('train', 'val')) -> None:
    """Check every dataset and evaluator annotation file ``cfg`` uses in ``phases``.

    Raises :class:`DatasetNotFoundError` or :class:`DatasetFormatError` (see the module docstring).
    """
    cache: Dict[str, dict] = {}
    scope = cfg.get('default_scope')
    for phase in phases:
        for ds in dataset_cfgs(cfg, phase):
            check_dataset_cfg(ds, cfg, scope, cache)
        evaluators = cfg.get(f'{phase}_evaluator') or []
        for ev in evaluators if isinstance(evaluators, (list, tuple)) else [evaluators]:
            ann_file = ev.get('ann_file') if isinstance(ev, dict) else None
            if ann_file and not _is_remote(ann_file, ev.get('backend_args')):
                if not osp.isfile(ann_file):
                    ds = next(dataset_cfgs(cfg, phase), {})
                    raise _not_found(f'{phase}_evaluator annotation file', ann_file, cfg, ds)
                check_coco_annotations(ann_file, _cache=cache)
