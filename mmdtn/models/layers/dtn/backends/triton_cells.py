"""The positional products of DynamicTokenNorm with pooling, m = P^h T on the cell grid (Eq. 5),
both factors of P^h in one pass, in Triton (Shao et al., ICLR 2022).

With pooling the Triton backend's passes over the tokens read and write per cell T (the cell
moments about the centre) and m, and backward dL/dm and dL/dT, float32 tensors of two moments per
cell and channel (:mod:`.triton_kernels`). Between them the products ran one factor at a time
(:mod:`.triton_band`): u = P_x T written and read back, and kept for backward (now formed there
again), where the gradients of P_y and P_x took one launch each and dL/du was written and read
back again: 4 T-sized tensors moved forward and 8 backward (10 with u formed again), in 2 and 4
(5) launches. Here a program forms m at a tile of cells of one cell row from the band of T about
them on chip, as the fused passes without pooling form it from the tokens
(:func:`.triton_fused._products`: P_y's row, then a ``tl.dot`` with P_x's rows), and u is never
formed:

    products            m = P^h T: T read, m written (one launch)
    products backward   dL/dT = P^hT dL/dm by the same products with the factors transposed, and
                        the program's share of the gradient of a^h from dL/dm at its cells and the
                        band of T (:func:`.triton_fused._products`; no float atomics):
                        dL/dm and T read, dL/dT written (one launch)

m keeps its raw second moment (the passes form the inter-token variance). The cell tensors keep
the layouts of :mod:`..function` (T and dL/dT column-major, m and dL/dm head-major; any strides);
H, W and the strides are runtime arguments (no recompilation per resolution). Heads of up to
:data:`.triton_fused.MAX_HEAD_CHANNELS` channels (a program holds a head's channels of its tile);
wider heads, every layer with ``MMDTN_TRITON_FUSED=0`` and the layers with pooling with
``MMDTN_TRITON_CELL_PRODUCTS=0`` run the products one factor at a time.
"""
import functools
import os

import torch
import triton
import triton.language as tl

from . import triton_fused as fused
from .triton_band import SPAN_BLOCK
from .triton_kernels import _image, _layout
from .triton_launch import LaunchOptions, cdiv, launch

__all__ = ['can_form_products', 'forms_products', 'cell_products', 'cell_products_backward',
           'specializations', 'head_block', 'tiles_table', 'TILES', 'WALKS']

#: Whether layers with pooling form their products here: by default (with
#: :data:`.triton_fused.ENABLED`); ``MMDTN_TRITON_CELL_PRODUCTS=0`` runs them one factor at a time
#: (the band products) and leaves the passes without pooling as they are: these kernels have not
#: yet been timed on a GPU, where the band products have (read at import).
ENABLED = os.environ.get('MMDTN_TRITON_CELL_PRODUCTS', '1') != '0'
#: (cells of a cell row per program, warps[, registers a thread]) by kernel and head width
#: (channels, padded to 16, 32 or 64: :func:`head_block`), as :data:`.triton_fused.TILES`; the cells
#: are the rows of P_x in one tl.dot (at least 16). Chosen as the fused token-gradient pass's tiles,
#: a program of which holds more; compiled without spills on sm_80 and sm_90
#: (``compile_kernels.py``), not yet timed on a GPU: ``tools/analysis/tune_fused_tiles.py --kernels
#: products products_backward`` times candidates on the GPU at hand and prints the tables to put
#: here.
TILES = {
    'products': {16: (16, 4), 32: (16, 4), 64: (16, 4)},
    'products_backward': {16: (16, 4), 32: (16, 4), 64: (16, 4)},
}
#: The walk over P_y^h's band, by kernel and head width as :data:`TILES`: (rows unrolled per
#: step, loads in flight), as :data:`.triton_fused.WALKS`; one row after the other, untimed.
WALKS = {
    'products': {16: (1, 1), 32: (1, 1), 64: (1, 1)},
    'products_backward': {16: (1, 1), 32: (1, 1), 64: (1, 1)},
}


def can_form_products(pool, d):
    """Whether the products of a layer with pooling ``pool`` and heads of d channels can be formed
    here: with pooling, heads of at most MAX_HEAD_CHANNELS channels."""
    return pool > 1 and d <= fused.MAX_HEAD_CHANNELS


def forms_products(pool, d):
    """Whether such a layer's products are formed here: where they can be, unless
    ``MMDTN_TRITON_FUSED=0`` (:data:`.triton_fused.ENABLED`) or ``MMDTN_TRITON_CELL_PRODUCTS=0``
    (:data:`ENABLED`)."""
    return fused.ENABLED and ENABLED and can_form_products(pool, d)


