"""CPU model of the fused backward (``BACKWARD_PLAN.md`` §4.2, §4.6; the plan's steps 5.1 and 5.2); with
``w_free=True`` it is the order of ``chunk_bwd_whole_sm90``, the fused kernel the backend runs.

:func:`bwd_fused_ref` computes dq, dk, dv, dg, dbeta and dh0 of one call from the forward's saved tensors
(the inputs of ``ops.backward``: q, k, v, beta, the chunk-local gate cumsum G, the inverse X, the chunk
start states h, v_new and w) in the kernel's order: one reverse walk per (sequence, value head) over
64-token chunks (value heads are batched here, their walks are independent), the state gradient dS carried
in fp32, and every gradient of a chunk formed in the same chunk step.  Notation per chunk: ``eG = exp(G)``,
``D_r = exp(G_last - G_r)``, ``E[r, j] = exp(G_r - G_j)`` for ``j <= r``; nq, nk the L2-norm row factors
(1 without the norm).  Tiles hold rows >= eos as TMA reads them (the next sequence's); those rows are zeroed
in Pt's columns, dOs, dQK, the inter-chunk dG term, acc and R (dQK and the dG term: else the in-chunk reverse
cumsum carries the next sequence's dO into dg).

* prep (state-free): ``Pt`` (p2), ``dOs`` (p3), ``dPm = dO vn^T`` -> ``dQK``, ``Z`` and the bf16
  ``dQKn``/``dQKq`` (p4), ``U = k S``, ``Y = v - diag(eG nk) U`` (p5), ``dOS = dO S^T`` and the final dq (p6).
* chain: ``dSb`` and ``<S, dS>`` (c1); ``acc = k dSb``, ``dS = e^{G_last} dS + q^T dOs`` (c2);
  ``acc = nk D acc + Pt dO``, ``ndvn = -acc`` (c3); ``dS += w^T ndvn`` (c4).
* grad: ``KK`` (g1); ``dk = dQKq^T q`` (g2); ``t = vn dSb^T`` (g3); ``Z' = X^T ndvn``,
  ``dv = dY = -diag(beta) Z'``, ``dbeta = -Z'.Y`` (g4: v_new = Tb Y with Tb = X diag(beta)); ``dY S^T`` (g5);
  ``dX = -(ndvn Y^T) diag(beta)``, ``T1 = X^T dX``, ``dA = -T1 X^T``, ``Ws`` (g6); ``dk += Ws k``, the L2
  Jacobian, dG and its in-chunk reverse cumsum (g7).

``round_to`` (None: exact in the compute dtype, float64 for float64 inputs) rounds where the kernel holds a
16-bit tile: dSb, ndvn, Pt, dQKn/dQKq, dOs, Y, dY, dX, T1, Ws, the seed kernel's R; X is read rounded
(its saved dtype); dq/dk are written per value head in 16 bits and summed over the GVA group in fp32 (B'),
dv in 16 bits, dbeta in beta's dtype, dg/dh0 fp32.

``segments=L`` (§4.6): each sequence's walk is split into walks of L chunks.  Per segment p >= 1 the seed
walk (the chain alone, in R form: ``dS = e^{G_last} dS + R^T dO - w^T diag(nk D) k dSb`` with the state-free
``R = diag(scale nq eG) q - Pt^T w``) gives ``dloc[p]`` from a zero end gradient and, from the seed I with
dO = 0, ``M_p^T``; the scan ``dS_end[p-1] = dloc[p] + M_p^T dS_end[p]`` runs from ``dS_end[last] = dht``, then
every segment's fused walk starts from its own seed.  ``windows=True`` (per value head): where the decay
bound (``cp_bounds.token_log_bound``) summed over a segment's first n chunks drops below cp.py's -150, dloc
walks only those n chunks and ``M_p := 0``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...cp import NEGLIGIBLE_LOG_BOUND
from ...cp_bounds import token_log_bound

C = 64
L2_EPS = 1e-6

# Names of additive terms to drop (tests only: each one must be seen by the oracle comparisons).
_DROPPED: frozenset = frozenset()


def _k(name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if name in _DROPPED else x


def _rounder(dt):
    if dt is None:
        return lambda x: x
    return lambda x: x.to(dt).to(x.dtype)


class _Ctx:
    """Inputs in the compute dtype, kernel layouts, and the walk metadata."""

    def __init__(self, q, k, v, beta, G, X, h, v_new, w, do, scale, cu, l2norm, round_to):
        NT, Hqk, K = q.shape
        Hv, V = v.shape[-2], v.shape[-1]
        exact = round_to is None
        cd = torch.float64 if exact and any(t.dtype == torch.float64 for t in (q, h, v_new, do)) \
            else torch.float32
        self.cd, self.R = cd, _rounder(round_to)
        self.NT, self.Hqk, self.Hv, self.K, self.V, self.ratio = NT, Hqk, Hv, K, V, Hv // Hqk
        self.scale, self.l2norm = float(scale), l2norm
        rep = lambda x: x.to(cd).repeat_interleave(self.ratio, 1)  # noqa: E731  value head h reads q/k head h // ratio
        self.q, self.k = rep(q), rep(k)
        self.v, self.do = v.to(cd), do.to(cd)
        self.beta = beta.to(cd)
        self.G, self.w = G.to(cd), w.to(cd)
        self.X = self.R(X.to(cd))
        self.h, self.vn = h.to(cd), v_new.to(cd)
        self.cu = cu
        nch = [(cu[n + 1] - cu[n] + C - 1) // C for n in range(len(cu) - 1)]
        self.nch = nch
        self.coff = [0]
        for c in nch:
            self.coff.append(self.coff[-1] + c)
        idx = torch.arange(C)
        self.incl = idx[:, None] >= idx[None, :]
        self.strict = idx[:, None] > idx[None, :]
        self._kraw, self._braw = k, beta

    def tile(self, n: int, ci: int) -> dict:
        """Chunk ci of sequence n, [Hv, C, *]: q/k/v/dO rows as TMA reads them (past eos: the next
        sequence's rows, past the tensor: zeros); G, beta masked past eos as the forward saved them."""
        bos, eos = self.cu[n] + ci * C, self.cu[n + 1]
        rows = torch.arange(bos, bos + C)
        valid = rows < eos
        inb = rows < self.NT
        rr = rows.clamp(max=self.NT - 1)
        ld = lambda x: torch.where(inb[:, None, None], x[rr], 0.).transpose(0, 1)  # noqa: E731
        t = dict(n=n, ci=ci, bos=bos, nv=int(valid.sum()), valid=valid, c=self.coff[n] + ci,
                 q=ld(self.q), k=ld(self.k), v=ld(self.v), do=ld(self.do),
                 b=torch.where(valid[:, None], self.beta[rr], 0.).T)
        c = t["c"]
        t.update(G=self.G[c], X=self.X[c], S=self.h[c], vn=self.vn[c], w=self.w[c])
        if self.l2norm:
            t["nq"] = torch.rsqrt((t["q"] * t["q"]).sum(-1) + L2_EPS)
            t["nk"] = torch.rsqrt((t["k"] * t["k"]).sum(-1) + L2_EPS)
        else:
            t["nq"] = t["nk"] = torch.ones(self.Hv, C, dtype=self.cd)
        G = t["G"]
        t["GL"] = G[:, -1]
        t["eG"] = torch.exp(G)
        t["D"] = torch.exp(t["GL"][:, None] - G)
        t["E"] = torch.exp(torch.where(self.incl, G[:, :, None] - G[:, None, :], -math.inf))
        return t


def _jacobian(x, n, d):
    """Back through ``x * n`` (n = rsqrt(|x|^2 + eps)) for the gradient d w.r.t. the normalised rows."""
    return n[..., None] * (d - (n * n * (x * d).sum(-1))[..., None] * x)


def _pt(cx: _Ctx, t: dict) -> torch.Tensor:
    """p2: Pt[j, r] = scale (q_r . k_j) nq_r nk_j E[r, j], r >= j, r < eos (16-bit)."""
    vr = t["valid"][None, :, None]
    P = torch.where(vr, cx.scale * (t["q"] @ t["k"].transpose(-1, -2)) * t["nq"][:, :, None]
                    * t["nk"][:, None, :] * t["E"], 0.)
    return cx.R(P.transpose(-1, -2))


def _prep(cx: _Ctx, t: dict) -> dict:
    R, s = cx.R, cx.scale
    q, k, do, S, vn, nq, nk, eG = t["q"], t["k"], t["do"], t["S"], t["vn"], t["nq"], t["nk"], t["eG"]
    vr = t["valid"][None, :]
    # p2
    QK = q @ k.transpose(-1, -2)
    Pt = _pt(cx, t)
    # p3
    dOs = R(torch.where(vr[..., None], do * (s * nq * eG)[..., None], 0.))
    # p4
    dPm = do @ vn.transpose(-1, -2)
    dQK = torch.where(vr[..., None], s * t["E"] * dPm, 0.)
    Z = dQK * QK * nq[:, :, None] * nk[:, None, :]
    dG = _k("p4.Z", Z.sum(-1) - Z.sum(-2))
    dQKn = R(dQK * nk[:, None, :])
    dQKq = R(dQK * nq[:, :, None])
    # p5
    U = k @ S
    Y = R(t["v"] - (eG * nk)[..., None] * U)
    # p6
    dOS = do @ S.transpose(-1, -2)
    dG = dG + _k("p6.ginter", torch.where(vr, s * eG * nq * (q * dOS).sum(-1), 0.))
    dq = _k("p6.dOS", s * eG[..., None] * dOS) + _k("p6.dQK_k", dQKn @ k)
    if cx.l2norm:
        dq = _jacobian(q, nq, dq)
    return dict(Pt=Pt, dOs=dOs, dQKq=dQKq, Y=Y, dG=dG, dq=R(dq))


def _chain(cx: _Ctx, t: dict, p: dict, dS: torch.Tensor, w_free: bool = False):
    """c1-c4: returns (dS at the chunk start, dSb, ndvn, <S, dS>).

    ``w_free`` (the whole-V design of BACKWARD_PLAN.md, session 14): c4 without w.  The forward's
    ``w = X diag(beta eG nk) k``, so ``w^T ndvn = k^T diag(eG nk) diag(beta) X^T ndvn = k^T dVg`` with
    ``dVg = -diag(eG nk) dY`` and ``dY = -diag(beta) X^T ndvn`` (g4's dv): the kernel forms dY anyway, and the
    walk then needs neither w's tile nor its bytes."""
    R = cx.R
    # c1
    dSb = R(dS)
    SdS = (t["S"] * dS).sum((-1, -2))
    # c2
    acc = _k("c3.kdS", t["k"] @ dSb)
    dS = torch.exp(t["GL"])[:, None, None] * dS + _k("c2.q_dOs", t["q"].transpose(-1, -2) @ p["dOs"])
    # c3
    acc = (t["nk"] * t["D"])[..., None] * acc + _k("c3.Pt_dO", p["Pt"] @ t["do"])
    acc = torch.where(t["valid"][None, :, None], acc, 0.)
    ndvn = R(-acc)
    # c4
    if w_free:
        dY = R(-t["b"][..., None] * (t["X"].transpose(-1, -2) @ ndvn))
        dVg = R(-(t["eG"] * t["nk"])[..., None] * dY)
        dS = dS + _k("c4.w_ndvn", t["k"].transpose(-1, -2) @ dVg)
    else:
        dS = dS + _k("c4.w_ndvn", t["w"].transpose(-1, -2) @ ndvn)
    return dS, dSb, ndvn, SdS


def _grad(cx: _Ctx, t: dict, p: dict, dSb, ndvn, SdS) -> dict:
    R = cx.R
    k, q, S, X, b, nk, eG, D, E = t["k"], t["q"], t["S"], t["X"], t["b"], t["nk"], t["eG"], t["D"], t["E"]
    Y = p["Y"]
    # g1
    KKn = (k @ k.transpose(-1, -2)) * nk[:, :, None] * nk[:, None, :]
    # g2
    dk = _k("g2.dQKq_q", p["dQKq"].transpose(-1, -2) @ q)
    # g3
    tt = t["vn"] @ dSb.transpose(-1, -2)
    dD = _k("g3.dD", nk * (k * tt).sum(-1))
    dk = dk + _k("g3.Dt", D[..., None] * tt)
    # g4: v_new = Tb Y, Tb = X diag(beta)
    Zp = X.transpose(-1, -2) @ ndvn
    dY = R(-b[..., None] * Zp)
    db = _k("g4.ZY", -(Zp * Y).sum(-1))
    # g5
    dYS = dY @ S.transpose(-1, -2)
    dk = dk + _k("g5.dYS", -eG[..., None] * dYS)
    dG = p["dG"] + _k("g5.dG", -eG * nk * (dYS * k).sum(-1))
    # g6
    dX = R(-(ndvn @ Y.transpose(-1, -2)) * b[:, None, :])
    T1 = R(X.transpose(-1, -2) @ dX)
    dA = torch.where(cx.strict, -(T1 @ X.transpose(-1, -2)), 0.)
    W = dA * b[:, :, None] * E
    Ws = R((W + W.transpose(-1, -2)) * nk[:, None, :])
    db = db + _k("g6.dA_KK", (dA * KKn * E).sum(-1))
    dAA = dA * torch.where(cx.strict, b[:, :, None] * KKn * E, 0.)
    # g7
    dk = dk + _k("g7.Ws_k", Ws @ k)
    if cx.l2norm:
        dk = _jacobian(k, nk, dk)
    dG = dG - D * dD + _k("g6.dAA", dAA.sum(-1) - dAA.sum(-2))
    last = _k("c1.SdS", torch.exp(t["GL"]) * SdS) + (D * dD).sum(-1)
    dG = torch.cat([dG[:, :-1], dG[:, -1:] + last[:, None]], -1)
    dg = dG.flip(-1).cumsum(-1).flip(-1)
    return dict(dk=R(dk), dv=dY, db=db, dg=dg)


def _fused_walk(cx: _Ctx, out: dict, n: int, chunks, dS: torch.Tensor, w_free: bool = False) -> torch.Tensor:
    """The fused kernel's walk over ``chunks`` of sequence n (in reverse) from the end gradient dS;
    writes every chunk's gradients, returns dS at the first chunk's start."""
    for ci in reversed(chunks):
        t = cx.tile(n, ci)
        p = _prep(cx, t)
        dS, dSb, ndvn, SdS = _chain(cx, t, p, dS, w_free)
        gr = _grad(cx, t, p, dSb, ndvn, SdS)
        sl = slice(t["bos"], t["bos"] + t["nv"])
        nv = t["nv"]
        out["dq"][sl] = p["dq"][:, :nv].transpose(0, 1)
        out["dk"][sl] = gr["dk"][:, :nv].transpose(0, 1)
        out["dv"][sl] = gr["dv"][:, :nv].transpose(0, 1)
        out["dg"][sl] = gr["dg"][:, :nv].T
        out["db"][sl] = gr["db"][:, :nv].T
    return dS


def _seed_walk(cx: _Ctx, n: int, chunks, dS: torch.Tensor, with_do: bool, start=None) -> torch.Tensor:
    """The seed kernel's chain in R form over ``chunks`` (in reverse).  ``start[h]``: head h's chain starts at
    chunk index ``start[h]`` (its window), dS of later chunks is discarded."""
    R = cx.R
    for ci in reversed(chunks):
        t = cx.tile(n, ci)
        vr = t["valid"][None, :, None]
        ndv = R(torch.where(vr, -(t["nk"] * t["D"])[..., None] * (t["k"] @ R(dS)), 0.))
        dS = torch.exp(t["GL"])[:, None, None] * dS + _k("seed.w_kdS", t["w"].transpose(-1, -2) @ ndv)
        if with_do:
            Rm = torch.where(vr, (cx.scale * t["nq"] * t["eG"])[..., None] * t["q"], 0.) \
                - _pt(cx, t).transpose(-1, -2) @ t["w"]
            dS = dS + _k("seed.R_dO", R(Rm).transpose(-1, -2) @ t["do"])
        if start is not None:
            dS = torch.where((ci <= start)[:, None, None], dS, 0.)
    return dS


def _windows(cx: _Ctx, n: int, chunks) -> torch.Tensor:
    """Per value head, the fewest leading chunks of ``chunks`` whose summed decay bound is below -150 (the
    product of their maps is negligible), as the last chunk index of the window; -1: no window."""
    bos = cx.cu[n] + chunks[0] * C
    eos = min(cx.cu[n] + (chunks[-1] + 1) * C, cx.cu[n + 1])
    kb = cx._kraw[bos:eos][None]
    bb = cx._braw[bos:eos][None]
    ell = token_log_bound(kb, torch.zeros_like(bb, dtype=torch.float32), bb, cx.l2norm).double()
    cum = torch.zeros(cx.Hv, dtype=torch.float64)
    start = torch.full((cx.Hv,), -1, dtype=torch.long)
    for j, ci in enumerate(chunks):
        a = ci * C - chunks[0] * C
        cum = cum + ell[a:a + C].sum(0) + cx.G[cx.coff[n] + ci][:, -1].double()
        hit = (start < 0) & (cum < NEGLIGIBLE_LOG_BOUND)
        start = torch.where(hit, torch.full_like(start, ci), start)
    return start


def bwd_fused_ref(q, k, v, beta, G, X, h, v_new, w, do, dht=None, *, scale: float, cu_seqlens=None,
                  l2norm: bool = False, round_to: Optional[torch.dtype] = None, segments: Optional[int] = None,
                  windows: bool = False, info: Optional[dict] = None, w_free: bool = False):
    """The fused backward of one call.

    q, k ``[NT, Hqk, K]``; v, do ``[NT, Hv, V]``; beta ``[NT, Hv]`` (leading [B, T] is flattened); G
    ``[NC, Hv, 64]``; X ``[NC, Hv, 64, 64]``; h ``[NC, Hv, K, V]`` (state at each chunk start); v_new
    ``[NC, Hv, 64, V]``; w ``[NC, Hv, 64, K]``; chunks numbered sequence by sequence; dht ``[N, Hv, K, V]`` or
    None; cu_seqlens ``[N + 1]`` (None: one sequence of NT tokens).  Returns (dq ``[NT, Hqk, K]``, dk, dv
    ``[NT, Hv, V]``, dg ``[NT, Hv]``, dbeta ``[NT, Hv]``, dh0 ``[N, Hv, K, V]``) in the compute dtype, rounded
    as the kernel writes them.  ``info`` (a dict) receives ``windows``: how many (segment, head) seed walks
    had a window.  ``w_free``: the chain's c4 through ``k^T dVg`` instead of ``w^T ndvn`` (``_chain``)."""
    K, V = q.shape[-1], v.shape[-1]
    Hqk, Hv = q.shape[-2], v.shape[-2]
    q, k = q.reshape(-1, Hqk, K), k.reshape(-1, Hqk, K)
    v, do = v.reshape(-1, Hv, V), do.reshape(-1, Hv, V)
    beta = beta.reshape(-1, Hv)
    NT = q.shape[0]
    cu = [0, NT] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    cx = _Ctx(q, k, v, beta, G, X, h, v_new, w, do, scale, cu, l2norm, round_to)
    cd, N = cx.cd, len(cu) - 1
    out = dict(dq=torch.zeros(NT, Hv, K, dtype=cd), dk=torch.zeros(NT, Hv, K, dtype=cd),
               dv=torch.zeros(NT, Hv, V, dtype=cd), dg=torch.zeros(NT, Hv, dtype=cd),
               db=torch.zeros(NT, Hv, dtype=cd))
    dh0 = torch.zeros(N, Hv, K, V, dtype=cd)
    nwin = 0
    for n in range(N):
        dS_end = dht[n].to(cd).clone() if dht is not None else torch.zeros(Hv, K, V, dtype=cd)
        allc = list(range(cx.nch[n]))
        if not segments or cx.nch[n] <= segments:
            dh0[n] = _fused_walk(cx, out, n, allc, dS_end, w_free)
            continue
        segs = [allc[a:a + segments] for a in range(0, len(allc), segments)]
        P = len(segs)
        # seeds: dloc[p], M_p^T for p >= 1 (independent walks), then the scan from the sequence end
        seeds = [None] * P
        seeds[P - 1] = dS_end
        dloc, Mt = [None] * P, [None] * P
        eye = torch.eye(K, dtype=cd).expand(Hv, K, K)
        for p in range(1, P):
            start = _windows(cx, n, segs[p]) if windows else torch.full((Hv,), -1, dtype=torch.long)
            has = start >= 0
            nwin += int(has.sum())
            st = torch.where(has, start, torch.full_like(start, segs[p][-1]))
            dloc[p] = _seed_walk(cx, n, segs[p], torch.zeros(Hv, K, V, dtype=cd), True, st)
            # M_p^T from the seed I with dO = 0; heads with a window: M_p := 0 (their walks would stop at once)
            Mt[p] = torch.where(has[:, None, None], 0., _seed_walk(cx, n, segs[p], eye.clone(), False))
        for p in range(P - 1, 0, -1):
            seeds[p - 1] = dloc[p] + _k("scan.M", Mt[p] @ seeds[p])
        for p in range(P - 1, -1, -1):
            dS0 = _fused_walk(cx, out, n, segs[p], seeds[p], w_free)
            if p == 0:
                dh0[n] = dS0
    if info is not None:
        info["windows"] = nwin
    R = cx.R
    gsum = lambda x: R(x.reshape(NT, Hqk, cx.ratio, K).sum(2))  # noqa: E731  (per-head 16-bit, fp32 sum)
    bdt = beta.dtype if beta.dtype in (torch.bfloat16, torch.float16) and round_to is not None else None
    db = _rounder(bdt)(out["db"])
    return gsum(out["dq"]), gsum(out["dk"]), out["dv"], out["dg"], db, dh0
