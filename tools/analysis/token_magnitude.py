"""Token magnitude before and after every block norm, per head (DTN paper, Fig. 1).

For one image, the embedding x (N tokens x C channels) entering and leaving ``norm1`` and ``norm2``
of every transformer block is split into G contiguous channel groups ("heads") and the L2 norm of
each token's group is drawn as an H x W heatmap. LayerNorm makes the magnitudes of all tokens alike;
inter-token statistics (IN, DTN) keep their differences. G is the layer's DTN head count, the
attention head count for LayerNorm layers, the DTN model's count for both models when two are
compared (so that the panels match), or ``--groups``.

Writes per norm layer ``token_magnitude_<layer>.png`` (rows: before/after per model; columns:
heads), ``token_magnitude_cv.png`` (the spread of magnitudes, std/mean over tokens, after each
norm), ``token_magnitude.csv`` (per layer, head: mean, std, cv) and ``token_magnitude.npz`` (the
maps, keys ``model/layer/before|after``) to ``--out``.

Example (LN vs DTN side by side)::

    python tools/analysis/token_magnitude.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        dtn.pth --images photo.jpg --compare configs/pvt/retinanet_pvt-t-ln_fpn_1x_coco.py ln.pth
"""
import os.path as osp
import textwrap

import numpy as np

from mmdtn.analysis import cli
from mmdtn.analysis.capture import NormRecorder, record
from mmdtn.analysis.plotting import heatmap_grid, per_layer_axes, plt, save


def attention_heads(block):
    """Number of attention heads of a transformer block (PVT or Swin)."""
    attn = block.module.attn
    inner = getattr(attn, 'w_msa', None) or getattr(attn, 'attn', None) or attn
    return int(inner.num_heads)


def magnitude_maps(x, hw_shape, groups):
    """(G, H, W) L2 norm of each token's channel group; ``x`` (1, N, C)."""
    n, c = x.shape[-2:]
    if c % groups:
        raise ValueError(f'{c} channels cannot be split into {groups} groups')
    h, w = hw_shape
    return x[0].reshape(n, groups, c // groups).norm(dim=-1).T.reshape(groups, h, w)


def record_norms(config, checkpoint, args):
    """The norm records of one model for the chosen image."""
    cfg, model = cli.load_backbone(config, checkpoint, args.device, args.pretrained)
    images = cli.images_of(args, cfg)
    if not 0 <= args.image_index < len(images):
        raise ValueError(f'--image-index {args.image_index} out of range: {len(images)} image(s)')
    name, image = list(images)[args.image_index]
    with NormRecorder(model) as recorder:
        record(model, image.to(args.device), recorder)
        return name, list(recorder.records)


def group_counts(models_records, override=None):
    """Groups per layer: ``override``, else the DTN count of any model, else attention heads."""
    counts = {}
    for _, records in models_records:
        for rec in records:
            if override:
                counts[rec.label] = override
            elif rec.is_dtn:
                counts[rec.label] = int(rec.module.num_heads)
    for _, records in models_records:
        for rec in records:
            counts.setdefault(rec.label, attention_heads(rec.block))
    return counts


def run(argv=None):
    p = cli.parser('token_magnitude', __doc__, images=True, compare=True)
    p.add_argument('--image-index', type=int, default=0,
                   help='which image of --images (sorted by name) to show (default: 0)')
    p.add_argument('--groups', type=int, default=None, help='channel groups (heads) per map')
    args, out = cli.parse(p, argv)
    models_records = []
    for label, config, checkpoint in cli.progress(cli.models_of(args), 'models'):
        image_name, records = record_norms(config, checkpoint, args)
        models_records.append((label, records))
    groups = group_counts(models_records, args.groups)
    maps, rows = {}, []
    for label, records in models_records:
        for rec in records:
            for when, x in (('before', rec.x), ('after', rec.y)):
                m = magnitude_maps(x, rec.hw_shape, groups[rec.label]).cpu().numpy()
                maps[f'{label}/{rec.label}/{when}'] = m
                for head, hm in enumerate(m):
                    mean, std = float(hm.mean()), float(hm.std())
                    rows.append(dict(model=label, layer=rec.label, dtn=rec.is_dtn, when=when,
                                     head=head, mean=mean, std=std,
                                     cv=std / mean if mean else float('nan')))
    np.savez_compressed(osp.join(out, 'token_magnitude.npz'), **maps)
    cli.write_csv(osp.join(out, 'token_magnitude.csv'), rows)
    layer_labels = list(dict.fromkeys(
        rec.label for _, records in models_records for rec in records))
    for layer in cli.progress(layer_labels, 'figures'):
        grid, row_labels = [], []
        for label, _ in models_records:
            for when in ('before', 'after'):
                key = f'{label}/{layer}/{when}'
                if key in maps:
                    grid.append(list(maps[key]))
                    row_labels.append(when if len(models_records) == 1 else
                                      '\n'.join(textwrap.wrap(label, 22)) + f'\n{when}')
        models = ' vs '.join(label for label, _ in models_records)
        heatmap_grid(grid, osp.join(out, f'token_magnitude_{layer}.png'), row_labels,
                     [f'head {h + 1}' for h in range(groups[layer])],
                     title=f'token magnitude before/after {layer}: {models}, image {image_name}',
                     share='row')
    fig, ax = plt.subplots(figsize=(6, 3))
    for label, _ in models_records:
        cv = [np.mean([r['cv'] for r in rows if r['model'] == label and r['layer'] == layer
                       and r['when'] == 'after']) for layer in layer_labels]
        ax.plot(range(len(layer_labels)), cv, marker='o', ms=3, label=label)
    per_layer_axes(ax, layer_labels, 'std/mean of token magnitude\nafter the norm', 7)
    save(fig, osp.join(out, 'token_magnitude_cv.png'))
    print(f'token magnitude maps of {len(layer_labels)} norm layers written to {out}')
    return dict(maps=maps, rows=rows, groups=groups)


if __name__ == '__main__':
    cli.main(run)
