"""Stage 1's ``X = (I + A)^-1`` on the tensor cores (``FLASHQLA_TILELANG_INTRA_INV=mma``, the default since session 25).

Why: Nsight Compute on stage 1's Tb form (H100, 16/32 1x32768, session 25 run 1) puts its L1 / shared-memory pipe
at 89% of peak: 2618 shared wavefronts per (chunk, head), 1828 of them in the CUDA-core inverse (P3a / P3b alone
1040: every FMA there reads an operand from shared memory, at 8 outputs per thread).  The same products as
``mma.sync.m16n8k8`` TF32 fragments read each operand once per warp.  Measured (H100, session 25 run 3): the inverse
848 wavefronts (zero blocks and P1 304, P2 140, P3 404), the kernel 1642 (was 2618), the L1 pipe 66% (was 89%),
the Tb form 0.224 -> 0.208 ms at 16/32 1x32768 (``benchmarks/results/h100_2026-12-05_session25_README.md``).

Precision: each product is "3xTF32": ``x = hi + lo`` with ``hi = tf32(x)`` and ``lo = x - hi`` (read as TF32), and
``a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi`` (the ``a_lo b_lo`` term, ~2^-22 relative, dropped), accumulated in fp32:
the same order of error as the fp32 FMAs it replaces (``tests/test_tilelang_intra_mma.py`` runs this very source on
the CPU, with the tensor-core instructions emulated, against the exact inverse).

One device function, ``flq_inv64_mma(A, X)``, called by all 128 threads of stage 1's CTA; ``A`` and ``X`` are the
fp32 shared tiles (64 rows, row pitch ``FLQ_INV_PITCH`` = 72 words), ``A`` strictly lower triangular with zeros on
and above the diagonal.  It writes all of ``X`` (its zero blocks too, so ``X`` needs no clearing first) and ends
with a ``__syncthreads``.  Blocks of 16, ``D_b = (I + A_bb)^-1``:

* P0  the six 16 x 16 blocks above the diagonal of X are zeroed (three 16-byte stores per thread);
* P1  warp b: ``D_b`` by forward substitution, lane c < 16 its column c, A's rows read as warp-wide broadcasts;
* P2  warp w, half p = w / 2, columns 8 (w % 2) .. + 7:  ``Y = A_{2p+1,2p} D_2p``, then
      ``X_{2p+1,2p} = -D_{2p+1} Y`` -- Y passes from the accumulator fragment to the B fragment by shuffles;
* P3  warp w, columns 8 w .. 8 w + 7 of the lower-left 32 x 32 block:  ``Y = A[32:64, 0:32] X[0:32, 0:32]``, then
      ``X[32:64, 0:32] = -X[32:64, 32:64] Y``; the k-steps that meet only zero blocks of the triangular factors are
      skipped (warp w starts Y's product at k-step w).

A ``__syncthreads`` separates P1, P2 and P3 (each reads only blocks the phases before it wrote).

Fragments (PTX ISA, ``mma.m16n8k8`` with ``.tf32``; lane = 4 g + t): A (16 x 8, row) ``a0 = (g, t)``,
``a1 = (g + 8, t)``, ``a2 = (g, t + 4)``, ``a3 = (g + 8, t + 4)``; B (8 x 8, col) ``b0 = (t, g)``, ``b1 = (t + 4, g)``;
C / D (16 x 8) ``c0 = (g, 2 t)``, ``c1 = (g, 2 t + 1)``, ``c2 = (g + 8, 2 t)``, ``c3 = (g + 8, 2 t + 1)``.
"""

PITCH = 72

