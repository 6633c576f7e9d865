// AVX2+FMA kernels (8-float vectors), compiled for that ISA by pragma so the rest of the module stays
// baseline; chosen at run time only when the CPU reports avx2 and fma.
#include "common.h"

#ifdef FLASHQLA_X86_MULTI_ISA
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#define FQ_NS avx2
#define FQ_NAME "avx2"
#define FQ_VW 8
#define FQ_NVMAX 2
#include "convert.h"
#include "kernels.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
