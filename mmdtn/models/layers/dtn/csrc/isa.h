// The namespace of the kernels of one build: ``baseline``, unless avx512.cpp compiles them again
// with MMDTN_ISA defined as ``avx512``. Everything whose machine code depends on the instruction
// set (vector types, kernels, their helpers) lives in mmdtn::cpu::MMDTN_ISA, so that the two
// builds never share a symbol.
#pragma once

#ifndef MMDTN_ISA
#define MMDTN_ISA baseline
#endif
