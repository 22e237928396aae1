"""DynamicTokenNorm under the tracers and memory tools of PyTorch: torch.compile, torch.export,
torch.jit.trace (mmengine's FLOP counter), saved-tensor hooks and activation checkpointing; and the
layer imported with torch alone."""
import gc
import subprocess
import sys
from functools import partial

import pytest
import torch
from test_dynamic_token_norm import randomize, tokens
from torch.utils._python_dispatch import TorchDispatchMode

from mmdtn import (DynamicTokenNorm, PyramidVisionTransformerDTN, SwinTransformerDTN,
                   set_dtn_backend)
from mmdtn.models.layers.dtn.reference import DenseDynamicTokenNorm

LAYER_PACKAGE = 'mmdtn/models/layers/dtn/'


def forward_backward(module, x, hw):
    y = module(x, hw)
    grads = torch.autograd.grad((y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum(),
                                [x, *module.parameters()])
    return [y.detach(), *grads]


@pytest.mark.parametrize('pool', [1, 2])
def test_compile_fullgraph_equals_eager_on_two_resolutions(dtn_backend, pool):
    """One graph for forward and backward (no break inside the layer), a second resolution without
    an error, and the eager results. aot_eager traces exactly what inductor would compile (dynamo,
    the custom ops' fake implementations and registered autograd, functionalization) without the
    minutes of C++ code generation on a CPU."""
    torch._dynamo.reset()
    norm = randomize(DynamicTokenNorm(32, 2, pool_size=pool))  # 16 channels per head: fused path
    compiled = torch.compile(norm, fullgraph=True, backend='aot_eager')
    for hw in [(6, 9), (11, 7)]:
        x = tokens(2, *hw, 32, torch.float32).requires_grad_()
        for a, b in zip(forward_backward(compiled, x, hw), forward_backward(norm, x, hw)):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_inductor_compiles_the_cpu_custom_ops(backend_setting):
    """With inductor, the generated code checks every custom-op output against its fake
    implementation (shapes, strides, dtypes)."""
    set_dtn_backend('cpu')
    torch._dynamo.reset()
    norm = randomize(DynamicTokenNorm(24, 3, pool_size=2))
    compiled = torch.compile(norm, fullgraph=True)
    x = tokens(2, 5, 7, 24, torch.float32).requires_grad_()
    for a, b in zip(forward_backward(compiled, x, (5, 7)), forward_backward(norm, x, (5, 7))):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('backbone', [PyramidVisionTransformerDTN, SwinTransformerDTN])
def test_no_graph_break_inside_dynamic_token_norm(backbone):
    model = backbone(pretrain_img_size=64).eval()
    explanation = torch._dynamo.explain(model)(torch.randn(1, 3, 64, 96))
    inside = [b for b in explanation.break_reasons
              if any(LAYER_PACKAGE in frame.filename for frame in b.user_stack)]
    assert not inside, [b.reason for b in inside]


def test_export_of_a_backbone_equals_eager_and_leaves_eager_intact():
    torch.manual_seed(0)
    model = PyramidVisionTransformerDTN(pretrain_img_size=64).eval()
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        eager = model(x)
    exported = torch.export.export(model, (x, ))
    for a, b in zip(exported.module()(x), eager):
        assert torch.allclose(a, b, atol=1e-5)
    # tracing caches nothing: later eager calls equal the earlier ones and the dense reference
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(x), eager))
    norm = next(m for m in model.modules() if isinstance(m, DynamicTokenNorm))
    tokens_ = tokens(1, 7, 9, 64, torch.float32)
    assert torch.allclose(norm(tokens_, (7, 9)), DenseDynamicTokenNorm(norm)(tokens_, (7, 9)),
                          atol=1e-5)


def test_flop_counter_and_jit_trace_of_a_detector(dtn_backend):
    """mmdet's get_flops.py way of counting (mmengine's get_model_complexity_info, gradients
    enabled) and torch.jit.trace run through a DTN detector."""
    from mmdet.registry import MODELS
    from mmdet.structures import DetDataSample
    from mmengine.analysis import get_model_complexity_info
    from mmengine.config import Config
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    cfg = Config.fromfile('configs/demo/retinanet_pvt_tiny_dtn_shapes.py')
    model = MODELS.build(cfg.model).eval()
    x = torch.randn(1, 3, 64, 96)
    shapes = dict(img_shape=(64, 96), pad_shape=(64, 96), batch_input_shape=(64, 96),
                  ori_shape=(64, 96), scale_factor=(1.0, 1.0))
    forward = model.forward
    model.forward = partial(forward, data_samples=[DetDataSample(metainfo=shapes)])
    result = get_model_complexity_info(model, None, inputs=x, show_table=False, show_arch=False)
    assert result['flops'] > 0
    model.forward = forward
    traced = torch.jit.trace(model.backbone, x, check_trace=False)
    for a, b in zip(traced(x), model.backbone(x)):
        assert torch.allclose(a, b, atol=1e-5)


