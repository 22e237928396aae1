// The fused passes of DynamicTokenNorm without pooling on CPUs (Eqs. 4 and 5 with the positional
// products of Eq. 5). u = P_x T (T: the moments x - centre and (x - centre)^2) and m = P_y u are as
// large as x; these passes never store them. Every task, a group of d channels of one head h of
// one image b, walks the token rows in order: it forms the rows of u with P_x straight from x into
// a ring holding the rows that P_y still needs, and from them m (and, backward, dL/dm and dL/du)
// one row at a time, in cache. A row tile is (2, W, d): both moments, W tokens, d channels; d must
// be a multiple of the vector width. A head's channels are split into groups only when there would
// be too few tasks for the threads otherwise.
#include "band.h"
#include "common.h"
#include "isa.h"
#include "kernels.h"
#include "token_math.h"
#include "vec.h"

namespace mmdtn::cpu::MMDTN_ISA {

// The nonzero spans and weights of one axis factor P (nh, L, L) of every head, in blocks of kRows
// rows (of columns with ``transpose``), as the banded products take them.
template <typename T>
struct BandBlocks {
  int64_t L, blocks, width = 1;  // width: the widest union span of a block
  std::vector<std::pair<int64_t, int64_t>> row, block;  // spans of every row, of every block
  std::vector<std::vector<T>> weights;                   // per block, see row_block
  BandBlocks(const T* P, int64_t nh, int64_t L_, bool transpose)
      : L(L_), blocks((L_ + kRows - 1) / kRows), row(nh * L_), block(nh * blocks),
        weights(nh * blocks) {
    for (int64_t r = 0; r < nh * blocks; ++r) {
      const int64_t h = r / blocks, i0 = (r % blocks) * kRows, rows = std::min(kRows, L - i0);
      const T* p = P + h * L * L;
      block[r] = row_block(p, i0, rows, L, transpose, weights[r]);
      for (int64_t q = 0; q < rows; ++q)
        row[h * L + i0 + q] = nonzero_span(p, i0 + q, L, transpose);
      width = std::max(width, block[r].second - block[r].first);
    }
  }
};

// The number of rows a ring must hold when row i needs the source rows span[i] and is taken up
// once they are formed (and, with ``own``, not before source row i): the rows formed so far back to
// the smallest start of the spans of the rows still to come.
inline int64_t ring_rows(const std::pair<int64_t, int64_t>* span, int64_t L, bool own) {
  std::vector<int64_t> first(L + 1, L);
  for (int64_t i = L - 1; i >= 0; --i)
    first[i] = std::min(first[i + 1], span[i].first < span[i].second ? span[i].first : L);
  int64_t last = 0, rows = 1;
  for (int64_t i = 0; i < L; ++i) {
    if (span[i].first < span[i].second) last = std::max(last, span[i].second);
    if (own) last = std::max(last, i + 1);
    rows = std::max(rows, last - first[i]);
  }
  return rows;
}

// Source rows of the banded products: the moments of one head's channels of a token row (x at
// channel h * d of token (b, y, 0), centre at channel h * d of image b) ...
template <typename T>
struct TokenMoments {
  const T* x;
  const T* centre;
  int64_t C;
  void load2(int64_t j, int64_t e, Vec<T>& t0, Vec<T>& t1) const {
    Vec<T> c;
    load<T>(t0, x + j * C + e);
    load<T>(c, centre + e);
    t0 -= c;
    t1 = t0 * t0;
  }
};

// ... or a row tile (2, W, d).
template <typename T>
struct TileRow {
  const T* tile;
  int64_t Wd, d;
  void load2(int64_t j, int64_t e, Vec<T>& t0, Vec<T>& t1) const {
    load<T>(t0, tile + j * d + e);
    load<T>(t1, tile + Wd + j * d + e);
  }
};

// out[s, i] = sum_j P[h, i, j] in_s[j] over the nonzero span of every row i (P[h, j, i] for the
// blocks of a transposed factor), for both slots of the row tile ``out``.
template <typename T, typename In>
void band_row(const BandBlocks<T>& bands, int64_t h, int64_t d, const In& in, T* out) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  const int64_t W = bands.L, Wd = W * d;
  for (int64_t blk = 0; blk < bands.blocks; ++blk) {
    const int64_t i0 = blk * kRows, rows = std::min(kRows, W - i0);
    const auto [j0, j1] = bands.block[h * bands.blocks + blk];
    const T* w = bands.weights[h * bands.blocks + blk].data();
    for (int64_t e = 0; e < d; e += 2 * V) {
      const bool two = e + 2 * V <= d;  // two vectors per slot, or the last one
      Vec<T> acc[kRows][4] = {};
      for (int64_t j = j0; j < j1; ++j) {
        Vec<T> a0, a1, b0, b1;
        in.load2(j, e, a0, a1);
        if (two) in.load2(j, e + V, b0, b1);
        const T* wj = w + (j - j0) * kRows;
#pragma GCC unroll 4
        for (int64_t q = 0; q < kRows; ++q) {
          acc[q][0] += wj[q] * a0;
          acc[q][1] += wj[q] * a1;
          if (two) {
            acc[q][2] += wj[q] * b0;
            acc[q][3] += wj[q] * b1;
          }
        }
      }
      for (int64_t q = 0; q < rows; ++q) {
        T* o0 = out + (i0 + q) * d + e;
        store<T>(o0, acc[q][0]);
        store<T>(o0 + Wd, acc[q][1]);
        if (two) {
          store<T>(o0 + V, acc[q][2]);
          store<T>(o0 + Wd + V, acc[q][3]);
        }
      }
    }
  }
}

