// Shared declarations of the cpu backend's native module (flashqla.backends.cpu._native).
//
// The module is built from one portable translation unit (module.cpp: bindings, OpenMP work lists,
// the dq/dk finalisation pass) plus one kernel translation unit per instruction set
// (kern_generic.cpp, kern_avx2.cpp, kern_avx512.cpp).  Each kernel unit includes kernels.h inside its
// own namespace with its own vector width, after a target pragma, so the wheel stays portable
// (baseline x86-64 / any arch) while AVX2 and AVX-512 machines get wide vectors; module.cpp picks
// the widest set the running CPU supports (override: FLASHQLA_CPU_ISA=generic|avx2|avx512).
//
// This header holds only plain declarations and standard includes, and is included *before* any
// target pragma so no inline code in it is compiled for a wider ISA than the baseline.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace flashqla_cpu {

// dtype codes passed from Python
enum DType : int { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

constexpr int CH = 64;  // chunk length (tokens)

// Everything one call needs.  Token-major layouts as the op's: q/k [tok, Hqk, K], v/o [tok, Hv, V],
// g/beta [tok, Hv], states [N, Hv, K, V] fp32.  Sequence n covers tokens [cu[n], cu[n+1]).
struct Problem {
  int N = 0;
  const int64_t* cu = nullptr;
  int Hqk = 1, Hv = 1, K = 0, V = 0;
  float scale = 1.f;
  int l2norm = 0;
  const void *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
  int dt_qkv = DT_F32, dt_g = DT_F32, dt_beta = DT_F32;
  const float* h0 = nullptr;  // [N, Hv, K, V] or null (zeros)
  // forward outputs
  float* ht = nullptr;  // [N, Hv, K, V] or null (not wanted)
  void* o = nullptr;    // [tok, Hv, V], dtype dt_qkv
  // backward
  const void* dout = nullptr;  // [tok, Hv, V], dtype dt_qkv
  const float* dht = nullptr;  // [N, Hv, K, V] or null (zeros)
  void* dv = nullptr;          // dtype dt_qkv
  void* dg = nullptr;          // dtype dt_g
  void* dbeta = nullptr;       // dtype dt_beta
  float* dh0 = nullptr;        // [N, Hv, K, V] or null (not wanted)
  float* dq_acc = nullptr;     // [tok, Hv, K] fp32: d(normalised q) per value head
  float* dk_acc = nullptr;     // [tok, Hv, K] fp32
};

// One instruction set's kernels.
struct KernelTable {
  const char* name;
  // floats of per-thread scratch for one (sequence, head) work item
  size_t (*ws_floats)(int K, int V);
  // floats of per-thread, per-sequence backward storage (chunk start states + v_new) for nch chunks
  size_t (*seq_floats)(int K, int V, int64_t nch);
  void (*fwd_item)(const Problem& p, int n, int h, float* ws);
  void (*bwd_item)(const Problem& p, int n, int h, float* ws, float* seqbuf);
};

namespace generic { extern const KernelTable table; }
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FLASHQLA_X86_MULTI_ISA 1
namespace avx2 { extern const KernelTable table; }
namespace avx512 { extern const KernelTable table; }
#endif

}  // namespace flashqla_cpu
