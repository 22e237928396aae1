"""The CPU demo: the synthetic shapes generator, a shortened ``tools/demo.py`` run, and the pieces
of ``tools/demo.py --pretrain``.

The short run trains Mask R-CNN PVT-Tiny-DTN from scratch for 150 of the demo's 500 iterations
and must reach a bbox and segm AP that an untrained model cannot reach. The pretraining route is
checked piece by piece (each piece runs whole in the tools' tests and in the measured demo): the
shape crops are an mmpretrain classification set whose labels are the source annotations', and a
classifier checkpoint of the demo's pretraining config starts the demo detector's backbone with
every tensor, DTN's gates and positional coefficients included, carried over.
"""
import collections
import copy
import importlib.util
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
from mmengine.registry import init_default_scope
from mmengine.runner.checkpoint import save_checkpoint
from PIL import Image
from pycocotools.coco import COCO

from mmdtn.datasets import check_datasets, generate_shape_crops
from mmdtn.datasets.synthetic_shapes import SHAPE_CLASSES, ShapesSpec, generate_shapes_dataset
from mmdtn.models.layers import DTN_ONLY_PARAMETERS

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
SMALL = dict(num_train=6, num_val=3, image_size=(96, 64), seed=3)

# Measured on the demo's data (val split, 50 images), single thread:
#   untrained (1 iteration):  bbox AP 0.000, AP50 0.000; segm AP 0.000
#   150 iterations:           bbox AP 0.027, AP50 0.084; segm AP 0.051
# The floors leave a factor of about 2.5 for run-to-run (thread count, platform) differences.
SHORT_ITERS = 150
FLOORS = {'coco/bbox_mAP': 0.01, 'coco/bbox_mAP_50': 0.03, 'coco/segm_mAP': 0.02}


def read(path):
    with open(path, 'rb') as f:
        return f.read()


def test_generator_is_deterministic_and_idempotent(tmp_path):
    a = generate_shapes_dataset(tmp_path / 'a', progress=False, **SMALL)
    b = generate_shapes_dataset(tmp_path / 'b', progress=False, **SMALL)
    for split in ('train', 'val'):
        assert read(a[f'{split}_ann']) == read(b[f'{split}_ann'])
        n = SMALL[f'num_{split}']
        for i in range(n):
            name = f'{i:06d}.png'
            image_a, image_b = osp.join(a[f'{split}_img'], name), osp.join(b[f'{split}_img'], name)
            assert read(image_a) == read(image_b)
    # a second call with the same settings reuses the files untouched
    mtime = os.stat(a['train_ann']).st_mtime_ns
    generate_shapes_dataset(tmp_path / 'a', progress=False, **SMALL)
    assert os.stat(a['train_ann']).st_mtime_ns == mtime
    # other settings rewrite the set; a different seed gives different data
    generate_shapes_dataset(tmp_path / 'a', progress=False, **dict(SMALL, seed=4))
    assert read(a['train_ann']) != read(b['train_ann'])
    # an incomplete set (a missing image) is regenerated
    os.remove(osp.join(b['val_img'], '000001.png'))
    generate_shapes_dataset(tmp_path / 'b', progress=False, **SMALL)
    assert osp.isfile(osp.join(b['val_img'], '000001.png'))


def test_generator_writes_valid_coco_with_masks_matching_boxes(tmp_path):
    info = generate_shapes_dataset(tmp_path, progress=False, **SMALL)
    coco = COCO(info['train_ann'])
    assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(SHAPE_CLASSES)
    assert len(coco.getImgIds()) == SMALL['num_train']
    spec = ShapesSpec(**SMALL)
    for img_id in coco.getImgIds():
        img = coco.loadImgs(img_id)[0]
        assert (img['width'], img['height']) == spec.image_size
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        assert spec.min_objects <= len(anns) <= spec.max_objects
        union = np.zeros((img['height'], img['width']), np.int32)
        for ann in anns:
            mask = coco.annToMask(ann)
            ys, xs = np.nonzero(mask)
            x, y, w, h = ann['bbox']
            # the rasterized mask lies within its box (pixel tolerance) and fills a fair part of it
            assert xs.min() >= x - 1 and xs.max() <= x + w + 1
            assert ys.min() >= y - 1 and ys.max() <= y + h + 1
            assert abs(mask.sum() - ann['area']) <= 0.25 * ann['area'] + 20
            union += mask
        assert union.max() <= 1  # occlusion-free: masks do not overlap


def test_generator_rejects_bad_settings(tmp_path):
    with pytest.raises(ValueError, match='max_size'):
        generate_shapes_dataset(tmp_path, progress=False, image_size=(32, 32), max_size=40)
    with pytest.raises(ValueError, match='min_objects'):
        generate_shapes_dataset(tmp_path, progress=False, min_objects=3, max_objects=2)


