// Chunked gated-delta-rule kernels for one instruction set (included once per kern_*.cpp).
//
// Before including, a unit defines FQ_NS (namespace), FQ_VW (floats per vector) and FQ_NVMAX (vectors
// per micro-tile row) and switches on its target ISA; everything here then lives in
// flashqla_cpu::FQ_NS and is compiled for that ISA only.
//
// Work item: one (sequence n, value head h), run by one thread, the sequence's chunks of 64 tokens in
// order (forward) or in reverse after a state pass (backward).  Per-thread scratch (ws_floats) holds
// the chunk's operands, padded: K -> Kp, V -> Vp (multiples of 16 floats) and the chunk length L ->
// Lr (multiple of 16), zero padding making every padded product exact.  All matrix products are
// "NN" row-major products C = alpha*A*B + beta*C run by a register-blocked micro-kernel (4 rows x
// NVMAX vectors of accumulators, broadcast A, vector B) over operands that fit L1/L2; transposed
// operands are materialised (cheap: O(64*K) per chunk) so every product streams rows.
//
// Chunk algebra (see flashqla/reference.py): with G = cumsum(g) (double), Gamma = exp(G),
// D[r,j] = exp(G_r - G_j) (j <= r, else 0) and start state S0:
//   A = diag(beta) (k k^T) o D_strict,  Tm = (I + A)^-1,   [W | U] = Tm [beta Gamma k | beta v]
//   Vn = U - W S0,   O = scale (Gamma q S0 + ((q k^T) o D) Vn),
//   S1 = Gamma_C S0 + (lambda k)^T Vn,   lambda_r = exp(G_C - G_r).
// Only differences G_r - G_j with r >= j are ever exponentiated, so strong decay underflows to 0 and
// never overflows.  The backward differentiates exactly this form (derivation in bwd_item).
//
// Memory: one scratch layout serves both directions: ~1.4 MiB per thread for K = V = 128 (the
// forward touches ~0.5 MiB of it, so a chunk's operands stay in L2).  The backward adds per-sequence
// storage of the chunk start states and Vn: nch * (Kp*Vp + 64*Vp) floats per thread.

namespace flashqla_cpu {
namespace FQ_NS {

typedef float vf __attribute__((vector_size(FQ_VW * 4)));
typedef int32_t vi __attribute__((vector_size(FQ_VW * 4)));
static constexpr int VW = FQ_VW;
static constexpr int NVMAX = FQ_NVMAX;
static constexpr int MR = 4;   // rows per micro-tile
static constexpr int C = CH;   // chunk
static constexpr int PADN = 16;

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }
static inline int rup(int x, int m) { return (x + m - 1) / m * m; }

static inline vf vld(const float* p) { vf x; __builtin_memcpy(&x, p, sizeof(vf)); return x; }
static inline void vst(float* p, vf x) { __builtin_memcpy(p, &x, sizeof(vf)); }
static inline vf vset(float a) { vf x = {}; return x + a; }
static inline vf vsel(vi m, vf a, vf b) {  // m ? a : b  (m lanes all-ones or zero)
  vi ia, ib;
  __builtin_memcpy(&ia, &a, sizeof(vf));
  __builtin_memcpy(&ib, &b, sizeof(vf));
  vi r = (ia & m) | (ib & ~m);
  vf out;
  __builtin_memcpy(&out, &r, sizeof(vf));
  return out;
}

// exp for fp32 lanes: Cody-Waite reduction + degree-6 polynomial (~1 ulp); x < -87.3 gives exactly 0.
static inline vf vexp(vf x) {
  const vf lo = vset(-87.3f), hi = vset(88.3f);
  vi under = x < lo;
  x = vsel(under, lo, x);
  x = vsel(x > hi, hi, x);
  vf t = x * 1.44269504088896341f + 12582912.0f;  // round(x / ln2) via the 1.5*2^23 trick
  vf n = t - 12582912.0f;
  vf r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vf p = vset(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  vf y = p * (r * r) + r + 1.0f;
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf s;
  __builtin_memcpy(&s, &e, sizeof(vf));
  return vsel(under, vset(0.f), y * s);
}

static inline float sexp(float x) {
  vf v = vexp(vset(x));
  return v[0];
}

// ---------------------------------------------------------------------------------------------------
// GEMM: C[M,N] = alpha * A[M,Kd] B[Kd,N] + beta * C, row-major, M % 4 == 0, N % VW == 0.
// tri: the A operand is known lower (A[i,p] = 0 for p > i) or upper (A[i,p] = 0 for p < i)
// triangular, so the inner range of each 4-row tile is cut accordingly.  out_lower: only the lower
// triangle (j <= i, to vector granularity) of C is needed; entries right of it are left unwritten.
enum { TRI_NONE = 0, TRI_LOWER = 1, TRI_UPPER = 2 };

template <int NV>
static inline void micro(int p0, int p1, const float* __restrict A, int lda, const float* __restrict B,
                         int ldb, float* __restrict Cm, int ldc, float alpha, float beta) {
  vf c0[NV], c1[NV], c2[NV], c3[NV];
#pragma GCC unroll 4
  for (int j = 0; j < NV; ++j) c0[j] = c1[j] = c2[j] = c3[j] = vset(0.f);
  const float* a0 = A;
  const float* a1 = A + lda;
  const float* a2 = A + 2 * lda;
  const float* a3 = A + 3 * lda;
  for (int p = p0; p < p1; ++p) {
    const float* b = B + (ptrdiff_t)p * ldb;
    vf bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = vld(b + j * VW);
    vf x0 = vset(a0[p]), x1 = vset(a1[p]), x2 = vset(a2[p]), x3 = vset(a3[p]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      c0[j] += x0 * bv[j];
      c1[j] += x1 * bv[j];
      c2[j] += x2 * bv[j];
      c3[j] += x3 * bv[j];
    }
  }
  vf* rows[4] = {c0, c1, c2, c3};
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    float* c = Cm + (ptrdiff_t)i * ldc;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      vf r = rows[i][j] * alpha;
      if (beta != 0.f) r += vld(c + j * VW) * beta;
      vst(c + j * VW, r);
    }
  }
}

