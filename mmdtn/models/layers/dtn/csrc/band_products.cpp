// Banded products with the positional factors P_x and P_y (Eq. 6) on CPUs: P X, P^T X and the
// gradient of P, over the nonzero span of every row of P. P is (nP, L, L) contiguous; matrix k of
// the batch uses P[k / group]. X and A are contiguous (n, L, N); Y is written in the layout of its
// destination. Both kernels work on kRows rows of P at a time over the union of their spans, with
// the accumulators in vector registers.
#include "band.h"
#include "common.h"
#include "isa.h"
#include "kernels.h"
#include "vec.h"

namespace mmdtn::cpu::MMDTN_ISA {

// Y[k, i] = sum_j P[i, j] X[k, j] (P[j, i] with ``transpose``) over the nonzero span of row i,
// written where ``out`` says (see BandDestination).
template <typename T>
void band_matmul_impl(const T* P, const T* X, const BandDestination& out, int64_t n, int64_t group,
                      int64_t L, int64_t N, bool transpose) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kTile = 4 * V;
  const int64_t blocks = (L + kRows - 1) / kRows, width = out.width;
  const bool whole = width % V == 0;  // every vector of a row lies in one chunk
  T* Y = out.out.data_ptr<T>();
  const int64_t* chunk = out.chunk.data();
  auto column = [&](int64_t c) { return chunk[c / width] + c % width; };
  at::parallel_for(0, n * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> w;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t k = r / blocks, i0 = (r % blocks) * kRows, rows = std::min(kRows, L - i0);
      const auto [j0, j1] = row_block(P + (k / group) * L * L, i0, rows, L, transpose, w);
      const T* x = X + k * L * N;
      T* y = Y + out.matrix[k] + i0 * out.row;
      int64_t c0 = 0;
      for (; c0 + kTile <= N; c0 += kTile) {
        Vec<T> acc[kRows][4] = {};
        for (int64_t j = j0; j < j1; ++j) {
          const T* xj = x + j * N + c0;
          Vec<T> x0, x1, x2, x3;
          load<T>(x0, xj);
          load<T>(x1, xj + V);
          load<T>(x2, xj + 2 * V);
          load<T>(x3, xj + 3 * V);
          const T* wj = w.data() + (j - j0) * kRows;
#pragma GCC unroll 4
          for (int64_t q = 0; q < kRows; ++q) {
            acc[q][0] += wj[q] * x0;
            acc[q][1] += wj[q] * x1;
            acc[q][2] += wj[q] * x2;
            acc[q][3] += wj[q] * x3;
          }
        }
        for (int64_t q = 0; q < rows; ++q)
          for (int64_t v = 0; v < 4; ++v) {
            const int64_t c = c0 + v * V;
            if (whole) {
              store<T>(y + q * out.row + column(c), acc[q][v]);
            } else {
              T lanes[V];
              store<T>(lanes, acc[q][v]);
              for (int64_t e = 0; e < V; ++e) y[q * out.row + column(c + e)] = lanes[e];
            }
          }
      }
      for (int64_t q = 0; q < rows; ++q)
        for (int64_t c = c0; c < N; ++c) {
          T total = 0;
          for (int64_t j = j0; j < j1; ++j) total += w[(j - j0) * kRows + q] * x[j * N + c];
          y[q * out.row + column(c)] = total;
        }
    }
  });
}

// G[k, i, j] = sum_c A[k, i, c] X[k, j, c] over the nonzero span of row i of P[k / group], 0
// elsewhere (the gradient of P, wherever the softmax passes it on).
template <typename T>
void band_outer_impl(const T* P, const T* A, const T* X, T* G, int64_t n, int64_t group,
                     int64_t L, int64_t N) {
  constexpr int64_t V = sizeof(Vec<T>) / sizeof(T);
  constexpr int64_t kCols = 6;
  const int64_t blocks = (L + kRows - 1) / kRows, full = N / V * V;
  at::parallel_for(0, n * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t k = r / blocks, i0 = (r % blocks) * kRows, rows = std::min(kRows, L - i0);
      std::pair<int64_t, int64_t> span[kRows];
      const auto [j0, j1] = row_spans(P + (k / group) * L * L, i0, rows, L, false, span);
      const T* a[kRows];
      for (int64_t q = 0; q < kRows; ++q) a[q] = A + (k * L + i0 + std::min(q, rows - 1)) * N;
      const T* x = X + k * L * N;
      T* g = G + (k * L + i0) * L;
      std::fill(g, g + rows * L, T(0));
      for (int64_t jb = j0; jb < j1; jb += kCols) {
        const T* xs[kCols];
        for (int64_t jj = 0; jj < kCols; ++jj) xs[jj] = x + std::min(jb + jj, j1 - 1) * N;
        Vec<T> acc[kRows][kCols] = {};
        for (int64_t c = 0; c < full; c += V) {
          Vec<T> av[kRows];
#pragma GCC unroll 4
          for (int64_t q = 0; q < kRows; ++q) load<T>(av[q], a[q] + c);
#pragma GCC unroll 6
          for (int64_t jj = 0; jj < kCols; ++jj) {
            Vec<T> xv;
            load<T>(xv, xs[jj] + c);
#pragma GCC unroll 4
            for (int64_t q = 0; q < kRows; ++q) acc[q][jj] += av[q] * xv;
          }
        }
        for (int64_t q = 0; q < rows; ++q)
          for (int64_t jj = 0; jj < kCols && jb + jj < j1; ++jj) {
            const int64_t j = jb + jj;
            if (j < span[q].first || j >= span[q].second) continue;  // stays 0
            T total = lane_sum<T>(acc[q][jj]);
            for (int64_t c = full; c < N; ++c) total += a[q][c] * xs[jj][c];
            g[q * L + j] = total;
          }
      }
    }
  });
}

namespace {

void matmul(const BandOperands& o, bool transpose, const BandDestination& out) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_band_matmul", [&] {
    band_matmul_impl<scalar_t>(o.p.data_ptr<scalar_t>(), o.x.data_ptr<scalar_t>(), out,
                               o.x.size(0), o.group, o.x.size(1), o.x.size(2), transpose);
  });
}

void outer(const BandOperands& o, const Tensor& a, Tensor& out) {
  AT_DISPATCH_FLOATING_TYPES(o.x.scalar_type(), "dtn_band_outer", [&] {
    band_outer_impl<scalar_t>(o.p.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                              o.x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), o.x.size(0),
                              o.group, o.x.size(1), o.x.size(2));
  });
}

}  // namespace

const BandKernels band_products = {matmul, outer};

}  // namespace mmdtn::cpu::MMDTN_ISA
