// Baseline kernels (any CPU the compiler targets by default; SSE2 on x86-64): 4-float vectors.
#include "common.h"

#define FQ_NS generic
#define FQ_NAME "generic"
#define FQ_VW 4
#define FQ_NVMAX 2
#include "convert.h"
#include "kernels.h"