static void gemm(int M, int N, int Kd, const float* A, int lda, const float* B, int ldb, float* Cm, int ldc,
                 float alpha, float beta, int tri = TRI_NONE, bool out_lower = false) {
  constexpr int NR = NVMAX * VW;
  for (int j0 = 0; j0 < N; j0 += NR) {
    const int nvb = imin(NVMAX, (N - j0) / VW);
    for (int i0 = 0; i0 < M; i0 += MR) {
      int nv = nvb;
      if (out_lower) {
        const int need = i0 + MR - j0;  // columns [j0, i0+MR) are needed
        if (need <= 0) continue;
        nv = imin(nv, (need + VW - 1) / VW);
      }
      int p0 = 0, p1 = Kd;
      if (tri == TRI_LOWER) p1 = imin(Kd, i0 + MR);
      else if (tri == TRI_UPPER) p0 = imin(Kd, i0);
      const float* a = A + (ptrdiff_t)i0 * lda;
      float* c = Cm + (ptrdiff_t)i0 * ldc + j0;
      const float* b = B + j0;
      switch (nv) {
        case 1: micro<1>(p0, p1, a, lda, b, ldb, c, ldc, alpha, beta); break;
#if FQ_NVMAX >= 2
        case 2: micro<2>(p0, p1, a, lda, b, ldb, c, ldc, alpha, beta); break;
#endif
#if FQ_NVMAX >= 3
        case 3: micro<3>(p0, p1, a, lda, b, ldb, c, ldc, alpha, beta); break;
#endif
#if FQ_NVMAX >= 4
        case 4: micro<4>(p0, p1, a, lda, b, ldb, c, ldc, alpha, beta); break;
#endif
        default: break;
      }
    }
  }
}

// dst[j*ldd + i] = src[i*lds + j] * (rowscale ? rowscale[i] : 1), i < M, j < N; M, N multiples of VW.
// VW x VW tiles are transposed in registers by log2(VW) butterfly stages of two-input shuffles
// (vpermt2ps on AVX-512), instead of VW*VW strided scalar stores.
#if defined(__clang__)
static void transpose(int M, int N, const float* src, int lds, float* dst, int ldd,
                      const float* rowscale = nullptr) {
  for (int i = 0; i < M; ++i) {
    const float s = rowscale ? rowscale[i] : 1.f;
    for (int j = 0; j < N; ++j) dst[(ptrdiff_t)j * ldd + i] = src[(ptrdiff_t)i * lds + j] * s;
  }
}
#else
// Shuffle masks as constant data (a constexpr table, so no dynamic initialiser runs ISA code at load).
struct TransposeMasks {
  int32_t lo[4][VW], hi[4][VW];  // per stage (block size 1, 2, 4, 8)
};
static constexpr TransposeMasks make_masks() {
  TransposeMasks t{};
  int st = 0;
  for (int b = 1; b < VW; b *= 2, ++st) {
    for (int l = 0; l < VW; ++l) {
      // lo: lanes with (l & b) take the second row's lane l-b, others the first's lane l;
      // hi: lanes with (l & b) take the second row's lane l, others the first's lane l+b.
      t.lo[st][l] = (l & b) ? VW + (l - b) : l;
      t.hi[st][l] = (l & b) ? VW + l : l + b;
    }
  }
  return t;
}
static constexpr TransposeMasks kTM = make_masks();

