"""ONNX export (docs/deployment.md): ``torch.onnx.export(model, (x, ), dynamo=True)`` of a DTN
backbone and of a DTN detector's ``mode='tensor'`` forward with the default DTN backend ('auto':
the compiled CPU kernels for eager CPU calls), exported with dynamic H and W and run in
onnxruntime at resolutions other than the exported one, equals eager PyTorch.

The models are small (two PVT stages of 16 and 32 channels) but keep what matters: DTN with
pooling (2) and without, and resolutions whose token grids leave partial cells at the border.
The tolerance is 1e-4 (absolute and relative): both runtimes compute in float32, with sums and
matrix products in other orders, and the errors measured are at most a few 1e-6.
"""
import os

import onnxruntime
import torch
from test_dynamic_token_norm import randomize

from mmdtn import (DynamicTokenNorm, PyramidVisionTransformerDTN, available_backends,
                   set_dtn_backend)
from mmdtn.models.layers.dtn.backends import select_backend
from mmdtn.models.layers.dtn.grid import TokenGrid

#: Two PVT-DTN stages: 16 channels, DTN pooling 2; 32 channels, no pooling.
BACKBONE = dict(pretrain_img_size=32, embed_dims=16, num_stages=2, num_layers=[1, 1],
                num_heads=[1, 2], patch_sizes=[4, 2], strides=[4, 2], sr_ratios=[4, 2],
                mlp_ratios=[2, 2], out_indices=(0, 1), dtn_pool_sizes=[2, 1])
EXPORTED = (64, 96)
#: first-stage token grids of 25 x 17 (partial border cells) and 16 x 24 (an image size that is no
#: multiple of the patch size)
OTHERS = [(100, 70), (65, 97)]
#: the backend of eager CPU calls under 'auto'
COMPILED = 'torch' if os.environ.get('MMDTN_WITH_OPS') == '0' else 'cpu'


def randomized(model):
    """``model`` with every DynamicTokenNorm's parameters drawn at random (gates, positional
    coefficients and affine parameters away from their initial values)."""
    for seed, norm in enumerate(m for m in model.modules() if isinstance(m, DynamicTokenNorm)):
        randomize(norm, seed)
    return model.eval()


def onnx_session(model):
    """``model`` exported by ``torch.onnx.export(..., dynamo=True)`` at EXPORTED with dynamic
    H and W, in an onnxruntime session."""
    x = torch.randn(1, 3, *EXPORTED)
    program = torch.onnx.export(model, (x, ), dynamo=True, dynamic_shapes=({2: 'H', 3: 'W'}, ))
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(),
                                           providers=['CPUExecutionProvider'])
    assert [str(d) for d in session.get_inputs()[0].shape] == ['1', '3', 'H', 'W']
    return session


def assert_onnx_equals_eager(session, model, flatten=lambda out: out):
    generator = torch.Generator().manual_seed(1)
    for hw in [EXPORTED, *OTHERS]:
        x = torch.randn(1, 3, *hw, generator=generator)
        with torch.no_grad():
            expected = flatten(model(x))
        outputs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        assert len(outputs) == len(expected)
        for out, ref in zip(outputs, expected):
            torch.testing.assert_close(torch.from_numpy(out), ref, rtol=1e-4, atol=1e-4)


def test_select_backend_is_the_portable_one_during_onnx_export(backend_setting, monkeypatch):
    """Eager CPU calls run on the compiled kernels; during ONNX export every call runs on the
    portable backend, whatever the setting."""
    x = torch.zeros(1, 6, 16)
    grid = TokenGrid(1, 2, 3, 16, 4, 2)
    assert available_backends('cpu')[0] == COMPILED
    assert select_backend(x, grid, torch.float32).name == COMPILED
    monkeypatch.setattr(torch.onnx, 'is_in_onnx_export', lambda: True)
    for name in ('auto', 'cpu', 'triton', 'torch'):
        set_dtn_backend(name)
        assert select_backend(x, grid, torch.float32).name == 'torch'


def test_backbone_exports_with_dynamic_resolution():
    torch.manual_seed(0)
    model = randomized(PyramidVisionTransformerDTN(**BACKBONE))
    assert_onnx_equals_eager(onnx_session(model), model)


def test_detector_tensor_forward_exports_with_dynamic_resolution():
    """RetinaNet with the backbone above, a 16-channel FPN and head: the ``mode='tensor'``
    forward (``forward``'s default mode), its class scores and box deltas of five levels."""
    from mmdet.registry import MODELS
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    cfg = Config.fromfile('configs/demo/retinanet_pvt_tiny_dtn_shapes.py')
    cfg.model.backbone.update(BACKBONE)
    cfg.model.neck.update(in_channels=[16, 32], out_channels=16)
    cfg.model.bbox_head.update(in_channels=16, feat_channels=16, stacked_convs=1)
    torch.manual_seed(0)
    model = randomized(MODELS.build(cfg.model))
    assert_onnx_equals_eager(onnx_session(model), model,
                             lambda out: [t for level in out for t in level])