def test_short_demo_run_learns(tmp_path):
    work_dir = tmp_path / 'work'
    cmd = [sys.executable, 'tools/demo.py', '--iters', str(SHORT_ITERS),
           '--work-dir', str(work_dir),
           '--data-root', str(tmp_path / 'data'), '--num-vis', '2']
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(work_dir / 'metrics.json') as f:
        result = json.load(f)
    metrics = result['metrics']
    assert result['iters'] == SHORT_ITERS
    for key, floor in FLOORS.items():
        assert metrics[key] >= floor, (key, metrics)
    assert 'bbox' in proc.stdout and 'AP50' in proc.stdout  # the printed AP table
    drawn = sorted(os.listdir(work_dir / 'predictions'))
    assert len(drawn) == 2 and all(name.endswith('.png') for name in drawn)
    assert (work_dir / 'predictions.png').is_file() and (work_dir / 'losses.png').is_file()


def demo_tool():
    """The module of tools/demo.py."""
    spec = importlib.util.spec_from_file_location('demo_tool', osp.join(ROOT, 'tools', 'demo.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CROPS = dict(shapes=dict(num_train=4, num_val=2, seed=5), crop_size=32)


def files_under(root):
    return sorted(osp.relpath(osp.join(d, f), root) for d, _, names in os.walk(root)
                  for f in names)


def test_shape_crops_are_a_classification_set_of_the_annotated_shapes(tmp_path):
    from mmpretrain.datasets import CustomDataset

    a = generate_shape_crops(tmp_path / 'a', progress=False, **CROPS)
    b = generate_shape_crops(tmp_path / 'b', progress=False, **CROPS)
    assert files_under(a['root']) == files_under(b['root'])
    for name in files_under(a['root']):
        assert read(osp.join(a['root'], name)) == read(osp.join(b['root'], name))
    mtime = os.stat(osp.join(a['root'], 'meta.json')).st_mtime_ns  # reused as it is
    generate_shape_crops(tmp_path / 'a', progress=False, **CROPS)
    assert os.stat(osp.join(a['root'], 'meta.json')).st_mtime_ns == mtime

    source = osp.join(a['root'], 'source', 'annotations')
    for split in ('train', 'val'):
        # one crop per annotated shape, in the folder of its class
        coco = COCO(osp.join(source, f'instances_{split}.json'))
        expected = collections.Counter(SHAPE_CLASSES[ann['category_id'] - 1]
                                       for ann in coco.dataset['annotations'])
        assert sorted(os.listdir(a[split])) == sorted(SHAPE_CLASSES)
        assert {c: len(os.listdir(osp.join(a[split], c))) for c in SHAPE_CLASSES} == \
            {c: expected[c] for c in SHAPE_CLASSES}
        # read by mmpretrain's own folder dataset, labelled by folder
        dataset = CustomDataset(data_root=a['root'], data_prefix=split,
                                metainfo=dict(classes=a['classes']), pipeline=[])
        assert len(dataset) == sum(expected.values())
        for info in dataset:
            path = info['img_path']
            assert a['classes'][info['gt_label']] == osp.basename(osp.dirname(path))
            with Image.open(path) as im:
                assert im.size == (32, 32) and im.mode == 'RGB'
    with pytest.raises(ValueError, match='crop_size must be >= 8'):
        generate_shape_crops(tmp_path / 'c', progress=False, shapes=CROPS['shapes'], crop_size=4)


def test_classifier_checkpoint_starts_the_demo_detector(tmp_path):
    """The demo's pretraining config (through tools/demo.py's settings) on the generated crops,
    saved as mmengine saves it, then loaded by the demo detector as tools/demo.py configures it:
    every backbone tensor is the classifier's (DTN's gates and positional coefficients, perturbed
    here so that an initialization cannot pass for them), PVT's position embeddings resampled
    from the crops' grid by timm's function; on the crops' grid the backbone computes the
    classifier backbone's features."""
    from mmdet.registry import MODELS as DET_MODELS
    from mmpretrain.registry import MODELS as CLS_MODELS
    from timm.layers import resample_abs_pos_embed

    demo = demo_tool()
    args = demo.parse_args(['--pretrain', '--pretrain-iters', '3', '--data-root',
                            str(tmp_path / 'shapes'), '--pretrain-data-root',
                            str(tmp_path / 'crops'), '--work-dir', str(tmp_path / 'work')])
    cls_cfg = demo.build_classifier_config(args, str(tmp_path / 'work' / 'classifier'))
    assert cls_cfg.train_cfg.max_iters == 3 and cls_cfg.default_hooks.checkpoint.interval == 3
    generate_shape_crops(args.pretrain_data_root, progress=False,
                         **dict(cls_cfg.shape_crops_spec, **CROPS))
    check_datasets(cls_cfg, ['train', 'val'])  # as the demo does before training

    init_default_scope('mmpretrain')
    torch.manual_seed(0)
    classifier = CLS_MODELS.build(cls_cfg.model)
    classifier.init_weights()
    with torch.no_grad():
        for p in classifier.parameters():
            p.add_(0.05 * torch.randn_like(p))
    cls_state = classifier.backbone.state_dict()
    dtn_keys = [k for k in cls_state if k.rsplit('.', 1)[-1] in DTN_ONLY_PARAMETERS]
    # (mean_gate, var_gate, pos_coef) x (norm1, norm2) x 2 layers x DTN's stages (1-3)
    assert len(dtn_keys) == 3 * 2 * 2 * 3
    checkpoint = str(tmp_path / 'classifier.pth')
    save_checkpoint(dict(meta=dict(iter=3), state_dict=classifier.state_dict()), checkpoint)

    init_default_scope('mmdet')
    cfg = demo.build_config(args)
    cfg = demo.start_from(cfg, checkpoint, cfg.finetune.backbone_lr_mult)
    assert cfg.model.backbone.init_cfg == dict(type='Pretrained', checkpoint=checkpoint)
    detector = DET_MODELS.build(cfg.model)
    detector.init_weights()
    det_state = detector.backbone.state_dict()
    assert sorted(det_state) == sorted(cls_state)
    pos_keys = [k for k in cls_state if k.endswith('pos_embed')]
    for key, value in cls_state.items():
        if key in pos_keys:  # 32 x 32 crops -> 128 x 128 images: each grid 4 times as wide
            side = int(value.shape[1]**0.5)
            expected = resample_abs_pos_embed(value, [4 * side] * 2, [side] * 2,
                                              num_prefix_tokens=0)
            torch.testing.assert_close(det_state[key], expected, rtol=0, atol=0)
        else:
            assert torch.equal(det_state[key], value), key

    # on the crops' grid: the same tensors and the same features
    same_grid = copy.deepcopy(cfg.model.backbone)
    same_grid.pretrain_img_size = cls_cfg.crop_size
    backbone = DET_MODELS.build(same_grid)
    backbone.init_weights()
    assert all(torch.equal(backbone.state_dict()[k], v) for k, v in cls_state.items())
    x = torch.randn(2, 3, cls_cfg.crop_size, cls_cfg.crop_size)
    classifier.eval(), backbone.eval()
    with torch.no_grad():
        torch.testing.assert_close(backbone(x)[3], classifier.backbone(x)[0], rtol=1e-5,
                                   atol=1e-5)


def compare_tool():
    """The module of tools/demo_compare.py."""
    spec = importlib.util.spec_from_file_location(
        'demo_compare', osp.join(ROOT, 'tools', 'demo_compare.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize('model', ['mask_rcnn', 'retinanet'])
def test_layernorm_twin_is_the_stock_pvt_with_the_same_settings(model):
    """The LN twin of a demo config differs from it only in ``dtn_stages=False``, and its backbone
    is mmdet's stock PVT-Tiny: the same parameters (names and shapes) and no DTN."""
    from mmdet.models.backbones import PyramidVisionTransformer
    from mmdet.registry import MODELS as DET_MODELS

    from mmdtn.models.layers import DynamicTokenNorm

    demo = demo_tool()
    dtn, ln = (demo.load_config(demo.detector_config(model, norm)) for norm in ('dtn', 'ln'))
    dtn_d, ln_d = copy.deepcopy(dtn.to_dict()), copy.deepcopy(ln.to_dict())
    assert ln_d['model']['backbone'].pop('dtn_stages') is False
    assert dtn_d == ln_d
    init_default_scope('mmdet')
    backbone = DET_MODELS.build(ln.model.backbone)
    stock_cfg = dict(ln.model.backbone)
    stock_cfg.pop('type'), stock_cfg.pop('dtn_stages')
    stock = PyramidVisionTransformer(**stock_cfg)
    assert not any(isinstance(m, DynamicTokenNorm) for m in backbone.modules())
    assert {k: v.shape for k, v in backbone.state_dict().items()} == \
        {k: v.shape for k, v in stock.state_dict().items()}


def test_pretrained_start_scales_every_backbone_learning_rate():
    """``start_from``: the fine-tuning's ``backbone_lr_mult`` reaches every backbone parameter
    and no other, and DTN's gates and positional coefficients keep no weight decay (mmengine
    applies a single matching key)."""
    from mmdet.registry import MODELS as DET_MODELS
    from mmengine.optim import build_optim_wrapper

    demo = demo_tool()
    cfg = demo.build_config(demo.parse_args(['--pretrain']))
    cfg = demo.start_from(cfg, 'unused.pth', 0.25)
    init_default_scope('mmdet')
    model = DET_MODELS.build(cfg.model)
    optimizer = build_optim_wrapper(model, cfg.optim_wrapper).optimizer
    base = cfg.optim_wrapper.optimizer.lr
    names = {id(p): n for n, p in model.named_parameters()}
    seen = 0
    for group in optimizer.param_groups:
        for p in group['params']:
            name = names[id(p)]
            expected = 0.25 * base if name.startswith('backbone.') else base
            assert group['lr'] == pytest.approx(expected), name
            no_decay = name.rsplit('.', 1)[-1] in DTN_ONLY_PARAMETERS
            assert group['weight_decay'] == (0 if no_decay else 0.05), name
            seen += no_decay
    assert seen == 3 * 2 * 2 * 3  # gates and positional coefficients of the DTN stages


def test_comparison_statistics_are_per_seed_differences():
    tool = compare_tool()
    metrics = lambda bbox, segm: {'coco/bbox_mAP': bbox, 'coco/segm_mAP': segm}  # noqa: E731
    results = {('from scratch', 'dtn', 0): metrics(0.30, 0.40),
               ('from scratch', 'ln', 0): metrics(0.20, 0.38),
               ('from scratch', 'dtn', 1): metrics(0.10, 0.30),
               ('from scratch', 'ln', 1): metrics(0.12, 0.32),
               ('from scratch', 'dtn', 2): metrics(0.20, 0.35),
               ('from scratch', 'ln', 2): {}}  # CocoMetric found nothing to evaluate: AP 0
    table = tool.compare(results, ('bbox', 'segm'))
    bbox = table['from scratch']['bbox']
    np.testing.assert_allclose(bbox['dtn'], [30, 10, 20])
    np.testing.assert_allclose(bbox['ln'], [20, 12, 0])
    np.testing.assert_allclose(bbox['difference'], [10, -2, 20])
    mean, std = tool.summarize(bbox['difference'])
    assert mean == pytest.approx(28 / 3) and std == pytest.approx(np.std([10, -2, 20], ddof=1))
    assert tool.summarize([5.0]) == (5.0, 0.0)
    markdown = tool.format_markdown(table).splitlines()
    assert markdown[0] == '| Start | AP | LayerNorm | DTN | DTN - LN |'
    assert markdown[2] == '| from scratch | bbox | 10.7 ± 10.1 | 20.0 ± 10.0 | +9.3 ± 11.0 |'


def test_compare_tool_trains_both_norms_and_resumes(tmp_path):
    """The comparison's whole path on a tiny schedule (two iterations, one seed, from scratch and
    pretrained): every training runs, the table, figure and values are written, and a second
    call reuses the finished trainings."""
    work_dir = tmp_path / 'work'
    cmd = [sys.executable, 'tools/demo_compare.py', '--iters', '2', '--seeds', '1',
           '--pretrain', '--pretrain-iters', '2', '--work-dir', str(work_dir),
           '--data-root', str(tmp_path / 'shapes'),
           '--pretrain-data-root', str(tmp_path / 'crops')]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(work_dir / 'comparison.json') as f:
        result = json.load(f)
    assert result['iters'] == 2 and result['seeds'] == 1
    assert sorted(result['ap']) == ['from scratch', 'pretrained']
    for start in result['ap'].values():
        assert sorted(start) == ['bbox', 'segm']
        for ap in start.values():
            assert all(len(ap[k]) == 1 for k in ('dtn', 'ln', 'difference'))
            assert ap['difference'][0] == pytest.approx(ap['dtn'][0] - ap['ln'][0])
    for norm in ('dtn', 'ln'):
        classifier = work_dir / norm / 'seed_0' / 'classifier'
        assert (classifier / 'iter_2.pth').is_file()
        with open(work_dir / norm / 'seed_0' / 'pretrained' / 'result.json') as f:
            assert 'init_cfg' in json.load(f)['config']
    assert (work_dir / 'comparison.png').is_file()
    assert '| pretrained | segm |' in (work_dir / 'comparison.md').read_text()

    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    log = (work_dir / 'ln' / 'seed_0' / 'pretrained' / 'demo.log').read_text()
    assert log.count('reusing the result of the same config') == 2  # classifier and detector