@triton.jit(do_not_specialize=['Hp', 'Wp', 'd', 't_shead', 't_sb', 't_srow', 't_scol',
                               't_plane', 'm_shead', 'm_sb', 'm_srow', 'm_scol', 'm_plane'])
def _products_kernel(t_ptr, p_y_ptr, p_x_ptr, m_ptr, Hp, Wp, d, t_shead, t_sb, t_srow, t_scol,
                     t_plane, m_shead, m_sb, m_srow, m_scol, m_plane, CELLS: tl.constexpr,
                     BAND: tl.constexpr, D_BLOCK: tl.constexpr, SPAN_BLOCK: tl.constexpr,
                     UNROLL: tl.constexpr, STAGES: tl.constexpr):
    """m = P^h T at cells w of cell row i of image b for head h (program (b Hp + i, block, h))."""
    row, block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, i = row // Hp, row % Hp
    w = block * CELLS + tl.arange(0, CELLS)
    c = tl.arange(0, D_BLOCK)
    real = c < d
    p_y, p_x = fused._factors(p_y_ptr, p_x_ptr, head, Hp, Wp)
    bands = fused._bands(p_y, p_x, i, w, Hp, Wp, False, SPAN_BLOCK)
    t_cells = _image(_image(t_ptr, head, t_shead), b, t_sb)
    first, second, _, _, _ = fused._products(t_cells, t_plane, t_cells, 0, 0.0, p_y, p_x, bands,
                                             i, w, Hp, Wp, t_srow, t_scol, c, real, 0.0, 0.0,
                                             False, False, True, False, BAND, D_BLOCK, UNROLL,
                                             STAGES)
    m_cells = _image(_image(m_ptr, head, m_shead), b, m_sb)
    offsets = i * m_srow + w[:, None] * m_scol + c[None, :]
    mask = (w < Wp)[:, None] & real[None, :]
    tl.store(m_cells + offsets, first, mask=mask)
    tl.store(m_cells + m_plane + offsets, second, mask=mask)


def _strides(first, plane):
    """(head, image, row, column, moment) strides of a cell tensor from the (B, Hp, Wp, heads, d)
    view of its first moment and the stride between its moments."""
    s_b, s_row, s_col, s_head = _layout(first)
    return s_head, s_b, s_row, s_col, plane


def _column_major_strides(t, grid):
    """:func:`_strides` of a column-major cell tensor (heads, Wp, 2, B, Hp, d) (T, dL/dT)."""
    return _strides(grid.from_column_major(t[:, :, 0]), t.stride(2))


def _head_major_strides(t, grid):
    """:func:`_strides` of a head-major cell tensor (heads, 2, B, Hp, Wp, d) (m, dL/dm)."""
    return _strides(grid.from_head_major(t[:, 0]), t.stride(1))


def cell_products(T, p_y, p_x, grid):
    """m = P^h T, head-major (heads, 2, B, Hp, Wp, d) float32 with its second moment raw, from T
    column-major (heads, Wp, 2, B, Hp, d) float32 and the factors P_y (heads, Hp, Hp) and P_x
    (heads, Wp, Wp): one launch."""
    m = T.new_empty(grid.head_major)
    spec = specializations(grid.d)[0]
    programs = (grid.B * grid.Hp, cdiv(grid.Wp, spec[1]['CELLS']), grid.heads)
    p_y, p_x = p_y.contiguous(), p_x.contiguous()
    launch('triton.cell_products', spec, programs, [T, p_y, p_x], [m], T, p_y, p_x, m, grid.Hp,
           grid.Wp, grid.d, *_column_major_strides(T, grid), *_head_major_strides(m, grid))
    return m


@triton.jit(do_not_specialize=['Hp', 'Wp', 'd', 't_shead', 't_sb', 't_srow', 't_scol',
                               't_plane', 'm_shead', 'm_sb', 'm_srow', 'm_scol', 'm_plane'])
