"""TileLang building blocks shared by the kernels of this backend.

Imported only from inside the kernel builders (after ``tilelang`` imported fine); the macros expand
inline into the calling ``T.prim_func``, so they produce the same TIR as the code written out there.
"""

from __future__ import annotations

L2_EPS = 1e-6


def make_l2_row_factors(C: int, D: int, acc: str = "float32", eps: float = L2_EPS):
    """A ``T.macro`` ``(x_s, n_s, sq_f, ss_f)``: the fused-L2-norm row factors of a ``[C, D]`` tile,
    ``n_s[r] = 1 / sqrt(sum_d x_s[r, d]^2 + eps)`` in ``acc`` (``sq_f`` ``[C, D]`` and ``ss_f`` ``[C]``
    are scratch fragments)."""
    import tilelang.language as T

    @T.macro
    def l2_row_factors(x_s, n_s, sq_f, ss_f):
        for r, d in T.Parallel(C, D):
            sq_f[r, d] = T.cast(x_s[r, d], acc) * T.cast(x_s[r, d], acc)
        T.reduce_sum(sq_f, ss_f, dim=1)
        for r in T.Parallel(C):
            n_s[r] = T.rsqrt(ss_f[r] + eps)

    return l2_row_factors


def make_l2_row_factors_ring(C: int, D: int, acc: str = "float32", eps: float = L2_EPS):
    """The same row factors for tiles held in a ring of shared slots: a ``T.macro``
    ``(x_s, n_s, s, sq_f, ss_f)`` with ``x_s`` ``[R, C, D]`` and ``n_s`` ``[R, C]``, slot ``s``."""
    import tilelang.language as T

    @T.macro
    def l2_row_factors(x_s, n_s, s, sq_f, ss_f):
        for r, d in T.Parallel(C, D):
            sq_f[r, d] = T.cast(x_s[s, r, d], acc) * T.cast(x_s[s, r, d], acc)
        T.reduce_sum(sq_f, ss_f, dim=1)
        for r in T.Parallel(C):
            n_s[s, r] = T.rsqrt(ss_f[r] + eps)

    return l2_row_factors


def make_start_state(has_src: bool, halo: bool):
    """A ``T.macro`` ``(src, dst_f, seq, h, v0, from_src)``: a walk's start state ``dst_f [K, BV]``, columns
    ``v0 ..`` of ``src[seq, h]`` (h0 for the forward's walk, dht for the state gradient's), or zeros: without
    ``src``, or (``halo``) where the walk starts in a halo, not at its sequence's edge (``from_src`` false; with
    ``halo`` off, ``seq`` is the grid's sequence and ``from_src`` is not read).  Under ``halo`` the start is a select
    after the load, as in the whole-V backward (``chunk_bwd_whole_sm90``): an if / else serialised the wgmma."""
    import tilelang.language as T

    # (a macro parameter may rename the variable bound to it in the TIR, which is part of the compile cache's key;
    # with these names the forward's unsplit kernels keep theirs)
    @T.macro
    def start_state(src, dst_f, seq, h, v0, from_src):
        if has_src:
            if halo:
                # a halo that reaches the sequence's edge walks from src (no approximation at all).  A select after
                # an unconditional load (seq is a real sequence), not an if / else around the copy: at BV 128 that
                # branch made ptxas serialise all 40 wgmma of the fused forward (a 512-byte stack; session 24)
                T.copy(src[seq, h, :, v0:v0 + dst_f.shape[1]], dst_f)
                for a, j in T.Parallel(dst_f.shape[0], dst_f.shape[1]):
                    dst_f[a, j] = T.if_then_else(from_src, dst_f[a, j], 0.0)
            else:
                T.copy(src[seq, h, :, v0:v0 + dst_f.shape[1]], dst_f)
        else:
            T.clear(dst_f)

    return start_state


def make_store_rows(C: int):
    """A ``T.macro`` ``(out, src_f, bos, eos, h, col0)``: ``out[bos + r, h, col0 + d] = src_f[r, d]`` (cast to
    ``out``'s dtype) for the rows ``r < eos - bos`` of a ``[C, W]`` fragment.  A whole chunk stores without a
    test per element, which would compile to a branch per store; only a sequence's last chunk takes the tested
    form."""
    import tilelang.language as T

    @T.macro
    def store_rows(out, src_f, bos, eos, h, col0):
        if bos + C <= eos:
            for r, d in T.Parallel(C, src_f.shape[1]):
                out[bos + r, h, col0 + d] = T.cast(src_f[r, d], out.dtype)
        else:
            for r, d in T.Parallel(C, src_f.shape[1]):
                if bos + r < eos:
                    out[bos + r, h, col0 + d] = T.cast(src_f[r, d], out.dtype)

    return store_rows