static inline void tile_transpose(vf* r) {
  int st = 0;
#pragma GCC unroll 4
  for (int b = 1; b < VW; b *= 2, ++st) {
    vi mlo, mhi;
    __builtin_memcpy(&mlo, kTM.lo[st], sizeof(vi));
    __builtin_memcpy(&mhi, kTM.hi[st], sizeof(vi));
#pragma GCC unroll 16
    for (int i = 0; i < VW; ++i) {
      if (i & b) continue;
      const vf a = r[i], c = r[i + b];
      r[i] = __builtin_shuffle(a, c, mlo);
      r[i + b] = __builtin_shuffle(a, c, mhi);
    }
  }
}

static void transpose(int M, int N, const float* src, int lds, float* dst, int ldd,
                      const float* rowscale = nullptr) {
  vf r[VW];
  for (int i0 = 0; i0 < M; i0 += VW) {
    for (int j0 = 0; j0 < N; j0 += VW) {
      for (int i = 0; i < VW; ++i) {
        r[i] = vld(src + (ptrdiff_t)(i0 + i) * lds + j0);
        if (rowscale) r[i] *= rowscale[i0 + i];
      }
      tile_transpose(r);
      for (int j = 0; j < VW; ++j) vst(dst + (ptrdiff_t)(j0 + j) * ldd + i0, r[j]);
    }
  }
}
#endif

static inline float vhsum(vf x) {
  float s = 0.f;
  for (int i = 0; i < VW; ++i) s += x[i];
  return s;
}

// sum a[i] b[i], n a multiple of VW
static inline float vdot(const float* a, const float* b, int n) {
  vf acc0 = vset(0.f), acc1 = vset(0.f);
  int i = 0;
  for (; i + 2 * VW <= n; i += 2 * VW) {
    acc0 += vld(a + i) * vld(b + i);
    acc1 += vld(a + i + VW) * vld(b + i + VW);
  }
  for (; i < n; i += VW) acc0 += vld(a + i) * vld(b + i);
  return vhsum(acc0 + acc1);
}

// ---------------------------------------------------------------------------------------------------
// Scratch layout (floats, every buffer 64-byte aligned relative to the 64-byte aligned base).
struct WS {
  int Kp, Vp, ldX;
  float *kq;   // [2C, Kp]: k rows 0..Lr, q rows Lr..2Lr (normalised when l2norm)
  float *vb;   // [C, Vp] raw v
  float *X;    // [C, ldX]: beta*Gamma*k | beta*v
  float *WU;   // [C, ldX]: W | U (U overwritten by Vn in the forward)
  float *kT;   // [Kp, C]
  float *KK, *QK, *D, *Am, *Tm, *P;  // [C, C]
  float *gq;   // [C, Kp] Gamma*q (forward)
  float *Y;    // [C, Vp]
  float *kdT;  // [Kp, C] (lambda*k)^T
  float *S;    // [Kp, Vp] running state (forward) / start state copy
  float *gam, *lam, *bet, *tmp;  // [C]
  double *Gd;  // [C]
  // backward only
  float *TmT, *PT, *dP, *dPm, *dTm, *M1, *dA, *Acat;  // [C, C] (Acat [C, 2C])
  float *DOV;   // [2C, Vp]: dO rows 0..Lr, dVn rows Lr..2Lr
  float *S0T, *dS, *dS1T;  // [Vp, Kp], [Kp, Vp], [Vp, Kp]
  float *VnT;   // [Vp, C]
  float *Kd;    // [C, Kp]
  float *Z;     // [2C, Kp]
  float *dKd;   // [C, Kp]
  float *AT;    // [Kp, 2C]
  float *dWU, *XT, *dX;  // [C, ldX], [ldX, C], [C, ldX]
  float *dqb, *dkb;      // [C, Kp]
  float *rowsum, *colsum, *dG, *dbet;  // [C]
};

static size_t carve(WS* w, float* base, int K, int V) {
  const int Kp = rup(imax(K, 1), PADN), Vp = rup(imax(V, 1), PADN), ldX = Kp + Vp;
  size_t off = 0;
  auto take = [&](size_t n) -> float* {
    float* p = base ? base + off : nullptr;
    off += (n + 15) / 16 * 16;
    return p;
  };
  WS t;
  t.Kp = Kp; t.Vp = Vp; t.ldX = ldX;
  t.kq = take(2 * C * Kp); t.vb = take(C * Vp); t.X = take(C * ldX); t.WU = take(C * ldX);
  t.kT = take(Kp * C);
  t.KK = take(C * C); t.QK = take(C * C); t.D = take(C * C); t.Am = take(C * C); t.Tm = take(C * C);
  t.P = take(C * C);
  t.gq = take(C * Kp); t.Y = take(C * Vp); t.kdT = take(Kp * C); t.S = take((size_t)Kp * Vp);
  t.gam = take(C); t.lam = take(C); t.bet = take(C); t.tmp = take(C);
  t.Gd = reinterpret_cast<double*>(take(2 * C));
  t.TmT = take(C * C); t.PT = take(C * C); t.dP = take(C * C); t.dPm = take(C * C); t.dTm = take(C * C);
  t.M1 = take(C * C); t.dA = take(C * C); t.Acat = take(2 * C * C);
  t.DOV = take(2 * C * Vp); t.S0T = take((size_t)Vp * Kp); t.dS = take((size_t)Kp * Vp);
  t.dS1T = take((size_t)Vp * Kp); t.VnT = take(Vp * C); t.Kd = take(C * Kp); t.Z = take(2 * C * Kp);
  t.dKd = take(C * Kp); t.AT = take(Kp * 2 * C); t.dWU = take(C * ldX); t.XT = take(ldX * C);
  t.dX = take(C * ldX); t.dqb = take(C * Kp); t.dkb = take(C * Kp);
  t.rowsum = take(C); t.colsum = take(C); t.dG = take(C); t.dbet = take(C);
  if (w) *w = t;
  return off;
}

