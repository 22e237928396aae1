"""``compile`` in a config: mmengine's Runner trains the CPU demo model with ``torch.compile``.

The end-to-end test uses dynamo's ``aot_eager`` backend: it traces forward and backward through
AOTAutograd (the DTN custom ops' fake implementations and registered autograd included) as
``inductor`` does, without generating and building C++ kernels. With ``compile=True``
(``inductor``) the same run also trains, but its first iteration compiles for several minutes on a
2-core CPU. Even with ``aot_eager`` dynamo needs about a minute for the forward and the losses and
another for the AdamW step over the config's per-parameter groups. To pay that once,
the data are one 64 x 64 image with one object, so that the second iteration meets the shapes of
the first, and the learning rate is constant: a scheduler changing it recompiles the optimizer
step at every iteration (dynamo guards on each group's float ``lr``).
"""
import math
import os.path as osp

import pytest
import torch
import torch._dynamo
from mmengine.config import Config, ConfigDict
from mmengine.optim import DefaultOptimWrapperConstructor

import mmdtn  # noqa: F401
from mmdtn.datasets import generate_shapes_dataset
from mmdtn.engine.compile import compile_options, plain_param_groups
from mmdtn.engine.runner import build_runner, run

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'configs', 'demo', 'retinanet_pvt_tiny_dtn_shapes.py')
SIZE = (64, 64)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_options():
    assert compile_options(Config(dict())) is None
    assert compile_options(Config(dict(compile=False))) is None
    assert compile_options(Config(dict(compile=True))) == {}
    assert compile_options(Config(dict(compile=dict(backend='aot_eager')))) == {
        'backend': 'aot_eager'}
    assert compile_options(Config(dict(compile=dict(disable=True)))) is None


def test_plain_param_groups_let_dynamo_compile_the_optimizer_step():
    """mmengine's constructor, given the config's ``optim_wrapper`` with a ``paramwise_cfg`` as
    the Runner gives it, leaves ``ConfigDict`` parameter groups, which dynamo's optimizer tracing
    cannot handle; plain dicts with the same entries can."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    cfg = Config(dict(optim_wrapper=dict(optimizer=dict(type='AdamW', lr=1e-2, weight_decay=0.05),
                                         paramwise_cfg=dict(norm_decay_mult=0.0))))
    paramwise = cfg.optim_wrapper.pop('paramwise_cfg')
    wrapper = DefaultOptimWrapperConstructor(cfg.optim_wrapper, paramwise)(model)
    groups = wrapper.optimizer.param_groups
    before = [dict(g) for g in groups]
    assert all(isinstance(g, ConfigDict) for g in groups)
    assert plain_param_groups(wrapper) == len(groups) == 4
    assert all(type(g) is dict for g in groups) and groups == before
    assert [g['weight_decay'] for g in groups] == [0.05, 0.05, 0.0, 0.0]
    assert plain_param_groups(wrapper) == 0

    @torch.compile(backend='aot_eager', fullgraph=False)
    def step(x):
        model(x).square().sum().backward()
        wrapper.optimizer.step()

    weight = model[0].weight.detach().clone()
    step(torch.randn(2, 3))
    assert not torch.equal(weight, model[0].weight)


def test_demo_model_trains_with_compile(tmp_path):
    generate_shapes_dataset(tmp_path / 'shapes', progress=False, num_train=1, num_val=1,
                            image_size=SIZE, min_objects=1, max_objects=1, min_size=20, max_size=30)
    cfg = Config.fromfile(DEMO)
    cfg.work_dir = str(tmp_path / 'work')
    cfg.compile = dict(backend='aot_eager')
    cfg.train_cfg.max_iters = 2
    cfg.param_scheduler = None
    cfg.default_hooks.logger.interval = 1
    cfg.default_hooks.checkpoint = None
    cfg.val_cfg = cfg.val_dataloader = cfg.val_evaluator = None
    loader = cfg.train_dataloader
    loader.update(batch_size=1, num_workers=0, persistent_workers=False)
    loader.dataset.data_root = str(tmp_path / 'shapes') + '/'
    for step in loader.dataset.pipeline:
        if step.type == 'Resize':
            step.scale = SIZE
        if step.type == 'RandomFlip':
            step.prob = 0.0

    runner = build_runner(cfg, 'none', ['train'])
    run(runner, 'train')

    assert hasattr(runner.model.train_step, '_torchdynamo_orig_callable')  # mmengine compiled it
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] > 0
    assert all(type(g) is dict for g in runner.optim_wrapper.optimizer.param_groups)
    values, _ = runner.message_hub.get_scalar('train/loss').data
    assert len(values) == 2 and all(math.isfinite(v) for v in values), values
