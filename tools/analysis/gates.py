"""DTN's gates lambda = sigmoid(gate) of the mean and of the variance per layer and head (Fig. 4).

lambda near 1 means intra-token (LayerNorm) statistics, near 0 inter-token statistics (Eq. 5).
CHECKPOINT is a checkpoint file, or a work directory: then every ``*.pth`` in it is read in the
order of its epoch/iteration number (``epoch_3.pth``, ``iter_2000.pth``) and the trajectory of every
gate across training is drawn, as in the paper's Fig. 4. Without CHECKPOINT the config's
initialization is shown.

Writes ``gates.png`` (layer x head heatmaps of the last checkpoint), ``gates_trajectory.png`` (with
several checkpoints), ``gates.csv`` and ``gates.json`` to ``--out``. Needs a DTN backbone.

Example::

    python tools/analysis/gates.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        work_dirs/retinanet_pvt-t-dtn_fpn_1x_coco
"""
import glob
import os.path as osp
import re

import numpy as np

from mmdtn.analysis import cli
from mmdtn.analysis.models import norm_labels, require_dtn
from mmdtn.analysis.plotting import plt, save

CHECKPOINTS_HELP = ('checkpoint (.pth) or work directory of checkpoints; without it the '
                    'initialization is shown')


def checkpoints_of(path):
    """``[(step, file)]``: a file, or every ``*.pth`` of a work directory sorted by its number."""
    if path is None:
        return [(0, None)]
    if osp.isfile(path):
        return [(_step(path), path)]
    if not osp.isdir(path):
        raise FileNotFoundError(f'checkpoint file or work directory not found: {path}')
    files = glob.glob(osp.join(path, '*.pth'))
    if not files:
        raise ValueError(f'no checkpoints (*.pth) in work directory {path}')
    return sorted(((_step(f), f) for f in files), key=lambda sf: (sf[0], sf[1]))


def _step(file):
    found = re.findall(r'\d+', osp.basename(file))
    return int(found[-1]) if found else 0


def gate_values(model, config):
    """``[(layer, mean_lambda (heads,), var_lambda (heads,))]`` of every DTN layer."""
    labels = norm_labels(model)
    return [(labels.get(name, name), m.mean_lambda.detach().cpu().numpy(),
             m.var_lambda.detach().cpu().numpy())
            for name, m in require_dtn(model, config, 'gates')]


def plot_last(values, title, path):
    heads = max(len(mv) for _, mv, _ in values)
    pad = lambda v: np.pad(v, (0, heads - len(v)), constant_values=np.nan)  # noqa: E731
    mean = np.stack([pad(mv) for _, mv, _ in values])
    var = np.stack([pad(vv) for _, _, vv in values])
    fig, axes = plt.subplots(1, 2, figsize=(2.2 + 0.45 * heads * 2, 1.2 + 0.28 * len(values)))
    for ax, data, name in ((axes[0], mean, 'lambda of the mean'),
                           (axes[1], var, 'lambda of the variance')):
        im = ax.imshow(data, vmin=0, vmax=1, cmap='coolwarm', aspect='auto')
        for (i, j), v in np.ndenumerate(data):
            if np.isfinite(v):
                ax.text(j, i, f'{v:.2f}', ha='center', va='center', fontsize=5)
        ax.set_title(name, fontsize=8)
        ax.set_xticks(range(heads))
        ax.set_xticklabels([str(h + 1) for h in range(heads)], fontsize=6)
        ax.set_xlabel('head', fontsize=7)
        ax.set_yticks(range(len(values)))
        ax.set_yticklabels([n for n, _, _ in values] if ax is axes[0] else [], fontsize=6)
    fig.colorbar(im, ax=list(axes), fraction=0.03)
    fig.suptitle(title, fontsize=8)
    return save(fig, path)


def plot_trajectory(trajectory, path, xlabel, max_cols=6):
    """Per DTN layer, lambda of the mean (upper panel) and of the variance (lower) of each head."""
    layers = list(dict.fromkeys(r['layer'] for r in trajectory))
    cols = min(max_cols, len(layers))
    groups = -(-len(layers) // cols)
    fig, axes = plt.subplots(2 * groups, cols, figsize=(2.1 * cols, 3.4 * groups), squeeze=False,
                             sharey=True, layout='constrained')
    for ax in axes.flat:
        ax.set_visible(False)
    for k, layer in enumerate(layers):
        lr = [r for r in trajectory if r['layer'] == layer]
        for part, key in enumerate(('mean_lambda', 'var_lambda')):
            ax = axes[2 * (k // cols) + part][k % cols]
            ax.set_visible(True)
            for head in sorted({r['head'] for r in lr}):
                hr = [r for r in lr if r['head'] == head]
                ax.plot([r['step'] for r in hr], [r[key] for r in hr], lw=1,
                        color=plt.cm.tab10(head % 10), label=f'head {head + 1}')
            ax.set_ylim(0, 1)
            ax.tick_params(labelsize=6)
            if part == 0:
                ax.set_title(layer, fontsize=7)
            else:
                ax.set_xlabel(xlabel, fontsize=7)
            if k % cols == 0:
                ax.set_ylabel('lambda ' + ('(mean)' if part == 0 else '(variance)'), fontsize=7)
    axes[0][0].legend(fontsize=5, loc='lower left')
    return save(fig, path)


def run(argv=None):
    args, out = cli.parse(cli.parser('gates', __doc__, checkpoint_help=CHECKPOINTS_HELP), argv)
    checkpoints = checkpoints_of(args.checkpoint)
    rows, values = [], []
    for step, file in cli.progress(checkpoints, 'checkpoints', len(checkpoints)):
        _, model = cli.load_backbone(args.config, file, args.device, args.pretrained)
        values = gate_values(model, args.config)
        for layer, mv, vv in values:
            for head in range(len(mv)):
                rows.append(dict(checkpoint=osp.basename(file) if file else 'initialisation',
                                 step=step, layer=layer, head=head, mean_lambda=float(mv[head]),
                                 var_lambda=float(vv[head])))
    last = osp.basename(checkpoints[-1][1]) if checkpoints[-1][1] else 'initialisation'
    plot_last(values, f'DTN gates: {last}', osp.join(out, 'gates.png'))
    if len(checkpoints) > 1:
        names = ' '.join(osp.basename(f) for _, f in checkpoints)
        xlabel = 'epoch' if 'epoch' in names else 'iteration' if 'iter' in names else 'checkpoint'
        plot_trajectory(rows, osp.join(out, 'gates_trajectory.png'), xlabel)
    return cli.write_results(out, 'gates', rows)  # a row per checkpoint, layer and head


if __name__ == '__main__':
    cli.main(run)