// acc[i0 + q, j - j0] += sum_{s, e} A_s[i0 + q, e] T_s(x)[j, e] over the blocks of rows of P_x
// and their union spans [j0, j1): one token row's share of the gradient of P_x, in lane-wise
// accumulators (vectors of the width of Vec, ``stride`` of them per row of P_x).
template <typename T>
void band_outer_row(const BandBlocks<T>& bands, int64_t h, int64_t d, const T* a,
                    const TokenMoments<T>& in, T* acc, int64_t stride) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kCols = 5;
  const int64_t W = bands.L, Wd = W * d;
  for (int64_t blk = 0; blk < bands.blocks; ++blk) {
    const int64_t i0 = blk * kRows, rows = std::min(kRows, W - i0);
    const auto [j0, j1] = bands.block[h * bands.blocks + blk];
    T* ab = acc + blk * kRows * stride * V;
    for (int64_t jb = j0; jb < j1; jb += kCols) {
      Vec<T> s[kRows][kCols];
#pragma GCC unroll 4
      for (int64_t q = 0; q < kRows; ++q)
#pragma GCC unroll 5
        for (int64_t jj = 0; jj < kCols; ++jj)
          load<T>(s[q][jj], ab + (q * stride + jb - j0 + jj) * V);
      for (int64_t e = 0; e < d; e += V) {
        Vec<T> a0[kRows], a1[kRows];
#pragma GCC unroll 4
        for (int64_t q = 0; q < kRows; ++q) {
          const T* aq = a + (i0 + std::min(q, rows - 1)) * d + e;
          load<T>(a0[q], aq);
          load<T>(a1[q], aq + Wd);
        }
#pragma GCC unroll 5
        for (int64_t jj = 0; jj < kCols; ++jj) {
          Vec<T> t0, t1;
          in.load2(std::min(jb + jj, j1 - 1), e, t0, t1);
#pragma GCC unroll 4
          for (int64_t q = 0; q < kRows; ++q) s[q][jj] += a0[q] * t0 + a1[q] * t1;
        }
      }
#pragma GCC unroll 4
      for (int64_t q = 0; q < kRows; ++q)
#pragma GCC unroll 5
        for (int64_t jj = 0; jj < kCols; ++jj)
          store<T>(ab + (q * stride + jb - j0 + jj) * V, s[q][jj]);
    }
  }
}

// Scratch memory of the calling thread, slot ``slot``, kept for the next call: freshly allocated
// memory costs a page fault per 4 KiB when first written.
template <typename T>
T* thread_scratch(int slot, int64_t n) {
  static thread_local std::vector<T> buffers[8];
  if (int64_t(buffers[slot].size()) < n) buffers[slot].resize(n);
  return buffers[slot].data();
}

