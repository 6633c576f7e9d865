"""CPU proof of stage 1's tensor-core inverse (``flashqla/backends/tilelang/intra_inverse_mma.py``).

The device function's own source is compiled with g++ and run by 128 CPU threads, one per CUDA thread: the
CUDA-only pieces are shims -- ``__syncthreads`` a barrier of the 128, ``__shfl_sync`` an exchange through a
per-warp table between two barriers of the warp, and ``mma.sync.m16n8k8`` TF32 a warp-wide product that gathers
every lane's fragment registers by the PTX ISA's layout (A ``a0 = (g, t)``, ``a1 = (g + 8, t)``, ``a2 = (g, t + 4)``,
``a3 = (g + 8, t + 4)``; B ``b0 = (t, g)``, ``b1 = (t + 4, g)``; C ``c0 = (g, 2 t)``, ``c1 = (g, 2 t + 1)``,
``c2 = (g + 8, 2 t)``, ``c3 = (g + 8, 2 t + 1)``), each lane then computing its own four outputs with the
operands' low 13 mantissa bits dropped, as the tensor cores read TF32.

So the index arithmetic, the shuffles, the phase order and the 3xTF32 split are the kernel's, byte for byte; what
the emulation assumes is the fragment layout above.  Checked against the exact inverse (float64) on the chunks
of ``test_tilelang_intra.py``: within fp32 round-off, like the CUDA-core inverse it replaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_tilelang_intra import CASES, C, PAD, build_A, emulate_blocked_inverse, exact_inverse, make_chunks, rel_rows  # noqa: E402

SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#define FLQ_EMULATE 1
#define __device__
#define __forceinline__ inline
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float2 make_float2(float a, float b) { return {a, b}; }
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct Dim { int x; };
static thread_local Dim threadIdx;
static std::barrier<>* g_block;
static std::barrier<>* g_warp[4];
static float g_shfl[4][32];
static unsigned g_frag[4][32][6];
static inline void __syncthreads() { g_block->arrive_and_wait(); }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __shfl_sync(unsigned, float v, int src) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  g_shfl[w][l] = v;
  g_warp[w]->arrive_and_wait();
  float r = g_shfl[w][src & 31];
  g_warp[w]->arrive_and_wait();
  return r;
}
static inline float tf32_operand(unsigned u) { return __uint_as_float(u & 0xffffe000u); }
static inline void flq_mma_tf32(float* d, const unsigned* a, const unsigned* b) {
  int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  for (int i = 0; i < 4; ++i) g_frag[w][l][i] = a[i];
  g_frag[w][l][4] = b[0];
  g_frag[w][l][5] = b[1];
  g_warp[w]->arrive_and_wait();
  float A[16][8], B[8][8];
  for (int ln = 0; ln < 32; ++ln) {
    int g = ln >> 2, t = ln & 3;
    A[g][t] = tf32_operand(g_frag[w][ln][0]);
    A[g + 8][t] = tf32_operand(g_frag[w][ln][1]);
    A[g][t + 4] = tf32_operand(g_frag[w][ln][2]);
    A[g + 8][t + 4] = tf32_operand(g_frag[w][ln][3]);
    B[t][g] = tf32_operand(g_frag[w][ln][4]);
    B[t + 4][g] = tf32_operand(g_frag[w][ln][5]);
  }
  g_warp[w]->arrive_and_wait();
  int g = l >> 2, t = l & 3;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    double s = 0.0;     // (the tensor cores' products of TF32 operands are exact in fp32; the sum rounds once)
    for (int k = 0; k < 8; ++k) s += (double)A[rows[i]][k] * (double)B[k][cols[i]];
    d[i] = (float)((double)d[i] + s);
  }
}
"""

