"""Bad or missing datasets stop with clear errors; empty images and crowd annotations just work.

Missing data root (COCO, ADE20K, ImageNet), missing or corrupt annotation file, an image listed
but absent, a missing label map, class folders that do not match the config:
``mmdtn.datasets.check_datasets`` (run by tools/train.py and tools/test.py before the Runner
is built) raises an error naming the path and the expected layout. Images without annotations and
crowd (RLE) annotations are valid COCO: mmdet's CocoDataset and CocoMetric handle them, checked
here exactly (a perfect prediction scores AP 1, a detection on a crowd region is not a false
positive).
"""
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
from mmengine.config import Config
from mmengine.registry import init_default_scope
from pycocotools import mask as mask_utils

import mmdtn  # noqa: F401
from mmdtn.datasets import (DatasetFormatError, DatasetNotFoundError, check_dataset_cfg,
                            check_datasets)
from tiny_datasets import CLASSES, CONFIGS, det_overrides, env_for_subprocess, make_coco, make_seg

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))


def tiny_det_cfg(tmp_path, root, with_mask=True):
    path = tmp_path / 'cfg.py'
    base = osp.join(CONFIGS, 'pvt', 'mask-rcnn_pvt-t-dtn_fpn_1x_coco.py')
    path.write_text(f"_base_ = {base!r}\n" + det_overrides(root, with_mask=with_mask))
    return Config.fromfile(str(path))


@pytest.fixture
def coco(tmp_path):
    root = str(tmp_path / 'coco')
    ann = make_coco(root, {'train': 3, 'val': 2}, empty_image=True, crowd=True)
    return root, ann, tiny_det_cfg(tmp_path, root)