// Rows of tiles, row r in slot r % size, in the calling thread's scratch slot ``slot``.
template <typename T>
struct TileRing {
  T* data;
  int64_t size, tile;
  std::vector<const T*> picked;  // scratch of combine_rows and row_dots
  TileRing(int64_t rows, int64_t tile_, int slot)
      : data(thread_scratch<T>(slot, rows * tile_)), size(rows), tile(tile_) {}
  T* operator[](int64_t r) { return data + (r % size) * tile; }
  const T* const* pick(std::pair<int64_t, int64_t> span) {
    picked.resize(std::max<int64_t>(span.second - span.first, 0));
    for (int64_t j = span.first; j < span.second; ++j) picked[j - span.first] = (*this)[j];
    return picked.data();
  }
};

// out = sum_{j in span} P[j] rows[j] over whole tiles (out = 0 for an empty span), P[j] at
// p + j * step; four vectors of out at a time stay in registers while the rows are summed.
template <typename T>
void combine_rows(const T* p, int64_t step, std::pair<int64_t, int64_t> span, TileRing<T>& rows,
                  T* out) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  const int64_t n = rows.tile, count = std::max<int64_t>(span.second - span.first, 0);
  const T* const* r = rows.pick(span);
  const T* w = p + span.first * step;
  int64_t c = 0;
  for (; c + 4 * V <= n; c += 4 * V) {
    Vec<T> acc[4] = {};
    for (int64_t j = 0; j < count; ++j) {
      const T wj = w[j * step];
#pragma GCC unroll 4
      for (int64_t v = 0; v < 4; ++v) {
        Vec<T> a;
        load<T>(a, r[j] + c + v * V);
        acc[v] += wj * a;
      }
    }
    for (int64_t v = 0; v < 4; ++v) store<T>(out + c + v * V, acc[v]);
  }
  for (; c < n; c += V) {  // tiles are whole vectors
    Vec<T> acc = {};
    for (int64_t j = 0; j < count; ++j) {
      Vec<T> a;
      load<T>(a, r[j] + c);
      acc += w[j * step] * a;
    }
    store<T>(out + c, acc);
  }
}

// out[j - span.first] = a . rows[j] over whole tiles for the rows j of span, eight at a time.
template <typename T>
void row_dots(const T* a, std::pair<int64_t, int64_t> span, TileRing<T>& rows, T* out) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kDots = 8;
  const int64_t n = rows.tile, count = std::max<int64_t>(span.second - span.first, 0);
  const T* const* r = rows.pick(span);
  for (int64_t j0 = 0; j0 < count; j0 += kDots) {
    const int64_t m = std::min(kDots, count - j0);
    Vec<T> acc[kDots] = {};
    for (int64_t c = 0; c < n; c += V) {
      Vec<T> av;
      load<T>(av, a + c);
#pragma GCC unroll 8
      for (int64_t jj = 0; jj < kDots; ++jj) {
        Vec<T> b;
        load<T>(b, r[j0 + std::min(jj, m - 1)] + c);
        acc[jj] += av * b;
      }
    }
    for (int64_t jj = 0; jj < m; ++jj) out[j0 + jj] = lane_sum<T>(acc[jj]);
  }
}

// A task of the fused passes: image b, head h, and the group of channels from c0 on.
struct HeadTask {
  int64_t b, h, c0;
};

// What the tasks of a fused pass share: the operands, P_x's blocks (of rows, and for the backward
// pass of columns, for P_x^T), P_y's row and column spans, and the sizes of the rings of rows of
// u = P_x T and of dL/dm. ``parts`` groups of d channels per head.
template <typename T>
struct OwnHeadPass {
  const T *x, *mu, *var, *centre, *py;
  std::array<const T*, 4> ratios;
  const T* w;
  T eps;
  int64_t B, H, W, C, nh, parts, d;
  BandBlocks<T> bx, bxt;
  std::vector<std::pair<int64_t, int64_t>> y_rows, y_cols;  // (nh * H) spans of P_y
  int64_t u_rows = 1, dm_rows = 1;

