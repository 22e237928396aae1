// What the CPU kernels of DynamicTokenNorm share (Shao et al., ICLR 2022, Eqs. 2, 4 and 5): the
// token grid, views of cell tensors and the operands of every kernel. Nothing here depends on the
// instruction set the kernels are compiled for (see isa.h).
//
// Tokens x are (B, H * W, C), row-major on the H x W grid. Token (b, i, j) takes the statistics of
// cell (b, i / s, j / s) of the pooled grid (Hp, Wp) = (ceil(H / s), ceil(W / s)). Cell tensors are
// strided views (B, Hp, Wp, nh, d) whose last dimension is contiguous (head-major or column-major
// results of the positional products). Work is split over (image, cell row) units, so that every
// cell is written by one thread.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

namespace mmdtn::cpu {

using torch::Tensor;

// Read access to one cell tensor (B, Hp, Wp, nh, d) with a contiguous last dimension.
template <typename T>
struct CellView {
  T* data;
  int64_t sb, si, sj, sh;
  explicit CellView(const Tensor& t)
      : data(t.data_ptr<T>()), sb(t.stride(0)), si(t.stride(1)), sj(t.stride(2)),
        sh(t.stride(3)) {}
  T* head(int64_t b, int64_t i, int64_t j, int64_t h) const {
    return data + b * sb + i * si + j * sj + h * sh;
  }
};

struct Grid {
  int64_t B, H, W, C, nh, d, s, Hp, Wp;
  Grid(const Tensor& x, int64_t H_, int64_t W_, int64_t s_, int64_t nh_)
      : B(x.size(0)), H(H_), W(W_), C(x.size(2)), nh(nh_), d(x.size(2) / nh_), s(s_),
        Hp((H_ + s_ - 1) / s_), Wp((W_ + s_ - 1) / s_) {}
  int64_t units() const { return B * Hp; }
  // token rows [i0, i1) of unit u = b * Hp + ci
  int64_t first_row(int64_t u) const { return (u % Hp) * s; }
  int64_t end_row(int64_t u) const { return std::min(H, first_row(u) + s); }
  // token columns [cj * s, end_col(cj)) of cell column cj
  int64_t end_col(int64_t cj) const { return std::min(W, (cj + 1) * s); }
  // real tokens of cell (unit u, column cj)
  int64_t cell_tokens(int64_t u, int64_t cj) const {
    return (end_row(u) - first_row(u)) * (end_col(cj) - cj * s);
  }
};

// Eq. 2 per token and the cell means of x (with pooling) or the sums of x over every token row.
struct StatisticsOperands {
  const Tensor& x;
  double n_var;  // the divisor of the intra-token variance: C, or C - 1 (reference convention)
  Tensor &mean_ln, &var_ln, &cells;
};

// The cell means of (x - centre)^2 (pooling only).
struct SecondMomentOperands {
  const Tensor &x, &centre;
  Tensor& second;
};

// Eqs. 4 and 5 with the cell statistics: ``first`` = P^h T_0 and ``second`` = the inter-token
// variance (with pooling) or the raw second moment P^h T_1 (without).
struct OutputOperands {
  const Tensor &x, &mean_ln, &var_ln, &first, &second, &centre, &ratios, &weight, &bias;
  double eps;
  Tensor& y;
};

// The backward passes over the tokens; cell tensors as in OutputOperands, dL/dm written into
// dm_first and dm_second.
struct TokenGradientOperands {
  const Tensor &g_y, &x, &mean_ln, &var_ln, &first, &second, &centre, &ratios, &weight;
  double eps;
  Tensor &dx, &tok1, &tok2, &sums;
  const Tensor &dm_first, &dm_second;
};

// dx += x beta + alpha + (dT_0 + 2 (x - centre) dT_1) / n, with beta and alpha per token from the
// sums tok1 and tok2 of the first pass (the gradient of Eq. 2); d_second may be absent.
struct InputGradientOperands {
  Tensor& dx;
  const Tensor &x, &tok1, &tok2, &mean_ln;
  double n_var;
  const Tensor& d_first;
  const Tensor* d_second;
  const Tensor& centre;
};

// Products with one positional factor P (nP, L, L) over its nonzero band; matrix k of the batch X
// (n, L, N) uses P[k / group].
struct BandOperands {
  const Tensor &p, &x;
  int64_t group;
};

// Where band_matmul writes Y[k, i, c] of its product (n, L, N): at out + matrix[k] + i * row +
// chunk[c / width] + c % width, with ``width`` the contiguous last dimension of ``out``, so that
// the product lands in any permuted layout without a second pass.
struct BandDestination {
  const Tensor& out;
  std::vector<int64_t> matrix, chunk;
  int64_t row, width;
};

// The fused passes without pooling (the positional products included).
struct FusedRowOperands {
  const Tensor &x, &mean_ln, &var_ln, &centre, &p_y, &p_x, &ratios, &weight;
  double eps;
  int64_t parts;  // groups of channels per head (tasks of their own)
};

}  // namespace mmdtn::cpu
