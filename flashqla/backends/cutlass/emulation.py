"""PyTorch emulation of the cutlass backend's kernels, step by step, with the kernels' rounding points.

Used only by the tests (``tests/test_backend_cutlass.py``): it checks, on a CPU, that the algebra the
kernels implement (the transposed-state recurrence, the negated ``w``, the masks, the blocked inverse)
and the places where they round to bf16 give the oracle's answer within the bf16 tolerances.  It is
never called by the backend itself.

:func:`prep_chunks` is ``chunk_prep_sm90`` for a batch of (chunk, head) pairs, :func:`invert_unit_lower`
its blocked forward substitution, :func:`recurrence_step` one chunk of ``chunk_fwd_sm90``; :func:`prep_chunks_tb`
and :func:`recurrence_step_fused` the fused inference forward's (``chunk_prep_sm90`` with ``tb``,
``chunk_fwd_ws_sm90`` with ``fused``).
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


def _prep_common(q, k, g, beta, valid, scale: float):
    """What both preps form: the masked k and beta, G, the strictly lower A and the causal Aqk (bf16-rounded)."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]            # [n, 64]
    zero = torch.zeros((), dtype=f32)
    q = q.to(f32)  # q rows past the end are not zeroed by the kernel: Aqk's mask removes them
    k = torch.where(rowmask[..., None], k.to(f32), zero)
    g = torch.where(rowmask, g.to(f32), zero)
    beta = torch.where(rowmask, beta.to(f32), zero)
    G = torch.cumsum(g, -1)
    idx = torch.arange(BT)
    diff = G[:, :, None] - G[:, None, :]
    strict = (idx[None, :] < idx[:, None])[None]
    incl = (idx[None, :] <= idx[:, None])[None] & rowmask[:, :, None]
    A = torch.where(strict, beta[:, :, None] * (k @ k.transpose(1, 2)) * torch.exp(torch.where(strict, diff, 0.0)), zero)
    aqk = _bf(torch.where(incl, scale * (q @ k.transpose(1, 2)) * torch.exp(torch.where(incl, diff, 0.0)), zero))
    return k, beta, G, A, aqk


def prep_chunks(q, k, v, g, beta, valid, scale: float):
    """Batched (chunk, head) prep: q, k [n, 64, K], v [n, 64, V] (bf16 values; rows >= valid hold whatever
    the TMA tile held), g, beta [n, 64] (only rows < valid are read), valid [n].

    Returns (-w [n, 64, K], u^T [n, V, 64], Aqk [n, 64, 64]) bf16-rounded fp32 and G [n, 64] fp32.
    """
    k, beta, G, A, aqk = _prep_common(q, k, g, beta, valid, scale)
    v = torch.where((torch.arange(BT)[None, :] < valid[:, None])[..., None], v.to(f32), torch.zeros((), dtype=f32))
    T = invert_unit_lower(A)
    tb = T * beta[:, None, :]
    a_tb = _bf(tb)
    a_tbg = _bf(tb * torch.exp(G)[:, None, :])
    w_neg = _bf(-(a_tbg @ k))
    u_t = _bf((a_tb @ v).transpose(1, 2))
    return w_neg, u_t, aqk, G


def prep_chunks_tb(q, k, g, beta, valid, scale: float):
    """The ``tb`` prep: (Tb = T diag(beta) [n, 64, 64], Aqk [n, 64, 64]) bf16-rounded fp32 and G [n, 64] fp32."""
    _, beta, G, A, aqk = _prep_common(q, k, g, beta, valid, scale)
    return _bf(invert_unit_lower(A) * beta[:, None, :]), aqk, G


