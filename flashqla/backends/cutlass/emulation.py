"""PyTorch emulation of the cutlass backend's kernels, step by step, with the kernels' rounding points.

Used only by the tests (``tests/test_backend_cutlass.py``): it checks, on a CPU, that the algebra the
kernels implement (the transposed-state recurrence, the negated ``w``, the masks, the blocked inverse)
and the places where they round to bf16 give the oracle's answer within the bf16 tolerances.  It is
never called by the backend itself.

:func:`prep_chunks` is ``chunk_prep_sm90`` for a batch of (chunk, head) pairs, :func:`invert_unit_lower`
its blocked forward substitution, :func:`recurrence_step` one chunk of ``chunk_fwd_sm90``.
"""

from __future__ import annotations

import torch

BT = 64
f32, bf16 = torch.float32, torch.bfloat16


def _bf(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and come back to fp32 (what a bf16 register / shared-memory tile holds)."""
    return x.to(bf16).to(f32)


def invert_unit_lower(A: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower A [..., 64, 64] (fp32), in the prep kernel's order of work."""
    T = torch.zeros_like(A)
    cols = torch.arange(16)
    for b in range(4):                      # diagonal blocks: forward substitution, all columns at once
        blk = A[..., 16 * b:16 * b + 16, 16 * b:16 * b + 16]
        X = torch.zeros_like(blk)
        for r in range(16):
            s = (blk[..., r, :r, None] * X[..., :r, :]).sum(-2)
            X[..., r, :] = torch.where(cols < r, -s, torch.where(cols == r, 1.0, 0.0))
        T[..., 16 * b:16 * b + 16, 16 * b:16 * b + 16] = X
    for d in range(1, 4):                   # off-diagonal blocks by block distance
        P = [A[..., 16 * (j + d):16 * (j + d) + 16, 16 * j:16 * (j + d)] @ T[..., 16 * j:16 * (j + d), 16 * j:16 * j + 16]
             for j in range(4 - d)]
        for j in range(4 - d):
            i = j + d
            T[..., 16 * i:16 * i + 16, 16 * j:16 * j + 16] = -(T[..., 16 * i:16 * i + 16, 16 * i:16 * i + 16] @ P[j])
    return T


def prep_chunks(q, k, v, g, beta, valid, scale: float):
    """Batched (chunk, head) prep: q, k [n, 64, K], v [n, 64, V] (bf16 values; rows >= valid hold whatever
    the TMA tile held), g, beta [n, 64] (only rows < valid are read), valid [n].

    Returns (-w [n, 64, K], u^T [n, V, 64], Aqk [n, 64, 64]) bf16-rounded fp32 and G [n, 64] fp32.
    """
    rowmask = torch.arange(BT)[None, :] < valid[:, None]            # [n, 64]
    zero = torch.zeros((), dtype=f32)
    q = q.to(f32)  # q rows past the end are not zeroed by the kernel: Aqk's mask removes them
    k, v = (torch.where(rowmask[..., None], x.to(f32), zero) for x in (k, v))
    g = torch.where(rowmask, g.to(f32), zero)
    beta = torch.where(rowmask, beta.to(f32), zero)
    G = torch.cumsum(g, -1)
    idx = torch.arange(BT)
    diff = G[:, :, None] - G[:, None, :]
    strict = (idx[None, :] < idx[:, None])[None]
    incl = (idx[None, :] <= idx[:, None])[None] & rowmask[:, :, None]
    A = torch.where(strict, beta[:, :, None] * (k @ k.transpose(1, 2)) * torch.exp(torch.where(strict, diff, 0.0)), zero)
    aqk = _bf(torch.where(incl, scale * (q @ k.transpose(1, 2)) * torch.exp(torch.where(incl, diff, 0.0)), zero))
    T = invert_unit_lower(A)
    tb = T * beta[:, None, :]
    a_tb = _bf(tb)
    a_tbg = _bf(tb * torch.exp(G)[:, None, :])
    w_neg = _bf(-(a_tbg @ k))
    u_t = _bf((a_tb @ v).transpose(1, 2))
    return w_neg, u_t, aqk, G


def recurrence_step(H, w_neg, u_t, aqk, G, q, k, valid, scale: float):
    """One chunk of the recurrence kernel for a batch of heads.  H [n, V, K] fp32 (the transposed state);
    q, k the raw TMA tiles [n, 64, K]; returns (o^T [n, V, 64] bf16-rounded, new H)."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    k = torch.where(rowmask[..., None], k.to(f32), torch.zeros((), dtype=f32))
    q = q.to(f32)
    Hb = _bf(H)
    vn = u_t + Hb @ w_neg.transpose(1, 2)                            # [n, V, 64]
    o = (Hb @ q.transpose(1, 2)) * (scale * torch.exp(G))[:, None, :]
    g_last = G[:, -1]
    vn_b = _bf(vn)
    vnd_b = _bf(vn * torch.exp(g_last[:, None] - G)[:, None, :])
    o = o + vn_b @ aqk.transpose(1, 2)
    H = H * torch.exp(g_last)[:, None, None] + vnd_b @ k
    return _bf(o), H


def forward(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """Whole op on packed inputs (B = 1): q, k [1, T, Hqk, K]; v [1, T, Hv, V]; g, beta [1, T, Hv].
    Returns (o [1, T, Hv, V] bf16, ht [N, Hv, K, V] fp32)."""
    _, Ttot, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    ratio = Hv // Hqk
    cu = [int(x) for x in cu_seqlens]
    N = len(cu) - 1
    o = torch.zeros(Ttot, Hv, V, dtype=f32)
    ht = torch.zeros(N, Hv, K, V, dtype=f32)
    heads_qk = torch.arange(Hv) // ratio

    def tiles(x, start, heads):
        """The TMA tile at token ``start``: the next 64 rows of the packed tensor, zero past its end."""
        rows = start + torch.arange(BT)
        inside = rows < Ttot
        t = x[0, rows.clamp(max=Ttot - 1)][:, heads]                   # [64, n, D]
        t = torch.where(inside[:, None, None], t, torch.zeros((), dtype=t.dtype))
        return t.transpose(0, 1).contiguous()                          # [n, 64, D]

    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        H = (initial_state[n].to(f32).transpose(1, 2).clone() if initial_state is not None
             else torch.zeros(Hv, V, K, dtype=f32))
        for c0 in range(bos, eos, BT):
            nv = min(BT, eos - c0)
            valid = torch.full((Hv,), nv)
            qt, kt, vt = tiles(q, c0, heads_qk), tiles(k, c0, heads_qk), tiles(v, c0, torch.arange(Hv))
            gt, bt = tiles(g[..., None], c0, torch.arange(Hv))[..., 0], tiles(beta[..., None], c0, torch.arange(Hv))[..., 0]
            w_neg, u_t, aqk, G = prep_chunks(qt, kt, vt, gt, bt, valid, scale)
            o_t, H = recurrence_step(H, w_neg, u_t, aqk, G, qt, kt, valid, scale)
            o[c0:c0 + nv] = o_t.transpose(1, 2)[:, :nv].transpose(0, 1)
        ht[n] = H.transpose(1, 2)
    return o[None].to(bf16), ht