def test_train_tool_missing_coco_names_expected_layout(tmp_path):
    """The command users type, in a directory without data/: one clear message, no traceback."""
    proc = subprocess.run(
        [sys.executable, osp.join(REPO, 'tools', 'train.py'),
         osp.join(CONFIGS, 'pvt', 'retinanet_pvt-t-dtn_fpn_1x_coco.py')],
        cwd=tmp_path, env=env_for_subprocess(None, REPO), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1
    err = proc.stderr
    assert 'Traceback' not in err and 'Traceback' not in proc.stdout
    assert "dataset (data root) not found: 'data/coco/'" in err
    for expected in ('data/coco/annotations/instances_train2017.json', 'data/coco/train2017/',
                     'data/coco/annotations/instances_val2017.json', 'data/coco/val2017/'):
        assert expected in err, err
    assert not (tmp_path / 'work_dirs').exists() or not os.listdir(tmp_path / 'work_dirs')


def test_missing_ade20k_names_expected_layout(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = Config.fromfile(osp.join(
        CONFIGS, 'swin',
        'swin-tiny-patch4-window7-in1k-pre-dtn_upernet_8xb2-160k_ade20k-512x512.py'))
    with pytest.raises(DatasetNotFoundError) as e:
        check_datasets(cfg, ['train', 'val'])
    msg = str(e.value)
    assert "'data/ade/ADEChallengeData2016'" in msg
    for expected in ('data/ade/ADEChallengeData2016/images/training/',
                     'data/ade/ADEChallengeData2016/annotations/training/',
                     'data/ade/ADEChallengeData2016/images/validation/',
                     'data/ade/ADEChallengeData2016/annotations/validation/'):
        assert expected in msg


def test_missing_imagenet_names_expected_layout(tmp_path, monkeypatch):
    """The ImageNet configs without data/imagenet/: the error names the folders mmpretrain reads
    and where ImageNet-1k comes from."""
    monkeypatch.chdir(tmp_path)
    cfg = Config.fromfile(osp.join(CONFIGS, 'imagenet', 'pvt-t-dtn_8xb128_in1k.py'))
    with pytest.raises(DatasetNotFoundError) as e:
        check_datasets(cfg, ['train', 'val', 'test'])
    msg = str(e.value)
    assert "dataset (data root) not found: 'data/imagenet'" in msg
    for expected in ('data/imagenet/train/', 'data/imagenet/val/', 'ILSVRC2012_img_train.tar',
                     'meta/train.txt'):
        assert expected in msg, msg


def test_imagenet_class_folders_must_match_the_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for split in ('train', 'val'):
        os.makedirs(tmp_path / 'data' / 'imagenet' / split / 'n01440764')
    cfg = Config.fromfile(osp.join(CONFIGS, 'imagenet', 'pvt-t-dtn_8xb128_in1k.py'))
    with pytest.raises(DatasetFormatError, match=r'data/imagenet/train/ holds 1 class folders, '
                       r'expected 1000'):
        check_datasets(cfg, ['train'])


def test_classification_classes_in_another_order_than_mmpretrains_labels(tmp_path):
    """mmpretrain's CustomDataset labels class folders in sorted order whatever the config's
    classes say: classes listed in another order would name every label wrongly."""
    for name in ('cat', 'ant'):
        os.makedirs(tmp_path / 'train' / name)
    ds = dict(type='CustomDataset', data_root=str(tmp_path), data_prefix='train',
              metainfo=dict(classes=('cat', 'ant')))
    with pytest.raises(DatasetFormatError, match=r'sorted order \(ant, cat\); list the classes in '
                       r'that order, not cat, ant'):
        check_dataset_cfg(ds, scope='mmpretrain')
    check_dataset_cfg(dict(ds, metainfo=dict(classes=('ant', 'cat'))), scope='mmpretrain')


def test_valid_tiny_coco_passes(coco):
    _, _, cfg = coco
    check_datasets(cfg, ['train', 'val', 'test'])


def test_missing_annotation_file(coco):
    _, ann, cfg = coco
    os.remove(ann['train'])
    with pytest.raises(DatasetNotFoundError, match='annotation file not found') as e:
        check_datasets(cfg, ['train'])
    assert ann['train'] in str(e.value) and 'instances_val.json' in str(e.value)  # the layout


@pytest.mark.parametrize('content, match', [
    ('{"images": [{"id": 1, "file_na', 'is not valid JSON: .* line 1'),  # truncated
    ('', 'is not valid JSON'),
    ('[1, 2]', 'holds a JSON list'),
    ('{"annotations": []}', 'has no "images"'),
    ('{"images": [{"id": 1}], "categories": []}', r"images\[0\] lacks \['file_name', 'height'"),
])
def test_corrupt_annotation_file(coco, content, match):
    _, ann, cfg = coco
    with open(ann['train'], 'w') as f:
        f.write(content)
    with pytest.raises(DatasetFormatError, match=match) as e:
        check_datasets(cfg, ['train'])
    assert ann['train'] in str(e.value)


def test_annotation_without_the_configs_classes(coco):
    _, ann, cfg = coco
    cfg.train_dataloader.dataset.metainfo = dict(classes=('square', 'triangle'))
    with pytest.raises(DatasetFormatError, match=r"no categories named \['triangle'\]"):
        check_datasets(cfg, ['train'])


def test_image_listed_but_absent(coco):
    root, ann, cfg = coco
    os.remove(osp.join(root, 'val', 'val_001.jpg'))
    with pytest.raises(DatasetNotFoundError) as e:
        check_datasets(cfg, ['train', 'val'])
    msg = str(e.value)
    assert "1 of 3 images listed in" in msg and "'val_001.jpg'" in msg
    assert osp.join(root, 'val', '') in msg and ann['val'] in msg


def test_evaluator_annotation_file_missing(coco):
    _, _, cfg = coco
    cfg.val_evaluator.ann_file = '/nonexistent/instances_val.json'
    with pytest.raises(DatasetNotFoundError, match='val_evaluator annotation file not found'):
        check_datasets(cfg, ['val'])


def test_segmentation_label_map_missing(tmp_path):
    root = str(tmp_path / 'seg')
    make_seg(root)
    cfg = Config.fromfile(osp.join(CONFIGS, 'pvt', 'fpn_pvt-t-dtn_8xb4-40k_ade20k-512x512.py'))
    cfg.train_dataloader.dataset.data_root = root
    check_datasets(cfg, ['train'])
    os.remove(osp.join(root, 'annotations', 'training', '002.png'))
    with pytest.raises(DatasetNotFoundError, match=r"1 of 4 label maps .* '002.png'"):
        check_datasets(cfg, ['train'])
    os.rename(osp.join(root, 'images', 'training'), osp.join(root, 'images', 'train'))
    with pytest.raises(DatasetNotFoundError, match='image folder not found') as e:
        check_datasets(cfg, ['train'])
    assert osp.join(root, 'images', 'training') in str(e.value)


def _build_dataset(cfg, phase):
    from mmdet.registry import DATASETS
    init_default_scope('mmdet')
    ds_cfg = cfg[f'{phase}_dataloader'].dataset.copy()
    ds_cfg.pipeline = [dict(type='LoadImageFromFile'),
                       dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                       dict(type='PackDetInputs')]
    return DATASETS.build(ds_cfg)


def test_empty_images_and_crowd_rle_are_handled(coco):
    root, ann, cfg = coco
    with open(ann['val']) as f:
        data = json.load(f)
    crowd = [a for a in data['annotations'] if a['iscrowd']]
    assert len(crowd) == 1 and isinstance(crowd[0]['segmentation']['counts'], list)

    # Training skips the image without annotations (filter_empty_gt); testing keeps it.
    train = _build_dataset(cfg, 'train')
    val = _build_dataset(cfg, 'val')
    assert len(train) == 3 and len(val) == 3
    assert sum(len(val.get_data_info(i)['instances']) == 0 for i in range(len(val))) == 1

    # The crowd object is an ignored instance whose RLE mask decodes to its exact area.
    sample = val[0]['data_samples']
    assert len(sample.ignored_instances) == 1
    crowd_mask = sample.ignored_instances.masks.to_ndarray()[0]
    assert crowd_mask.sum() == crowd[0]['area']
    assert len(sample.gt_instances) == 1  # the regular object of image 1

    # CocoMetric: perfect predictions score AP 1 (bbox and segm); an extra confident detection on
    # the crowd region is matched to the crowd and ignored, not counted as a false positive.
    from mmdet.evaluation import CocoMetric
    metric = CocoMetric(ann_file=ann['val'], metric=['bbox', 'segm'])
    metric.dataset_meta = dict(classes=CLASSES)
    h, w = data['images'][0]['height'], data['images'][0]['width']
    preds = []
    for img in data['images']:
        boxes, labels, masks = [], [], []
        for a in data['annotations']:
            if a['image_id'] != img['id']:
                continue
            x, y, bw, bh = a['bbox']
            boxes.append([x, y, x + bw, y + bh])
            labels.append(a['category_id'] - 1)
            seg = a['segmentation']
            rle = mask_utils.frPyObjects(seg, h, w)
            masks.append(mask_utils.decode(mask_utils.merge(rle) if isinstance(rle, list) else rle))
        n = len(boxes)
        preds.append(dict(
            img_id=img['id'], ori_shape=(h, w),
            pred_instances=dict(
                bboxes=torch.tensor(boxes, dtype=torch.float32).reshape(n, 4),
                scores=torch.full((n,), 0.9), labels=torch.tensor(labels, dtype=torch.long),
                masks=torch.from_numpy(np.array(masks, dtype=bool).reshape(n, h, w)))))
    metric.process({}, preds)
    results = metric.evaluate(size=len(preds))
    assert results['coco/bbox_mAP'] == pytest.approx(1.0)
    assert results['coco/segm_mAP'] == pytest.approx(1.0)