def recurrence_step_fused(H, tb, aqk, G, q, k, v, valid, scale: float):
    """One chunk of the fused recurrence: ``v_new^T = (v^T - (Hb k^T) diag(Gamma)) Tb^T`` with the bracket rounded
    to bf16 (the A operand of its wgmma), k and v rows past the end zeroed; the rest as :func:`recurrence_step`."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    zero = torch.zeros((), dtype=f32)
    k, v = (torch.where(rowmask[..., None], x.to(f32), zero) for x in (k, v))
    q = q.to(f32)
    Hb = _bf(H)
    x = _bf(v.transpose(1, 2) - (Hb @ k.transpose(1, 2)) * torch.exp(G)[:, None, :])     # [n, V, 64]
    return _output_and_update(H, Hb, x @ tb.transpose(1, 2), aqk, G, q, k, scale)


def _output_and_update(H, Hb, vn, aqk, G, q, k, scale: float):
    """The rest of a chunk step once v_new^T ``vn`` is formed (both recurrences): o^T (bf16-rounded) and the new H."""
    o = (Hb @ q.transpose(1, 2)) * (scale * torch.exp(G))[:, None, :]
    g_last = G[:, -1]
    vn_b = _bf(vn)
    vnd_b = _bf(vn * torch.exp(g_last[:, None] - G)[:, None, :])
    o = o + vn_b @ aqk.transpose(1, 2)
    H = H * torch.exp(g_last)[:, None, None] + vnd_b @ k
    return _bf(o), H


def recurrence_step(H, w_neg, u_t, aqk, G, q, k, valid, scale: float):
    """One chunk of the recurrence kernel for a batch of heads.  H [n, V, K] fp32 (the transposed state);
    q, k the raw TMA tiles [n, 64, K]; returns (o^T [n, V, 64] bf16-rounded, new H)."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    k = torch.where(rowmask[..., None], k.to(f32), torch.zeros((), dtype=f32))
    q = q.to(f32)
    Hb = _bf(H)
    vn = u_t + Hb @ w_neg.transpose(1, 2)                            # [n, V, 64]
    return _output_and_update(H, Hb, vn, aqk, G, q, k, scale)


def forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, fused: bool = False):
    """Whole op on packed inputs (B = 1): q, k [1, T, Hqk, K]; v [1, T, Hv, V]; g, beta [1, T, Hv].
    Returns (o [1, T, Hv, V] bf16, ht [N, Hv, K, V] fp32).  ``fused``: the fused inference forward's steps."""
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
            if fused:
                tb, aqk, G = prep_chunks_tb(qt, kt, gt, bt, valid, scale)
                o_t, H = recurrence_step_fused(H, tb, aqk, G, qt, kt, vt, valid, scale)
            else:
                w_neg, u_t, aqk, G = prep_chunks(qt, kt, vt, gt, bt, valid, scale)
                o_t, H = recurrence_step(H, w_neg, u_t, aqk, G, qt, kt, valid, scale)
            o[c0:c0 + nv] = o_t.transpose(1, 2)[:, :nv].transpose(0, 1)
        ht[n] = H.transpose(1, 2)
    return o[None].to(bf16), ht


