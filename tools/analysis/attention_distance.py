"""Mean attention distance of every attention layer and head (DTN paper, Fig. 2 and appendix B.1).

For query token i of head h, d_i = sum_j A_ij * ||p_i - p_j||, the attention-weighted Euclidean
distance to the tokens it attends to; a layer's value is the mean of d_i over the queries of an
image, averaged over the images. Distances are in tokens ("patches") of the layer's stage and, to
compare stages, in input pixels (tokens times the stage's stride). PVT's spatially reduced keys sit
at the centres of their reduction cells; Swin attends inside its (shifted) windows and queries on
the window padding are left out. Attention weights are recomputed from each module's own parameters.

Writes ``attention_distance.csv`` / ``.json`` and ``attention_distance.png`` (one column per model:
a dot per head and layer, like the paper's Fig. 2) to ``--out``.

Example::

    python tools/analysis/attention_distance.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        ckpt.pth --images my_images/ \\
        --compare configs/pvt/retinanet_pvt-t-ln_fpn_1x_coco.py ln_ckpt.pth
"""
from collections import defaultdict

import numpy as np

from mmdtn.analysis import cli
from mmdtn.analysis.attention import distance_sums
from mmdtn.analysis.capture import AttentionRecorder, record
from mmdtn.analysis.plotting import plt, save


def layer_distances(records, image_hw):
    """Per attention record: ``(record, per-head mean distance in tokens, stride in pixels)``."""
    out = []
    for rec in records:
        sums, count = 0, 0
        for attn, q_pos, k_pos, q_valid in rec.chunks():
            s, c = distance_sums(attn, q_pos, k_pos, q_valid)
            sums, count = sums + s, count + c
        stride = (image_hw[0] / rec.hw_shape[0] + image_hw[1] / rec.hw_shape[1]) / 2
        out.append((rec, (sums / count).cpu().numpy(), stride))
    return out


def analyse_model(label, config, checkpoint, args):
    """Rows (one per layer and head) of the mean attention distance of one model over the images."""
    cfg, model = cli.load_backbone(config, checkpoint, args.device, args.pretrained)
    images = cli.images_of(args, cfg)
    per_layer = defaultdict(list)
    meta = {}
    with AttentionRecorder(model) as recorder:
        for _, image in cli.progress(images, f'{label}: images', len(images)):
            record(model, image.to(args.device), recorder)
            for rec, dist, stride in layer_distances(recorder.records, image.shape[-2:]):
                per_layer[rec.block.name].append((dist, dist * stride))
                meta[rec.block.name] = rec
    rows = []
    for layer_idx, (name, values) in enumerate(per_layer.items()):
        rec = meta[name]
        tokens = np.mean([v[0] for v in values], 0)
        pixels = np.mean([v[1] for v in values], 0)
        for head in range(len(tokens)):
            rows.append(dict(model=label, layer=layer_idx, block=rec.block.label, module=name,
                             kind=rec.kind, head=head, distance_tokens=float(tokens[head]),
                             distance_pixels=float(pixels[head]), images=len(values)))
    return rows


def plot(rows, path):
    models = list(dict.fromkeys(r['model'] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 5.2), squeeze=False,
                             sharey='row', layout='constrained')
    for col, model in enumerate(models):
        mrows = [r for r in rows if r['model'] == model]
        stage_of = {r['layer']: r['block'].split('.')[0] for r in mrows}
        for row, (key, unit) in enumerate((('distance_tokens', 'tokens of the stage'),
                                           ('distance_pixels', 'input pixels'))):
            ax = axes[row][col]
            heads = max(r['head'] for r in mrows) + 1
            for head in range(heads):
                hr = [r for r in mrows if r['head'] == head]
                ax.scatter([r['layer'] + 1 for r in hr], [r[key] for r in hr], s=12,
                           color=plt.cm.tab10(head % 10), label=f'head {head + 1}')
            layers = sorted(stage_of)
            for a, b in zip(layers, layers[1:]):
                if stage_of[a] != stage_of[b]:
                    ax.axvline(b + 0.5, color='0.8', lw=0.8)
            ax.set_xlabel('layer (block)', fontsize=8)
            ax.set_ylabel(f'mean attention distance\n({unit})', fontsize=8)
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(model, fontsize=9)
        axes[0][col].legend(fontsize=6, ncol=2, loc='best')
    return save(fig, path)


def run(argv=None):
    args, out = cli.parse(cli.parser('attention_distance', __doc__, images=True, compare=True),
                          argv)
    rows = []
    for label, config, checkpoint in cli.models_of(args):
        rows += analyse_model(label, config, checkpoint, args)
    return cli.write_results(out, 'attention_distance', rows, plot)  # a row per layer and head


if __name__ == '__main__':
    cli.main(run)
