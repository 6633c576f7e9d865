"""Plain PyTorch references for the gated delta rule: the oracle of every test.

Two forms of the same function:

* :func:`recurrent_gated_delta_rule_ref` walks the recurrence token by token.  Run it in float64 and
  it is the oracle every backend is compared with.  Per value head ``h`` (query/key head
  ``h // (Hv // Hqk)``) and token ``t``::

      S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T
      o_t = scale * S_t^T q_t

* :func:`chunk_gated_delta_rule_ref` is the chunked (chunk 64) form the GPU kernels implement, written
  with ordinary differentiable tensor ops so autograd gives its backward.  Within a chunk with
  cumulative log-gate ``G`` (``Gamma = exp(G)``) and start state ``S0``::

      A[r, j] = beta_r (k_r . k_j) exp(G_r - G_j)       for j < r (strictly lower)
      T       = (I + A)^-1                                (UT transform, unit lower triangular)
      w       = T (beta * Gamma * k)        u = T (beta * v)
      v_new   = u - w S0
      o       = scale * (Gamma * q) S0 + scale * ((q k^T) * exp(G_r - G_j), j <= r) v_new
      S_next  = Gamma_C * S0 + (exp(G_C - G) * k)^T v_new

Both handle varlen (``cu_seqlens``), GVA (Hv a multiple of Hqk), an initial state, the final state,
the fused q/k L2 norm option, lengths that are not a multiple of 64 and zero-length sequences.
They take tensors in any floating dtype and compute in ``compute_dtype`` (default: float64 when any
input is float64, else float32); ``o`` comes back in ``v``'s dtype and the state in the compute dtype.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` along the last dim (the form the fused kernels use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _sequence_bounds(B: int, T: int, cu_seqlens) -> list[tuple[int, int, int]]:
    """(batch index, start, end) per sequence."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    if isinstance(cu_seqlens, torch.Tensor):
        cu = [int(x) for x in cu_seqlens.tolist()]
    else:
        cu = [int(x) for x in cu_seqlens]
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, compute_dtype):
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    cd = compute_dtype
    q, k, v, g, beta = (x.to(cd) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    ratio = v.shape[2] // q.shape[2]
    if ratio > 1:
        q = q.repeat_interleave(ratio, dim=2)
        k = k.repeat_interleave(ratio, dim=2)
    return q, k, v, g, beta, float(scale)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens=None,
    compute_dtype: Optional[torch.dtype] = None,
):
    """Token-by-token recurrence; returns ``(o, final_state or None)``.  Differentiable."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    cd = compute_dtype or _compute_dtype(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf, scale = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cd)
    seqs = _sequence_bounds(B, T, cu_seqlens)
    outs = [[] for _ in range(B)]
    finals = []
    for n, (b, bos, eos) in enumerate(seqs):
        if initial_state is not None:
            S = initial_state[n].to(cd)
        else:
            S = qf.new_zeros(Hv, K, V)
        for t in range(bos, eos):
            S = S * torch.exp(gf[b, t])[:, None, None]
            pred = torch.einsum("hkv,hk->hv", S, kf[b, t])
            delta = (vf[b, t] - pred) * bf[b, t][:, None]
            S = S + kf[b, t][:, :, None] * delta[:, None, :]
            outs[b].append(torch.einsum("hkv,hk->hv", S, qf[b, t]) * scale)
        finals.append(S)
    o = torch.stack([torch.stack(rows, 0) if rows else vf.new_zeros(0, Hv, V) for rows in outs], 0)
    final = torch.stack(finals, 0) if output_final_state else None
    return o.to(v.dtype), final


def _chunk_one_sequence(q, k, v, g, beta, scale, S0, chunk_size):
    """Chunked form for one sequence.  q, k: [L, H, K]; v: [L, H, V]; g, beta: [L, H]; S0: [H, K, V]."""
    L, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if L == 0:
        return v.new_zeros(0, H, V), S0
    n = (L + C - 1) // C
    pad = n * C - L
    if pad:
        # Zero k, v, beta and g leave the state unchanged: the padded tokens are exact no-ops.
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # [H, n, C, *]
    q, k, v = (x.reshape(n, C, H, -1).permute(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(n, C, H).permute(2, 0, 1) for x in (g, beta))
    G = g.cumsum(-1)
    diff = G[..., :, None] - G[..., None, :]
    idx = torch.arange(C, device=q.device)
    strict = idx[:, None] > idx[None, :]
    incl = idx[:, None] >= idx[None, :]
    decay_strict = torch.exp(diff.masked_fill(~strict, float("-inf")))
    decay_incl = torch.exp(diff.masked_fill(~incl, float("-inf")))
    A = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay_strict
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    gamma = torch.exp(G)
    rhs = torch.cat([beta[..., None] * gamma[..., None] * k, beta[..., None] * v], -1)
    sol = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    w, u = sol[..., :K], sol[..., K:]
    attn = (q @ k.transpose(-1, -2)) * decay_incl
    outs = []
    S = S0
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ S
        o_c = (gamma[:, c, :, None] * q[:, c]) @ S + attn[:, c] @ v_new
        outs.append(o_c * scale)
        g_last = G[:, c, -1]
        k_decayed = torch.exp(g_last[:, None] - G[:, c])[..., None] * k[:, c]
        S = torch.exp(g_last)[:, None, None] * S + k_decayed.transpose(-1, -2) @ v_new
    o = torch.stack(outs, 1).reshape(H, n * C, V).permute(1, 0, 2)[:L]
    return o, S


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens=None,
    chunk_size: int = CHUNK_SIZE,
    compute_dtype: Optional[torch.dtype] = None,
):
    """Chunked (UT/WY) form; returns ``(o, final_state or None)``.  Differentiable by autograd."""
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    cd = compute_dtype or _compute_dtype(q, k, v, g, beta, initial_state)
    qf, kf, vf, gf, bf, scale = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cd)
    seqs = _sequence_bounds(B, T, cu_seqlens)
    pieces: list[list[torch.Tensor]] = [[] for _ in range(B)]
    finals = []
    for n, (b, bos, eos) in enumerate(seqs):
        S0 = initial_state[n].to(cd) if initial_state is not None else qf.new_zeros(Hv, K, V)
        o_n, S_n = _chunk_one_sequence(qf[b, bos:eos], kf[b, bos:eos], vf[b, bos:eos], gf[b, bos:eos],
                                       bf[b, bos:eos], scale, S0, chunk_size)
        pieces[b].append(o_n)
        finals.append(S_n)
    o = torch.stack([torch.cat(p, 0) if p else vf.new_zeros(T, Hv, V) for p in pieces], 0)
    final = torch.stack(finals, 0) if output_final_state else None
    return o.to(v.dtype), final

