// AVX-512 kernels (16-float vectors, 4x4 zmm accumulator tiles), compiled for that ISA by pragma;
// chosen at run time only when the CPU reports avx512f.
#include "common.h"

#ifdef FLASHQLA_X86_MULTI_ISA
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma,f16c")
#endif

#define FQ_NS avx512
#define FQ_NAME "avx512"
#define FQ_VW 16
#define FQ_NVMAX 4
#include "convert.h"
#include "kernels.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
