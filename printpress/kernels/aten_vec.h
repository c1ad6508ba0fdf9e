// ATen's vector code (at::vec::Vectorized) for the CPU capability ATen dispatches to on this machine: AVX-512 or AVX2,
// whichever the compiler's -march=native offers, so that a kernel built from ATen's vector headers computes what ATen's
// own kernels compute (softmax.cpp, layers.cpp; each checks that against ATen on its first use). PRINTPRESS_VEC is
// defined where one of them compiles. Include it before any ATen header: CPU_CAPABILITY picks the vector headers'
// namespace.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#define PRINTPRESS_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define PRINTPRESS_VEC 1
#endif

#ifdef PRINTPRESS_VEC
#include <ATen/cpu/vec/vec.h>
#endif
