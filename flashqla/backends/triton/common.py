"""Shared Triton helpers of the "triton" backend: chunk coordinates, tile loads, dots, the 16x16 inverse.

Conventions used by every kernel of this package
------------------------------------------------
* Chunk size ``BT = 64`` tokens; a chunk is a row block ``r = 0..63``, rows ``r >= L`` (past the end
  of the sequence) are padding: they load as zeros (``g`` and ``beta`` too), so a padded token is an exact
  no-op of the recurrence, and the chunk-local cumulative gate ``G`` of a padded row equals the one of
  the last real row.
* Token-major tensors ``[B, T, H, D]`` are addressed by a *global token index* ``t = b*T + local``
  (``B == 1`` and ``t = cu_seqlens[n] + local`` for varlen): element ``(t, h, d)`` sits at
  ``(t*H + h)*D + d``.  Offsets are int64 so ``B*T*H*D >= 2**31`` is fine.
* Chunk ids: parallel kernels run one program per chunk ``pid`` (all chunks of all sequences, in
  order).  Non-varlen: ``pid = b*NT + i``; varlen: ``chunk_indices[pid] = (n, i)``.  The per-chunk
  state buffers are indexed by ``pid`` (it equals ``chunk_offsets[n] + i``).
* ``IEEE`` (constexpr) is True for float32 inputs: every dot then runs in full fp32
  (``input_precision="ieee"``), which is what makes the fp32 tests meet 1e-4 against float64.  Otherwise
  the operands are cast to the input dtype (bf16/fp16) with fp32 accumulation, as FLA does.
"""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK = 64                      # chunk size (tokens), host side
BT = tl.constexpr(CHUNK)        # the same, for kernels (globals must be constexpr objects)
L2_EPS = tl.constexpr(1e-6)     # the l2norm option: x * rsqrt(sum(x^2) + eps)
# fp32 dots of the fp32-input path (tests; slow on GPUs: FMA loops, heavy local memory).  "tf32x3" was
# tried: faster math but its hi/lo operand copies need up to 224 KB of shared memory, over an A100's.
IEEE_PREC = tl.constexpr("ieee")