static size_t ws_floats(int K, int V) { return carve(nullptr, nullptr, K, V); }

static size_t seq_floats(int K, int V, int64_t nch) {
  const int Kp = rup(imax(K, 1), PADN), Vp = rup(imax(V, 1), PADN);
  return (size_t)nch * ((size_t)Kp * Vp + (size_t)C * Vp);
}

// ---------------------------------------------------------------------------------------------------
// Chunk preparation shared by forward and backward: loads the chunk [t0, t0+L) of head h, builds
// k/q (normalised), v, G, Gamma, lambda, beta, kT, KK, QK, D, A, Tm, P and X.  Returns Gamma_C.
static float prep_chunk(const Problem& pb, const WS& w, int h, int hq, int64_t t0, int L, int Lr,
                        bool need_qk) {
  const int K = pb.K, V = pb.V, Kp = w.Kp, Vp = w.Vp, ldX = w.ldX;
  float* kb = w.kq;
  float* qb = w.kq + (ptrdiff_t)Lr * Kp;
  double g_acc = 0.0;
  for (int r = 0; r < Lr; ++r) {
    float* kr = kb + (ptrdiff_t)r * Kp;
    float* qr = qb + (ptrdiff_t)r * Kp;
    float* vr = w.vb + (ptrdiff_t)r * Vp;
    if (r < L) {
      const int64_t tok = t0 + r;
      load_row(pb.k, pb.dt_qkv, (tok * pb.Hqk + hq) * K, K, kr);
      load_row(pb.q, pb.dt_qkv, (tok * pb.Hqk + hq) * K, K, qr);
      load_row(pb.v, pb.dt_qkv, (tok * pb.Hv + h) * V, V, vr);
      for (int i = K; i < Kp; ++i) kr[i] = qr[i] = 0.f;
      for (int i = V; i < Vp; ++i) vr[i] = 0.f;
      if (pb.l2norm) {
        float sk = 0.f, sq = 0.f;
        for (int i = 0; i < K; ++i) { sk += kr[i] * kr[i]; sq += qr[i] * qr[i]; }
        const float rk = 1.f / std::sqrt(sk + 1e-6f), rq = 1.f / std::sqrt(sq + 1e-6f);
        for (int i = 0; i < K; ++i) { kr[i] *= rk; qr[i] *= rq; }
      }
      g_acc += (double)load_elem(pb.g, pb.dt_g, tok * pb.Hv + h);
      w.bet[r] = load_elem(pb.beta, pb.dt_beta, tok * pb.Hv + h);
    } else {
      for (int i = 0; i < Kp; ++i) kr[i] = qr[i] = 0.f;
      for (int i = 0; i < Vp; ++i) vr[i] = 0.f;
      w.bet[r] = 0.f;
    }
    w.Gd[r] = g_acc;  // padded rows keep G_{L-1}: zero-gate no-op tokens
  }
  const double GC = w.Gd[L - 1];
  for (int r = 0; r < Lr; ++r) {
    w.tmp[r] = (float)w.Gd[r];
    w.lam[r] = (float)(GC - w.Gd[r]);
  }
  for (int r = 0; r < Lr; r += VW) {
    vst(w.gam + r, vexp(vld(w.tmp + r)));
    vst(w.lam + r, vexp(vld(w.lam + r)));
  }
  const float gammaC = sexp((float)GC);

  // X = [beta*Gamma*k | beta*v]
  for (int r = 0; r < Lr; ++r) {
    const float bg = w.bet[r] * w.gam[r], b = w.bet[r];
    const float* kr = kb + (ptrdiff_t)r * Kp;
    const float* vr = w.vb + (ptrdiff_t)r * Vp;
    float* xr = w.X + (ptrdiff_t)r * ldX;
    for (int i = 0; i < Kp; ++i) xr[i] = bg * kr[i];
    for (int i = 0; i < Vp; ++i) xr[Kp + i] = b * vr[i];
  }

  transpose(Lr, Kp, kb, Kp, w.kT, C);
  gemm(Lr, Lr, Kp, kb, Kp, w.kT, C, w.KK, C, 1.f, 0.f, TRI_NONE, true);
  if (need_qk) gemm(Lr, Lr, Kp, qb, Kp, w.kT, C, w.QK, C, 1.f, 0.f, TRI_NONE, true);

  // D[r, j] = exp(G_r - G_j) for j <= r (difference taken in double), 0 above the diagonal.
  for (int r = 0; r < Lr; ++r) {
    const double Gr = w.Gd[r];
    float* dr = w.D + (ptrdiff_t)r * C;
    for (int j = 0; j < Lr; ++j) dr[j] = j <= r ? (float)(Gr - w.Gd[j]) : -1000.f;
    for (int j = 0; j < Lr; j += VW) vst(dr + j, vexp(vld(dr + j)));
  }
  // A (strictly lower) and P (lower incl), full rows written
  for (int r = 0; r < Lr; ++r) {
    const float* dr = w.D + (ptrdiff_t)r * C;
    const float* kk = w.KK + (ptrdiff_t)r * C;
    float* ar = w.Am + (ptrdiff_t)r * C;
    const float b = w.bet[r];
    for (int j = 0; j < Lr; ++j) ar[j] = j < r ? b * kk[j] * dr[j] : 0.f;
    if (need_qk) {
      const float* qk = w.QK + (ptrdiff_t)r * C;
      float* pr = w.P + (ptrdiff_t)r * C;
      for (int j = 0; j < Lr; ++j) pr[j] = j <= r ? qk[j] * dr[j] : 0.f;
    }
  }
  // Tm = (I + A)^-1 by forward substitution on rows: Tm_r = e_r - sum_{j<r} A[r,j] Tm_j
  for (int r = 0; r < Lr; ++r) {
    float* tr = w.Tm + (ptrdiff_t)r * C;
    const float* ar = w.Am + (ptrdiff_t)r * C;
    for (int j = 0; j < Lr; ++j) tr[j] = 0.f;
    tr[r] = 1.f;
    for (int j = 0; j < r; ++j) {
      const vf a = vset(ar[j]);
      const float* tj = w.Tm + (ptrdiff_t)j * C;
      // Tm row j is zero right of its diagonal, so whole vectors up to rup(j+1, VW) are exact
      for (int c = 0; c <= j; c += VW) vst(tr + c, vld(tr + c) - a * vld(tj + c));
    }
  }
  return gammaC;
}

