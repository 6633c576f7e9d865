// pybind11 entry point of the cpu backend's native module (flashqla.backends.cpu._native).
//
// Tensors arrive as raw addresses (tensor.data_ptr()) plus sizes and dtype codes; Python allocates
// every output, so the build needs no torch headers.  Each call releases the GIL, builds the work
// list of (sequence, value head) items sorted longest first, and runs it with an OpenMP dynamic
// schedule (one item per grab) on `nthreads` threads; each thread owns one 64-byte aligned scratch
// block (and, in the backward, one per-sequence buffer of chunk states), allocated once per call.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef FLASHQLA_HAVE_OPENMP
#include <omp.h>
#endif

#include "common.h"
#include "convert.h"

namespace py = pybind11;
using namespace flashqla_cpu;

namespace {

bool cpu_has(const char* feat) {
#ifdef FLASHQLA_X86_MULTI_ISA
  __builtin_cpu_init();
  if (!std::strcmp(feat, "avx512f")) return __builtin_cpu_supports("avx512f");
  if (!std::strcmp(feat, "avx2")) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  (void)feat;
  return false;
}

const KernelTable* table_named(const std::string& want) {
#ifdef FLASHQLA_X86_MULTI_ISA
  if (want == "avx512") return cpu_has("avx512f") ? &avx512::table : nullptr;
  if (want == "avx2") return cpu_has("avx2") ? &avx2::table : nullptr;
#endif
  if (want == "generic") return &generic::table;
  return nullptr;
}

const KernelTable* best_table() {
  const char* env = std::getenv("FLASHQLA_CPU_ISA");
  if (env && *env) {
    if (const KernelTable* t = table_named(env)) return t;
  }
  for (const char* name : {"avx512", "avx2", "generic"})
    if (const KernelTable* t = table_named(name)) return t;
  return &generic::table;
}

std::atomic<const KernelTable*> g_table{nullptr};

const KernelTable* pick_table() {
  const KernelTable* t = g_table.load();
  if (!t) {
    t = best_table();
    g_table.store(t);
  }
  return t;
}

// Switch the kernels' instruction set ("" = best available); false when this CPU lacks it.
bool set_isa(const std::string& name) {
  const KernelTable* t = name.empty() ? best_table() : table_named(name);
  if (!t) return false;
  g_table.store(t);
  return true;
}

struct Aligned {
  float* p = nullptr;
  explicit Aligned(size_t floats) {
    size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    if (bytes == 0) bytes = 64;
    p = static_cast<float*>(std::aligned_alloc(64, bytes));
    if (p) std::memset(p, 0, bytes);
  }
  ~Aligned() { std::free(p); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
};

std::vector<std::pair<int, int>> work_list(const Problem& pb) {
  std::vector<std::pair<int, int>> items;
  items.reserve((size_t)pb.N * pb.Hv);
  for (int n = 0; n < pb.N; ++n)
    for (int h = 0; h < pb.Hv; ++h) items.emplace_back(n, h);
  // Longest sequences first: the dynamic schedule then balances the short tail.
  std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) {
    return pb.cu[a.first + 1] - pb.cu[a.first] > pb.cu[b.first + 1] - pb.cu[b.first];
  });
  return items;
}

int threads_for(int nthreads, size_t items) {
  int nt = nthreads > 0 ? nthreads : 1;
  if ((size_t)nt > items) nt = (int)std::max<size_t>(items, 1);
  return nt;
}

void check_common(const Problem& pb) {
  if (pb.N < 0 || pb.Hqk <= 0 || pb.Hv <= 0 || pb.Hv % pb.Hqk != 0 || pb.K <= 0 || pb.V <= 0)
    throw std::invalid_argument("flashqla cpu: bad sizes");
  for (int d : {pb.dt_qkv, pb.dt_g, pb.dt_beta})
    if (d < 0 || d > 2) throw std::invalid_argument("flashqla cpu: bad dtype code");
}

void fill_problem(Problem& pb, const std::vector<int64_t>& cu, int Hqk, int Hv, int K, int V, double scale,
                  bool l2norm, uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g, uintptr_t beta, int dt_qkv,
                  int dt_g, int dt_beta, uintptr_t h0) {
  if (cu.size() < 1) throw std::invalid_argument("flashqla cpu: empty cu_seqlens");
  pb.N = (int)cu.size() - 1;
  pb.cu = cu.data();
  pb.Hqk = Hqk; pb.Hv = Hv; pb.K = K; pb.V = V;
  pb.scale = (float)scale;
  pb.l2norm = l2norm ? 1 : 0;
  pb.q = reinterpret_cast<const void*>(q);
  pb.k = reinterpret_cast<const void*>(k);
  pb.v = reinterpret_cast<const void*>(v);
  pb.g = reinterpret_cast<const void*>(g);
  pb.beta = reinterpret_cast<const void*>(beta);
  pb.dt_qkv = dt_qkv; pb.dt_g = dt_g; pb.dt_beta = dt_beta;
  pb.h0 = reinterpret_cast<const float*>(h0);
  check_common(pb);
}