def test_counters_count_dtn_by_its_formula(backend_setting):
    """The custom ops carry the one DTN FLOP formula: torch.utils.flop_counter (2 per
    multiply-add) and mmengine's FlopAnalyzer (1 per multiply-add) count a layer with it."""
    from mmengine.analysis import FlopAnalyzer
    from torch.utils.flop_counter import FlopCounterMode

    from mmdtn.models.layers.dtn.flops import dtn_flops
    set_dtn_backend('cpu')
    norm = DynamicTokenNorm(32, 4, pool_size=2)
    x = tokens(2, 6, 9, 32, torch.float32)
    expected = dtn_flops(2, 32, 4, (6, 9), 2)
    with FlopCounterMode(display=False) as counter:
        norm(x, (6, 9))
    assert counter.get_total_flops() == 2 * expected

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = norm

        def forward(self, x):
            return self.norm(x, (6, 9))

    analyzer = FlopAnalyzer(Layer(), (x, ))
    analyzer.unsupported_ops_warnings(False)
    assert analyzer.by_module()['norm'] == expected


class RecordingOps(TorchDispatchMode):
    """A dispatch mode that notes the name of every operation it sees (``ops``)."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))


def test_eager_calls_run_the_custom_ops_python_without_their_dispatch(backend_setting):
    """Eager calls of the compiled kernels run their Python in an autograd Function, without the
    custom ops' dispatch; under a dispatch mode the layer runs as its custom ops. Both give the
    same output and gradients."""
    set_dtn_backend('cpu')
    norm = randomize(DynamicTokenNorm(16, 4, pool_size=2))
    x = tokens(2, 6, 9, 16, torch.float32).requires_grad_()
    with torch.profiler.profile() as profiler:
        eager = forward_backward(norm, x, (6, 9))
    names = {event.name for event in profiler.events()}
    assert not any(name.startswith('mmdtn::') for name in names), sorted(names)
    with RecordingOps() as recording:
        custom = forward_backward(norm, x, (6, 9))
    assert {'mmdtn::dtn_cpu_forward', 'mmdtn::dtn_cpu_backward'} <= recording.ops
    for a, b in zip(eager, custom):
        assert torch.equal(a, b)


def new_tensors_after(fn):
    """``fn()`` under saved-tensor hooks that pack every saved tensor into a numpy copy (and its
    device, where it is unpacked again); returns its output and the tensors that the call left
    alive besides it (nothing, if the backward pass keeps all it needs as saved tensors)."""
    def pack(t):
        return t.device, t.detach().cpu().numpy().copy()

    def unpack(packed):
        device, values = packed
        return torch.from_numpy(values).to(device)

    gc.collect()
    before = {id(o) for o in gc.get_objects() if torch.is_tensor(o)}
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = fn()
    gc.collect()
    return y, [o for o in gc.get_objects()
               if torch.is_tensor(o) and id(o) not in before and o is not y]


@pytest.mark.parametrize('pool,C', [(1, 32), (2, 24), (1, 24)])
def test_backward_keeps_nothing_but_saved_tensors(dtn_backend, pool, C):
    norm = randomize(DynamicTokenNorm(C, 2, pool_size=pool))
    x = tokens(2, 6, 8, C, torch.float32).requires_grad_()
    y, hidden = new_tensors_after(lambda: norm(x, (6, 8)))
    assert not hidden, [tuple(t.shape) for t in hidden]
    g = torch.linspace(-1, 1, y.numel()).view_as(y)
    grads = torch.autograd.grad((y * g).sum(), [x, *norm.parameters()])  # through the unpacking
    expected = torch.autograd.grad((norm(x, (6, 8)) * g).sum(), [x, *norm.parameters()])
    for a, b in zip(grads, expected):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def live_bytes_after(fn):
    """Bytes that ``fn()`` allocated and had not freed when it returned (CPU allocator events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == '[memory]']
    return sum(e.nbytes() for e in events), out


def test_checkpointed_dtn_backbone_keeps_no_more_than_layernorm(dtn_backend):
    """Under activation checkpointing (with_cp) a DTN backbone keeps what the same backbone with
    LayerNorm keeps (the blocks' inputs), plus at most the small positional tables."""
    x = torch.randn(1, 3, 128, 128)
    kept = {}
    for name, dtn_stages in [('ln', False), ('dtn', (True, True, True, False))]:
        torch.manual_seed(0)
        model = PyramidVisionTransformerDTN(pretrain_img_size=128, with_cp=True,
                                            dtn_stages=dtn_stages)
        kept[name], outs = live_bytes_after(lambda: model(x))
        kept[name] -= sum(o.numel() * o.element_size() for o in outs)
    assert kept['dtn'] <= kept['ln'] + 64 * 1024, kept


def test_layer_imports_with_torch_alone():
    script = ('import sys\n'
              'for name in ("mmdet", "mmseg", "mmengine", "mmcv", "timm"):\n'
              '    sys.modules[name] = None  # not installed\n'
              'import torch, mmdtn\n'
              'from mmdtn import DynamicTokenNorm, set_dtn_backend\n'
              'assert not mmdtn.WITH_OPENMMLAB\n'
              'x = torch.randn(2, 12, 8, requires_grad=True)\n'
              'DynamicTokenNorm(8, 2, pool_size=2)(x, (3, 4)).sum().backward()\n'
              'print("ok")\n')
    out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == 'ok', out.stderr