static void load_state(const float* src, const WS& w, int K, int V, float* dst) {
  const int Vp = w.Vp;
  std::memset(dst, 0, sizeof(float) * (size_t)w.Kp * Vp);
  if (!src) return;
  for (int i = 0; i < K; ++i) std::memcpy(dst + (ptrdiff_t)i * Vp, src + (ptrdiff_t)i * V, sizeof(float) * V);
}

static void store_state(const float* src, const WS& w, int K, int V, float* dst) {
  for (int i = 0; i < K; ++i) std::memcpy(dst + (ptrdiff_t)i * V, src + (ptrdiff_t)i * w.Vp, sizeof(float) * V);
}

// State pass over all chunks of (n, h).  mode 0: forward (writes o, ht).  mode 1: backward pass 1
// (stores each chunk's start state and Vn into seqbuf).
static void run_chunks(const Problem& pb, int n, int h, float* ws, float* seqbuf, int mode) {
  WS w;
  carve(&w, ws, pb.K, pb.V);
  const int K = pb.K, V = pb.V, Kp = w.Kp, Vp = w.Vp, ldX = w.ldX;
  const int hq = h / (pb.Hv / pb.Hqk);
  const int64_t bos = pb.cu[n], eos = pb.cu[n + 1];
  const size_t sKV = (size_t)K * V;
  load_state(pb.h0 ? pb.h0 + ((size_t)n * pb.Hv + h) * sKV : nullptr, w, K, V, w.S);
  int c = 0;
  for (int64_t t0 = bos; t0 < eos; t0 += C, ++c) {
    const int L = (int)((eos - t0) < C ? (eos - t0) : C);
    const int Lr = rup(L, PADN);
    const bool fwd = mode == 0;
    const float gammaC = prep_chunk(pb, w, h, hq, t0, L, Lr, fwd);
    float* Vn = w.WU + Kp;  // [Lr, Vp] with ld ldX
    // [W | U] = Tm X
    gemm(Lr, ldX, Lr, w.Tm, C, w.X, ldX, w.WU, ldX, 1.f, 0.f, TRI_LOWER);
    if (mode == 1) {
      float* st = seqbuf + (size_t)c * ((size_t)Kp * Vp + (size_t)C * Vp);
      std::memcpy(st, w.S, sizeof(float) * (size_t)Kp * Vp);
    }
    if (fwd) {
      // Gamma*q, then Y = (Gamma q) S0
      const float* qb = w.kq + (ptrdiff_t)Lr * Kp;
      for (int r = 0; r < Lr; ++r)
        for (int i = 0; i < Kp; ++i) w.gq[r * Kp + i] = w.gam[r] * qb[r * Kp + i];
      gemm(Lr, Vp, Kp, w.gq, Kp, w.S, Vp, w.Y, Vp, 1.f, 0.f);
    }
    // Vn = U - W S0 (in place over U)
    gemm(Lr, Vp, Kp, w.WU, ldX, w.S, Vp, Vn, ldX, -1.f, 1.f);
    if (fwd) {
      gemm(Lr, Vp, Lr, w.P, C, Vn, ldX, w.Y, Vp, 1.f, 1.f, TRI_LOWER);
      for (int r = 0; r < L; ++r)
        store_row(pb.o, pb.dt_qkv, ((t0 + r) * pb.Hv + h) * V, V, w.Y + (ptrdiff_t)r * Vp, pb.scale);
    } else {
      float* vs = seqbuf + (size_t)c * ((size_t)Kp * Vp + (size_t)C * Vp) + (size_t)Kp * Vp;
      for (int r = 0; r < Lr; ++r) std::memcpy(vs + (ptrdiff_t)r * Vp, Vn + (ptrdiff_t)r * ldX, sizeof(float) * Vp);
    }
    // S = Gamma_C S + (lambda k)^T Vn
    transpose(Lr, Kp, w.kq, Kp, w.kdT, C, w.lam);
    gemm(Kp, Vp, Lr, w.kdT, C, Vn, ldX, w.S, Vp, 1.f, gammaC);
  }
  if (mode == 0 && pb.ht) store_state(w.S, w, K, V, pb.ht + ((size_t)n * pb.Hv + h) * sKV);
}