void fwd(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g, uintptr_t beta, int dt_qkv, int dt_g, int dt_beta,
         uintptr_t h0, uintptr_t ht, uintptr_t o, const std::vector<int64_t>& cu, int Hqk, int Hv, int K, int V,
         double scale, bool l2norm, int nthreads) {
  Problem pb;
  fill_problem(pb, cu, Hqk, Hv, K, V, scale, l2norm, q, k, v, g, beta, dt_qkv, dt_g, dt_beta, h0);
  pb.ht = reinterpret_cast<float*>(ht);
  pb.o = reinterpret_cast<void*>(o);
  const KernelTable* kt = pick_table();
  const auto items = work_list(pb);
  const size_t wsn = kt->ws_floats(K, V);
  const int nt = threads_for(nthreads, items.size());
  bool oom = false;
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp parallel num_threads(nt)
#endif
  {
    Aligned ws(wsn);
    if (!ws.p) {
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp atomic write
#endif
      oom = true;
    }
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (long i = 0; i < (long)items.size(); ++i)
      if (ws.p) kt->fwd_item(pb, items[i].first, items[i].second, ws.p);
  }
  if (oom) throw std::bad_alloc();
}

void bwd(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t g, uintptr_t beta, int dt_qkv, int dt_g, int dt_beta,
         uintptr_t h0, uintptr_t dout, uintptr_t dht, uintptr_t dq_acc, uintptr_t dk_acc, uintptr_t dv,
         uintptr_t dg, uintptr_t dbeta, uintptr_t dh0, const std::vector<int64_t>& cu, int Hqk, int Hv, int K,
         int V, double scale, bool l2norm, int nthreads) {
  Problem pb;
  fill_problem(pb, cu, Hqk, Hv, K, V, scale, l2norm, q, k, v, g, beta, dt_qkv, dt_g, dt_beta, h0);
  pb.dout = reinterpret_cast<const void*>(dout);
  pb.dht = reinterpret_cast<const float*>(dht);
  pb.dq_acc = reinterpret_cast<float*>(dq_acc);
  pb.dk_acc = reinterpret_cast<float*>(dk_acc);
  pb.dv = reinterpret_cast<void*>(dv);
  pb.dg = reinterpret_cast<void*>(dg);
  pb.dbeta = reinterpret_cast<void*>(dbeta);
  pb.dh0 = reinterpret_cast<float*>(dh0);
  const KernelTable* kt = pick_table();
  const auto items = work_list(pb);
  int64_t max_nch = 0;
  for (int n = 0; n < pb.N; ++n) max_nch = std::max<int64_t>(max_nch, (cu[n + 1] - cu[n] + CH - 1) / CH);
  const size_t wsn = kt->ws_floats(K, V);
  const size_t sqn = kt->seq_floats(K, V, max_nch);
  const int nt = threads_for(nthreads, items.size());
  bool oom = false;
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp parallel num_threads(nt)
#endif
  {
    Aligned ws(wsn);
    Aligned sq(sqn);
    if (!ws.p || !sq.p) {
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp atomic write
#endif
      oom = true;
    }
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (long i = 0; i < (long)items.size(); ++i)
      if (ws.p && sq.p) kt->bwd_item(pb, items[i].first, items[i].second, ws.p, sq.p);
  }
  if (oom) throw std::bad_alloc();
}

// dx[t, hq, :] from acc[t, h, :] summed over the value heads h of query/key head hq, then (l2norm)
// through x_hat = x / sqrt(|x|^2 + eps):  dx = (dx_hat - x_hat <x_hat, dx_hat>) / sqrt(|x|^2 + eps).
void finalize_qk(uintptr_t acc_p, uintptr_t x_p, uintptr_t out_p, int dt, int64_t tokens, int Hqk, int Hv, int K,
                 bool l2norm, int nthreads) {
  const float* acc = reinterpret_cast<const float*>(acc_p);
  const void* x = reinterpret_cast<const void*>(x_p);
  void* out = reinterpret_cast<void*>(out_p);
  if (Hqk <= 0 || Hv % Hqk != 0 || K <= 0) throw std::invalid_argument("flashqla cpu: bad sizes");
  const int ratio = Hv / Hqk;
  const int64_t rows = tokens * Hqk;
  const int nt = threads_for(nthreads, (size_t)std::max<int64_t>(rows / 64, 1));
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp parallel num_threads(nt)
#endif
  {
    std::vector<float> d(K), xv(K);
#ifdef FLASHQLA_HAVE_OPENMP
#pragma omp for schedule(static)
#endif
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = i / Hqk;
      const int hq = (int)(i % Hqk);
      const float* a = acc + (t * Hv + (int64_t)hq * ratio) * K;
      for (int c = 0; c < K; ++c) d[c] = a[c];
      for (int r = 1; r < ratio; ++r)
        for (int c = 0; c < K; ++c) d[c] += a[(int64_t)r * K + c];
      if (l2norm) {
        load_row(x, dt, i * K, K, xv.data());
        float ss = 0.f;
        for (int c = 0; c < K; ++c) ss += xv[c] * xv[c];
        const float rn = 1.f / std::sqrt(ss + 1e-6f);
        float dot = 0.f;
        for (int c = 0; c < K; ++c) dot += xv[c] * rn * d[c];
        for (int c = 0; c < K; ++c) d[c] = (d[c] - xv[c] * rn * dot) * rn;
      }
      store_row(out, dt, i * K, K, d.data(), 1.f);
    }
  }
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "flashqla cpu backend (C++17): chunked gated delta rule forward/backward, see flashqla.backends.cpu";
#ifdef FLASHQLA_HAVE_OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
  m.def("isa", [] { return std::string(pick_table()->name); }, "instruction set of the kernels in use");
  m.def("set_isa", &set_isa, py::arg("name"),
        "use the generic / avx2 / avx512 kernels (\"\" = best available); False if the CPU lacks them");
  m.def("fwd", &fwd, py::call_guard<py::gil_scoped_release>());
  m.def("bwd", &bwd, py::call_guard<py::gil_scoped_release>());
  m.def("finalize_qk", &finalize_qk, py::call_guard<py::gil_scoped_release>());
}
