// The kernels of each family, as tables of entry points per instruction set. Every family
// (token_passes.cpp, band_products.cpp, fused_rows.cpp) is compiled once for the baseline
// instruction set and, on x86-64 with GCC or Clang, once more for AVX-512 (avx512.cpp); ops.cpp
// picks the table at run time.
#pragma once

#include "common.h"

namespace mmdtn::cpu {

// Per-token passes: statistics and the output forward, the two passes over the tokens backward.
struct TokenPassKernels {
  void (*statistics)(const StatisticsOperands&, const Grid&);
  void (*second_moment)(const SecondMomentOperands&, const Grid&);
  void (*output)(const OutputOperands&, const Grid&);
  void (*token_gradients)(const TokenGradientOperands&, const Grid&);
  void (*input_gradient)(const InputGradientOperands&, const Grid&);
};

// Banded products with a positional factor: P X (or P^T X) into ``out`` (in its layout), and
// the gradient of P.
struct BandKernels {
  void (*matmul)(const BandOperands&, bool transpose, const BandDestination& out);
  void (*outer)(const BandOperands&, const Tensor& a, Tensor& out);
};

// The fused passes without pooling: the output, and the backward pass with the gradients of P_y
// and P_x, row by row.
struct FusedRowKernels {
  void (*forward)(const FusedRowOperands&, const Grid&, const Tensor& bias, Tensor& y);
  void (*backward)(const FusedRowOperands&, const Grid&, const Tensor& grad, double n_var,
                   Tensor& dx, Tensor& g_y, Tensor& g_x, Tensor& sums, Tensor& tok);
};

namespace baseline {
extern const TokenPassKernels token_passes;
extern const BandKernels band_products;
extern const FusedRowKernels fused_rows;
}  // namespace baseline

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MMDTN_AVX512 1
namespace avx512 {
extern const TokenPassKernels token_passes;
extern const BandKernels band_products;
extern const FusedRowKernels fused_rows;
}  // namespace avx512
#endif

}  // namespace mmdtn::cpu