def pair_offset(out, row, h, col):
    """The element offset of a GVA pair's even column in ``out`` [NT, H, D], as an integer: an element's address
    (``T.address_of``) in an extern call gets a bounds test per element from TileLang's memory-safety pass, and ptxas
    then recomputes the 64-bit address inside each test (~17 instructions per reduction instead of ~2)."""
    import tilelang.language as T

    return (T.cast(row, "int64") * out.shape[1] + h) * out.shape[2] + col - col % 2


def make_red_rows(C: int):
    """A ``T.macro`` ``(out, src_f, bos, eos, h, col0, pend)`` as :func:`make_store_rows`'s, that adds instead of
    storing: ``out[bos + r, h, col0 + d] += src_f[r, d]``, both columns of a pair rounded to ``out``'s 16-bit dtype
    and added by one ``red.global.add.noftz.bf16x2`` / ``f16x2`` (round to nearest).  The kernel must
    ``T.import_source(RED_PAIR_SRC)``; ``pend`` is a ``T.alloc_local((1,), "float32")`` that holds a pair's even
    column until its odd one comes.

    Why this form: ``T.atomic_add`` on 16-bit pairs emits ``AtomicAddx2``, whose ``atomicAdd(__nv_bfloat162 *)`` is
    generic-address inline PTX; ptxas then adds a shared-memory CAS loop beside every global ATOM (3.3 K SASS
    instructions more in the whole-V backward).  A scalar 16-bit ``red`` has no SASS form either (a CAS loop too).
    A wgmma fragment holds each pair of adjacent columns in one thread, in consecutive local registers, and the
    parallel loop over it runs them in that order (even column, then odd), which ``d % 2`` tells the helper: the
    even call parks its value in ``pend``, the odd one issues the pair's ``REDG.E.ADD.BF16x2``.  A CPU test checks
    that order in the generated source; the GPU tests check the sums."""
    import tilelang.language as T

    @T.macro
    def red_rows(out, src_f, bos, eos, h, col0, pend):
        fn = "flq_red_pair_bf16" if str(out.dtype) == "bfloat16" else "flq_red_pair_f16"
        if bos + C <= eos:
            for r, d in T.Parallel(C, src_f.shape[1]):
                T.call_extern("handle", fn, out.data, pair_offset(out, bos + r, h, col0 + d), src_f[r, d], d % 2,
                              T.address_of(pend[0]))
        else:
            for r, d in T.Parallel(C, src_f.shape[1]):
                if bos + r < eos:
                    T.call_extern("handle", fn, out.data, pair_offset(out, bos + r, h, col0 + d), src_f[r, d], d % 2,
                                  T.address_of(pend[0]))

    return red_rows


