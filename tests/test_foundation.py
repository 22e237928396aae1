"""The installed stack: registration in both OpenMMLab scopes and mmcv's compiled ops on CPU."""
import inspect
import subprocess
import sys

import pytest
import torch

import mmdtn


def _registered_classes():
    return [obj for name, obj in vars(mmdtn).items()
            if inspect.isclass(obj) and name in mmdtn.__all__ and isinstance(obj, type)
            and issubclass(obj, torch.nn.Module)]


def test_every_module_is_found_in_mmdet_and_mmseg_registries():
    from mmdet.registry import MODELS as MMDET_MODELS
    from mmseg.registry import MODELS as MMSEG_MODELS

    classes = _registered_classes()
    assert classes, 'mmdtn exports no modules'
    for cls in classes:
        assert MMDET_MODELS.get(cls.__name__) is cls, cls.__name__
        assert MMSEG_MODELS.get(cls.__name__) is cls, cls.__name__


def test_custom_imports_line_is_enough(tmp_path):
    """A fresh interpreter that only reads a config with the custom_imports line finds mmdtn's
    modules."""
    names = [cls.__name__ for cls in _registered_classes()]
    cfg = tmp_path / 'cfg.py'
    cfg.write_text("custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)\n")
    code = (
        'import sys\n'
        'from mmengine.config import Config\n'
        f'Config.fromfile({str(cfg)!r})\n'
        'from mmdet.registry import MODELS as D\n'
        'from mmseg.registry import MODELS as S\n'
        f'for name in {names!r}:\n'
        '    assert D.get(name) is not None and S.get(name) is not None, name\n'
        'print("ok")\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith('ok'), out.stderr[-2000:]


def test_mmcv_nms_runs_on_cpu():
    from mmcv.ops import nms

    boxes = torch.tensor([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7])
    dets, keep = nms(boxes, scores, iou_threshold=0.5)
    assert keep.tolist() == [0, 2]
    assert dets.shape == (2, 5)


def test_mmcv_roi_align_runs_on_cpu():
    """mmcv's compiled RoIAlign agrees with torchvision's independent implementation."""
    from mmcv.ops import RoIAlign
    from torchvision.ops import roi_align

    torch.manual_seed(0)
    feat = torch.randn(2, 3, 16, 20)
    rois = torch.tensor([[0, 1.0, 2.0, 9.5, 12.0], [1, 4.0, 0.0, 19.0, 15.0]])
    for aligned in (False, True):
        out = RoIAlign((4, 4), spatial_scale=0.5, sampling_ratio=2, aligned=aligned)(feat, rois)
        ref = roi_align(feat, rois, (4, 4), spatial_scale=0.5, sampling_ratio=2, aligned=aligned)
        assert out.shape == (2, 3, 4, 4)
        assert torch.allclose(out, ref, atol=1e-5)


def test_versions_are_the_pinned_ones():
    import mmcv
    import mmdet
    import mmengine
    import mmseg

    assert mmcv.__version__ == '2.1.0'
    assert mmengine.__version__ == '0.10.7'
    assert mmdet.__version__ == '3.3.0'
    assert mmseg.__version__ == '1.2.2'
    assert torch.__version__.startswith('2.14.1')


@pytest.mark.parametrize('module', ['mmdtn.checkpoint', 'mmdtn.registry'])
def test_core_modules_import(module):
    __import__(module)
