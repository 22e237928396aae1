"""Variation coefficient |(x - mu) / x| of LN, IN and DTN means at every DTN layer (Fig. 3b).

At every DTN layer, for the tokens x entering it, the mean mu of each normalizer is compared with
x: LN (each token's mean over its channels, Eq. 2), IN (each channel's mean over all tokens of the
image, Eq. 3), DTN's inter-token part alone (P^h x, Eq. 5) and DTN (the gated mix, Eq. 5), taken
from the layer's own ``statistics``. The value is the mean of |(x - mu) / x| over all elements with
x != 0 (its median is reported too, being robust to x near 0), averaged over the images. A large
value means the statistic is far from the token features (the paper finds IN's estimates worst).

Writes ``variation_coefficient.png``, ``variation_coefficient.csv`` and ``.json`` to ``--out``.
Needs a DTN backbone.

Example::

    python tools/analysis/variation_coefficient.py configs/pvt/retinanet_pvt-t-dtn_fpn_1x_coco.py \\
        ckpt.pth --images my_images/
"""
from collections import defaultdict

import numpy as np
import torch

from mmdtn.analysis import cli
from mmdtn.analysis.capture import NormRecorder, record
from mmdtn.analysis.plotting import per_layer_axes, plt, save

STATISTICS = (('LN', 'mean_ln'), ('IN', None), ('DTN inter-token', 'mean_it'), ('DTN', 'mean'))


def variation(x, mu):
    """``(mean, median)`` of |(x - mu) / x| over the elements with x != 0."""
    nz = x != 0
    ratio = ((x - mu).abs() / x.abs().clamp_min(1e-30))[nz.expand_as(x)]
    return float(ratio.double().mean()), float(ratio.double().median())


@torch.no_grad()
def layer_variations(records):
    """``{(layer, statistic): (mean, median)}`` for the DTN records of one forward pass."""
    out = {}
    for rec in records:
        if not rec.is_dtn:
            continue
        x = rec.x
        stats = rec.module.statistics(x, rec.hw_shape)
        for label, key in STATISTICS:
            mu = x.mean(dim=1, keepdim=True) if key is None else stats[key]
            out[(rec.label, label)] = variation(x, mu)
    return out


def plot(rows, path):
    layers = list(dict.fromkeys(r['layer'] for r in rows))
    labels = [s for s, _ in STATISTICS]
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(1.2 + 0.5 * len(layers), 3))
    for i, stat in enumerate(labels):
        vals = [next(r['vc_mean'] for r in rows if r['layer'] == layer and r['statistic'] == stat)
                for layer in layers]
        offset = (i - (len(labels) - 1) / 2) * width
        ax.bar(np.arange(len(layers)) + offset, vals, width, label=stat)
    ax.set_yscale('log')
    per_layer_axes(ax, layers, 'mean |(x - mu) / x|')
    return save(fig, path)


def run(argv=None):
    args, out = cli.parse(cli.parser('variation_coefficient', __doc__, images=True), argv)
    cfg, model = cli.load_backbone(args.config, args.checkpoint, args.device, args.pretrained,
                                   dtn_for='variation coefficient')
    images = cli.images_of(args, cfg)
    values = defaultdict(list)
    with NormRecorder(model) as recorder:
        for _, image in cli.progress(images, 'images', len(images)):
            record(model, image.to(args.device), recorder)
            for key, v in layer_variations(recorder.records).items():
                values[key].append(v)
    rows = [dict(layer=layer, statistic=stat, vc_mean=float(np.mean([v[0] for v in vs])),
                 vc_median=float(np.mean([v[1] for v in vs])), images=len(vs))
            for (layer, stat), vs in values.items()]
    return cli.write_results(out, 'variation_coefficient', rows, plot)


if __name__ == '__main__':
    cli.main(run)
