"""Forward stage 1 (Hopper): everything that is local to one 64-token chunk.

Grid: ``(total_chunks, Hv)``, 128 threads (one warpgroup), no loop.  CTA ``(c, h)`` takes chunk ``c``
(``chunk_indices[c] = (sequence n, chunk i of n)``, rows ``bos = cu[n] + 64 i`` .. ``min(bos + 64,
cu[n+1])``) of value head ``h``; its query/key head is ``h // ratio`` (GVA, indexed in the kernel).

Per CTA, with rows past the sequence end treated as ``g = beta = 0`` (they then drop out exactly):

1. TMA loads of the k tile ``[64, K]`` and the v tile ``[64, V]``; g and beta (any float dtype) go to
   shared memory as fp32 through predicated loads.
2. ``G = cumsum(g)`` (fp32, in shared memory).
3. ``KK = k k^T`` (wgmma, fp32 accumulators).  With the fused L2 norm the row factors
   ``n_r = rsqrt(|k_r|^2 + 1e-6)`` come from KK's diagonal, and are applied to fp32 products only, so
   the normalised k is never rounded to 16 bits.
4. ``A[r, j] = beta_r n_r n_j KK[r, j] exp(G_r - G_j)`` for ``j < r`` (only differences of G are
   exponentiated: finite for any decay, also ``g = -1e4``), stored row-major in shared memory.
5. ``X = (I + A)^-1`` in fp32 on the CUDA cores, blocked (see below), every thread busy.
6. ``w = (X diag(beta exp(G) n)) k`` and ``u = (X diag(beta)) v``: the column scalings are folded into
   two 16-bit copies of X, so k and v enter the wgmma unmodified (one rounding fewer than scaling k
   and v).  Each product is staged through the shared tile of its own operand (k_s for w, v_s for
   u: the operand is dead once its wgmma finished) and written with TMA.

The inverse (all fp32, exact algebra; ``test_tilelang_intra.py`` replays these steps on the CPU).
Blocks of 16: ``A_ij`` (i, j = 0..3), ``D_b = (I + A_bb)^-1``; halves of 32: ``(0) = blocks 0,1``,
``(1) = blocks 2,3``.  With ``L = [[L11, 0], [L21, L22]]`` unit lower triangular,
``L^-1 = [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]]``, applied twice:

* P1  ``D_b`` by forward substitution: threads 0..63, thread = (block b, column c), 120 FMAs on a
  16-vector in registers (threads 64..127 have nothing to do here; this step is the short one).
* P2a ``Y_p = A_{2p+1,2p} D_2p``           (p = 0, 1: two 16x16x16 products, 4 outputs / thread)
* P2b ``X_{2p+1,2p} = -D_{2p+1} Y_p``        -> the two 32x32 diagonal halves ``X_(0)``, ``X_(1)``
* P3a ``Y = A_(1)(0) X_(0)``                (32x32 by 32; the zero block of X_(0) is skipped)
* P3b ``X_(1)(0) = -X_(1) Y``               (32x32 by 32; the zero block of X_(1) is skipped)

Each of P2a..P3b is a small GEMM in which a thread owns a few rows (warp-uniform, so A / X rows are
broadcast reads, vectorisable to 16 bytes) of one or two columns (lane-dependent, consecutive: no bank
conflict); 8 accumulators at most, ~630 FMAs and ~330 shared loads per thread in all (the former
column-per-thread substitution: 2016 FMAs + 2016 loads on 64 threads, the rest idle).  Intermediates
``Y`` go to the upper triangle of ``A_s`` (zero, never read as A).  ``X_s`` is cleared up front, so
its upper triangle is the exact zero of X (X_out is written whole).  Both fp32 tiles have a row stride
of 72 words: the A rows two neighbouring half-warps broadcast, and the fragment -> A_s stores, fall
in different banks.  A ``__syncthreads`` separates the phases (every phase writes only what no thread
reads in the same phase).

``tb_only`` (the fused inference forward): no v tile, no w / u; step 6 becomes ``Tb = X diag(beta)`` in the
input dtype, ``[NC, Hv, 64, 64]``, and G.  The fused recurrence forms v_new from v, k and Tb itself.  With
``save_x`` as well (the fused training forward, whose backward is the whole-V kernel: it reads X, never w or u)
the CTA also writes X.

Outputs, chunk-major so that stage 2 reads whole tiles with TMA and the padded tail rows of a last
chunk are well defined (zero in w and u, ``G = G_last`` in G): ``w [NC, Hv, 64, K]``, ``u [NC, Hv, 64,
V]`` in the input dtype, ``G [NC, Hv, 64]`` fp32 and, when the backward needs it, ``X [NC, Hv, 64,
64]`` in the input dtype (session 10; it was fp32, but its one reader, the backward's wy kernel, rounds it to
16 bits on load anyway: the same bits, half the bytes).

Budget (bf16/fp16, K = V = 128, ptxas for sm_90a): shared memory k 16 KB, v 16 KB (also the w / u
staging), A 18 KB and X 18 KB (fp32, padded), the two 16-bit X copies 8 KB each (TileLang places them
over the A tile, dead by then), small vectors: 69 KB dynamic + 2 KB static (the cumsum), so three CTAs
per SM; 92 registers per thread, no local memory (the former kernel: 255 registers for its 64-float
substitution column next to the two 64-float accumulators, 66 KB, two CTAs per SM).  With three
CTAs per SM one CTA's TMA loads / stores overlap the other CTAs' arithmetic.
"""