static void fwd_item(const Problem& pb, int n, int h, float* ws) { run_chunks(pb, n, h, ws, nullptr, 0); }

// ---------------------------------------------------------------------------------------------------
// Backward of one chunk, given dS (gradient w.r.t. the state after the chunk), turned in place into
// the gradient w.r.t. the chunk's start state.  Derivation (per chunk, s = scale):
//   from O:   dS0 += s (Gq)^T dO;  d(Gq) = s dO S0^T;  dP = s dO Vn^T;  dVn += s P^T dO
//   from S1:  dS0 += Gamma_C dS1;  dGamma_C = <S0, dS1>;  dKd = Vn dS1^T;  dVn += Kd dS1
//   Vn:       dU = dVn;  dW = -dVn S0^T;  dS0 -= W^T dVn
//   [W|U]=TmX: dTm = [dW|dU] X^T;  dX = Tm^T [dW|dU];  dA = -Tm^T dTm Tm^T (strictly lower part)
//   A:        dbeta_r += sum_j dA KK D;  dKK = dA o beta_r D -> dk += (dKK + dKK^T) k;  dG += rows-cols of dA o A
//   P:        dPm = dP o D -> dq += dPm k, dk += dPm^T q;  dG += rows-cols of dP o P
//   gates:    dG_r += Gamma_r dGamma_r - lambda_r dlambda_r;  dG_C += Gamma_C dGamma_C + sum lambda dlambda
//   g:        dg = reverse cumsum of dG within the chunk.
static void bwd_chunk(const Problem& pb, const WS& w, int h, int hq, int64_t t0, int L, const float* S0,
                      const float* Vn) {
  const int K = pb.K, V = pb.V, Kp = w.Kp, Vp = w.Vp, ldX = w.ldX;
  const int Lr = rup(L, PADN);
  const float s = pb.scale;
  const float gammaC = prep_chunk(pb, w, h, hq, t0, L, Lr, true);
  const float* kb = w.kq;
  const float* qb = w.kq + (ptrdiff_t)Lr * Kp;
  // W = Tm (beta Gamma k)
  gemm(Lr, Kp, Lr, w.Tm, C, w.X, ldX, w.WU, ldX, 1.f, 0.f, TRI_LOWER);
  // dO
  float* dO = w.DOV;
  float* dVn = w.DOV + (ptrdiff_t)Lr * Vp;
  for (int r = 0; r < Lr; ++r) {
    float* d = dO + (ptrdiff_t)r * Vp;
    if (r < L) {
      load_row(pb.dout, pb.dt_qkv, ((t0 + r) * pb.Hv + h) * V, V, d);
      for (int i = V; i < Vp; ++i) d[i] = 0.f;
    } else {
      for (int i = 0; i < Vp; ++i) d[i] = 0.f;
    }
  }
  // Kd = lambda k
  for (int r = 0; r < Lr; ++r)
    for (int i = 0; i < Kp; ++i) w.Kd[r * Kp + i] = w.lam[r] * kb[r * Kp + i];
  // dVn = Kd dS1 + s P^T dO
  gemm(Lr, Vp, Kp, w.Kd, Kp, w.dS, Vp, dVn, Vp, 1.f, 0.f);
  transpose(Lr, Lr, w.P, C, w.PT, C);
  gemm(Lr, Vp, Lr, w.PT, C, dO, Vp, dVn, Vp, s, 1.f, TRI_UPPER);
  // dP = s dO Vn^T (lower)
  transpose(Lr, Vp, Vn, Vp, w.VnT, C);
  gemm(Lr, Lr, Vp, dO, Vp, w.VnT, C, w.dP, C, s, 0.f, TRI_NONE, true);
  // Z = [dO; dVn] S0^T
  transpose(Kp, Vp, S0, Vp, w.S0T, Kp);
  gemm(2 * Lr, Kp, Vp, w.DOV, Vp, w.S0T, Kp, w.Z, Kp, 1.f, 0.f);
  // dKd = Vn dS1^T
  transpose(Kp, Vp, w.dS, Vp, w.dS1T, Kp);
  gemm(Lr, Kp, Vp, Vn, Vp, w.dS1T, Kp, w.dKd, Kp, 1.f, 0.f);
  // dGamma_C = <S0, dS1>
  double dgamC = 0.0;
  for (int i = 0; i < Kp; ++i) dgamC += vdot(S0 + (ptrdiff_t)i * Vp, w.dS + (ptrdiff_t)i * Vp, Vp);
  // dS0 = Gamma_C dS1 + [s (Gamma q)^T | -W^T] [dO; dVn]
  const int ldAT = 2 * C;
  for (int r = 0; r < Lr; ++r) { w.tmp[r] = s * w.gam[r]; w.rowsum[r] = -1.f; }
  transpose(Lr, Kp, qb, Kp, w.AT, ldAT, w.tmp);
  transpose(Lr, Kp, w.WU, ldX, w.AT + Lr, ldAT, w.rowsum);
  gemm(Kp, Vp, 2 * Lr, w.AT, ldAT, w.DOV, Vp, w.dS, Vp, 1.f, gammaC);
  // [dW | dU] = [-Z2 | dVn]
  const float* Z1 = w.Z;
  const float* Z2 = w.Z + (ptrdiff_t)Lr * Kp;
  for (int r = 0; r < Lr; ++r) {
    float* d = w.dWU + (ptrdiff_t)r * ldX;
    for (int i = 0; i < Kp; ++i) d[i] = -Z2[r * Kp + i];
    std::memcpy(d + Kp, dVn + (ptrdiff_t)r * Vp, sizeof(float) * Vp);
  }
  // dTm = [dW|dU] X^T (strictly lower part used); dX = Tm^T [dW|dU]
  transpose(Lr, ldX, w.X, ldX, w.XT, C);
  gemm(Lr, Lr, ldX, w.dWU, ldX, w.XT, C, w.dTm, C, 1.f, 0.f, TRI_NONE, true);
  transpose(Lr, Lr, w.Tm, C, w.TmT, C);
  gemm(Lr, ldX, Lr, w.TmT, C, w.dWU, ldX, w.dX, ldX, 1.f, 0.f, TRI_UPPER);
  // dA = -Tm^T (dTm_strict) Tm^T
  for (int r = 0; r < Lr; ++r) {
    float* d = w.dTm + (ptrdiff_t)r * C;
    for (int j = 0; j < Lr; ++j) d[j] = j < r ? d[j] : 0.f;
  }
  gemm(Lr, Lr, Lr, w.dTm, C, w.TmT, C, w.M1, C, 1.f, 0.f, TRI_LOWER);
  gemm(Lr, Lr, Lr, w.TmT, C, w.M1, C, w.dA, C, -1.f, 0.f, TRI_UPPER, true);

  // Elementwise terms on the chunk's L x L triangles.
  for (int r = 0; r < Lr; ++r) { w.rowsum[r] = 0.f; w.colsum[r] = 0.f; w.dbet[r] = 0.f; }
  const int ldA = 2 * C;
  for (int r = 0; r < Lr; ++r) {
    const float* dar = w.dA + (ptrdiff_t)r * C;
    const float* ar = w.Am + (ptrdiff_t)r * C;
    const float* kkr = w.KK + (ptrdiff_t)r * C;
    const float* dr = w.D + (ptrdiff_t)r * C;
    const float* dpr = w.dP + (ptrdiff_t)r * C;
    const float* pr = w.P + (ptrdiff_t)r * C;
    float* bmr = w.M1 + (ptrdiff_t)r * C;  // M1 reused: Bm = dA o beta_r D (strictly lower)
    float* dpmr = w.dPm + (ptrdiff_t)r * C;
    const float b = w.bet[r];
    float rs = 0.f, db = 0.f;
    for (int j = 0; j < Lr; ++j) {
      const bool strict = j < r, incl = j <= r;
      const float da = strict ? dar[j] : 0.f;
      const float ma = da * ar[j];
      db += strict ? da * kkr[j] * dr[j] : 0.f;
      bmr[j] = da * b * dr[j];
      const float dp = incl ? dpr[j] : 0.f;
      dpmr[j] = dp * dr[j];
      const float mp = dp * pr[j];
      rs += ma + mp;
      w.colsum[j] += ma + mp;
    }
    w.rowsum[r] = rs;
    w.dbet[r] = db;
  }
  // Acat = [Bm + Bm^T | dPm^T]
  for (int r = 0; r < Lr; ++r) {
    float* a = w.Acat + (ptrdiff_t)r * ldA;
    for (int j = 0; j < Lr; ++j) {
      a[j] = w.M1[r * C + j] + w.M1[j * C + r];
      a[Lr + j] = w.dPm[j * C + r];
    }
  }
  // dk = [Bsym | dPm^T] [k; q],  dq = dPm k
  gemm(Lr, Kp, 2 * Lr, w.Acat, ldA, w.kq, Kp, w.dkb, Kp, 1.f, 0.f);
  gemm(Lr, Kp, Lr, w.dPm, C, kb, Kp, w.dqb, Kp, 1.f, 0.f, TRI_LOWER);

  // Per-row terms and the gate gradients.
  double dGC = (double)gammaC * dgamC;
  for (int r = 0; r < L; ++r) {
    const float* qr = qb + (ptrdiff_t)r * Kp;
    const float* kr = kb + (ptrdiff_t)r * Kp;
    const float* vr = w.vb + (ptrdiff_t)r * Vp;
    const float* z1 = Z1 + (ptrdiff_t)r * Kp;
    const float* dkd = w.dKd + (ptrdiff_t)r * Kp;
    const float* dxk = w.dX + (ptrdiff_t)r * ldX;
    const float* dxv = dxk + Kp;
    float* dq = w.dqb + (ptrdiff_t)r * Kp;
    float* dk = w.dkb + (ptrdiff_t)r * Kp;
    const float g_ = w.gam[r], l_ = w.lam[r], b_ = w.bet[r];
    const float sg = s * g_, bg = b_ * g_;
    const float qz = vdot(qr, z1, Kp), kdk = vdot(kr, dkd, Kp), kx = vdot(kr, dxk, Kp);
    const float vx = vdot(vr, dxv, Vp);
    for (int i = 0; i < Kp; i += VW) {
      vst(dq + i, vld(dq + i) + sg * vld(z1 + i));
      vst(dk + i, vld(dk + i) + l_ * vld(dkd + i) + bg * vld(dxk + i));
    }
    const float dgam = s * qz + b_ * kx;
    const float dlam = kdk;
    w.dG[r] = w.rowsum[r] - w.colsum[r] + g_ * dgam - l_ * dlam;
    dGC += (double)l_ * dlam;
    w.dbet[r] += g_ * kx + vx;
    // outputs of this token
    const int64_t tok = t0 + r;
    float* oq = pb.dq_acc + (tok * pb.Hv + h) * K;
    float* ok = pb.dk_acc + (tok * pb.Hv + h) * K;
    std::memcpy(oq, dq, sizeof(float) * K);
    std::memcpy(ok, dk, sizeof(float) * K);
    store_row(pb.dv, pb.dt_qkv, (tok * pb.Hv + h) * V, V, dxv, b_);
    store_elem(pb.dbeta, pb.dt_beta, tok * pb.Hv + h, w.dbet[r]);
  }
  w.dG[L - 1] += (float)dGC;
  double acc = 0.0;
  for (int r = L - 1; r >= 0; --r) {
    acc += w.dG[r];
    store_elem(pb.dg, pb.dt_g, (t0 + r) * pb.Hv + h, (float)acc);
  }
}