@triton.jit
def mm(a, b, IEEE: tl.constexpr, DT: tl.constexpr):
    """a @ b with fp32 accumulation: full fp32 when IEEE, else operands in DT (bf16/fp16)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=IEEE_PREC)
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def mmf(a, b, IEEE: tl.constexpr):
    """a @ b of fp32 operands: full fp32 when IEEE, else tf32 (10-bit mantissa, 2x bf16's precision)
    for the triangular solves, whose results are rounded to the input dtype anyway."""
    if IEEE:
        return tl.dot(a, b, input_precision=IEEE_PREC)
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr, DT: tl.constexpr):
    """acc + a @ b, accumulated in place (no second [M, N] fp32 tile live), precision as ``mm``."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=IEEE_PREC)
    else:
        return tl.dot(a.to(DT), b.to(DT), acc)


@triton.jit
def chunk_coords(pid, cu_ptr, cidx_ptr, T, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """(sequence n, global token of the chunk's first row t0 [int64], valid rows L) of chunk ``pid``."""
    if IS_VARLEN:
        n = tl.load(cidx_ptr + pid * 2).to(tl.int32)
        i = tl.load(cidx_ptr + pid * 2 + 1).to(tl.int32)
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    else:
        n = pid // NT
        i = pid % NT
        bos = n.to(tl.int64) * T
        eos = bos + T
    t0 = bos + i.to(tl.int64) * BT
    L = tl.minimum(eos - t0, BT).to(tl.int32)
    return n, t0, L


@triton.jit
def seq_bounds(n, cu_ptr, coff_ptr, T, NT, IS_VARLEN: tl.constexpr, BT: tl.constexpr):
    """(bos, eos, number of chunks, id of the first chunk) of sequence ``n`` (bos/eos/id int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
        nt = tl.cdiv(eos - bos, BT).to(tl.int32)
        cbase = tl.load(coff_ptr + n).to(tl.int64)
    else:
        bos = n.to(tl.int64) * T
        eos = bos + T
        nt = NT
        cbase = n.to(tl.int64) * NT
    return bos, eos, nt, cbase


@triton.jit
def serial_program(cu_ptr, coff_ptr, ord_ptr, T, NT, TT, Hqk, Hv, K: tl.constexpr, V: tl.constexpr,
                   BV: tl.constexpr, IS_VARLEN: tl.constexpr, ORDERED: tl.constexpr):
    """Coordinates of a program of a serial state kernel (grid ``(N * Hv, V // BV)``): ``(v0, h, hk, bos, eos,
    nt, cbase, sbase, GS)`` = its first state column, value head, query/key head, the sequence's token range,
    chunk count and first chunk id (``seq_bounds``), the element offset of its [K, V] state (int64) and the
    plane stride of the gate buffer.

    ``ORDERED`` (varlen, ``ops`` knob ``serial.order``): a 1-D grid of ``N * Hv * (V // BV)`` programs, sequence
    by sequence in the order of ``ord_ptr`` (longest first: ``VarlenMeta.walk_order``).  Blocks start in grid
    order, so the longest walks are spread over the SMs before any SM takes a second one; in the 2-D grid the
    V-blocks are outermost, and with 28672 + 4096 tokens about half the long walks share an SM with another."""
    if ORDERED:
        NV: tl.constexpr = V // BV
        pid = tl.program_id(0)
        v0 = (pid % NV) * BV
        rest = pid // NV
        h = rest % Hv
        n = tl.load(ord_ptr + rest // Hv)
    else:
        pid = tl.program_id(0)
        v0 = tl.program_id(1) * BV
        n = pid // Hv
        h = pid % Hv
    hk = h // (Hv // Hqk)
    bos, eos, nt, cbase = seq_bounds(n, cu_ptr, coff_ptr, T, NT, IS_VARLEN, BT)
    sbase = (n.to(tl.int64) * Hv + h) * K * V
    return v0, h, hk, bos, eos, nt, cbase, sbase, gate_plane(Hv, TT)


@triton.jit
def chunk_ptr(ptr, t0, head, H, D: tl.constexpr, TT):
    """Scalar pointer to element ``(t0, head, 0)`` of a token-major ``[*, H, D]`` tensor, the token clamped into
    ``[0, TT)``; with ``row_offs`` the address of every lane of a chunk tile.

    Rows past the end of the sequence are masked at every load/store; the clamps additionally keep the
    *address* of a masked lane inside the buffer.  A compiled kernel may issue the loads of a loop iteration
    that does not exist (the software pipeliner prefetches iteration i+1, predicated off; ``L <= 0``, and this
    pointer then names a real token), or keep a masked lane's address in a ``cp.async`` with src-size 0: neither
    may then point outside the tensor, whatever the hardware does with such an address.  For real rows the
    clamps are the identity."""
    return ptr + (tl.minimum(tl.maximum(t0, 0), TT - 1) * H + head) * D


@triton.jit
def row_offs(r, L, H, D: tl.constexpr):
    """int32 element offsets of chunk rows ``r`` from ``chunk_ptr``; a row past the end takes the last real row's
    offset, so with ``chunk_ptr``'s clamp every address lies inside the tensor.

    Why split so: int64 clamps and products per row and per load (the previous form) made the serial state
    kernel's loop ~1.8x the instructions of FLA's ``fwd_h`` (sm_90 SASS, compile-only, session 13); the per-token
    int64 part is one scalar per chunk and the per-row part int32 (64 * H * D < 2**31 for any head count we take).
    """
    return tl.minimum(r, tl.maximum(L - 1, 0)) * (H * D)


@triton.jit
def load_rows(ptr, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, row0, TT):
    """Tile [R, D] of rows ``row0 .. row0+R`` of chunk-relative tokens, zero past ``L``.

    Tiles keep their storage dtype: a bf16 dot operand held in fp32 would take twice the registers.
    """
    r = row0 + tl.arange(0, R)
    d = tl.arange(0, D)
    offs = row_offs(r, L, H, D)[:, None] + d[None, :]
    return tl.load(chunk_ptr(ptr, t0, head, H, D, TT) + offs, mask=(r < L)[:, None], other=0.0)


@triton.jit
def store_rows(ptr, x, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, row0, TT):
    r = row0 + tl.arange(0, R)
    d = tl.arange(0, D)
    offs = row_offs(r, L, H, D)[:, None] + d[None, :]
    tl.store(chunk_ptr(ptr, t0, head, H, D, TT) + offs, x.to(ptr.dtype.element_ty), mask=(r < L)[:, None])


@triton.jit
def load_cols(ptr, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, c0, BC: tl.constexpr, TT):
    """Tile [R, BC] (storage dtype): columns ``c0 .. c0+BC`` of a [*, H, D] tensor, zero past ``L``."""
    r = tl.arange(0, R)
    d = c0 + tl.arange(0, BC)
    offs = row_offs(r, L, H, D)[:, None] + d[None, :]
    return tl.load(chunk_ptr(ptr, t0, head, H, D, TT) + offs, mask=(r < L)[:, None], other=0.0)


@triton.jit
def store_cols(ptr, x, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, c0, BC: tl.constexpr, TT):
    r = tl.arange(0, R)
    d = c0 + tl.arange(0, BC)
    offs = row_offs(r, L, H, D)[:, None] + d[None, :]
    tl.store(chunk_ptr(ptr, t0, head, H, D, TT) + offs, x.to(ptr.dtype.element_ty), mask=(r < L)[:, None])


@triton.jit
def load_vec(ptr, t0, L, head, H, R: tl.constexpr, row0, TT):
    """Per-token scalars [R] (fp32) of a [*, H] tensor, zero past ``L``."""
    r = row0 + tl.arange(0, R)
    return tl.load(chunk_ptr(ptr, t0, head, H, 1, TT) + row_offs(r, L, H, 1), mask=r < L, other=0.0).to(tl.float32)


@triton.jit
def store_vec(ptr, x, t0, L, head, H, R: tl.constexpr, TT):
    r = tl.arange(0, R)
    tl.store(chunk_ptr(ptr, t0, head, H, 1, TT) + row_offs(r, L, H, 1), x.to(ptr.dtype.element_ty), mask=r < L)


@triton.jit
def gate_plane(Hv, TT):
    """``GS = Hv * TT`` (int64): the offset of the gate buffer's ``lo`` plane (``load_gate``).  ``tl.cast``, not
    ``Hv.to``: a launch with one value head gets ``Hv`` as the Python int 1 (Triton specialises integer arguments
    equal to 1), which has no ``.to`` (the shared suite's one-head case on the H200, session 14)."""
    return tl.cast(Hv, tl.int64) * TT


@triton.jit
def load_gate(G_ptr, t0, L, h, TT, GS, R: tl.constexpr, row0):
    """Chunk-local cumulative gate (hi, lo) [R] of rows row0.. from the buffer of the prep kernel.

    The buffer is ``[2, Hv, TT]`` fp32: plane 0 the fp32 rounding ``hi`` of the fp64 cumsum, plane 1
    (at offset ``GS = Hv*TT``) the remainder ``lo``.  Padded rows read the last real row (index
    clamped), which is what the recurrence sees: their gate is 0.
    """
    r = row0 + tl.arange(0, R)
    # the token index is also clamped into [0, TT): never out of bounds, whatever loads a compiler
    # might issue for a loop iteration that does not exist (L <= 0, a length-0 sequence at token 0)
    p = chunk_ptr(G_ptr + h.to(tl.int64) * TT, t0, 0, 1, 1, TT) + row_offs(r, L, 1, 1)
    return tl.load(p), tl.load(p + GS)


@triton.jit
def load_gate_last(G_ptr, t0, L, h, TT, GS):
    """(hi, lo) of the cumulative gate at the chunk's last real row (index clamped as above)."""
    p = G_ptr + h.to(tl.int64) * TT + tl.minimum(tl.maximum(t0 + L - 1, 0), TT - 1)
    return tl.load(p), tl.load(p + GS)


@triton.jit
def gdiff(hi_a, lo_a, hi_b, lo_b):
    """G_a - G_b from (hi, lo) pairs.

    When G_a and G_b are close (the only case where exp(G_a - G_b) is not ~0), ``hi_a - hi_b`` is exact
    (Sterbenz) and the remainders restore what rounding G to fp32 lost, so the decay between nearby
    tokens stays accurate even when |G| ~ 1e5 (g = -1e4 gates); a plain fp32 G would be off by
    ulp(|G|) in the exponent.
    """
    return (hi_a - hi_b) + (lo_a - lo_b)


@triton.jit
def masked_decay(x, m, d):
    """``x * exp(d)`` where ``m``, else 0 (``d`` an exponent ``G_a - G_b``, ``m`` the causal mask): the exp is taken
    only of the masked-in exponents, which are <= 0, so however strong the decay nothing overflows and no
    ``inf * 0`` reaches the masked-out entries."""
    return tl.where(m, x * tl.exp(tl.where(m, d, 0.0)), 0.0)


@triton.jit
def l2n(x, USE_L2: tl.constexpr, EPS: tl.constexpr):
    """Row-wise x * rsqrt(sum(x^2) + eps) (in fp32) when USE_L2, else x; rows of zeros stay zero."""
    if USE_L2:
        xf = x.to(tl.float32)
        return xf * tl.rsqrt(tl.sum(xf * xf, 1) + EPS)[:, None]
    else:
        return x


@triton.jit
def load_state(ptr, base, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr):
    """Tile [K, BV] (storage dtype) of a [.., K, V] state at element offset ``base`` (int64)."""
    dk = tl.arange(0, K)
    dv = v0 + tl.arange(0, BV)
    return tl.load(ptr + base + dk[:, None] * V + dv[None, :])


@triton.jit
def store_state(ptr, x, base, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr):
    dk = tl.arange(0, K)
    dv = v0 + tl.arange(0, BV)
    tl.store(ptr + base + dk[:, None] * V + dv[None, :], x.to(ptr.dtype.element_ty))


@triton.jit
def load_tb(ptr, chunk, h, Hv, TRANS: tl.constexpr):
    """The [64, 64] tile of chunk ``chunk`` (int64) and value head ``h`` of a ``[chunks, Hv, 64, 64]`` buffer
    (``Tb`` of the Tb-only prep, or the inverse a training forward kept), transposed when ``TRANS``."""
    r = tl.arange(0, BT)
    base = ptr + (chunk * Hv + h) * (BT * BT)
    if TRANS:
        return tl.load(base + r[None, :] * BT + r[:, None])
    else:
        return tl.load(base + r[:, None] * BT + r[None, :])


# Transposed tiles, for the kernels that hold the state as S^T [BV, K] (TRANSPOSED: see chunk_state)
@triton.jit
def load_t(ptr, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, c0, BC: tl.constexpr, TT):
    """Tile [BC, R] (storage dtype): columns ``c0 .. c0+BC`` of the chunk's R rows, transposed."""
    r = tl.arange(0, R)
    d = c0 + tl.arange(0, BC)
    offs = row_offs(r, L, H, D)[None, :] + d[:, None]
    return tl.load(chunk_ptr(ptr, t0, head, H, D, TT) + offs, mask=(r < L)[None, :], other=0.0)


@triton.jit
def store_t(ptr, xt, t0, L, head, H, D: tl.constexpr, R: tl.constexpr, c0, BC: tl.constexpr, TT):
    """Store a [BC, R] tile transposed into columns ``c0 .. c0+BC`` of the chunk's rows (rows < L)."""
    r = tl.arange(0, R)
    d = c0 + tl.arange(0, BC)
    offs = row_offs(r, L, H, D)[None, :] + d[:, None]
    tl.store(chunk_ptr(ptr, t0, head, H, D, TT) + offs, xt.to(ptr.dtype.element_ty), mask=(r < L)[None, :])


@triton.jit
def load_state_t(ptr, base, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr):
    """Tile [BV, K] = columns ``v0 ..`` of a [.., K, V] state, transposed."""
    dk = tl.arange(0, K)
    dv = v0 + tl.arange(0, BV)
    return tl.load(ptr + base + dk[None, :] * V + dv[:, None])


@triton.jit
def store_state_t(ptr, xt, base, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr):
    dk = tl.arange(0, K)
    dv = v0 + tl.arange(0, BV)
    tl.store(ptr + base + dk[None, :] * V + dv[:, None], xt.to(ptr.dtype.element_ty))