def _products_backward_kernel(t_ptr, dm_ptr, p_y_ptr, p_x_ptr, dt_ptr, coef_ptr, Hp, Wp, d,
                              t_shead, t_sb, t_srow, t_scol, t_plane, m_shead, m_sb, m_srow,
                              m_scol, m_plane, CELLS: tl.constexpr, BAND: tl.constexpr,
                              D_BLOCK: tl.constexpr, SPAN_BLOCK: tl.constexpr,
                              UNROLL: tl.constexpr, STAGES: tl.constexpr):
    """For cells w of cell row i of image b and head h (program (b Hp + i, block, h)): dL/dT =
    P^hT dL/dm there (dL/dT with T's strides, dL/dm with m's), and the program's share of the
    gradient of a^h (programs, heads, 3)."""
    row, block, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, i = row // Hp, row % Hp
    w = block * CELLS + tl.arange(0, CELLS)
    c = tl.arange(0, D_BLOCK)
    real = c < d
    mask = (w < Wp)[:, None] & real[None, :]
    p_y, p_x = fused._factors(p_y_ptr, p_x_ptr, head, Hp, Wp)
    dm_cells = _image(_image(dm_ptr, head, m_shead), b, m_sb)
    t_cells = _image(_image(t_ptr, head, t_shead), b, t_sb)
    transposed = fused._bands(p_y, p_x, i, w, Hp, Wp, True, SPAN_BLOCK)
    dt_first, dt_second, _, _, _ = fused._products(dm_cells, m_plane, dm_cells, 0, 0.0, p_y,
                                                   p_x, transposed, i, w, Hp, Wp, m_srow, m_scol,
                                                   c, real, 0.0, 0.0, False, True, True, False,
                                                   BAND, D_BLOCK, UNROLL, STAGES)
    dt_cells = _image(_image(dt_ptr, head, t_shead), b, t_sb)
    offsets = i * t_srow + w[:, None] * t_scol + c[None, :]
    tl.store(dt_cells + offsets, dt_first, mask=mask)
    tl.store(dt_cells + t_plane + offsets, dt_second, mask=mask)
    # the gradient of a^h: dL/dm at this program's cells against the band of T about them
    offsets = i * m_srow + w[:, None] * m_scol + c[None, :]
    dm_first = tl.load(dm_cells + offsets, mask=mask, other=0.0)
    dm_second = tl.load(dm_cells + m_plane + offsets, mask=mask, other=0.0)
    bands = fused._bands(p_y, p_x, i, w, Hp, Wp, False, SPAN_BLOCK)
    _, _, da1, da2, da3 = fused._products(t_cells, t_plane, t_cells, 0, 0.0, p_y, p_x, bands, i,
                                          w, Hp, Wp, t_srow, t_scol, c, real, dm_first, dm_second,
                                          False, False, False, True, BAND, D_BLOCK, UNROLL,
                                          STAGES)
    coef = coef_ptr + ((row * tl.num_programs(1) + block) * tl.num_programs(2) + head) * 3
    tl.store(coef, da1)
    tl.store(coef + 1, da2)
    tl.store(coef + 2, da3)


def cell_products_backward(dm, T, p_y, p_x, grid):
    """dL/dT, column-major as T, and the programs' shares (programs, heads, 3) of the gradient of
    a^h, from dL/dm (head-major, with respect to m's raw moments), T and the factors: one
    launch."""
    dT = torch.empty_like(T)
    spec = specializations(grid.d)[1]
    programs = (grid.B * grid.Hp, cdiv(grid.Wp, spec[1]['CELLS']), grid.heads)
    shares = T.new_empty(programs[0] * programs[1], grid.heads, 3)
    p_y, p_x = p_y.contiguous(), p_x.contiguous()
    launch('triton.cell_products_backward', spec, programs, [T, dm, p_y, p_x], [dT, shares], T,
           dm, p_y, p_x, dT, shares, grid.Hp, grid.Wp, grid.d, *_column_major_strides(T, grid),
           *_head_major_strides(dm, grid))
    return dT, shares


def head_block(d):
    """The width :data:`TILES` and :data:`WALKS` are keyed by for heads of d channels: d padded to
    16 or the power of two above it."""
    return max(16, triton.next_power_of_2(d))


def tiles_table(name, d_block, arch=None):
    """The table by head width that kernel ``name`` takes its tiles from (:data:`TILES` on every
    architecture; as :func:`.triton_fused.tiles_table`)."""
    return TILES[name]


def _spec(kernel, name, d):
    d_block = head_block(d)
    cells, *options = TILES[name][d_block]
    unroll, stages = WALKS[name][d_block]
    return kernel, dict(CELLS=cells, BAND=fused.BAND, D_BLOCK=d_block, SPAN_BLOCK=SPAN_BLOCK,
                        UNROLL=unroll, STAGES=stages), LaunchOptions(*options)


@functools.lru_cache(maxsize=None)
def specializations(d, arch=None):
    """(kernel, constexprs, launch options) of the products and their backward for heads of d
    channels (the same on every architecture ``arch``)."""
    return (_spec(_products_kernel, 'products', d),
            _spec(_products_backward_kernel, 'products_backward', d))
