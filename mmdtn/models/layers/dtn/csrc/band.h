// The nonzero band of a positional factor P (P_x or P_y, Eq. 6): far from the diagonal its
// weights are exact zeros (see positional.py), so the products visit only the nonzero span of every
// row, kRows rows at a time over the union of their spans.
#pragma once

#include "common.h"
#include "isa.h"

namespace mmdtn::cpu::MMDTN_ISA {

constexpr int64_t kRows = 4;

// The span [j0, j1) of the nonzero entries of row i of the L x L matrix p (of column i with
// ``transpose``); empty (j0 == j1) for a zero row.
template <typename T>
inline std::pair<int64_t, int64_t> nonzero_span(const T* p, int64_t i, int64_t L, bool transpose) {
  const int64_t step = transpose ? L : 1;
  const T* row = transpose ? p + i : p + i * L;
  int64_t j0 = 0, j1 = L;
  while (j0 < L && row[j0 * step] == T(0)) ++j0;
  while (j1 > j0 && row[(j1 - 1) * step] == T(0)) --j1;
  return {j0, j1};
}

// The spans of rows [i0, i0 + rows) of p (of its columns with ``transpose``), into ``span``,
// and their union [j0, j1).
template <typename T>
inline std::pair<int64_t, int64_t> row_spans(const T* p, int64_t i0, int64_t rows, int64_t L,
                                             bool transpose, std::pair<int64_t, int64_t>* span) {
  int64_t j0 = L, j1 = 0;
  for (int64_t q = 0; q < rows; ++q) {
    span[q] = nonzero_span(p, i0 + q, L, transpose);
    if (span[q].first < span[q].second)
      j0 = std::min(j0, span[q].first), j1 = std::max(j1, span[q].second);
  }
  return {j0, std::max(j0, j1)};
}

// Rows [i0, i0 + rows) of p (transposed or not): the union [j0, j1) of their spans and their
// weights there, w[(j - j0) * kRows + q] (0 for q >= rows).
template <typename T>
inline std::pair<int64_t, int64_t> row_block(const T* p, int64_t i0, int64_t rows, int64_t L,
                                             bool transpose, std::vector<T>& w) {
  std::pair<int64_t, int64_t> span[kRows];
  const auto [j0, j1] = row_spans(p, i0, rows, L, transpose, span);
  w.assign((j1 - j0) * kRows, T(0));
  for (int64_t j = j0; j < j1; ++j)
    for (int64_t q = 0; q < rows; ++q)
      w[(j - j0) * kRows + q] = transpose ? p[j * L + i0 + q] : p[(i0 + q) * L + j];
  return {j0, j1};
}

}  // namespace mmdtn::cpu::MMDTN_ISA
