// Vectors of 64 bytes (GCC vector extensions: one AVX-512 register, or four SSE registers in the
// baseline build) and the memory helpers of the kernels that use them explicitly.
#pragma once

#include "isa.h"

namespace mmdtn::cpu::MMDTN_ISA {

template <typename T>
struct VecOf;
template <>
struct VecOf<float> {
  typedef float type __attribute__((vector_size(64)));
};
template <>
struct VecOf<double> {
  typedef double type __attribute__((vector_size(64)));
};
template <typename T>
using Vec = typename VecOf<T>::type;

template <typename T>
inline void load(Vec<T>& v, const T* p) {
  __builtin_memcpy(&v, p, sizeof(v));
}

template <typename T>
inline void store(T* p, const Vec<T>& v) {
  __builtin_memcpy(p, &v, sizeof(v));
}

template <typename T>
inline T lane_sum(const Vec<T>& v) {
  T total = 0;
  for (size_t c = 0; c < sizeof(v) / sizeof(T); ++c) total += v[c];
  return total;
}

// Prefetch the n values at p (a head's channels of a token of the next row: walking one head, the
// hardware prefetchers do not see these strided streams).
template <typename T, bool WRITE = false>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t k = 0; k < n; k += 64 / sizeof(T)) __builtin_prefetch(p + k, WRITE ? 1 : 0);
}

}  // namespace mmdtn::cpu::MMDTN_ISA
