"""CPU experiment (session 33, issue #8): what the whole-V backward's gradients would lose if the training forward
saved only every other chunk state, the odd ones rebuilt from the previous saved bf16 state, k and the saved v_new
(``S_c = e^{G_last} S_{c-1} + k_{c-1}^T (e^{G_last - G} * v_new_{c-1})``, rounded to bf16 as a saved state is).

It feeds ``chunk_bwd_fused_ref.bwd_fused_ref`` (the kernel's CPU model, bf16 rounding points, w-free order) the
forward emulation's saved tensors, once as saved and once with the odd states rebuilt, and prints each gradient's
relative L2 error against the float64 oracle.  Usage: ``python benchmarks/half_states_numerics.py`` (~2 min).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from test_tilelang_bwd_fused_ref import GRADS, _oracle, _saved, fused  # noqa: E402

from flashqla.testing import Case, rel_l2  # noqa: E402

CASES = [Case("bf16_gva2", 1, 2, 128, 128, seqlens=(64 * 12 + 17,)),
         Case("bf16_gva2_no_decay", 1, 2, 128, 128, seqlens=(64 * 12,), gate="zero"),
         Case("bf16_strong_decay", 1, 2, 128, 128, seqlens=(64 * 10 + 5,), gate="strong")]


def rebuild_odd_states(h, G, v_new, k, ratio):
    """``h`` with every odd chunk's state rebuilt from the chunk before (one sequence, chunks in order)."""
    NC, Hv = G.shape[:2]
    K = k.shape[-1]
    padded = torch.zeros(NC * 64, k.shape[1], K, dtype=k.dtype)
    padded[:k.shape[0]] = k
    out = h.clone()
    for c in range(1, NC, 2):
        for hv in range(Hv):
            g = G[c - 1, hv].float()
            kc = padded[(c - 1) * 64:c * 64, hv // ratio].float()
            state = torch.exp(g[-1]) * h[c - 1, hv].float() + kc.T @ (torch.exp(g[-1] - g)[:, None] * v_new[c - 1, hv].float())
            out[c, hv] = state.to(h.dtype)
    return out


def main() -> None:
    dt = torch.bfloat16
    for case in CASES:
        inp, st, scale = _saved(case, dt, dt)
        ref = _oracle(case, dt)
        k = inp["k"].reshape(-1, inp["k"].shape[2], inp["k"].shape[3])
        ratio = st["G"].shape[1] // k.shape[1]
        rebuilt = rebuild_odd_states(st["h"], st["G"], st["v_new"], k, ratio)
        T = inp["q"].shape[1]
        errs = {}
        for name, h in (("saved", st["h"]), ("rebuilt", rebuilt)):
            grads = fused.bwd_fused_ref(inp["q"], inp["k"], inp["v"], inp["beta"], st["G"], st["X"], h, st["v_new"],
                                        st["w"], inp["do"], inp["dht"] if case.ht else None, scale=scale,
                                        cu_seqlens=[0, T], round_to=dt, w_free=True)
            errs[name] = {n: rel_l2(t.double().reshape(ref[n].shape), ref[n].double())
                          for n, t in zip(GRADS, grads) if n in ref}
        print(f"{case.name}: states rebuilt vs saved, rel-L2 {rel_l2(rebuilt.double(), st['h'].double()):.2e}")
        for n in errs["saved"]:
            print(f"  {n:6s} rel-L2 vs float64: saved states {errs['saved'][n]:.3e}, rebuilt {errs['rebuilt'][n]:.3e}")


if __name__ == "__main__":
    main()