  OwnHeadPass(const FusedRowOperands& t, int64_t H_, int64_t W_, int64_t nh_, int64_t parts_,
              bool backward)
      : x(t.x.data_ptr<T>()), mu(t.mean_ln.data_ptr<T>()), var(t.var_ln.data_ptr<T>()),
        centre(t.centre.data_ptr<T>()), py(t.p_y.data_ptr<T>()),
        ratios(ratio_rows<T>(t.ratios, t.x.size(2))), w(t.weight.data_ptr<T>()),
        eps(static_cast<T>(t.eps)), B(t.x.size(0)), H(H_), W(W_), C(t.x.size(2)), nh(nh_),
        parts(parts_), d(t.x.size(2) / nh_ / parts_), bx(t.p_x.data_ptr<T>(), nh_, W_, false),
        bxt(t.p_x.data_ptr<T>(), backward ? nh_ : 0, W_, true), y_rows(nh_ * H_),
        y_cols(nh_ * H_) {
    for (int64_t h = 0; h < nh; ++h) {
      const T* p = py + h * H * H;
      for (int64_t i = 0; i < H; ++i) {
        y_rows[h * H + i] = nonzero_span(p, i, H, false);
        y_cols[h * H + i] = nonzero_span(p, i, H, true);
      }
      u_rows = std::max(u_rows, ring_rows(y_rows.data() + h * H, H, false));
      dm_rows = std::max(dm_rows, ring_rows(y_cols.data() + h * H, H, true));
    }
  }
  int64_t tasks() const { return B * nh * parts; }
  HeadTask task(int64_t k) const {
    const int64_t h = k / parts % nh;
    return {k / (parts * nh), h, (h * parts + k % parts) * d};
  }
  int64_t tile() const { return 2 * W * d; }
  TokenMoments<T> moments(const HeadTask& k, int64_t y) const {
    return {x + (k.b * H + y) * W * C + k.c0, centre + k.b * C + k.c0, C};
  }
  // whether the sources of row k of dL/du = P_y^T dL/dm (the rows i of P_y's column k) are all
  // among the rows <= i
  bool complete(int64_t h, int64_t k, int64_t i) const {
    const auto span = y_cols[h * H + k];
    return span.first >= span.second || span.second <= i + 1;
  }
  // m row i of task k into ``m``, forming the rows of u it needs (next: the next row of u)
  void m_row(const HeadTask& k, int64_t i, TileRing<T>& u, int64_t& next, T* m) const {
    const auto span = y_rows[k.h * H + i];
    for (; next < span.second; ++next) {
      if (next + 1 < H) {  // the x of the next row of u, strided: the prefetchers miss it
        const T* xn = moments(k, next + 1).x;
        for (int64_t j = 0; j < W; ++j) prefetch<T>(xn + j * C, d);
      }
      band_row(bx, k.h, d, moments(k, next), u[next]);
    }
    combine_rows(py + (k.h * H + i) * H, int64_t(1), span, u, m);
  }
};

// Eqs. 4 and 5 without pooling, fused with the products of Eq. 5: y, task by task.
template <typename T>
void tokens_forward_impl(const FusedRowOperands& t, const Tensor& bias, int64_t H,
                         int64_t W, int64_t nh, int64_t parts, Tensor& y) {
  const OwnHeadPass<T> o(t, H, W, nh, parts, false);
  const auto [lam_m, kap_m, lam_v, kap_v] = o.ratios;
  const T* pb = bias.data_ptr<T>();
  T* pout = y.data_ptr<T>();
  const int64_t C = o.C, d = o.d, Wd = W * d;
  at::parallel_for(0, o.tasks(), 1, [&](int64_t begin, int64_t end) {
    TileRing<T> u(o.u_rows, o.tile(), 0);
    T* m = thread_scratch<T>(1, o.tile());
    for (int64_t k = begin; k < end; ++k) {
      const auto task = o.task(k);
      const int64_t b = task.b, c0 = task.c0;
      const T* cen = o.centre + b * C + c0;
      int64_t next = 0;
      for (int64_t i = 0; i < H; ++i) {
        o.m_row(task, i, u, next, m);
        for (int64_t j = 0; j < W; ++j) {
          const int64_t tok = (b * H + i) * W + j;
          const T mu = o.mu[tok], var = o.var[tok];
          const T *xt = o.x + tok * C + c0, *f = m + j * d, *q = f + Wd;
          const T *lm = lam_m + c0, *km = kap_m + c0, *lv = lam_v + c0, *kv = kap_v + c0;
          const T *w = o.w + c0, *bb = pb + c0;
          T* yt = pout + tok * C + c0;
          if (i + 1 < H) {
            prefetch<T>(xt + W * C, d);
            prefetch<T, true>(yt + W * C, d);
          }
#pragma omp simd
          for (int64_t k = 0; k < d; ++k)
            yt[k] = token_output(xt[k], mu, var, f[k] + cen[k],
                                 inter_token_variance<T, true>(f[k], q[k]), lm[k], km[k], lv[k],
                                 kv[k], w[k], bb[k], o.eps);
        }
      }
    }
  });
}

