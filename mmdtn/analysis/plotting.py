"""Matplotlib helpers (Agg backend, no screen needed) for compact PNG figures."""
import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

__all__ = ['plt', 'save', 'heatmap_grid', 'per_layer_axes']


def save(fig, path, dpi=80):
    """Write ``fig`` to ``path`` (PNG) and close it."""
    fig.savefig(path, dpi=dpi, bbox_inches='tight')
    plt.close(fig)
    return path


def per_layer_axes(ax, layers, ylabel, legend_size=6):
    """Label ``ax`` for one value per layer: the layer names under the x axis, ``ylabel``, and
    the legend."""
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels(layers, rotation=90, fontsize=6)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.legend(fontsize=legend_size)


def heatmap_grid(maps, path, row_labels=(), col_labels=(), title=None, cmap='viridis',
                 share='row', marks=None, cell=1.6, colorbar=True):
    """A grid of heatmaps ``maps[row][col]`` (2-D arrays, or None for an empty cell).

    ``share``: 'row' gives each row one colour scale, 'all' one scale for the figure, 'none' one
    per map. ``marks[row][col]``: optional list of ``(row, col, colour)`` cells outlined by a box.
    """
    rows, cols = len(maps), max(len(r) for r in maps)
    fig, axes = plt.subplots(rows, cols, figsize=(cell * cols + (0.8 if colorbar else 0),
                                                  cell * rows + (0.4 if title else 0)),
                             squeeze=False, layout='constrained')
    valid = [np.asarray(m) for r in maps for m in r if m is not None]
    lo_all = min(float(m.min()) for m in valid) if valid else 0
    hi_all = max(float(m.max()) for m in valid) if valid else 1
    titled = set()
    for i in range(rows):
        row_valid = [np.asarray(m) for m in maps[i] if m is not None]
        for j in range(cols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            m = maps[i][j] if j < len(maps[i]) else None
            if m is None:
                ax.axis('off')
                continue
            if share == 'row':
                vmin = min(float(v.min()) for v in row_valid)
                vmax = max(float(v.max()) for v in row_valid)
            elif share == 'all':
                vmin, vmax = lo_all, hi_all
            else:
                vmin = vmax = None
            im = ax.imshow(np.asarray(m), cmap=cmap, vmin=vmin, vmax=vmax, interpolation='nearest')
            for r, c, colour in (marks[i][j] if marks else None) or []:
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor=colour,
                                           linewidth=1.5))
            if j not in titled and j < len(col_labels):
                ax.set_title(col_labels[j], fontsize=8)
                titled.add(j)
            if j == 0 and i < len(row_labels):
                ax.set_ylabel(row_labels[i], fontsize=7)
        if colorbar and row_valid:
            fig.colorbar(im, ax=list(axes[i]), fraction=0.025, pad=0.01)
    if title:
        fig.suptitle(title, fontsize=9)
    return save(fig, path)
