"""Positional attention P^h of every DTN layer and head (DTN paper, Eqs. 6-7, Figs. 7-8).

P^h = softmax(R a^h) weighs the (pooled) tokens from which DTN takes its inter-token statistics.
For one token of the pooled grid (default: the centre cell; ``--token ROW COL``) its row of P^h is
drawn as an image of the grid, for every head of every DTN layer, at the token maps of an input of
``--size`` (default 224 x 224). The chosen token is outlined in yellow, the row's maximum in red.
With the paper's initialization (Eq. 7) each head peaks at a different neighbour.
With a checkpoint, the rows are drawn at initialization ("before": the config's freshly built
backbone) and from the checkpoint ("after"), as in Fig. 8.

Writes ``positional_attention_<before|after>.png``, ``positional_attention.json`` (per layer and
head: pooled grid, token, row sum, peak offset (d_row, d_col), peak weight, a^h) and
``positional_attention.npz`` (the rows) to ``--out``. Needs a DTN backbone.

Example::

    python tools/analysis/positional_attention.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        ckpt.pth
"""
import os.path as osp

import numpy as np
import torch

from mmdtn.analysis import cli
from mmdtn.analysis.flops import DTNShapeRecorder
from mmdtn.analysis.models import norm_labels, require_dtn
from mmdtn.analysis.plotting import heatmap_grid


def dtn_grids(model, size, device):
    """``{name: (hw_shape, pooled_shape)}`` of every DTN layer for an input of ``size``."""
    recorder = DTNShapeRecorder(model)
    try:
        with torch.no_grad():
            model(torch.zeros(1, 3, *size, device=device))
    finally:
        recorder.remove()
    return {layer['name']: (layer['hw_shape'], layer['pooled_shape']) for layer in recorder.layers}


def positional_rows(model, grids, token):
    """Per DTN layer: (name, module, pooled shape, token (r, c), rows (heads, h, w))."""
    out, labels = [], norm_labels(model)
    for name, module in require_dtn(model, 'the model', 'positional attention'):
        if name not in grids:
            continue
        hw, (h, w) = grids[name]
        r, c = token if token is not None else (h // 2, w // 2)
        if not (0 <= r < h and 0 <= c < w):
            raise ValueError(f'--token {r} {c} is outside the {h} x {w} pooled grid of {name}')
        p = module.positional_matrix(hw).detach()
        if p.shape[-1] != h * w:
            raise ValueError(f'{name}: P^h has {p.shape[-1]} columns, pooled grid {h} x {w}')
        out.append((labels.get(name, name), module, (h, w), (r, c),
                    p[:, r * w + c].reshape(-1, h, w).cpu()))
    return out


def summarise(stage, layers):
    rows = []
    for name, module, (h, w), (r, c), prow in layers:
        for head, m in enumerate(prow):
            peak = int(m.argmax())
            pr, pc = divmod(peak, w)
            rows.append(dict(state=stage, layer=name, head=head, pooled_shape=[h, w], token=[r, c],
                             row_sum=float(m.sum()), peak_offset=[pr - r, pc - c],
                             peak_weight=float(m.max()),
                             pos_coef=[float(v) for v in module.pos_coef[head].detach().cpu()]))
    return rows


def plot(stage, layers, path):
    grid, labels, marks = [], [], []
    for name, _, (h, w), (r, c), prow in layers:
        grid.append([m.numpy() for m in prow])
        labels.append(f'{name}\n{h}x{w}')
        marks.append([[(r, c, 'yellow'), (*divmod(int(m.argmax()), w), 'red')] for m in prow])
    heads = max(len(g) for g in grid)
    return heatmap_grid(grid, path, labels, [f'head {i + 1}' for i in range(heads)],
                        title=f'P^h row of the outlined token ({stage})', share='none',
                        marks=marks, cmap='magma', colorbar=False)


def run(argv=None):
    p = cli.parser('positional_attention', __doc__,
                   checkpoint_help='checkpoint (.pth); without it only the initialization is shown')
    p.add_argument('--size', type=int, nargs=2, metavar=('H', 'W'), default=(224, 224),
                   help='input size that sets the token maps (default: 224 224)')
    p.add_argument('--token', type=int, nargs=2, metavar=('ROW', 'COL'), default=None,
                   help='token (cell of the pooled grid) whose row is drawn (default: centre)')
    args, out = cli.parse(p, argv)
    checkpoints = [('before', None)] + ([('after', args.checkpoint)] if args.checkpoint else [])
    states = [(state, cli.load_backbone(args.config, checkpoint, args.device, args.pretrained,
                                        dtn_for='positional attention')[1])
              for state, checkpoint in checkpoints]
    grids = dtn_grids(states[0][1], args.size, args.device)
    rows, arrays = [], {}
    for stage, m in cli.progress(states, 'states'):
        layers = positional_rows(m, grids, args.token)
        rows += summarise(stage, layers)
        arrays.update({f'{stage}/{name}': prow.numpy() for name, _, _, _, prow in layers})
        plot(stage, layers, osp.join(out, f'positional_attention_{stage}.png'))
    cli.write_json(osp.join(out, 'positional_attention.json'), rows)
    np.savez_compressed(osp.join(out, 'positional_attention.npz'), **arrays)
    print(f'P^h rows of {len(rows)} (layer, head) pairs written to {out}')
    return rows


if __name__ == '__main__':
    cli.main(run)