CHUNK = 64
L2_EPS = 1e-6
# Row stride (fp32 words) of the A and X tiles in shared memory (see the module docstring).
PAD = 72
# CTAs per SM of the persistent Tb forms (``persist``): 52 KB of shared memory each
PERSIST_CTAS_PER_SM = 4
# and of the compact Tb forms (``compact``): 35 KB
COMPACT_CTAS_PER_SM = 5


def build_intra(dtype: str, beta_dtype: str, K: int, V: int, l2norm: bool, save_x: bool,
                tb_only: bool = False, scores: bool = False, head_major: bool = False, threads: int = 128,
                hw_ex2: bool = False, compact: bool = False, inv_mma: bool = False, uniform: bool = False,
                persist: bool = False, x_beta: bool = False):
    """``tb_only`` (the fused forward, ``chunk_fwd_ws_sm90`` with ``fused=True``): no v, w or u; the CTA
    writes ``Tb = X diag(beta)`` ``[NC, Hv, 64, 64]`` in the input dtype (the fused recurrence forms
    ``v_new = Tb (v - diag(exp(G) n) k S)`` itself) and ``G``.  Signature
    ``(q, k, g, beta, cu_seqlens, chunk_indices, Tb_out, P_out, G_out, ratio)`` (q and P_out placeholders
    unless ``scores``); ``V`` is unused.  With ``save_x`` (no ``scores``): also ``X`` in the input dtype, signature
    ``(k, g, beta, cu_seqlens, chunk_indices, Tb_out, X_out, G_out, ratio)``.

    ``head_major`` (experimental, ``FLASHQLA_TILELANG_INTRA_ORDER=head``): the grid is ``(Hv, NC)``, so CTAs
    launched together share their chunk and walk the value heads: the ``ratio`` heads of a query/key head
    read the same k tile (an L2 hit after the first) and the gate / beta rows of one chunk are read
    together.  The default ``(NC, Hv)`` puts consecutive chunks of one head side by side.

    ``scores`` (with ``tb_only``; the ws recurrence's ``pscores`` option): the CTA also loads the q tile and
    writes the masked, decayed scores ``P[r, j] = (q k^T)[r, j] nq_r nk_j exp(G_r - G_j)`` (``j <= r``, else 0)
    ``[NC, Hv, 64, 64]`` in the input dtype, so the recurrence does not compute them (once per V-block CTA).

    ``compact`` (with ``tb_only``, no ``scores``; ``FLASHQLA_TILELANG_INTRA_COMPACT=1``, session 20; its GPU test
    passes, but session 23 measured it slower, 0.226 -> 0.299 ms at 16/32 1x32768 on an H100, so it is off): A and
    X are unpadded 64 x 64 fp32 tiles whose columns are XOR-swizzled per row, ``j ^ 8 (r & 3)`` (a
    permutation within each row, applied to every access, so the algebra is unchanged).  The swizzle gives the
    bank spread that the pad of 8 words gave for the inverse's access patterns.  At 16 KB, A then shares the k
    tile's space (k is dead once k k^T is formed) and X shrinks by 2 KB: 33 KB of shared memory instead of 53.  With
    the 96 registers ptxas then gives it (84 before: the swizzle's index arithmetic), five CTAs fit per SM instead of
    four, for a kernel that waits on latency.

    ``inv_mma`` (``FLASHQLA_TILELANG_INTRA_INV=mma``, the default since session 25): step 5 is the device function of
    ``intra_inverse_mma.py`` (the blocked inverse's products as 3xTF32 ``mma.sync`` fragments; ``flq_inv64_mma_sw`` on
    the compact tiles), which also writes X's zero blocks, so X is not cleared first.  Stage 1's shared-memory pipe
    went from 89% to 66% and the Tb form from 0.224 to 0.208 ms at 16/32 1x32768 (H100).

    ``uniform`` (dense calls, ``FLASHQLA_TILELANG_INTRA_UNIFORM``): every sequence has ``T = cu_seqlens[1]`` tokens
    and the chunks are numbered sequence by sequence, so a CTA finds its rows from its chunk number
    (:func:`chunk_bounds`) instead of the chunk table.

    ``persist`` (the Tb forms with ``inv_mma``, ``FLASHQLA_TILELANG_INTRA_PERSIST``, session 25, the default since 26):
    grid ``(nprog, Hv)``, four CTAs per SM (``__launch_bounds__(128, 4)``: 128 registers, 52 KB); CTA ``(p, h)``
    walks chunks ``p, p + nprog, ...`` of value head h, and issues the next chunk's k-tile TMA load and its gate /
    beta loads (into registers) as soon as this chunk's ``k k^T`` has read the k tile, so they fly while A, the
    inverse and Tb are formed.  Tb, X and G go to global memory straight from the X tile (no staging tile).

    ``x_beta`` (with ``tb_only`` and ``save_x``; ``FLASHQLA_TILELANG_TRAIN_XBETA=1``, session 37, off until measured):
    the fused training forward's stage 1 writes X and, in ``Tb_out``'s place, beta chunk-major ``[NC, Hv, 64]`` fp32
    (zero past a sequence's end), not Tb: the recurrence (``build_fwd_ws(x_beta=True)``) forms
    ``v_new = X bf16(diag(beta) Y)`` from them, so each chunk and head writes 8 KB less (X is written for the
    backward anyway).
    """
    import tilelang.language as T

    from ._common import EX2_APPROX_SRC, ex2_approx, symbolic_sizes
    from .intra_inverse_mma import INVERSE_MMA_SRC

    assert threads == 128, "the inverse's thread mapping is written for one warpgroup"
    C = CHUNK
    acc = "float32"
    NT, NC, NS, Hqk, Hv = symbolic_sizes()
    # The X output is only written when the backward needs it; otherwise a tiny placeholder is
    # passed, with its own symbolic sizes.
    XN = NC if save_x else T.dynamic("XN")
    XH = Hv if save_x else T.dynamic("XH")
    LOG2E = 1.4426950408889634
    assert not compact or (tb_only and not scores), "compact: the Tb-only forms without the scores"
    # the device functions a kernel calls, imported as one source (a kernel takes one T.import_source); the w / u
    # form takes exp (no ex2.approx) whatever hw_ex2 says
    extern_src = (EX2_APPROX_SRC if hw_ex2 and tb_only else "") + (INVERSE_MMA_SRC if inv_mma else "")
    has_extern = bool(extern_src)
    assert not persist or (tb_only and inv_mma and not scores and not head_major and not compact), \
        "persist: the padded Tb forms (with or without X) with the tensor-core inverse"
    APAD = C if compact else PAD
    assert not x_beta or (tb_only and save_x), "x_beta: the training Tb form (with X)"
    # Tb_out: Tb, or with x_beta beta chunk-major (see the docstring)
    TB_SHAPE, TB_DT = ((NC, Hv, C), acc) if x_beta else ((NC, Hv, C, C), dtype)

    def sw(r, j):
        # the column of A / X entry (r, j) in its tile: XOR-swizzled when compact (see the docstring)
        return j ^ ((r & 3) * 8) if compact else j

    def ex(x):
        # The Tb-only form (inference) takes the hardware ex2 (~2 ulp; what the recurrence's fastexp uses):
        # accurate expf is some ten instructions, and the 4096 of A (and 4096 of P) per chunk are a large
        # share of this issue-bound kernel's work.  The training form keeps expf (bitwise as before).  T.exp2 is
        # exp2f, MUFU.EX2 inside a subnormal-range test; ``hw_ex2`` (FLASHQLA_TILELANG_EX2=approx, session 16,
        # not yet run on a GPU) takes the instruction alone
        if tb_only and hw_ex2:
            return ex2_approx(x * LOG2E)
        return T.exp2(x * LOG2E) if tb_only else T.exp(x)

    @T.macro
    def form_A(g_s, b_s, n_s, cw_s, A_s, kk_f):
        # step 4 from k k^T in kk_f
        if l2norm:
            for r, j in T.Parallel(C, C):
                if r == j:
                    n_s[r] = T.rsqrt(kk_f[r, j] + L2_EPS)
            for r, j in T.Parallel(C, C):
                kk_f[r, j] = kk_f[r, j] * b_s[r] * n_s[r] * n_s[j] * ex(g_s[r] - g_s[j])
        else:
            for r in T.Parallel(C):
                n_s[r] = 1.0
            for r, j in T.Parallel(C, C):
                kk_f[r, j] = kk_f[r, j] * b_s[r] * ex(g_s[r] - g_s[j])
        # Computed unconditionally in registers, masked by a select, then stored: shared loads inside
        # T.if_then_else are one branch per element, and shared stores between shared loads keep the loop in
        # program order -- a latency chain per element either way (session 15, chunk_bwd_whole_sm90).
        # exp(g_r - g_j) may overflow above the diagonal; the select drops it.
        for r, j in T.Parallel(C, C):
            kk_f[r, j] = T.if_then_else(r > j, kk_f[r, j], 0.0)
        for r, j in T.Parallel(C, C):
            A_s[r, sw(r, j)] = kk_f[r, j]
        if not tb_only:     # (w's column scaling; the Tb-only form has no w)
            for r in T.Parallel(C):
                cw_s[r] = b_s[r] * T.exp(g_s[r]) * n_s[r]
        T.sync_threads()

    @T.macro
    def gates_and_A(k_s, g_s, b_s, n_s, cw_s, A_s, kk_f, g, beta, bos, eos, h):
        # steps 2-4 (the k tile's TMA load is in flight; the caller waits for it before calling)
        T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
        form_A(g_s, b_s, n_s, cw_s, A_s, kk_f)

    @T.macro
    def load_gates(g_s, b_s, X_s, g, beta, bos, eos, h):
        for r in T.Parallel(C):
            g_s[r] = T.if_then_else(bos + r < eos, g[bos + r, h], 0.0)
            b_s[r] = T.if_then_else(bos + r < eos, T.cast(beta[bos + r, h], acc), 0.0)
        if not inv_mma:     # (flq_inv64_mma writes X's zero blocks itself)
            T.clear(X_s)
        T.cumsum(g_s, dim=0)

    @T.macro
    def invert_fma(A_s, X_s):
        # step 5, X = (I + A)^-1 (see the module docstring); X_s was cleared up front
        tx = T.get_thread_binding()
        warp = tx // 32
        lane = tx % 32

        # ---- P1: D_b = (I + A_bb)^-1, thread (b, col) = (tx // 16, tx % 16), tx < 64
        if tx < 64:
            d0 = (tx // 16) * 16
            cc = tx % 16
            x = T.alloc_local((16,), acc)
            for m in T.unroll(16):
                x[m] = T.if_then_else(m == cc, 1.0, 0.0)
            for m in T.unroll(16):
                for r in T.unroll(m + 1, 16):
                    x[r] = x[r] - A_s[d0 + r, sw(d0 + r, d0 + m)] * x[m]
            for r in T.unroll(16):
                X_s[d0 + r, sw(d0 + r, d0 + cc)] = x[r]
        T.sync_threads()

        # ---- P2: the 32x32 diagonal halves.  Half p = tx // 64 (base row/col 32 p); in it,
        # column cc = tx % 16 and rows ri + 4 i (i = 0..3) of the 16x16 block, ri = (tx % 64) // 16.
        p0 = (tx // 64) * 32
        ri = (tx % 64) // 16
        c2 = tx % 16
        y2 = T.alloc_local((4,), acc)
        # P2a: Y = A_{lower} D_upper  -> upper-triangle scratch A_s[p0 + 0:16, p0 + 16:32]
        for i in T.unroll(4):
            y2[i] = 0.0
        for m in T.unroll(16):
            for i in T.unroll(4):
                y2[i] = y2[i] + A_s[p0 + 16 + ri + 4 * i, sw(p0 + 16 + ri + 4 * i, p0 + m)] * X_s[p0 + m, sw(p0 + m, p0 + c2)]
        for i in T.unroll(4):
            A_s[p0 + ri + 4 * i, sw(p0 + ri + 4 * i, p0 + 16 + c2)] = y2[i]
        T.sync_threads()
        # P2b: X_{lower-left} = -D_lower Y  -> X_s[p0 + 16:32, p0 + 0:16]
        for i in T.unroll(4):
            y2[i] = 0.0
        for m in T.unroll(16):
            for i in T.unroll(4):
                y2[i] = y2[i] - X_s[p0 + 16 + ri + 4 * i, sw(p0 + 16 + ri + 4 * i, p0 + 16 + m)] * A_s[p0 + m, sw(p0 + m, p0 + 16 + c2)]
        for i in T.unroll(4):
            X_s[p0 + 16 + ri + 4 * i, sw(p0 + 16 + ri + 4 * i, p0 + c2)] = y2[i]
        T.sync_threads()

        # ---- P3a: Y = A[32:64, 0:32] X[0:32, 0:32]  -> scratch A_s[0:32, 32:64].
        # Thread: rows r3 + 8 i (i = 0..3), r3 = tx // 16; columns c3 and 16 + c3, c3 = tx % 16.
        # Column 16 + c3 only meets rows 16..31 of X_(0) (its rows 0..15 are zero there).
        r3 = tx // 16
        c3 = tx % 16
        ya = T.alloc_local((4,), acc)
        yb = T.alloc_local((4,), acc)
        for i in T.unroll(4):
            ya[i] = 0.0
            yb[i] = 0.0
        for m in T.unroll(16):
            for i in T.unroll(4):
                ya[i] = ya[i] + A_s[32 + r3 + 8 * i, sw(32 + r3 + 8 * i, m)] * X_s[m, sw(m, c3)]
        for m in T.unroll(16, 32):
            for i in T.unroll(4):
                ya[i] = ya[i] + A_s[32 + r3 + 8 * i, sw(32 + r3 + 8 * i, m)] * X_s[m, sw(m, c3)]
                yb[i] = yb[i] + A_s[32 + r3 + 8 * i, sw(32 + r3 + 8 * i, m)] * X_s[m, sw(m, 16 + c3)]
        for i in T.unroll(4):
            A_s[r3 + 8 * i, sw(r3 + 8 * i, 32 + c3)] = ya[i]
            A_s[r3 + 8 * i, sw(r3 + 8 * i, 48 + c3)] = yb[i]
        T.sync_threads()

        # ---- P3b: X[32:64, 0:32] = -X[32:64, 32:64] Y  (Y in A_s[0:32, 32:64]).
        # Thread: column lane; rows warp + 4 i of the upper 16 (X_(1) rows there only meet Y's
        # rows 0..15) and 16 + warp + 4 i of the lower 16.
        za = T.alloc_local((4,), acc)
        zb = T.alloc_local((4,), acc)
        for i in T.unroll(4):
            za[i] = 0.0
            zb[i] = 0.0
        for m in T.unroll(16):
            for i in T.unroll(4):
                za[i] = za[i] - X_s[32 + warp + 4 * i, sw(32 + warp + 4 * i, 32 + m)] * A_s[m, sw(m, 32 + lane)]
                zb[i] = zb[i] - X_s[48 + warp + 4 * i, sw(48 + warp + 4 * i, 32 + m)] * A_s[m, sw(m, 32 + lane)]
        for m in T.unroll(16, 32):
            for i in T.unroll(4):
                zb[i] = zb[i] - X_s[48 + warp + 4 * i, sw(48 + warp + 4 * i, 32 + m)] * A_s[m, sw(m, 32 + lane)]
        for i in T.unroll(4):
            X_s[32 + warp + 4 * i, sw(32 + warp + 4 * i, lane)] = za[i]
            X_s[48 + warp + 4 * i, sw(48 + warp + 4 * i, lane)] = zb[i]
        T.sync_threads()

    @T.macro
    def invert(A_s, X_s):
        if inv_mma:
            # step 5 on the tensor cores (intra_inverse_mma.py); it ends with a __syncthreads
            T.call_extern("handle", "flq_inv64_mma_sw" if compact else "flq_inv64_mma", A_s.access_ptr("rw"),
                          X_s.access_ptr("w"))
        else:
            invert_fma(A_s, X_s)

    def make_prologue(with_v: bool, with_q: bool = False):
        # steps 1-5 for one chunk (k, v when w / u follow, q when the scores do): loads, gates, A and
        # X = (I + A)^-1
        @T.macro
        def prologue(k, v, g, beta, k_s, v_s, g_s, b_s, n_s, cw_s, A_s, X_s, kk_f, bar, bos, eos, h, hq,
                     q=None, q_s=None):
            # The TMA loads in flight at once (one mbarrier, every thread arrives once), overlapped
            # with the small gate / beta loads, the cumsum and the clearing of X.
            T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar)
            if with_v:
                T.tma_copy(v[bos:bos + C, h, :], v_s, barrier=bar)
            if with_q:
                T.tma_copy(q[bos:bos + C, hq, :], q_s, barrier=bar)
            T.mbarrier_arrive(bar)
            load_gates(g_s, b_s, X_s, g, beta, bos, eos, h)
            T.mbarrier_wait_parity(bar, 0)
            gates_and_A(k_s, g_s, b_s, n_s, cw_s, A_s, kk_f, g, beta, bos, eos, h)
            invert(A_s, X_s)
        return prologue

    def chunk_bounds(c, cu_seqlens, chunk_indices):
        # chunk c's first row and its sequence's end.  ``uniform`` (every sequence T = cu_seqlens[1] tokens, chunks
        # numbered sequence by sequence): from c alone, after one load that every CTA shares (an L1 hit), where
        # the table lookup is two dependent loads (chunk_indices, then cu_seqlens) ahead of the tile loads
        if uniform:
            tlen = cu_seqlens[1]
            cps = (tlen + C - 1) // C
            first = (c // cps) * tlen
            return first + (c % cps) * C, first + tlen
        seq = chunk_indices[c, 0]
        return cu_seqlens[seq] + chunk_indices[c, 1] * C, cu_seqlens[seq + 1]

    def grid():
        return (Hv, NC) if head_major else (NC, Hv)

    def order(bx):
        # (chunk, value head) from the block indices
        return (bx[1], bx[0]) if head_major else (bx[0], bx[1])

    prologue_wu = make_prologue(True)
    prologue_tb = make_prologue(False)
    prologue_tbs = make_prologue(False, True)

    @T.prim_func
    def gdn_fwd_intra(
        k: T.Tensor((NT, Hqk, K), dtype),
        v: T.Tensor((NT, Hv, V), dtype),
        g: T.Tensor((NT, Hv), acc),
        beta: T.Tensor((NT, Hv), beta_dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        w_out: T.Tensor((NC, Hv, C, K), dtype),
        u_out: T.Tensor((NC, Hv, C, V), dtype),
        G_out: T.Tensor((NC, Hv, C), acc),
        X_out: T.Tensor((XN, XH, C, C), dtype),
        ratio: T.int32,
    ):
        with T.Kernel(*grid(), threads=threads) as bx:
            if has_extern:
                T.import_source(extern_src)
            c, h = order(bx)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            n_s = T.alloc_shared((C,), acc)
            cw_s = T.alloc_shared((C,), acc)
            A_s = T.alloc_shared((C, APAD), acc)
            X_s = T.alloc_shared((C, APAD), acc)
            Xw_s = T.alloc_shared((C, C), dtype)
            Xu_s = T.alloc_shared((C, C), dtype)
            kk_f = T.alloc_fragment((C, C), acc)
            w_f = T.alloc_fragment((C, K), acc)
            u_f = T.alloc_fragment((C, V), acc)
            bar = T.alloc_barrier(threads)

            bos, eos = chunk_bounds(c, cu_seqlens, chunk_indices)
            hq = h // ratio

            prologue_wu(k, v, g, beta, k_s, v_s, g_s, b_s, n_s, cw_s, A_s, X_s, kk_f, bar, bos, eos, h, hq)

            if save_x:
                for r, j in T.Parallel(C, C):
                    X_out[c, h, r, j] = T.cast(X_s[r, sw(r, j)], dtype)
            for r, j in T.Parallel(C, C):
                Xw_s[r, j] = T.cast(X_s[r, sw(r, j)] * cw_s[j], dtype)
                Xu_s[r, j] = T.cast(X_s[r, sw(r, j)] * b_s[j], dtype)

            T.gemm(Xw_s, k_s, w_f, clear_accum=True)
            T.copy(w_f, k_s)
            T.copy(k_s, w_out[c, h, :, :])
            T.gemm(Xu_s, v_s, u_f, clear_accum=True)
            T.copy(u_f, v_s)
            T.copy(v_s, u_out[c, h, :, :])
            T.copy(g_s, G_out[c, h, :])

    from ._common import make_l2_row_factors

    l2_row_factors = make_l2_row_factors(C, K, acc, L2_EPS)
    # q and P_out are placeholders (own symbolic sizes, never touched) unless the scores are written
    QN, QH = (NT, Hqk) if scores else T.dynamic("QN, QH")
    PN, PH = (NC, Hv) if scores else T.dynamic("PN, PH")

    @T.prim_func
    def gdn_fwd_intra_tb(
        q: T.Tensor((QN, QH, K), dtype),
        k: T.Tensor((NT, Hqk, K), dtype),
        g: T.Tensor((NT, Hv), acc),
        beta: T.Tensor((NT, Hv), beta_dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        Tb_out: T.Tensor((NC, Hv, C, C), dtype),
        P_out: T.Tensor((PN, PH, C, C), dtype),
        G_out: T.Tensor((NC, Hv, C), acc),
        ratio: T.int32,
    ):
        with T.Kernel(*grid(), threads=threads) as bx:
            if compact:
                # (its 35 KB of shared memory fit five CTAs per SM: registers must too, at most 102)
                T.annotate_min_blocks_per_sm(COMPACT_CTAS_PER_SM)
            if has_extern:
                T.import_source(extern_src)
            c, h = order(bx)
            k_s = T.alloc_shared((C, K), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            n_s = T.alloc_shared((C,), acc)
            cw_s = T.alloc_shared((C,), acc)
            A_s = T.alloc_shared((C, APAD), acc)
            X_s = T.alloc_shared((C, APAD), acc)
            Tb_s = T.alloc_shared((C, C), dtype)
            kk_f = T.alloc_fragment((C, C), acc)
            bar = T.alloc_barrier(threads)
            if scores:
                q_s = T.alloc_shared((C, K), dtype)
                nq_s = T.alloc_shared((C,), acc)
                P_s = T.alloc_shared((C, C), dtype)
                gr_f = T.alloc_fragment((C,), acc)
                gc_f = T.alloc_fragment((C,), acc)
                if l2norm:
                    sq_f = T.alloc_fragment((C, K), acc)
                    ss_f = T.alloc_fragment((C,), acc)

            bos, eos = chunk_bounds(c, cu_seqlens, chunk_indices)
            hq = h // ratio

            if scores:
                prologue_tbs(k, None, g, beta, k_s, None, g_s, b_s, n_s, cw_s, A_s, X_s, kk_f, bar, bos, eos, h,
                             hq, q, q_s)
            else:
                prologue_tb(k, None, g, beta, k_s, None, g_s, b_s, n_s, cw_s, A_s, X_s, kk_f, bar, bos, eos, h, hq)

            # beta is zero on rows past the sequence end, so Tb's columns there are zero, and so are its
            # rows (X's rows there are unit rows): the fused recurrence's v_new rows past the end are 0
            for r, j in T.Parallel(C, C):
                Tb_s[r, j] = T.cast(X_s[r, sw(r, j)] * b_s[j], dtype)
            T.copy(Tb_s, Tb_out[c, h, :, :])
            T.copy(g_s, G_out[c, h, :])

            if scores:
                # the gates go to registers first, so the P store loop reads no shared memory
                if l2norm:
                    l2_row_factors(q_s, nq_s, sq_f, ss_f)
                T.gemm(q_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                for r in T.Parallel(C):
                    gr_f[r] = g_s[r]
                for j in T.Parallel(C):
                    gc_f[j] = g_s[j]
                if l2norm:
                    for r, j in T.Parallel(C, C):
                        kk_f[r, j] = kk_f[r, j] * nq_s[r] * n_s[j]
                for r, j in T.Parallel(C, C):
                    P_s[r, j] = T.if_then_else(j <= r, kk_f[r, j] * ex(gr_f[r] - gc_f[j]), 0.0)
                T.copy(P_s, P_out[c, h, :, :])

    @T.prim_func
    def gdn_fwd_intra_tbx(
        k: T.Tensor((NT, Hqk, K), dtype),
        g: T.Tensor((NT, Hv), acc),
        beta: T.Tensor((NT, Hv), beta_dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        Tb_out: T.Tensor(TB_SHAPE, TB_DT),
        X_out: T.Tensor((NC, Hv, C, C), dtype),
        G_out: T.Tensor((NC, Hv, C), acc),
        ratio: T.int32,
    ):
        with T.Kernel(*grid(), threads=threads) as bx:
            if compact:
                # (its 35 KB of shared memory fit five CTAs per SM: registers must too, at most 102)
                T.annotate_min_blocks_per_sm(COMPACT_CTAS_PER_SM)
            if has_extern:
                T.import_source(extern_src)
            c, h = order(bx)
            k_s = T.alloc_shared((C, K), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            n_s = T.alloc_shared((C,), acc)
            cw_s = T.alloc_shared((C,), acc)
            A_s = T.alloc_shared((C, APAD), acc)
            X_s = T.alloc_shared((C, APAD), acc)
            Tb_s = None if x_beta else T.alloc_shared((C, C), dtype)     # (x_beta: no Tb)
            Xb_s = T.alloc_shared((C, C), dtype)
            kk_f = T.alloc_fragment((C, C), acc)
            bar = T.alloc_barrier(threads)

            bos, eos = chunk_bounds(c, cu_seqlens, chunk_indices)
            hq = h // ratio
            prologue_tb(k, None, g, beta, k_s, None, g_s, b_s, n_s, cw_s, A_s, X_s, kk_f, bar, bos, eos, h, hq)
            # Tb for the fused recurrence (as gdn_fwd_intra_tb), X for the whole-V backward (as gdn_fwd_intra);
            # x_beta: beta in Tb's place
            if x_beta:
                for r, j in T.Parallel(C, C):
                    Xb_s[r, j] = T.cast(X_s[r, sw(r, j)], dtype)
                T.copy(b_s, Tb_out[c, h, :])
            else:
                for r, j in T.Parallel(C, C):
                    Tb_s[r, j] = T.cast(X_s[r, sw(r, j)] * b_s[j], dtype)
                    Xb_s[r, j] = T.cast(X_s[r, sw(r, j)], dtype)
                T.copy(Tb_s, Tb_out[c, h, :, :])
            T.copy(Xb_s, X_out[c, h, :, :])
            T.copy(g_s, G_out[c, h, :])

    @T.macro
    def prefetch_chunk(c, k, g, beta, cu_seqlens, chunk_indices, k_s, g_next, b_next, bar, tx, h, hq):
        # (persist) chunk c's k tile by TMA onto ``bar``, its gates and beta into registers (rows past the sequence
        # end zero, as load_gates has them)
        bos, eos = chunk_bounds(c, cu_seqlens, chunk_indices)
        T.tma_copy(k[bos:bos + C, hq, :], k_s, barrier=bar)
        if tx < C:
            g_next[0] = T.if_then_else(bos + tx < eos, g[bos + tx, h], 0.0)
            b_next[0] = T.if_then_else(bos + tx < eos, T.cast(beta[bos + tx, h], acc), 0.0)

    @T.prim_func
    def gdn_fwd_intra_tb_persist(
        k: T.Tensor((NT, Hqk, K), dtype),
        g: T.Tensor((NT, Hv), acc),
        beta: T.Tensor((NT, Hv), beta_dtype),
        cu_seqlens: T.Tensor((NS + 1,), "int32"),
        chunk_indices: T.Tensor((NC, 2), "int32"),
        Tb_out: T.Tensor(TB_SHAPE, TB_DT),
        X_out: T.Tensor((XN, XH, C, C), dtype),
        G_out: T.Tensor((NC, Hv, C), acc),
        ratio: T.int32,
        nprog: T.int32,
    ):
        # ``persist`` (see the docstring): CTA (p, h) takes chunks p, p + nprog, ... of value head h, and loads the
        # next chunk's k tile, gates and beta while it computes this one
        with T.Kernel(nprog, Hv, threads=threads) as (bp, h):
            # (four CTAs per SM, as shared memory allows: ptxas would otherwise take 148 registers, three CTAs)
            T.annotate_min_blocks_per_sm(PERSIST_CTAS_PER_SM)
            T.import_source(extern_src)
            k_s = T.alloc_shared((C, K), dtype)
            g_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            n_s = T.alloc_shared((C,), acc)
            cw_s = T.alloc_shared((C,), acc)
            A_s = T.alloc_shared((C, APAD), acc)
            X_s = T.alloc_shared((C, APAD), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            g_next = T.alloc_local((1,), acc)
            b_next = T.alloc_local((1,), acc)
            bar = T.alloc_barrier(threads)
            tx = T.get_thread_binding()
            hq = h // ratio
            niter = T.ceildiv(NC - bp, nprog)

            prefetch_chunk(bp, k, g, beta, cu_seqlens, chunk_indices, k_s, g_next, b_next, bar, tx, h, hq)
            for it in T.serial(niter):
                c = bp + it * nprog
                # (the gates and beta of this chunk, loaded during the last one; every thread arrives once per
                # chunk on the k tile's barrier, whose transaction count the tile's TMA load posted)
                T.mbarrier_arrive(bar)
                if tx < C:
                    g_s[tx] = g_next[0]
                    b_s[tx] = b_next[0]
                T.sync_threads()
                T.cumsum(g_s, dim=0)
                T.mbarrier_wait_parity(bar, it % 2)
                T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                T.sync_threads()
                # k k^T is in registers and k_s is free: the next chunk's loads fly while this one's A, inverse
                # and Tb are formed
                if it + 1 < niter:
                    prefetch_chunk(c + nprog, k, g, beta, cu_seqlens, chunk_indices, k_s, g_next, b_next, bar, tx, h,
                                   hq)
                form_A(g_s, b_s, n_s, cw_s, A_s, kk_f)
                invert(A_s, X_s)
                # straight to global memory (coalesced rows): a staging tile would take shared memory that four
                # CTAs per SM do not have beside k, A and X
                if x_beta:
                    for r in T.Parallel(C):
                        Tb_out[c, h, r] = b_s[r]
                else:
                    for r, j in T.Parallel(C, C):
                        Tb_out[c, h, r, j] = T.cast(X_s[r, sw(r, j)] * b_s[j], dtype)
                if save_x:
                    for r, j in T.Parallel(C, C):
                        X_out[c, h, r, j] = T.cast(X_s[r, sw(r, j)], dtype)
                for r in T.Parallel(C):
                    G_out[c, h, r] = g_s[r]
                T.sync_threads()

    if persist:
        return gdn_fwd_intra_tb_persist
    if tb_only:
        if save_x:
            assert not scores, "save_x with tb_only: no scores"
            return gdn_fwd_intra_tbx
        return gdn_fwd_intra_tb
    assert not scores, "scores: with tb_only only"
    return gdn_fwd_intra