static void bwd_item(const Problem& pb, int n, int h, float* ws, float* seqbuf) {
  WS w;
  carve(&w, ws, pb.K, pb.V);
  const int K = pb.K, V = pb.V, Kp = w.Kp, Vp = w.Vp;
  const int hq = h / (pb.Hv / pb.Hqk);
  const int64_t bos = pb.cu[n], eos = pb.cu[n + 1];
  const size_t sKV = (size_t)K * V;
  const int64_t nch = (eos - bos + C - 1) / C;
  if (nch > 0) run_chunks(pb, n, h, ws, seqbuf, 1);
  load_state(pb.dht ? pb.dht + ((size_t)n * pb.Hv + h) * sKV : nullptr, w, K, V, w.dS);
  const size_t stride = (size_t)Kp * Vp + (size_t)C * Vp;
  for (int64_t c = nch - 1; c >= 0; --c) {
    const int64_t t0 = bos + c * C;
    const int L = (int)((eos - t0) < C ? (eos - t0) : C);
    const float* S0 = seqbuf + (size_t)c * stride;
    const float* Vn = S0 + (size_t)Kp * Vp;
    bwd_chunk(pb, w, h, hq, t0, L, S0, Vn);
  }
  if (pb.dh0) store_state(w.dS, w, K, V, pb.dh0 + ((size_t)n * pb.Hv + h) * sKV);
}

extern const KernelTable table;
const KernelTable table = {FQ_NAME, ws_floats, seq_floats, fwd_item, bwd_item};

}  // namespace FQ_NS
}  // namespace flashqla_cpu
