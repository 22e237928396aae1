"""The token grid of one DynamicTokenNorm call and the layouts its passes share.

Tokens x are (B, N, C), row-major on an H x W grid (N = H W). With pooling (App. B.1 of the paper)
the inter-token statistics are computed on the Hp x Wp = ceil(H / s) x ceil(W / s) grid of s x s
cells, border cells averaging only their real tokens, and every token takes the statistics of its
cell. The C channels form ``heads`` groups of d = C / heads channels, each with its own P^h.

The positional products (Eq. 5) work per head on the cell grid. Their input, the two moments T, is
column-major, (heads, Wp, 2, B, Hp, d), so that P_x^h multiplies all of a head's columns in one
matrix product; the results u = P_x T and m = P_y u are head-major, (heads, 2, B, Hp, Wp, d), where
P_y^h multiplies all rows of a head at once.
"""
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

__all__ = ['TokenGrid', 'pooled_size']


def pooled_size(hw_shape, pool):
    """(Hp, Wp) = (ceil(H / s), ceil(W / s)), the cell grid of App. B.1 for tokens on ``hw_shape``
    = (H, W) and pooling size s (ints, or symbolic ints under dynamic shapes). A floor division of
    non-negative numbers: the ONNX exporter translates a symbolic // as a truncating division."""
    H, W = hw_shape
    return (H + pool - 1) // pool, (W + pool - 1) // pool


@dataclass(frozen=True)
class TokenGrid:
    """Sizes of one call (plain ints: a constant for ``torch.compile``, symbolic under dynamic
    shapes), and views between the layouts of its tensors. The derived sizes (N, d, Hp, Wp,
    pooled) are attributes, set once: the passes read them many times per call."""

    B: int
    H: int
    W: int
    C: int
    heads: int
    pool: int
    N: int = field(init=False, compare=False)  # tokens, H W
    d: int = field(init=False, compare=False)  # channels per head
    Hp: int = field(init=False, compare=False)  # cell rows
    Wp: int = field(init=False, compare=False)  # cell columns
    pooled: bool = field(init=False, compare=False)

    def __post_init__(self):
        Hp, Wp = pooled_size((self.H, self.W), self.pool)
        for name, value in (('N', self.H * self.W), ('d', self.C // self.heads), ('Hp', Hp),
                            ('Wp', Wp), ('pooled', self.pool > 1)):
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, x, hw_shape, heads, pool):
        """The grid of tokens ``x`` (B, N, C) on ``hw_shape`` = (H, W): made once per sizes of
        plain ints (a grid holds numbers only), afresh for symbolic ones."""
        B, _, C = x.shape
        sizes = (B, hw_shape[0], hw_shape[1], C, heads, pool)
        if all(type(v) is int for v in sizes):
            return _cached_grid(*sizes)
        return cls(*sizes)

    # ---------------------------------------------------------------- tokens and cells
    def cell_counts(self, device, dtype):
        """Real tokens of every cell, (Hp, Wp, 1)."""
        s = self.pool
        rows = (self.H - torch.arange(0, self.H, s, device=device)).clamp(max=s)
        cols = (self.W - torch.arange(0, self.W, s, device=device)).clamp(max=s)
        return (rows[:, None] * cols[None, :]).to(dtype)[..., None]

    def cell_sums(self, t):
        """Sums over the real tokens of every cell: (B, N, k) -> (B, Hp, Wp, k)."""
        s, k = self.pool, t.shape[-1]
        image = t.reshape(self.B, self.H, self.W, k)
        if s == 1:
            return image
        padded = F.pad(image, (0, 0, 0, self.Wp * s - self.W, 0, self.Hp * s - self.H))
        return padded.view(self.B, self.Hp, s, self.Wp, s, k).sum((2, 4))

    def cell_means(self, t):
        """Means over the real tokens of every cell: (B, N, k) -> (B, Hp, Wp, k)."""
        if self.pool == 1:
            return self.cell_sums(t)
        return self.cell_sums(t) / self.cell_counts(t.device, t.dtype)

    def to_tokens(self, cells):
        """Every token takes its cell's value: (B, Hp, Wp, k) -> (B, N, k)."""
        s, k = self.pool, cells.shape[-1]
        if s == 1:
            return cells.reshape(self.B, self.N, k)
        up = cells[:, :, None, :, None].expand(self.B, self.Hp, s, self.Wp, s, k)
        up = up.reshape(self.B, self.Hp * s, self.Wp * s, k)[:, :self.H, :self.W]
        return up.reshape(self.B, self.N, k)

    # ---------------------------------------------------------------- layouts of the products
    @property
    def column_major(self):
        """Shape of the moments T and their gradient: (heads, Wp, 2, B, Hp, d)."""
        return (self.heads, self.Wp, 2, self.B, self.Hp, self.d)

    @property
    def head_major(self):
        """Shape of the products u, m and their gradients: (heads, 2, B, Hp, Wp, d)."""
        return (self.heads, 2, self.B, self.Hp, self.Wp, self.d)

    def split(self, t):
        """(..., C) -> (..., heads, d) view."""
        return t.view(*t.shape[:-1], self.heads, self.d)

    def to_column_major(self, t):
        """(B, h, w, C) -> (heads, w, B, h, d) view (h, w: the cell grid or 1)."""
        return self.split(t).permute(3, 2, 0, 1, 4)

    def from_column_major(self, t):
        """(heads, Wp, B, Hp, d) -> (B, Hp, Wp, heads, d) view."""
        return t.permute(2, 3, 1, 0, 4)

    def from_head_major(self, t):
        """(heads, B, Hp, Wp, d) -> (B, Hp, Wp, heads, d) view."""
        return t.permute(1, 2, 3, 0, 4)

    def to_head_major(self, t):
        """(B, Hp, Wp, C) -> (heads, B, Hp, Wp, d) view."""
        return self.split(t).permute(3, 0, 1, 2, 4)

    def cells_of(self, t):
        """(B, Hp, Wp, heads, d) -> (B, Hp, Wp, C)."""
        return t.reshape(self.B, self.Hp, self.Wp, self.C)


@functools.lru_cache(maxsize=4096)
def _cached_grid(*sizes):
    return TokenGrid(*sizes)