MAIN = r"""
template <bool SW>
static void run_chunk(const float* in, float* out) {
  std::vector<float> A(64 * FLQ_INV_PITCH, std::nanf("")), X(64 * FLQ_INV_PITCH, std::nanf(""));
  // (words outside the tile's entries -- the pad columns -- hold garbage, as shared memory would)
  for (int r = 0; r < 64; ++r)
    for (int j = 0; j < 64; ++j) A[flq_at<SW>(r, j)] = in[r * 64 + j];
  std::barrier<> block(128);
  std::barrier<> w0(32), w1(32), w2(32), w3(32);
  g_block = &block;
  g_warp[0] = &w0; g_warp[1] = &w1; g_warp[2] = &w2; g_warp[3] = &w3;
  std::vector<std::thread> th;
  for (int i = 0; i < 128; ++i)
    th.emplace_back([&, i] {
      threadIdx.x = i;
      if (SW) flq_inv64_mma_sw(A.data(), X.data()); else flq_inv64_mma(A.data(), X.data());
    });
  for (auto& x : th) x.join();
  for (int r = 0; r < 64; ++r)
    for (int j = 0; j < 64; ++j) out[r * 64 + j] = X[flq_at<SW>(r, j)];
}

int main(int argc, char** argv) {
  // argv[1]: n chunks, argv[2]: 1 for the compact (swizzled) tiles; stdin: n * 64 * 64 floats of A; stdout: X
  int n = std::atoi(argv[1]), sw = std::atoi(argv[2]);
  std::vector<float> in((size_t)n * 4096), out((size_t)n * 4096);
  if (std::fread(in.data(), 4, in.size(), stdin) != in.size()) return 2;
  for (int c = 0; c < n; ++c) {
    if (sw) run_chunk<true>(in.data() + (size_t)c * 4096, out.data() + (size_t)c * 4096);
    else run_chunk<false>(in.data() + (size_t)c * 4096, out.data() + (size_t)c * 4096);
  }
  std::fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler here")
    from flashqla.backends.tilelang.intra_inverse_mma import INVERSE_MMA_SRC, PITCH
    assert PITCH == PAD
    d = tmp_path_factory.mktemp("inv_mma")
    src = d / "inv.cpp"
    src.write_text(SHIM + INVERSE_MMA_SRC + MAIN)
    exe = d / "inv"
    res = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", str(src), "-o", str(exe)], capture_output=True,
                         text=True)
    if res.returncode != 0 and "barrier" in res.stderr and "No such file" in res.stderr:
        pytest.skip("no C++20 <barrier> here")
    assert res.returncode == 0, res.stderr[-3000:]

    def run(A32: torch.Tensor, sw: bool = False) -> torch.Tensor:
        n = A32.shape[0]
        out = subprocess.run([str(exe), str(n), str(int(sw))], input=A32.contiguous().numpy().tobytes(),
                             capture_output=True, check=True).stdout
        return torch.frombuffer(bytearray(out), dtype=torch.float32).reshape(n, C, C)
    return run


@pytest.mark.parametrize("sw", [False, True], ids=["padded", "compact"])
@pytest.mark.parametrize("decay,beta_kind,l2norm,pad,corr", CASES)
def test_mma_inverse_matches_exact(emulator, decay, beta_kind, l2norm, pad, corr, sw):
    k, g, beta = make_chunks(3, decay=decay, beta_kind=beta_kind, l2norm=l2norm, pad_from=pad,
                             seed=int(decay * 10) + 7 * (pad or 0), corr=corr)
    A32, _, _ = build_A(k, g, beta, l2norm, torch.float32)
    X = emulator(A32, sw)
    if sw:      # (the same products in the same order: the layout changes where each operand lives, not its value)
        assert torch.equal(X, emulator(A32, False))
    assert bool(torch.isfinite(X).all())
    X_ref = exact_inverse(A32.double())
    e_mma = rel_rows(X.double(), X_ref)
    e_fma = rel_rows(emulate_blocked_inverse(A32).double(), X_ref)
    assert e_mma < 1e-5, (e_mma, e_fma)
    assert e_mma < 4 * e_fma + 1e-6, (e_mma, e_fma)
    eye = torch.eye(C, dtype=torch.float64)
    assert rel_rows(X.double() - eye, X_ref - eye) < 1e-5 or float(A32.abs().max()) == 0
    # exact structure: unit diagonal, zero upper triangle (the zero blocks are written), padded rows are identity
    idx = torch.arange(C)
    assert bool((torch.diagonal(X, dim1=-2, dim2=-1) == 1).all())
    assert bool((X[:, idx[:, None] < idx[None, :]] == 0).all())
    if pad is not None:
        assert torch.equal(X[:, pad:, :], torch.eye(C)[pad:].expand(3, -1, -1))


@pytest.mark.parametrize("sw", [False, True], ids=["padded", "compact"])
def test_mma_inverse_fails_on_a_wrong_layout(emulator, sw):
    """The check has teeth: a nonzero A whose inverse is known exactly (A = N strictly lower with one band)."""
    A = torch.zeros(1, C, C)
    A[0, torch.arange(1, C), torch.arange(C - 1)] = 0.5      # (I + A)^-1 = sum (-A)^k, banded
    X = emulator(A, sw)
    X_ref = exact_inverse(A.double())
    assert rel_rows(X.double(), X_ref) < 1e-6
    assert float(X[0, 63, 0]) == pytest.approx((-0.5) ** 63, rel=1e-5)


@pytest.mark.compile
@pytest.mark.parametrize("form", ["tb", "tbx", "tb-l2norm", "tbs", "wu"])
def test_inv_mma_stage1_lowers(form):
    """``build_intra(inv_mma=True)`` lowers for sm_90a: the inverse's 18 3xTF32 products (54 HMMA.1688 TF32 in the
    SASS), stage 1's own k k^T still one pipelined wgmma, no local memory, and X no longer cleared by the CTA (the
    device function writes its zero blocks)."""
    pytest.importorskip("tilelang")
    import tilelang
    from flashqla.backends.tilelang import chunk_intra_sm90 as m
    from flashqla.backends.tilelang._compile import TARGET
    from test_backend_tilelang import assert_resources, assert_wgmma_pipelined, kernel_sass
    l2norm, save_x, tb_only, scores = form == "tb-l2norm", form == "tbx", form != "wu", form == "tbs"

    def build(inv):
        return tilelang.compile(m.build_intra("bfloat16", "bfloat16", 128, 128, l2norm, save_x, tb_only=tb_only,
                                              scores=scores, inv_mma=inv), out_idx=None, target=TARGET)
    kern, base = build(True), build(False)
    src = kern.get_kernel_source()
    assert "flq_inv64_mma((&(((float*)A_s)[0])), (&(((float*)X_s)[0])));" in src
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src and "wgmma" in src and "tma_load" in src
    assert_resources(kern)
    assert_wgmma_pipelined(kern, form)
    sass, sass_base = kernel_sass(kern), kernel_sass(base)
    if sass is not None:
        assert sass.count("HMMA.1688.F32.TF32") == 54
        assert "HMMA" not in sass_base
        shared = lambda s: sum(s.count(op) for op in (" LDS", " STS"))     # noqa: E731
        assert shared(sass) < 0.8 * shared(sass_base), (shared(sass), shared(sass_base))


def test_inv_mma_and_uniform_keys(monkeypatch):
    """The tensor-core inverse and the uniform row lookup are compile-key options at the end: with both off the keys
    are the former ones (carried caches keep matching); ``mma`` is the default and reads the compact tiles where
    those are asked for (never with the scores); ``uniform`` only where the caller says so."""
    from flashqla.backends.tilelang import ops
    seen = []
    monkeypatch.setattr(ops, "get_kernel", lambda name, builder, key: seen.append((name, key)))
    for var in ("FLASHQLA_TILELANG_INTRA_COMPACT", "FLASHQLA_TILELANG_EX2", "FLASHQLA_TILELANG_INTRA_INV",
                "FLASHQLA_TILELANG_INTRA_ORDER"):
        monkeypatch.delenv(var, raising=False)
    assert ops.intra_inv_mma()
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", "fma")
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False)
    ops.intra_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, True)
    assert [len(k) for _, k in seen] == [7, 6]
    monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_INV")
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_COMPACT", "1")
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False)
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False, scores=True)
    ops.intra_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, True)
    assert [k[-2:] for _, k in seen[2:]] == [(True, True), (False, True), (False, True)]
    assert [len(k) for _, k in seen[2:]] == [13, 13, 13]
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False, save_x=True, uniform=True, persist=True)
    ops.intra_kernel(torch.bfloat16, torch.bfloat16, 128, 128, False, True, uniform=True)
    # (compact, inv_mma, uniform, persist) and (compact, inv_mma, uniform): the persistent form never compact
    assert seen[5][1][-4:] == (False, True, True, True) and seen[6][1][-3:] == (False, True, True)


@pytest.mark.compile
def test_uniform_rows_lower_without_the_chunk_table():
    """``build_intra(uniform=True)``: a CTA's rows come from its chunk number and ``cu_seqlens[1]``; the kernels
    never read ``chunk_indices`` (the table form reads it for every CTA)."""
    pytest.importorskip("tilelang")
    import re
    import tilelang
    from flashqla.backends.tilelang import chunk_intra_sm90 as m
    from flashqla.backends.tilelang._compile import TARGET
    for save_x, tb_only in ((False, True), (True, True), (True, False)):
        srcs = [tilelang.compile(m.build_intra("bfloat16", "bfloat16", 128, 128, False, save_x, tb_only=tb_only,
                                               uniform=u), out_idx=None, target=TARGET).get_kernel_source()
                for u in (False, True)]
        body = lambda s: s[s.index("{", s.index("__launch_bounds__")):]      # noqa: E731
        assert re.search(r"chunk_indices\[", body(srcs[0])), (save_x, tb_only)
        assert not re.search(r"chunk_indices\[", body(srcs[1])), (save_x, tb_only)
        assert re.search(r"cu_seqlens\[\(?(\(int64_t\))?1\)?\]", body(srcs[1])), (save_x, tb_only)


@pytest.mark.compile
@pytest.mark.parametrize("save_x,uniform", [(False, True), (True, True), (False, False)],
                         ids=["tb-uniform", "tbx-uniform", "tb-table"])
def test_intra_persist_lowers_for_four_ctas_per_sm(save_x, uniform):
    """``build_intra(persist=True)``: one loop over the CTA's chunks with the next k tile's TMA load inside it, at most
    128 registers (``__launch_bounds__(128, 4)``) with no local memory, at most 54 KB of shared memory (four CTAs per
    SM), and Tb / X / G written straight from the X tile (no TMA store)."""
    pytest.importorskip("tilelang")
    import tilelang
    from flashqla.backends.tilelang import chunk_intra_sm90 as m
    from flashqla.backends.tilelang._compile import TARGET
    from test_backend_tilelang import assert_resources, assert_wgmma_pipelined, kernel_sass
    kern = tilelang.compile(m.build_intra("bfloat16", "bfloat16", 128, 128, False, save_x, tb_only=True, inv_mma=True,
                                          uniform=uniform, persist=True), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "__launch_bounds__(128, 4)" in src
    loop = src[src.index("for (int it = 0;"):]
    assert loop.count("tl::tma_load(") == 1 and "tma_store" not in src
    assert "bar[0].wait((it & 1))" in loop
    assert_resources(kern, max_regs=128, max_dyn_smem_kb=54)
    assert_wgmma_pipelined(kern, "persist")
    sass = kernel_sass(kern)
    if sass is not None:
        assert sass.count("HMMA.1688.F32.TF32") == 54


def test_intra_persist_key_and_programs(monkeypatch):
    """The persistent form is the default on equal-length calls, can be switched on for all or off, needs the
    tensor-core inverse, and launches one wave of four CTAs per SM over the value heads (never more CTAs per head
    than chunks); fewer per SM on request."""
    from flashqla.backends.tilelang import ops
    from flashqla.dispatch.device import fake_device
    monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_PERSIST", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_INV", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_PERSIST_CTAS", raising=False)
    # auto: where stage 1 finds its rows from the chunk number (the measured, GPU-tested calls)
    assert ops.intra_persist() and ops.intra_persist(uniform=True) and not ops.intra_persist(uniform=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST", "0")
    assert not ops.intra_persist()
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST", "1")
    assert ops.intra_persist() and ops.intra_persist(uniform=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", "fma")
    assert not ops.intra_persist()
    seen = []
    monkeypatch.setattr(ops, "get_kernel", lambda name, builder, key: seen.append((name, key)))
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False, save_x=True, uniform=True, persist=True)
    assert seen[0][1][-3:] == (False, True, True) and len(seen[0][1]) == 15
    dev = torch.device("cpu")
    with fake_device(sm_count=132):
        assert ops.intra_persist_programs(512, 32, dev) == 16
        # the fewest CTAs at the same chunks per CTA: 66 would walk 7-8 chunks each, 64 walk 8 and free 16 slots
        assert ops.intra_persist_programs(512, 8, dev) == 64
        assert ops.intra_persist_programs(512, 16, dev) == 32          # 33 -> 32, 16 chunks each
        assert ops.intra_persist_programs(512, 24, dev) == 22          # 22 x 24 = 528: 24 chunks each, none fewer
        assert ops.intra_persist_programs(100, 4, dev) == 100          # a CTA per chunk
        assert ops.intra_persist_programs(0, 8, dev) == 1
        for chunks, hv in ((512, 8), (512, 16), (4100 // 64 + 1, 2), (1000, 3), (777, 48)):
            n = ops.intra_persist_programs(chunks, hv, dev)
            full = min(chunks, 4 * 132 // hv)
            assert -(-chunks // n) == -(-chunks // full) and n <= full
        assert ops.intra_persist_programs(3, 8, dev) == 3
        monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST_CTAS", "3")
        assert ops.intra_persist_programs(512, 32, dev) == 12
        monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST_CTAS", "5")
        with pytest.raises(ValueError, match="FLASHQLA_TILELANG_INTRA_PERSIST_CTAS"):
            ops.intra_persist_programs(512, 32, dev)
        monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_PERSIST_CTAS")
        assert ops.intra_persist_programs(512, 1024, dev) == 1


@pytest.mark.compile
def test_inv_mma_with_hw_ex2_lowers():
    """``FLASHQLA_TILELANG_EX2=approx`` with the tensor-core inverse: both device functions in one imported source (a
    kernel takes one ``T.import_source``; two failed to build, session 25)."""
    pytest.importorskip("tilelang")
    import tilelang
    from flashqla.backends.tilelang import chunk_intra_sm90 as m
    from flashqla.backends.tilelang._compile import TARGET
    for kw in (dict(save_x=False), dict(save_x=True), dict(save_x=False, uniform=True, persist=True)):
        sx = kw.pop("save_x")
        src = tilelang.compile(m.build_intra("bfloat16", "bfloat16", 128, 128, False, sx, tb_only=True, hw_ex2=True,
                                             inv_mma=True, **kw), out_idx=None, target=TARGET).get_kernel_source()
        assert "flq_ex2_approx(" in src and "flq_inv64_mma(" in src and "mma.sync.aligned" in src
