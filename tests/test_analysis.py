"""The analysis tools (tools/analysis/) on tiny randomly initialized PVT/Swin backbones.

Each tool runs end to end and writes its files; the numbers obey facts that can be checked exactly:
recomputed attention reproduces the modules' outputs, uniform attention has the analytic mean
distance, an LN-equivalent DTN gives LN's token magnitudes, P^h rows sum to 1 and peak where Eq. 7
puts them, and DTN's FLOPs follow the documented formula on the pooled grid.
"""
import importlib.util
import itertools
import math
import os.path as osp
import re

import numpy as np
import pytest
import torch
from PIL import Image

from mmdtn.analysis.attention import (grid_positions, mean_attention_distance, mha_output,
                                      window_output, window_positions)
from mmdtn.analysis.capture import AttentionRecorder, record
from mmdtn.analysis.models import build_backbone, load_config
from mmdtn.models.layers.dtn.flops import dtn_flops

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))

PVT = dict(pretrain_img_size=64, embed_dims=8, num_layers=[1, 1, 1, 1], num_heads=[1, 2, 2, 4],
           sr_ratios=[8, 4, 2, 1], mlp_ratios=[2, 2, 2, 2], drop_path_rate=0.0)
SWIN = dict(pretrain_img_size=64, embed_dims=8, depths=[2, 2], num_heads=[2, 4], strides=[4, 2],
            window_size=4, mlp_ratio=2, out_indices=(0, 1), drop_path_rate=0.0,
            dtn_pool_sizes=[4, 2])
RETINA = """
_base_ = 'mmdet::retinanet/retinanet_r50_fpn_1x_coco.py'
custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)
model = dict(
    backbone=dict(_delete_=True, {backbone}),
    neck=dict(in_channels=[8, 16, 16, 32], out_channels=16, start_level=1, num_outs=3),
    bbox_head=dict(num_classes=2, in_channels=16, feat_channels=16, stacked_convs=1,
                   anchor_generator=dict(strides=[8, 16, 32])))
"""


def _kw(d):
    return ', '.join(f'{k}={v!r}' for k, v in d.items())