# ------------------------------------------------------------------------------------------------ backward
def forward_saving(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """:func:`forward` plus what the training forward stores per chunk (for :func:`backward`):
    the bf16 state at the chunk start ``S`` [Hv, K, V], the bf16 ``vn`` [Hv, 64, V], the prep outputs and
    the bf16 ``T``.  Returns (o, ht, saved) with saved[n] = list of per-chunk dicts."""
    _, Ttot, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    ratio = Hv // Hqk
    cu = [int(x) for x in cu_seqlens]
    N = len(cu) - 1
    o = torch.zeros(Ttot, Hv, V, dtype=f32)
    ht = torch.zeros(N, Hv, K, V, dtype=f32)
    heads_qk = torch.arange(Hv) // ratio
    saved = []
    for n in range(N):
        bos, eos = cu[n], cu[n + 1]
        H = (initial_state[n].to(f32).transpose(1, 2).clone() if initial_state is not None
             else torch.zeros(Hv, V, K, dtype=f32))
        per = []
        for c0 in range(bos, eos, BT):
            nv = min(BT, eos - c0)
            valid = torch.full((Hv,), nv)
            qt, kt, vt = _tiles(q, c0, heads_qk), _tiles(k, c0, heads_qk), _tiles(v, c0, torch.arange(Hv))
            gt = _tiles(g[..., None], c0, torch.arange(Hv))[..., 0]
            bt = _tiles(beta[..., None], c0, torch.arange(Hv))[..., 0]
            w_neg, u_t, aqk, G = prep_chunks(qt, kt, vt, gt, bt, valid, scale)
            T = _prep_T(kt, gt, bt, valid)
            Hb = _bf(H)
            vn_b = _bf(u_t + Hb @ w_neg.transpose(1, 2)).transpose(1, 2)        # [Hv, 64, V]
            o_t, H = recurrence_step(H, w_neg, u_t, aqk, G, qt, kt, valid, scale)
            o[c0:c0 + nv] = o_t.transpose(1, 2)[:, :nv].transpose(0, 1)
            per.append(dict(c0=c0, valid=nv, S=Hb.transpose(1, 2), vn=vn_b, w_neg=w_neg, aqk=aqk, G=G, T=_bf(T)))
        ht[n] = H.transpose(1, 2)
        saved.append(per)
    return o[None].to(bf16), ht, saved


def _tiles(x, start, heads):
    Ttot = x.shape[1]
    rows = start + torch.arange(BT)
    inside = rows < Ttot
    t = x[0, rows.clamp(max=Ttot - 1)][:, heads]
    t = torch.where(inside[:, None, None], t, torch.zeros((), dtype=t.dtype))
    return t.transpose(0, 1).contiguous()


def _prep_T(k, g, beta, valid):
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    zero = torch.zeros((), dtype=f32)
    k = torch.where(rowmask[..., None], k.to(f32), zero)
    g = torch.where(rowmask, g.to(f32), zero)
    beta = torch.where(rowmask, beta.to(f32), zero)
    G = torch.cumsum(g, -1)
    idx = torch.arange(BT)
    strict = (idx[None, :] < idx[:, None])[None]
    diff = G[:, :, None] - G[:, None, :]
    A = torch.where(strict, beta[:, :, None] * (k @ k.transpose(1, 2)) * torch.exp(torch.where(strict, diff, 0.0)), zero)
    return invert_unit_lower(A)


def bwd_state_step(dH, do, q, k, w_neg, aqk, G, valid, scale):
    """One chunk of the backward state recurrence (reverse order), heads batched.  dH [n, V, K] fp32 is
    the transposed gradient of the state at the chunk END; returns (dS' bf16 [n, K, V] to store,
    dvn bf16 [n, 64, V], dH at the chunk start)."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    zero = torch.zeros((), dtype=f32)
    do, q, k = (torch.where(rowmask[..., None], x.to(f32), zero) for x in (do, q, k))
    dHb = _bf(dH)
    acc1 = do.transpose(1, 2) @ aqk                                    # dO^T P      [n, V, 64]
    acc2 = dHb @ k.transpose(1, 2)                                     # dH' k^T     [n, V, 64]
    g_last = G[:, -1]
    dvn = acc1 + acc2 * torch.exp(g_last[:, None] - G)[:, None, :]
    dvn_b = _bf(dvn)
    a1 = _bf(do.transpose(1, 2) * (scale * torch.exp(G))[:, None, :])
    dH_new = dH * torch.exp(g_last)[:, None, None] + a1 @ q + dvn_b @ w_neg
    return dHb.transpose(1, 2), dvn_b.transpose(1, 2), dH_new


def bwd_dqk_chunk(q, k, do, S, dS, vn, dvn, aqk, G, valid, scale):
    """The o / state paths of one chunk (kernel bwd_dqk), heads batched.  Returns dq [n, 64, K] (final),
    dk_part [n, 64, K], dw bf16 [n, 64, K], dG1 [n, 64]."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    zero = torch.zeros((), dtype=f32)
    q, k, do = (torch.where(rowmask[..., None], x.to(f32), zero) for x in (q, k, do))
    idx = torch.arange(BT)
    incl = (idx[None, :] <= idx[:, None])[None] & rowmask[:, :, None]
    gam = torch.exp(G)
    g_last = G[:, -1]
    d = torch.exp(g_last[:, None] - G)
    dq1 = do @ S.transpose(1, 2)                                       # dO S^T      [n, 64, K]
    dG = gam * scale * (q * dq1).sum(-1)                               # Gamma_t in o
    dP = do @ vn.transpose(1, 2)                                       # [n, t, s]
    dG = dG + (dP * aqk).sum(-1) - (dP * aqk).sum(-2)                  # decay inside P
    M = torch.exp(torch.where(incl, G[:, :, None] - G[:, None, :], 0.0))
    dPm = torch.where(incl, dP * scale * M, zero)
    dPm_b = _bf(dPm)
    dq = dq1 * (scale * gam)[..., None] + dPm_b @ k
    dk1 = vn @ dS.transpose(1, 2)                                      # vn dS'^T    [n, 64, K]
    dd = (k * dk1).sum(-1)                                             # d(d_s)
    dG = dG - d * dd
    dG[:, -1] += (d * dd).sum(-1) + torch.exp(g_last) * (S * dS).sum((-1, -2))
    dk = dk1 * d[..., None] + dPm_b.transpose(1, 2) @ q
    dw = _bf(-(dvn @ S.transpose(1, 2)))
    return dq, dk, dw, dG


def bwd_wy_chunk(k, v, g, beta, T, dw, du, dk_part, dG1, valid):
    """The WY / gate part of one chunk (kernel bwd_wy), heads batched.  Returns dk, dv, dbeta, dg [n, 64]."""
    rowmask = torch.arange(BT)[None, :] < valid[:, None]
    zero = torch.zeros((), dtype=f32)
    k, v = (torch.where(rowmask[..., None], x.to(f32), zero) for x in (k, v))
    g = torch.where(rowmask, g.to(f32), zero)
    beta = torch.where(rowmask, beta.to(f32), zero)
    G = torch.cumsum(g, -1)
    gam = torch.exp(G)
    Tt = T.transpose(1, 2)
    acc1 = Tt @ du                                                     # T^T du      [n, 64 j, V]
    dbeta = (v * acc1).sum(-1)
    dv = acc1 * beta[..., None]
    acc2 = Tt @ dw                                                     # T^T dw      [n, 64 j, K]
    gw = (k * acc2).sum(-1)
    dbeta = dbeta + gam * gw
    dG = dG1 + beta * gam * gw
    dk = acc2 * (beta * gam)[..., None]
    X = du @ v.transpose(1, 2)
    Y = dw @ k.transpose(1, 2)
    dT_b = _bf(X * beta[:, None, :] + Y * (beta * gam)[:, None, :])
    Z_b = _bf(dT_b @ T.transpose(1, 2))                                # dT T^T
    idx = torch.arange(BT)
    strict = (idx[None, :] < idx[:, None])[None] & rowmask[:, :, None]
    dA = torch.where(strict, -(Tt @ Z_b), zero)                        # -T^T dT T^T
    E = torch.exp(torch.where(strict, G[:, :, None] - G[:, None, :], 0.0))
    KK = k @ k.transpose(1, 2)
    A = torch.where(strict, beta[:, :, None] * KK * E, zero)
    dbeta = dbeta + torch.where(strict, dA * KK * E, zero).sum(-1)
    dG = dG + (dA * A).sum(-1) - (dA * A).sum(-2)
    F_b = _bf(torch.where(strict, dA * beta[:, :, None] * E, zero))
    dk = dk + F_b @ k + F_b.transpose(1, 2) @ k + dk_part
    dg = torch.flip(torch.cumsum(torch.flip(dG, [-1]), -1), [-1])
    return dk, dv, dbeta, dg


def backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, intermediates=None):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of the emulated forward, by the backward kernels' steps.

    ``intermediates``: a dict that receives the per-chunk workspaces in global chunk order, stacked
    [C, Hv, ...]: S, vn, w_neg, aqk, G, T (training forward), dS, dvn (state-gradient recurrence),
    dw, dG1 (bwd_dqk) -- the kernels' workspaces, for kernel-by-kernel comparisons."""
    _, Ttot, Hqk, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    ratio = Hv // Hqk
    _, _, saved = forward_saving(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    cu = [int(x) for x in cu_seqlens]
    heads_qk = torch.arange(Hv) // ratio
    allh = torch.arange(Hv)
    dq = torch.zeros(Ttot, Hv, K)
    dk = torch.zeros(Ttot, Hv, K)
    dv = torch.zeros(Ttot, Hv, V)
    dbeta = torch.zeros(Ttot, Hv)
    dg = torch.zeros(Ttot, Hv)
    dh0 = torch.zeros(len(cu) - 1, Hv, K, V)
    for n, per in enumerate(saved):
        dH = dht[n].to(f32).transpose(1, 2).clone() if dht is not None else torch.zeros(Hv, V, K)
        grads = [None] * len(per)
        for ci in reversed(range(len(per))):
            ch = per[ci]
            valid = torch.full((Hv,), ch["valid"])
            c0 = ch["c0"]
            qt, kt = _tiles(q, c0, heads_qk), _tiles(k, c0, heads_qk)
            dot = _tiles(do, c0, allh)
            dS, dvn, dH = bwd_state_step(dH, dot, qt, kt, ch["w_neg"], ch["aqk"], ch["G"], valid, scale)
            grads[ci] = (dS, dvn)
        dh0[n] = dH.transpose(1, 2)
        for ci, ch in enumerate(per):
            dS, dvn = grads[ci]
            valid = torch.full((Hv,), ch["valid"])
            c0, nv = ch["c0"], ch["valid"]
            qt, kt, vt = _tiles(q, c0, heads_qk), _tiles(k, c0, heads_qk), _tiles(v, c0, allh)
            dot = _tiles(do, c0, allh)
            gt = _tiles(g[..., None], c0, allh)[..., 0]
            bt = _tiles(beta[..., None], c0, allh)[..., 0]
            dq_c, dk_p, dw, dG1 = bwd_dqk_chunk(qt, kt, dot, ch["S"], dS, ch["vn"], dvn, ch["aqk"], ch["G"], valid, scale)
            if intermediates is not None:
                for name, val in (("S", ch["S"]), ("vn", ch["vn"]), ("w_neg", ch["w_neg"]), ("aqk", ch["aqk"]),
                                  ("G", ch["G"]), ("T", ch["T"]), ("dS", dS), ("dvn", dvn), ("dw", dw),
                                  ("dG1", dG1)):
                    intermediates.setdefault(name, []).append(val)
            dk_c, dv_c, db_c, dg_c = bwd_wy_chunk(kt, vt, gt, bt, ch["T"], dw, dvn, dk_p, dG1, valid)
            sl = slice(c0, c0 + nv)
            dq[sl] = dq_c[:, :nv].transpose(0, 1)
            dk[sl] = dk_c[:, :nv].transpose(0, 1)
            dv[sl] = dv_c[:, :nv].transpose(0, 1)
            dbeta[sl] = db_c[:, :nv].transpose(0, 1)
            dg[sl] = dg_c[:, :nv].transpose(0, 1)
    if intermediates is not None:
        for name in list(intermediates):
            intermediates[name] = torch.stack(intermediates[name], 0)
    dq = dq.view(Ttot, Hqk, ratio, K).sum(2)
    dk = dk.view(Ttot, Hqk, ratio, K).sum(2)
    return dq[None], dk[None], dv[None], dg[None], dbeta[None], (dh0 if initial_state is not None else None)
