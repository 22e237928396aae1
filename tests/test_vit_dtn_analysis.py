"""The analysis tools on the ViTs (mmseg's VisionTransformer and VisionTransformerDTN): attention
distance over the patch grid with the class token left out, token magnitude of the patch tokens,
DTN's P^h and gates."""
import math
import os.path as osp

import pytest
import torch

from mmdtn.analysis.attention import mha_output
from mmdtn.analysis.capture import AttentionRecorder, NormRecorder, record
from mmdtn.analysis.models import build_backbone, load_config, transformer_blocks
from test_analysis import tool

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
#: ViT-S*'s ImageNet configs, shrunk: 3 layers (DTN in the first 2) on 32 x 32 images
SMALL = "model = dict(backbone=dict(img_size=32, patch_size=8, num_layers=3{extra}))\n"


@pytest.fixture(scope='module')
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp('vit_analysis')
    paths = {}
    for norm, extra in (('dtn', ', dtn_layers=2'), ('ln', '')):
        base = osp.join(ROOT, 'configs', 'imagenet', f'vit-s-star-{norm}_4xb256_in1k.py')
        paths[norm] = str(d / f'vit_{norm}.py')
        (d / f'vit_{norm}.py').write_text(f'_base_ = {base!r}\n' + SMALL.format(extra=extra))
    return paths


def test_blocks_are_one_stage_and_attention_is_recomputed_without_the_class_token(configs):
    model = build_backbone(load_config(configs['dtn']))
    assert [b.label for b in transformer_blocks(model)] == \
        ['stage1.block1', 'stage1.block2', 'stage1.block3']
    outputs = []
    hooks = [layer.attn.attn.register_forward_hook(
        lambda m, args, kwargs, out: outputs.append(out[0]), with_kwargs=True)
        for layer in model.layers]
    with AttentionRecorder(model) as attention, NormRecorder(model) as norms:
        record(model, torch.randn(1, 3, 48, 40), attention, norms)
    for h in hooks:
        h.remove()
    assert [r.kind for r in attention.records] == ['global'] * 3
    # the DTN layers see the 6 x 5 patches only; the last layer the class token too
    assert [r.num_prefix_tokens for r in attention.records] == [0, 0, 1]
    for rec, out in zip(attention.records, outputs):
        assert rec.hw_shape == (6, 5)
        attn = rec.weights()  # patch queries on patch keys
        assert attn.shape == (1, 6, 30, 30)
        if rec.num_prefix_tokens == 0:  # nothing left out: the module's output, recomputed
            assert torch.allclose(attn.sum(-1), torch.ones(()), atol=1e-5)
            torch.testing.assert_close(mha_output(rec.module.attn, attn, rec.key),
                                       out.transpose(0, 1), atol=1e-5, rtol=1e-4)  # seq-first
        else:  # the class token's share is left out
            assert (attn.sum(-1) < 1).all()
    assert len(norms.records) == 6 and all(r.x.shape == (1, 30, 384) for r in norms.records)
    assert [r.is_dtn for r in norms.records] == [True] * 4 + [False] * 2


def test_tools_run_on_the_vit_and_its_ln_twin(configs, tmp_path):
    rows = tool('attention_distance').run([configs['dtn'], '--size', '32', '32', '--out',
                                           str(tmp_path / 'distance'), '--compare', configs['ln']])
    assert {r['model'] for r in rows} == {'vit_dtn', 'vit_ln'} and len(rows) == 2 * 3 * 6
    assert all(0 <= r['distance_tokens'] <= 3 * math.sqrt(2) for r in rows)  # 4 x 4 patches
    assert (tmp_path / 'distance' / 'attention_distance.png').stat().st_size > 0
    magnitude = tool('token_magnitude').run([configs['dtn'], '--size', '32', '32', '--out',
                                             str(tmp_path / 'magnitude')])
    assert magnitude['groups']['stage1.block1.norm1'] == 6  # ViT-S*'s DTN heads
    positional = tool('positional_attention').run([configs['dtn'], '--size', '32', '32', '--out',
                                                   str(tmp_path / 'positional')])
    assert positional
    gates = tool('gates').run([configs['dtn'], '--out', str(tmp_path / 'gates')])
    assert len(gates) == 2 * 2 * 6  # DTN layers x norms x heads