def make_grad_rows(C: int, gva_pair: bool):
    """A ``T.macro`` ``(out, src_f, bos, eos, hv, col0, pend)``: a dq / dk tile of value head ``hv`` stored into
    its own row of ``out`` [NT, Hv, D] (:func:`make_store_rows`), or with ``gva_pair`` (GVA ratio 2) added into its
    pair's row ``hv // 2`` of ``out`` [NT, Hqk, D] (:func:`make_red_rows`; ``pend`` is its local).  The backward
    kernels' ``gva_pair`` option, in one place."""
    import tilelang.language as T

    store_rows = make_store_rows(C)
    red_rows = make_red_rows(C)

    @T.macro
    def grad_rows(out, src_f, bos, eos, hv, col0, pend):
        if gva_pair:
            red_rows(out, src_f, bos, eos, hv // 2, col0, pend)
        else:
            store_rows(out, src_f, bos, eos, hv, col0)

    return grad_rows


# The pair reductions of ``make_red_rows`` (plain CUDA types only: imported sources precede TileLang's headers).
# ``cvt.rn.{bf16,f16}x2.f32 d, a, b`` puts a in the upper half, so the odd column goes first.
_RED_PAIR_TEMPLATE = """
__device__ __forceinline__ void flq_red_pair_{t}(const void *base, long long offset, float x, int odd, float *pend) {{
  if (!odd) {{
    *pend = x;
  }} else {{
    unsigned packed;
    asm("cvt.rn.{t}x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(x), "f"(*pend));
    asm volatile("red.global.add.noftz.{t}x2 [%0], %1;" :: "l"((const unsigned short *)base + offset), "r"(packed));
  }}
}}
"""
RED_PAIR_SRC = "".join(_RED_PAIR_TEMPLATE.format(t=t) for t in ("bf16", "f16"))

# The GVA pair's zeroing inside the whole-V backward (``build_bwd_whole(pair_zero=True)``; its docstring has the
# protocol).  One warp runs each helper; the words are 64-bit (the kernel's int64 ``trace_out`` parameter carries
# them), a pair's ticket first, then a flag per (chunk, query/key head), all zero at launch.
PAIR_ZERO_SRC = """
__device__ __forceinline__ int flq_pair_ticket(const void *words, long long idx) {
  unsigned long long t = 0;
  if ((threadIdx.x & 31) == 0) t = atomicAdd((unsigned long long *)words + idx, 1ULL);
  return (int)__shfl_sync(0xffffffffu, (unsigned)t, 0);
}
// zeroes nrows rows of 128 16-bit elements: row r at element off0 + r * stride of base, 16 bytes a lane a store
__device__ __forceinline__ void flq_zero_rows128(const void *base, long long off0, long long stride, int nrows) {
  unsigned short *p = (unsigned short *)base + off0;   // (const: how TileLang passes its outputs)
  for (int e = threadIdx.x & 31; e < nrows * 16; e += 32) {
    unsigned short *dst = p + (long long)(e >> 4) * stride + (e & 15) * 8;
    asm volatile("st.global.v4.b32 [%0], {%1, %1, %1, %1};" :: "l"(dst), "r"(0) : "memory");
  }
}
// every lane's zeroes before lane 0's flag (the warp barrier, then one release fence: fence.acq_rel, like an
// acquire load, also invalidates the SM's L1, CCTL.IVALL; the form with those measured +0.28 ms, session 30 runs 2-3)
__device__ __forceinline__ void flq_pair_publish(const void *words, long long idx) {
  __syncwarp();
  if ((threadIdx.x & 31) == 0) {
    asm volatile("fence.release.gpu;" ::: "memory");
    asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" :: "l"((unsigned long long *)words + idx), "l"(1ULL) : "memory");
  }
  __syncwarp();
}
// walk step `step` of a CTA of the pair (its chunk nchunks - 1 - step from c0, rows from bos0, up to eos): nothing
// for a halo step (step < nhalo) or past the walk; else its two tiles zeroed (dq then dk) and its flag set
__device__ __forceinline__ void flq_pair_zero_step(const void *words, const void *dq, const void *dk, int step,
                                                   int nchunks, int nhalo, int bos0, int eos, int c0, int hq,
                                                   int nseg, int hqk) {
  if (step >= nchunks || step < nhalo) return;
  int chunk = nchunks - 1 - step;
  int row0 = bos0 + chunk * 64;
  int rows = min(eos - row0, 64);
  long long off = ((long long)row0 * hqk + hq) * 128;
  flq_zero_rows128(dq, off, (long long)hqk * 128, rows);
  flq_zero_rows128(dk, off, (long long)hqk * 128, rows);
  flq_pair_publish(words, (long long)nseg * hqk + (long long)(c0 + chunk) * hqk + hq);
}
__device__ __forceinline__ void flq_pair_wait(const void *words, long long idx) {
  // relaxed polls (an acquire load invalidates L1 each time), one acquire fence once the flag is seen
  if ((threadIdx.x & 31) == 0) {
    unsigned long long v;
    do {
      asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"((unsigned long long *)words + idx) : "memory");
    } while (v == 0ULL);
    asm volatile("fence.acquire.gpu;" ::: "memory");
  }
  __syncwarp();
}
"""


# ``ex2.approx.ftz.f32`` as a device function (``T.import_source(EX2_APPROX_SRC)`` in the kernel, then
# ``T.call_extern("float32", "flq_ex2_approx", x)``).  TileLang's ``T.exp2`` (and ``T.__exp``) compile to
# ``exp2f``, which without fast math wraps the same MUFU.EX2 in a denormal-range test and two predicated
# multiplies: four instructions where this is one.  The results differ only where exp2f's would be subnormal
# (below 2^-126; flushed to zero here).
EX2_APPROX_SRC = """
__device__ __forceinline__ float flq_ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


def ex2_approx(x):
    """``2^x`` as one ``ex2.approx.ftz`` (the kernel must ``T.import_source(EX2_APPROX_SRC)``)."""
    import tilelang.language as T

    return T.call_extern("float32", "flq_ex2_approx", x)


def symbolic_sizes():
    """The symbolic (``T.dynamic``) sizes the kernels share, so a new length never recompiles:
    ``(NT, NC, NS, Hqk, Hv)`` -- tokens (B * T, or the packed varlen length), chunks over all
    sequences, sequences, query/key heads, value heads."""
    import tilelang.language as T

    return T.dynamic("NT"), T.dynamic("NC"), T.dynamic("NS"), T.dynamic("Hqk"), T.dynamic("Hv")