INVERSE_MMA_SRC = r"""
#ifndef FLQ_INV64_MMA_DEFINED
#define FLQ_INV64_MMA_DEFINED
#define FLQ_INV_PITCH 72

// the word of entry (r, c) of a 64 x 64 fp32 tile: row pitch 72 (the padded tiles), or with SW (stage 1's compact
// form) row pitch 64 and the columns XOR-swizzled per row, c ^ 8 (r & 3) (chunk_intra_sm90.build_intra's sw); the
// swizzle keeps groups of 4 (and 2) aligned columns together, so the 16- and 8-byte accesses below stay whole
template <bool SW>
__device__ __forceinline__ int flq_at(int r, int c) {
  return SW ? r * 64 + (c ^ ((r & 3) << 3)) : r * FLQ_INV_PITCH + c;
}

#ifndef FLQ_EMULATE
// d += a b, one m16n8k8 TF32 product (fp32 accumulators; the tensor cores read the top 19 bits of each operand)
__device__ __forceinline__ void flq_mma_tf32(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// x = hi + lo: hi is x rounded to TF32 (nearest, ties away; two integer operations where cvt.rna.tf32.f32 is a
// longer sequence with NaN tests: the operands here are finite), lo = x - hi exactly, |lo| <= 2^-11 |x|, which the
// tensor cores then read truncated to TF32 (relative 2^-10 of lo)
template <int N>
__device__ __forceinline__ void flq_split(unsigned* hi, unsigned* lo, const float* x) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    hi[i] = (__float_as_uint(x[i]) + 0x1000u) & 0xffffe000u;
    lo[i] = __float_as_uint(x[i] - __uint_as_float(hi[i]));
  }
}

// d += a b in about fp32 precision (3xTF32 from split operands; the lo x lo term dropped, the small terms first)
__device__ __forceinline__ void flq_mma3(float* d, const unsigned* ah, const unsigned* al, const unsigned* bh,
                                         const unsigned* bl) {
  flq_mma_tf32(d, al, bh);
  flq_mma_tf32(d, ah, bl);
  flq_mma_tf32(d, ah, bh);
}

// the A fragment of the 16 x 8 tile of M at (r0, c0)
template <bool SW>
__device__ __forceinline__ void flq_frag_a(float* a, const float* M, int r0, int c0, int g, int t) {
  a[0] = M[flq_at<SW>(r0 + g, c0 + t)];
  a[1] = M[flq_at<SW>(r0 + g + 8, c0 + t)];
  a[2] = M[flq_at<SW>(r0 + g, c0 + t + 4)];
  a[3] = M[flq_at<SW>(r0 + g + 8, c0 + t + 4)];
}

// the B fragment of the 8 x 8 tile of M at (k0, n0) (M row-major, rows = k)
template <bool SW>
__device__ __forceinline__ void flq_frag_b(float* b, const float* M, int k0, int n0, int g, int t) {
  b[0] = M[flq_at<SW>(k0 + t, n0 + g)];
  b[1] = M[flq_at<SW>(k0 + t + 4, n0 + g)];
}

// the B fragments of both k-steps of a 16 x 8 accumulator y (its rows are the k index): b0 for rows 0..7, b1 for
// rows 8..15.  Entry (i, j) of y sits in lane 4 i' + j / 2 (i' = i mod 8) as c0 / c1 (i < 8) or c2 / c3, by j's parity.
__device__ __forceinline__ void flq_acc_to_b(float* b0, float* b1, const float* y, int g, int t) {
  const int lo = t * 4 + (g >> 1), hi = (t + 4) * 4 + (g >> 1);
  const bool odd = (g & 1) != 0;
  float v0 = __shfl_sync(0xffffffffu, y[0], lo), v1 = __shfl_sync(0xffffffffu, y[1], lo);
  float v2 = __shfl_sync(0xffffffffu, y[0], hi), v3 = __shfl_sync(0xffffffffu, y[1], hi);
  b0[0] = odd ? v1 : v0;
  b0[1] = odd ? v3 : v2;
  v0 = __shfl_sync(0xffffffffu, y[2], lo); v1 = __shfl_sync(0xffffffffu, y[3], lo);
  v2 = __shfl_sync(0xffffffffu, y[2], hi); v3 = __shfl_sync(0xffffffffu, y[3], hi);
  b1[0] = odd ? v1 : v0;
  b1[1] = odd ? v3 : v2;
}

// M[(r0 ..), (n0 ..)] = -d, a 16 x 8 accumulator
template <bool SW>
__device__ __forceinline__ void flq_store_neg(float* M, const float* d, int r0, int n0, int g, int t) {
  *(float2*)(M + flq_at<SW>(r0 + g, n0 + 2 * t)) = make_float2(-d[0], -d[1]);
  *(float2*)(M + flq_at<SW>(r0 + g + 8, n0 + 2 * t)) = make_float2(-d[2], -d[3]);
}

template <bool SW>
__device__ __forceinline__ void flq_inv64_mma_t(float* A, float* X) {
  const int tx = threadIdx.x;
  const int warp = tx >> 5, lane = tx & 31, g = lane >> 2, t = lane & 3;

  // ---- P0: the blocks above the diagonal are zero
  {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      // block blk = 0..5 is (0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)
      const int q = tx + 128 * i, blk = q >> 6, w = q & 63;
      const int bi = blk < 3 ? 0 : (blk < 5 ? 1 : 2), bj = blk < 3 ? blk + 1 : (blk < 5 ? blk - 1 : 3);
      *(float4*)(X + flq_at<SW>(16 * bi + (w >> 2), 16 * bj + 4 * (w & 3))) =
          make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }

  // ---- P1: D_b = (I + A_bb)^-1, warp b, lane c < 16 its column c
  if (lane < 16) {
    const int d0 = 16 * warp, c = lane;
    float x[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) x[r] = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float s0 = (r == c) ? 1.f : 0.f, s1 = 0.f;
      // (columns m >= r of the row are A's zeros, and x[m] is still 0 there)
#pragma unroll
      for (int m4 = 0; m4 < (r + 3) / 4; ++m4) {
        const float4 a = *(const float4*)(A + flq_at<SW>(d0 + r, d0 + 4 * m4));
        s0 -= a.x * x[4 * m4];
        s1 -= a.y * x[4 * m4 + 1];
        s0 -= a.z * x[4 * m4 + 2];
        s1 -= a.w * x[4 * m4 + 3];
      }
      x[r] = s0 + s1;
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) X[flq_at<SW>(d0 + r, d0 + c)] = x[r];
  }
  __syncthreads();

  // ---- P2: X_{2p+1,2p} = -D_{2p+1} A_{2p+1,2p} D_2p, warp w: half p = w / 2, columns 8 (w % 2) ..
  {
    const int p = warp >> 1, nh = warp & 1;
    const int r1 = 32 * p + 16, c0 = 32 * p, n0 = c0 + 8 * nh;
    float y[4] = {0.f, 0.f, 0.f, 0.f}, z[4] = {0.f, 0.f, 0.f, 0.f}, a[4], b[2], b0[2], b1[2];
    unsigned ah[4], al[4], bh[2], bl[2], b0h[2], b0l[2], b1h[2], b1l[2];
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      if (ks < nh) continue;                    // (D_2p's rows 0..7 are zero in columns 8..15)
      flq_frag_a<SW>(a, A, r1, c0 + 8 * ks, g, t);
      flq_frag_b<SW>(b, X, c0 + 8 * ks, n0, g, t);
      flq_split<4>(ah, al, a);
      flq_split<2>(bh, bl, b);
      flq_mma3(y, ah, al, bh, bl);
    }
    flq_acc_to_b(b0, b1, y, g, t);
    flq_split<2>(b0h, b0l, b0);
    flq_split<2>(b1h, b1l, b1);
    flq_frag_a<SW>(a, X, r1, r1, g, t);
    flq_split<4>(ah, al, a);
    flq_mma3(z, ah, al, b0h, b0l);
    flq_frag_a<SW>(a, X, r1, r1 + 8, g, t);
    flq_split<4>(ah, al, a);
    flq_mma3(z, ah, al, b1h, b1l);
    flq_store_neg<SW>(X, z, r1, n0, g, t);
  }
  __syncthreads();

  // ---- P3: X[32:64, 0:32] = -X[32:64, 32:64] A[32:64, 0:32] X[0:32, 0:32], warp w: columns 8 w ..
  {
    const int n0 = 8 * warp;
    float y0[4] = {0.f, 0.f, 0.f, 0.f}, y1[4] = {0.f, 0.f, 0.f, 0.f};
    float z0[4] = {0.f, 0.f, 0.f, 0.f}, z1[4] = {0.f, 0.f, 0.f, 0.f};
    float a[4], b[2], bq[4][2];
    unsigned ah[4], al[4], bh[2], bl[2], bqh[4][2], bql[4][2];
    // (X[0:32, 0:32] is zero in column n0 + j at rows < 8 warp: the k-steps before `warp` add nothing)
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if (ks < warp) continue;
      flq_frag_b<SW>(b, X, 8 * ks, n0, g, t);
      flq_split<2>(bh, bl, b);
      flq_frag_a<SW>(a, A, 32, 8 * ks, g, t);
      flq_split<4>(ah, al, a);
      flq_mma3(y0, ah, al, bh, bl);
      flq_frag_a<SW>(a, A, 48, 8 * ks, g, t);
      flq_split<4>(ah, al, a);
      flq_mma3(y1, ah, al, bh, bl);
    }
    flq_acc_to_b(bq[0], bq[1], y0, g, t);
    flq_acc_to_b(bq[2], bq[3], y1, g, t);
#pragma unroll
    for (int q = 0; q < 4; ++q) flq_split<2>(bqh[q], bql[q], bq[q]);
    // rows 32..47 of X[32:64, 32:64] are zero past column 47: two k-steps; rows 48..63: four
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      flq_frag_a<SW>(a, X, 32, 32 + 8 * q, g, t);
      flq_split<4>(ah, al, a);
      flq_mma3(z0, ah, al, bqh[q], bql[q]);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      flq_frag_a<SW>(a, X, 48, 32 + 8 * q, g, t);
      flq_split<4>(ah, al, a);
      flq_mma3(z1, ah, al, bqh[q], bql[q]);
    }
    flq_store_neg<SW>(X, z0, 32, n0, g, t);
    flq_store_neg<SW>(X, z1, 48, n0, g, t);
  }
  __syncthreads();
}

// the padded tiles (row pitch 72) and the compact ones (pitch 64, swizzled)
__device__ __forceinline__ void flq_inv64_mma(float* A, float* X) { flq_inv64_mma_t<false>(A, X); }
__device__ __forceinline__ void flq_inv64_mma_sw(float* A, float* X) { flq_inv64_mma_t<true>(A, X); }
#endif
"""