// The backward pass without pooling, fused with the products of Eq. 5. Per task, row i:
// m_i, then the terms of own_cell_grad (D1 into dx, dL/dm_i into a ring), the gradient of P_y
// (dL/dm_i . u_j), and, in order, every row k <= i of dL/du = P_y^T dL/dm whose sources are all
// formed (OwnHeadPass::complete): its share of the gradient of P_x, and dx_k += dT_0 + 2 (x -
// centre) dT_1 with dT = P_x^T dL/du. Then, per token, dx += x beta + alpha with beta and alpha
// from Eq. 2 (see _dtn_backward). Writes the gradients of P_y (per task, (tasks, H, H)) and of P_x
// ((tasks, W, W)) into g_y and g_x, within the nonzero spans (zeros elsewhere), the per-image sums
// (B, 6, C) as backward_tokens_impl, and the per-task token sums into tok.
template <typename T>
void tokens_backward_impl(const FusedRowOperands& t, const Tensor& grad, double n_var,
                          int64_t H, int64_t W, int64_t nh, int64_t parts, Tensor& dx,
                          Tensor& g_y, Tensor& g_x, Tensor& sums,
                          Tensor& tok) {
  const OwnHeadPass<T> o(t, H, W, nh, parts, true);
  const auto [lam_m, kap_m, lam_v, kap_v] = o.ratios;
  const T* pg = grad.data_ptr<T>();
  T* pdx = dx.data_ptr<T>();
  T *pgy = g_y.data_ptr<T>(), *pgx = g_x.data_ptr<T>(), *psums = sums.data_ptr<T>();
  T* ptok = tok.data_ptr<T>();  // (2, tasks, N): per task D1 . lam_m and D2 . lam_v
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  const int64_t C = o.C, d = o.d, Wd = W * d, N = H * W, n = o.tile();
  const int64_t stride = (o.bx.width + 4) / 5 * 5 + 5;  // accumulators per row of P_x
  const int64_t tasks = o.tasks(), per_image = tasks / o.B;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    TileRing<T> u(o.u_rows, n, 0), dm(o.dm_rows, n, 1);
    T *m = thread_scratch<T>(2, n), *du = thread_scratch<T>(3, n), *dT = thread_scratch<T>(4, n);
    std::vector<T> s(6 * d);
    const int64_t acc_size = o.bx.blocks * kRows * stride * V;
    T* acc = thread_scratch<T>(5, acc_size);
    for (int64_t k = begin; k < end; ++k) {
      const auto task = o.task(k);
      const int64_t b = task.b, h = task.h, c0 = task.c0;
      const T* cen = o.centre + b * C + c0;
      const T *lm = lam_m + c0, *km = kap_m + c0, *lv = lam_v + c0, *kv = kap_v + c0;
      const T* w = o.w + c0;
      const T* py = o.py + h * H * H;
      T* gy = pgy + k * H * H;
      T *tok1 = ptok + k * N, *tok2 = tok1 + tasks * N;
      std::fill(gy, gy + H * H, T(0));  // row_dots writes the nonzero spans only
      std::fill(s.begin(), s.end(), T(0));
      std::fill(acc, acc + acc_size, T(0));
      int64_t next_u = 0, next_k = 0;
      // row r of dL/du: its share of the gradient of P_x, and P_x^T dL/du into dx
      auto du_row = [&](int64_t r) {
        combine_rows(py + r, H, o.y_cols[h * H + r], dm, du);
        const auto in = o.moments(task, r);
        band_outer_row(o.bx, h, d, du, in, acc, stride);
        band_row(o.bxt, h, d, TileRow<T>{du, Wd, d}, dT);
        for (int64_t j = 0; j < W; ++j) {
          const T* xt = in.x + j * C;
          T* dxt = pdx + ((b * H + r) * W + j) * C + c0;
          const T *t0 = dT + j * d, *t1 = t0 + Wd;
          if (r + 1 < H) {
            prefetch<T>(xt + W * C, d);
            prefetch<T, true>(dxt + W * C, d);
          }
#pragma omp simd
          for (int64_t e = 0; e < d; ++e) dxt[e] += t0[e] + T(2) * (xt[e] - cen[e]) * t1[e];
        }
      };
      for (int64_t i = 0; i < H; ++i) {
        o.m_row(task, i, u, next_u, m);
        T* dmi = dm[i];
        for (int64_t j = 0; j < W; ++j) {
          const int64_t tk = (b * H + i) * W + j;
          const T *xt = o.x + tk * C + c0, *gt = pg + tk * C + c0;
          const T *f = m + j * d, *q = f + Wd;
          T *dxt = pdx + tk * C + c0, *of = dmi + j * d, *oq = of + Wd;
          if (i + 1 < H) {
            prefetch<T>(xt + W * C, d);
            prefetch<T>(gt + W * C, d);
            prefetch<T, true>(dxt + W * C, d);
          }
          const auto [sum1, sum2] = own_cell_head(d, xt, gt, w, o.mu[tk], o.var[tk], lm, km, lv,
                                                  kv, cen, f, q, o.eps, dxt, of, oq, s.data(), d);
          tok1[i * W + j] = sum1;
          tok2[i * W + j] = sum2;
        }
        // the gradient of P_y: dL/dP_y[i, j] = dL/dm_i . u_j
        const auto span = o.y_rows[h * H + i];
        row_dots(dmi, span, u, gy + i * H + span.first);
        for (; next_k <= i && o.complete(h, next_k, i); ++next_k) du_row(next_k);
      }
      for (; next_k < H; ++next_k) du_row(next_k);
      // the gradient of P_x from the lane-wise accumulators, within the rows' spans
      T* gx = pgx + k * W * W;
      std::fill(gx, gx + W * W, T(0));
      for (int64_t a = 0; a < W; ++a) {
        const auto [j0, j1] = o.bx.row[h * W + a];
        const int64_t b0 = o.bx.block[h * o.bx.blocks + a / kRows].first;
        for (int64_t j = j0; j < j1; ++j) {
          Vec<T> lanes;
          load<T>(lanes, acc + (a * stride + j - b0) * V);
          gx[a * W + j] = lane_sum<T>(lanes);
        }
      }
      for (int64_t r = 0; r < 6; ++r)
        std::copy(s.begin() + r * d, s.begin() + (r + 1) * d, psums + (b * 6 + r) * C + c0);
    }
  });
  // dx += x beta + alpha, beta = -2 dL/dvar_ln / n_var, alpha = dL/dmu_ln / C - beta mu_ln
  at::parallel_for(0, o.B * N, 256, [&](int64_t begin, int64_t end) {
    for (int64_t tk = begin; tk < end; ++tk) {
      const int64_t b = tk / N, r = tk % N;
      T a1 = 0, a2 = 0;
      for (int64_t k = b * per_image; k < (b + 1) * per_image; ++k) {
        a1 += ptok[k * N + r];
        a2 += ptok[(tasks + k) * N + r];
      }
      const T beta = -a2 / T(n_var), alpha = -a1 / T(C) - beta * o.mu[tk];
      const T* xt = o.x + tk * C;
      T* dxt = pdx + tk * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) dxt[c] += xt[c] * beta + alpha;
    }
  });
}

namespace {

void forward(const FusedRowOperands& o, const Grid& g, const Tensor& bias, Tensor& y) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_fused_forward", [&] {
    tokens_forward_impl<scalar_t>(o, bias, g.H, g.W, g.nh, o.parts, y);
  });
}

void backward(const FusedRowOperands& o, const Grid& g, const Tensor& grad, double n_var,
              Tensor& dx, Tensor& g_y, Tensor& g_x, Tensor& sums, Tensor& tok) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_fused_backward", [&] {
    tokens_backward_impl<scalar_t>(o, grad, n_var, g.H, g.W, g.nh, o.parts, dx, g_y, g_x, sums,
                                   tok);
  });
}

}  // namespace

const FusedRowKernels fused_rows = {forward, backward};

}  // namespace mmdtn::cpu::MMDTN_ISA
