// The kernels of token_passes.cpp, band_products.cpp and fused_rows.cpp compiled a second time, for
// AVX-512 (x86-64 with GCC or Clang; ops.cpp picks them at run time where the CPU has AVX-512 and
// ATEN_CPU_CAPABILITY does not say otherwise). As PyTorch does for its own CPU kernels, the
// sources are compiled once per instruction set; here by including them into this translation
// unit under the AVX-512 target, in the namespace mmdtn::cpu::avx512. The backward passes keep
// many values live, and AVX-512's 32 vector registers halve their time.
//
// Everything included before the target switch (PyTorch, the standard library, common.h) keeps
// the baseline instruction set.
#include "common.h"
#include "kernels.h"

#ifdef MMDTN_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512cd,avx512bw,avx512dq,avx512vl,avx2,fma")
#define MMDTN_ISA avx512
#include "band_products.cpp"
#include "fused_rows.cpp"
#include "token_passes.cpp"
#undef MMDTN_ISA
#pragma GCC pop_options
#endif
