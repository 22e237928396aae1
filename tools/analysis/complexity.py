"""Parameters and FLOPs of the backbone and the whole model, DTN's own operations shown separately.

The format of the DTN paper's Tables 1, 2, 9 and 12: parameters and FLOPs of a DTN model next to
its LayerNorm twin, at one input size (batch 1). Everything except DTN is counted by mmengine's
``FlopAnalyzer`` (one multiply-add = one FLOP, LayerNorm = 5 per element); every DynamicTokenNorm
layer is counted by the one DTN formula, ``mmdtn/models/layers/dtn/flops.py``, from the layer's
channels, heads, token map and pooling size (as ``benchmark_backbones.py``). Column ``DTN``: that
count, as implemented (P^h applied factorized along W and H); column ``dense P``: the model's total
with the paper's dense T x T P^h instead. The LN twin is derived from the config (the stock
backbone type without the DTN/DPN settings) unless ``--compare`` names one.

Writes ``complexity.json``, ``complexity.csv`` (one row per model and part),
``complexity_dtn_layers.csv`` (the formula per DTN layer) and ``complexity.png`` to ``--out`` and
prints the table. For two-stage detectors the whole-model count includes the RoI heads run on every
RPN proposal of the ``mode='tensor'`` forward, as mmdet's own ``get_flops`` counts them.

Example (the paper's 224 x 224 and a detection size)::

    python tools/analysis/complexity.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        --size 224 224
    python tools/analysis/complexity.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        --size 800 1344
"""
import os.path as osp

import torch

from mmdtn.analysis import cli
from mmdtn.analysis.flops import TensorForward, complexity
from mmdtn.analysis.models import build_backbone, build_model, ln_twin_config, load_config
from mmdtn.analysis.plotting import plt, save


def whole_model_inputs(model, size, device):
    """Inputs and data samples for a detector's/segmentor's ``mode='tensor'`` forward."""
    inputs = torch.randn(1, 3, *size, device=device)
    samples = None
    try:
        from mmdet.models.detectors import BaseDetector
        from mmdet.structures import DetDataSample
    except ImportError:  # pragma: no cover
        BaseDetector = None
    if BaseDetector is not None and isinstance(model, BaseDetector):
        meta = dict(img_shape=tuple(size), ori_shape=tuple(size), pad_shape=tuple(size),
                    batch_input_shape=tuple(size), scale_factor=(1.0, 1.0))
        samples = [DetDataSample(metainfo=meta)]
    return inputs, samples


def analyse(label, cfg, config_path, size, device):
    """Complexity rows (backbone, whole model) of one config."""
    torch.manual_seed(0)
    backbone = build_backbone(cfg, device, config_path)
    rows = [dict(model=label, part='backbone',
                 **complexity(backbone, torch.randn(1, 3, *size, device=device)))]
    if 'type' in cfg.model:
        model = build_model(cfg, device, config_path)
        inputs, samples = whole_model_inputs(model, size, device)
        rows.append(dict(model=label, part=type(model).__name__,
                         **complexity(TensorForward(model, samples), inputs)))
    return rows


def _g(v):
    return f'{v / 1e9:.3f}G' if v >= 1e8 else f'{v / 1e6:.2f}M'


def table(rows):
    """The printed table: one line per model and part, FLOPs relative to the LN twin."""
    base = {r['part_kind']: r for r in rows if r['role'] == 'LN twin'}

    def rel(value, ref):
        return f'{100 * (value / ref - 1):+.1f}%' if ref else ''

    lines = [f'{"":8s} {"model":34s} {"part":16s} {"params":>8s} {"FLOPs":>8s} {"DTN":>8s} '
             f'{"vs LN":>7s} {"dense P":>8s} {"vs LN":>7s}']
    for r in rows:
        ref = base.get(r['part_kind'])
        ref = ref['flops'] if ref and ref is not r else None
        dtn = _g(r['dtn_flops']) if r['dtn_flops'] else '-'
        lines.append(f'{r["role"]:8s} {r["model"][:34]:34s} {r["part"][:16]:16s} '
                     f'{r["params"] / 1e6:7.2f}M {_g(r["flops"]):>8s} {dtn:>8s} '
                     f'{rel(r["flops"], ref):>7s} {_g(r["flops_dense_p"]):>8s} '
                     f'{rel(r["flops_dense_p"], ref):>7s}')
    return '\n'.join(lines)


def plot(rows, path):
    parts = list(dict.fromkeys(r['part_kind'] for r in rows))
    fig, axes = plt.subplots(1, len(parts), figsize=(3.2 * len(parts), 2.8), squeeze=False,
                             layout='constrained')
    for ax, part in zip(axes[0], parts):
        pr = [r for r in rows if r['part_kind'] == part]
        names = [r['role'] for r in pr]
        other = [(r['flops'] - r['dtn_flops']) / 1e9 for r in pr]
        dtn = [r['dtn_flops'] / 1e9 for r in pr]
        ax.bar(names, other, color='0.6', label='other operations')
        ax.bar(names, dtn, bottom=other, color='tab:red', label='DTN (formula)')
        h, w = pr[0]['input_size']
        ax.set_title(f"{pr[0]['part']}, {h} x {w}", fontsize=8)
        ax.set_ylabel('GFLOPs', fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    return save(fig, path)


def run(argv=None):
    p = cli.parser('complexity', __doc__, checkpoint_help='optional; checked against the config '
                   'but not needed: FLOPs and parameters do not depend on the weights')
    p.add_argument('--size', type=int, nargs=2, metavar=('H', 'W'), default=(224, 224),
                   help='input size (default: 224 224)')
    p.add_argument('--compare', default=None, metavar='CONFIG2',
                   help='LN twin config (default: derived from CONFIG)')
    p.add_argument('--no-twin', action='store_true', help='analyze CONFIG alone')
    args, out = cli.parse(p, argv)
    cfg = load_config(args.config)
    if args.checkpoint:
        cli.load_backbone(args.config, args.checkpoint, args.device)
    models = [('model', osp.splitext(osp.basename(args.config))[0], cfg, args.config)]
    if not args.no_twin:
        if args.compare:
            models.append(('LN twin', osp.splitext(osp.basename(args.compare))[0],
                           load_config(args.compare), args.compare))
        else:
            twin = ln_twin_config(cfg)
            if twin is not None:
                models.append(('LN twin', models[0][1], twin, args.config + ' (LN twin)'))
    rows, layer_rows = [], []
    for role, label, c, path in cli.progress(models, 'models'):
        for kind, r in zip(('backbone', 'model'), analyse(label, c, path, args.size, args.device)):
            r.update(role=role, part_kind=kind, input_size=list(args.size),
                     flops_dense_p=r['flops'] - r['dtn_flops'] + r['dtn_flops_dense'])
            for layer in r.pop('dtn_layers'):
                layer_rows.append(dict(model=label, part=r['part'], **{
                    k: (list(v) if isinstance(v, tuple) else v) for k, v in layer.items()}))
            rows.append(r)
    print(table(rows))
    cli.write_json(osp.join(out, 'complexity.json'), dict(rows=rows, dtn_layers=layer_rows))
    cli.write_csv(osp.join(out, 'complexity.csv'), rows)
    if layer_rows:
        cli.write_csv(osp.join(out, 'complexity_dtn_layers.csv'), layer_rows)
    plot(rows, osp.join(out, 'complexity.png'))
    return dict(rows=rows, dtn_layers=layer_rows)


if __name__ == '__main__':
    cli.main(run)