def tool(name):
    """The module of tools/analysis/<name>.py."""
    spec = importlib.util.spec_from_file_location(f'analysis_{name}',
                                                  osp.join(ROOT, 'tools', 'analysis', f'{name}.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    """Tiny configs, two images of different sizes and an LN checkpoint."""
    d = tmp_path_factory.mktemp('analysis')
    configs = {
        'pvt_dtn': RETINA.format(backbone=_kw(dict(type='PyramidVisionTransformerDTN', dtn_heads=4,
                                                   **PVT))),
        'pvt_dtn_lninit': RETINA.format(backbone=_kw(dict(
            type='PyramidVisionTransformerDTN', dtn_heads=4, dtn_init='layernorm', **PVT))),
        'pvt_ln': RETINA.format(backbone=_kw(dict(type='PyramidVisionTransformer', **PVT))),
        'swin_dtn': "custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)\n"
                    'model = dict(backbone=dict('
                    f"{_kw(dict(type='SwinTransformerDTN', **SWIN))}))\n",
    }
    paths = {}
    for name, text in configs.items():
        paths[name] = str(d / f'{name}.py')
        (d / f'{name}.py').write_text(text)
    images = d / 'images'
    images.mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in (('a', (64, 64)), ('b', (72, 88))):
        pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(images / f'{name}.png')
    paths['images'] = str(images)
    (d / 'empty').mkdir()
    paths['empty'] = str(d / 'empty')
    torch.manual_seed(0)
    ln = build_backbone(load_config(paths['pvt_ln']))
    paths['ln_ckpt'] = str(d / 'ln.pth')
    torch.save({'state_dict': {f'backbone.{k}': v for k, v in ln.state_dict().items()}},
               paths['ln_ckpt'])
    swin = build_backbone(load_config(paths['swin_dtn']))
    paths['swin_ckpt'] = str(d / 'swin.pth')
    torch.save({'state_dict': swin.state_dict()}, paths['swin_ckpt'])
    paths['dir'] = d
    return paths


# ----------------------------------------------------------------- attention recomputation
def test_recomputed_pvt_attention_reproduces_the_module_output(files):
    from mmdet.models.backbones.pvt import SpatialReductionAttention
    model = build_backbone(load_config(files['pvt_dtn']))
    outputs = []
    hooks = [m.register_forward_hook(lambda m, a, kw, out: outputs.append((kw['identity'], out)),
                                     with_kwargs=True)
             for m in model.modules() if isinstance(m, SpatialReductionAttention)]
    with AttentionRecorder(model) as recorder:
        record(model, torch.randn(1, 3, 72, 88), recorder)
    for h in hooks:
        h.remove()
    assert len(recorder.records) == len(outputs) == 4
    for rec, (identity, out) in zip(recorder.records, outputs):
        attn = rec.weights()
        assert torch.allclose(attn.sum(-1), torch.ones(()), atol=1e-5)
        assert rec.key_positions().shape[0] == attn.shape[-1]
        again = identity + mha_output(rec.module.attn, attn, rec.key)
        torch.testing.assert_close(again, out, atol=1e-5, rtol=1e-4)


def test_recomputed_swin_window_attention_reproduces_the_module_output(files):
    model = build_backbone(load_config(files['swin_dtn']))
    outputs = []
    hooks = [b.attn.w_msa.register_forward_hook(lambda m, a, out: outputs.append(out))
             for b in (blk for s in model.stages for blk in s.blocks)]
    with AttentionRecorder(model) as recorder:
        record(model, torch.randn(1, 3, 72, 88), recorder)  # 18 x 22 tokens: padded windows
    for h in hooks:
        h.remove()
    assert [r.module.shift_size for r in recorder.records] == [0, 2, 0, 2]
    for rec, out in zip(recorder.records, outputs):
        torch.testing.assert_close(window_output(rec.module.w_msa, rec.weights(), rec.windows), out,
                                   atol=1e-5, rtol=1e-4)
        # positions: the module's own shift and partition applied to a map of coordinates
        ws, shift = rec.module.window_size, rec.module.shift_size
        h, w = rec.hw_shape
        hp, wp = -(-h // ws) * ws, -(-w // ws) * ws
        coords = grid_positions((hp, wp)).view(1, hp, wp, 2)
        coords = torch.roll(coords, (-shift, -shift), (1, 2)) if shift else coords
        expected = rec.module.window_partition(coords).view(-1, ws * ws, 2)
        pos, valid = window_positions((h, w), ws, shift)
        assert torch.equal(pos, expected)
        assert int(valid.sum()) == h * w


# ----------------------------------------------------------------- mean attention distance
def analytic_uniform_distance(n):
    """Mean distance of uniform attention over an n x n grid: pairs at offset (dx, dy) number
    (n - |dx|)(n - |dy|), so d = sum (n-|dx|)(n-|dy|) sqrt(dx^2 + dy^2) / n^4."""
    return math.fsum((n - abs(dx)) * (n - abs(dy)) * math.hypot(dx, dy)
                     for dx in range(-n + 1, n) for dy in range(-n + 1, n)) / n ** 4


@pytest.mark.parametrize('n', [1, 2, 5, 16])
def test_uniform_attention_gives_the_analytic_mean_distance(n):
    pos = grid_positions((n, n))
    attn = torch.full((1, 3, n * n, n * n), 1.0 / (n * n), dtype=torch.float64)
    got = mean_attention_distance(attn, pos, pos)
    assert torch.allclose(got, torch.full((3, ), analytic_uniform_distance(n), dtype=got.dtype),
                          rtol=1e-9, atol=1e-12)


def test_uniform_attention_in_a_model_gives_the_analytic_distance():
    """With zero query projections every query attends uniformly; PVT without spatial reduction."""
    from mmdet.registry import MODELS
    model = MODELS.build(dict(type='PyramidVisionTransformer',
                              **{**PVT, 'sr_ratios': [1, 1, 1, 1]}))
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            with torch.no_grad():
                m.in_proj_weight[:m.embed_dim].zero_()
                m.in_proj_bias[:m.embed_dim].zero_()
    dist = tool('attention_distance')
    with AttentionRecorder(model.eval()) as recorder:
        record(model, torch.randn(1, 3, 64, 64), recorder)
        results = dist.layer_distances(recorder.records, (64, 64))
    for (rec, tokens, stride), n in zip(results, (16, 8, 4, 2)):
        assert rec.hw_shape == (n, n)
        np.testing.assert_allclose(tokens, analytic_uniform_distance(n), rtol=1e-6)
        assert stride == 64 / n


def test_attention_distance_tool_writes_csv_and_plot(files, tmp_path):
    rows = tool('attention_distance').run([files['pvt_dtn'], '--images', files['images'], '--out',
                                           str(tmp_path), '--compare', files['pvt_ln']])
    assert {r['model'] for r in rows} == {'pvt_dtn', 'pvt_ln'}
    assert len(rows) == 2 * sum(PVT['num_heads'])
    assert all(r['images'] == 2 and r['distance_tokens'] >= 0 for r in rows)
    for f in ('attention_distance.csv', 'attention_distance.json', 'attention_distance.png'):
        assert (tmp_path / f).stat().st_size > 0
    swin = tool('attention_distance').run([files['swin_dtn'], '--out', str(tmp_path / 'swin')])
    assert {r['kind'] for r in swin} == {'window'} and len(swin) == 2 * 2 + 2 * 4
    # inside a 4 x 4 window no distance exceeds the window's diagonal
    assert all(r['distance_tokens'] <= 3 * math.sqrt(2) for r in swin)


# ----------------------------------------------------------------- token magnitude
def test_token_magnitude_of_ln_equivalent_dtn_equals_ln(files, tmp_path):
    """The LN checkpoint loaded into a DTN backbone with dtn_init='layernorm': same maps as LN."""
    with pytest.warns(UserWarning, match='keep the configured initialization'):
        result = tool('token_magnitude').run([
            files['pvt_dtn_lninit'], files['ln_ckpt'], '--images', files['images'], '--out',
            str(tmp_path), '--compare', files['pvt_ln'], files['ln_ckpt']])
    maps = result['maps']
    dtn_keys = [k for k in maps if k.startswith('pvt_dtn_lninit/')]
    assert len(dtn_keys) == 4 * 2 * 2  # blocks x norms x before/after
    assert any(r['dtn'] for r in result['rows'])
    for key in dtn_keys:
        other = maps[key.replace('pvt_dtn_lninit/', 'pvt_ln/', 1)]
        assert maps[key].shape == other.shape
        np.testing.assert_allclose(maps[key], other, rtol=1e-4, atol=1e-5)
    # groups: DTN heads (4) for both models where the DTN model has DTN, attention heads elsewhere
    assert result['groups']['stage1.block1.norm1'] == 4
    assert result['groups']['stage4.block1.norm1'] == PVT['num_heads'][3]
    assert (tmp_path / 'token_magnitude_stage1.block1.norm1.png').stat().st_size > 0
    assert (tmp_path / 'token_magnitude_cv.png').exists()
    assert (tmp_path / 'token_magnitude.csv').exists()


# ----------------------------------------------------------------- positional attention
def test_positional_rows_sum_to_one_and_peak_where_eq7_says(files, tmp_path):
    dtn = build_backbone(load_config(files['pvt_dtn']))
    ckpt = tmp_path / 'trained.pth'
    with torch.no_grad():
        for name, p in dtn.named_parameters():
            if name.endswith('pos_coef'):
                p[:, 1:] = 0  # "trained": every head centred on its token
    torch.save({'state_dict': dtn.state_dict()}, ckpt)
    rows = tool('positional_attention').run([files['pvt_dtn'], str(ckpt), '--size', '64', '64',
                                             '--out', str(tmp_path)])
    before = [r for r in rows if r['state'] == 'before']
    after = [r for r in rows if r['state'] == 'after']
    assert len(before) == len(after) == 3 * 2 * 4  # DTN stages x norms x heads
    for r in rows:
        assert abs(r['row_sum'] - 1) < 1e-5
    for r in before:  # Eq. 7: a^h = [-1, 2 Dx, 2 Dy] peaks at the offset (Dy, Dx) = (row, col)
        a1, a2, a3 = r['pos_coef']
        assert a1 == -1
        assert r['peak_offset'] == [round(a3 / 2), round(a2 / 2)]
    for layer, group in itertools.groupby(before, key=lambda r: r['layer']):
        offsets = [tuple(r['peak_offset']) for r in group]
        assert len(set(offsets)) == len(offsets), f'{layer}: heads share a neighbour {offsets}'
    assert all(r['peak_offset'] == [0, 0] for r in after)
    assert {tuple(r['pooled_shape']) for r in before} == {(4, 4)}  # 16/4, 8/2, 4/1
    for f in ('positional_attention_before.png', 'positional_attention_after.png',
              'positional_attention.json', 'positional_attention.npz'):
        assert (tmp_path / f).stat().st_size > 0


# ----------------------------------------------------------------- gates
def test_gates_of_a_checkpoint_and_their_trajectory(files, tmp_path):
    model = build_backbone(load_config(files['pvt_dtn']))
    work = tmp_path / 'work'
    work.mkdir()
    for epoch in (1, 2, 10):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith('mean_gate'):
                    p.fill_(epoch / 10)
                if name.endswith('var_gate'):
                    p.fill_(-epoch / 10)
        state = {f'backbone.{k}': v for k, v in model.state_dict().items()}
        torch.save({'meta': {'epoch': epoch}, 'state_dict': state}, work / f'epoch_{epoch}.pth')
    rows = tool('gates').run([files['pvt_dtn'], str(work), '--out', str(tmp_path / 'out')])
    assert [r['step'] for r in rows][::len(rows) // 3] == [1, 2, 10]
    for r in rows:
        assert r['mean_lambda'] == pytest.approx(1 / (1 + math.exp(-r['step'] / 10)), rel=1e-6)
        assert r['var_lambda'] == pytest.approx(1 / (1 + math.exp(r['step'] / 10)), rel=1e-6)
    assert (tmp_path / 'out' / 'gates_trajectory.png').stat().st_size > 0
    single = tool('gates').run([files['pvt_dtn'], str(work / 'epoch_2.pth'), '--out',
                                str(tmp_path / 'one')])
    assert len(single) == 3 * 2 * 4 and (tmp_path / 'one' / 'gates.png').exists()
    init = tool('gates').run([files['pvt_dtn'], '--out', str(tmp_path / 'init')])
    assert all(r['mean_lambda'] == 0.5 for r in init)  # Algorithm 1: gates 0


# ----------------------------------------------------------------- variation coefficient
def test_variation_coefficient_tool(files, tmp_path):
    rows = tool('variation_coefficient').run([files['pvt_dtn_lninit'], '--images', files['images'],
                                              '--out', str(tmp_path)])
    stats = {(r['layer'], r['statistic']): r['vc_mean'] for r in rows}
    layers = {layer for layer, _ in stats}
    assert len(layers) == 3 * 2 and all(r['images'] == 2 for r in rows)
    for layer in layers:  # LN-equivalent DTN: its mean is LN's
        assert stats[(layer, 'DTN')] == pytest.approx(stats[(layer, 'LN')], rel=1e-3)
        assert np.isfinite(stats[(layer, 'IN')])
    assert (tmp_path / 'variation_coefficient.png').stat().st_size > 0
    assert (tmp_path / 'variation_coefficient.csv').exists()


# ----------------------------------------------------------------- complexity
def test_complexity_dtn_flops_follow_the_pooled_grid(files, tmp_path):
    complexity = tool('complexity')
    results = {}
    for size in (64, 96):  # 96: 24 x 24 tokens, pooled grids 6 x 6, 6 x 6, 6 x 6
        twin = [] if size == 64 else ['--no-twin']
        results[size] = complexity.run([files['pvt_dtn'], '--size', str(size), str(size), '--out',
                                        str(tmp_path / str(size)), *twin])
        assert (tmp_path / str(size) / 'complexity.png').exists()
        assert (tmp_path / str(size) / 'complexity_dtn_layers.csv').exists()
    channels = [8, 16, 16]
    pools = [4, 2, 1]
    for size, result in results.items():
        rows = {(r['role'], r['part_kind']): r for r in result['rows']}
        expected, ln_counted = 0, 0
        for stage, (c, s) in enumerate(zip(channels, pools)):
            hw = (size // 4 // 2 ** stage, ) * 2
            expected += 2 * dtn_flops(1, c, 4, hw, s)  # norm1 and norm2
            ln_counted += 2 * 5 * hw[0] * hw[1] * c  # mmengine's LayerNorm count in the twin
        dtn = rows[('model', 'backbone')]
        assert dtn['dtn_flops'] == expected
        assert rows[('model', 'model')]['dtn_flops'] == expected
        assert rows[('model', 'model')]['flops'] > dtn['flops']
        assert dtn['dtn_params'] == 6 * 5 * 4  # 6 DTN layers x (2 gates + 3 coefficients) x 4 heads
        for layer in result['dtn_layers']:
            hw, (ph, pw) = layer['hw_shape'], layer['pooled_shape']
            s = pools[int(re.search(r'layers\.(\d+)', layer['name']).group(1))]
            assert (ph, pw) == (-(-hw[0] // s), -(-hw[1] // s))
            assert layer['flops'] == dtn_flops(1, layer['channels'], 4, hw, s)
            assert layer['flops_dense'] > layer['flops'] or (ph, pw) == (1, 1)
        if size == 64:
            assert set(rows) == {('model', 'backbone'), ('model', 'model'), ('LN twin', 'backbone'),
                                 ('LN twin', 'model')}
            twin = rows[('LN twin', 'backbone')]
            assert dtn['params'] - twin['params'] == dtn['dtn_params']
            # everything but the block norms is the same: DTN's formula replaces LN's count
            assert dtn['flops'] - dtn['dtn_flops'] == twin['flops'] - ln_counted
            assert (rows[('model', 'model')]['flops'] - rows[('LN twin', 'model')]['flops']
                    == dtn['flops'] - twin['flops'])


# ----------------------------------------------------------------- errors
def test_clear_errors(files, tmp_path, capsys):
    out = ['--out', str(tmp_path)]
    for name in ('gates', 'positional_attention', 'variation_coefficient'):
        with pytest.raises(ValueError, match='without DynamicTokenNorm layers'):
            tool(name).run([files['pvt_ln'], *out])
    with pytest.raises(ValueError, match=r'(?s)does not match.*layers\.0\.0\.projection\.weight'):
        tool('gates').run([files['pvt_dtn'], files['swin_ckpt'], *out])
    with pytest.raises(ValueError, match='no images'):
        tool('attention_distance').run([files['pvt_dtn'], '--images', files['empty'], *out])
    with pytest.raises(FileNotFoundError, match='missing.py'):
        tool('complexity').run([str(tmp_path / 'missing.py'), *out])
    with pytest.raises(FileNotFoundError, match='nothing.pth'):
        tool('token_magnitude').run([files['pvt_dtn'], str(tmp_path / 'nothing.pth'), *out])
    variation = tool('variation_coefficient')
    with pytest.raises(SystemExit) as exit_info:
        variation.cli.main(variation.run, [files['pvt_ln'], *out])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith('error: ') and 'without DynamicTokenNorm layers' in last


def test_complexity_of_a_swin_backbone_and_its_twin(files, tmp_path):
    """A config with only a backbone; the LN twin is mmdet's SwinTransformer
    (train() returns None)."""
    result = tool('complexity').run([files['swin_dtn'], '--size', '72', '88',
                                     '--out', str(tmp_path)])
    rows = {r['role']: r for r in result['rows']}
    assert set(rows) == {'model', 'LN twin'}
    assert len(result['dtn_layers']) == 4 * 2  # blocks x norms
    assert rows['model']['dtn_flops'] == sum(layer['flops'] for layer in result['dtn_layers'])
    assert rows['LN twin']['dtn_flops'] == 0 and rows['model']['flops'] > rows['LN twin']['flops']


def test_complexity_and_benchmark_report_the_same_flops(tmp_path):
    """tools/analysis/complexity.py (backbone from a config) and benchmark_backbones.py (backbone
    from the registry) count the same DTN backbone alike: one DTN formula for every tool."""
    cfg = tmp_path / 'pvtv2_b0_dtn.py'
    cfg.write_text("custom_imports = dict(imports=['mmdtn'], allow_failed_imports=False)\n"
                   "model = dict(backbone=dict(type='PyramidVisionTransformerV2DTN', "
                   'embed_dims=32, num_layers=[2, 2, 2, 2]))\n')
    result = tool('complexity').run([str(cfg), '--size', '64', '96', '--out', str(tmp_path)])
    rows = {r['role']: r for r in result['rows']}
    benchmark = tool('benchmark_backbones').count_flops('pvtv2_b0', (64, 96))
    assert benchmark['dtn'] == (rows['model']['params'], rows['model']['flops'])
    assert benchmark['ln'] == (rows['LN twin']['params'], rows['LN twin']['flops'])
    assert rows['model']['dtn_flops'] == sum(
        dtn_flops(1, layer['channels'], layer['num_heads'], layer['hw_shape'], layer['pool_size'])
        for layer in result['dtn_layers'])


def test_images_follow_the_config_normalisation_and_channel_order():
    from mmengine.config import Config

    from mmdtn.analysis.images import to_tensor
    red = Image.new('RGB', (3, 2), (255, 0, 0))
    mean, std = [10.0, 20.0, 30.0], [2.0, 4.0, 5.0]
    for bgr_to_rgb, first in ((True, (255 - 10) / 2), (False, (0 - 10) / 2)):
        cfg = Config(dict(model=dict(data_preprocessor=dict(mean=mean, std=std,
                                                            bgr_to_rgb=bgr_to_rgb))))
        x = to_tensor(red, cfg)
        assert x.shape == (1, 3, 2, 3)
        assert torch.allclose(x[0, 0], torch.full((2, 3), first))


def test_benchmark_backbones_tool_prints_both_tables():
    """The backbone benchmark end to end on a tiny input: FLOPs and parameters, then time (both
    backbones alternating in one process, by default with glibc's malloc keeping freed memory on
    Linux CPUs), the host's part of it, and memory (one process each), forward passes under
    bfloat16 autocast."""
    import subprocess
    import sys
    proc = subprocess.run(
        [sys.executable, osp.join(ROOT, 'tools', 'analysis', 'benchmark_backbones.py'),
         '--models', 'pvtv2_b0', '--batches', '1', '--size', '64x96', '--flops-sizes', '64x64',
         '--repeats', '2', '--iters', '1', '--threads', '1', '--autocast', 'bfloat16'],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    keep = sys.platform.startswith('linux') and not torch.cuda.is_available()
    assert f'malloc of the timing processes: {"keep" if keep else "system"}' in lines[0]
    assert 'autocast=bfloat16' in lines[0]
    flops = next(line for line in lines if line.split()[:2] == ['pvtv2_b0', '64x64'])
    assert re.search(r'\+\d+\.\d+%', flops)  # DTN's FLOPs above the stock backbone's
    timed = next(line for line in lines if line.split()[:2] == ['pvtv2_b0', '1']).split()
    t_ln, t_dtn, ratio, spread = float(timed[2]), float(timed[3]), timed[4], timed[5]
    assert t_ln > 0 and t_dtn > 0 and ratio.endswith('x')
    low, high = map(float, spread.split('-'))
    assert low <= float(ratio[:-1]) <= high
    assert float(timed[8][:-1]) > 0  # memory ratio
    host_ln, host_dtn = float(timed[9]), float(timed[10])  # the host's part of an iteration
    assert 0 < host_ln <= t_ln and 0 < host_dtn <= t_dtn
