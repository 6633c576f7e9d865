"""A GatedDeltaNet-style layer on flashqla: chunked prefill, then decode steps on a state pool.

The layer (as in Qwen3-Next / FLA's GatedDeltaNet): q/k/v projections, each through a short causal
depthwise conv1d + SiLU; the decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``
from two small projections; the gated delta rule (q/k L2-normalised inside the op); an output gate
``RMSNorm(o) * silu(gate)``; the output projection.

Serving keeps, per request slot, two pieces of state, both in pools indexed by slot:

* the recurrent state, ``[P, Hv, V, K]`` (``state_layout="VK"``, what serving engines use);
* the conv state, the last ``conv_size - 1`` (pre-conv) inputs of q, k and v: ``[P, channels, conv_size - 1]``.

``prefill`` runs whole prompts with :func:`flashqla.chunk_gated_delta_rule` (``output_final_state=True``)
and stores both states at the requests' slots; ``decode`` runs one (or a few, for speculative verify)
tokens per request with :func:`flashqla.decode.gated_delta_rule_decode`, which updates the pool in place;
slot ``-1`` marks a padded batch row.

Run it (CPU is fine): ``python examples/gated_deltanet.py`` -- it prefills three prompts, decodes a few
steps (with a padded row and a 2-token verify step), and checks the outputs against one prefill over the
whole sequences.  ``--compile`` also runs the decode step through ``torch.compile(fullgraph=True)``
(via the custom ops of :mod:`flashqla.library`).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import flashqla
from flashqla import library
from flashqla.decode import gated_delta_rule_decode


class GDNStatePool:
    """Per-slot recurrent and conv states of one layer."""

    def __init__(self, num_slots: int, layer: "GatedDeltaNet", state_dtype=torch.float32, device="cpu"):
        self.num_slots = num_slots
        self.recurrent = torch.zeros(num_slots, layer.num_v_heads, layer.head_v_dim, layer.head_k_dim,
                                     dtype=state_dtype, device=device)
        # One extra conv row (index num_slots) is scratch for padded batch rows, so the conv update is a
        # plain index_copy_ with no data-dependent shapes (torch.compile friendly).
        self.conv = torch.zeros(num_slots + 1, layer.conv_channels, layer.conv_size - 1, device=device)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int = 128, num_k_heads: int = 2, num_v_heads: int = 4, head_k_dim: int = 32,
                 head_v_dim: int = 32, conv_size: int = 4, norm_eps: float = 1e-6):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError("num_v_heads must be a multiple of num_k_heads")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.conv_size = conv_size
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_channels = 2 * self.key_dim + self.value_dim
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        # One depthwise causal conv over the concatenated q|k|v channels (same as three separate ones).
        self.conv_weight = nn.Parameter(torch.randn(self.conv_channels, conv_size) / math.sqrt(conv_size))
        # Decay parameters as in Mamba2/GDN: A in [1, 16], dt in [1e-3, 0.1] through an inverse softplus.
        self.A_log = nn.Parameter(torch.empty(num_v_heads).uniform_(1, 16).log())
        dt = torch.exp(torch.rand(num_v_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(head_v_dim))
        self.norm_eps = norm_eps
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    # -- pieces shared by prefill and decode -------------------------------------------------------

    def _qkv_in(self, x):
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)   # [B, T, C]

    def _split(self, mixed):
        B, T, _ = mixed.shape
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], -1)
        return (q.reshape(B, T, self.num_k_heads, self.head_k_dim), k.reshape(B, T, self.num_k_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def _gates(self, x):
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)   # [B, T, Hv] fp32
        beta = torch.sigmoid(self.b_proj(x))
        return g, beta

    def _out(self, x, o):
        B, T = o.shape[:2]
        gate = self.g_proj(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        of = o.float()
        of = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.o_norm_weight
        of = of * F.silu(gate.float())
        return self.o_proj(of.to(x.dtype).reshape(B, T, self.value_dim))

    # -- prefill: whole prompts ---------------------------------------------------------------------

    def prefill(self, x: torch.Tensor, pool: GDNStatePool = None, slots: torch.Tensor = None):
        """x ``[B, T, hidden]`` (B prompts of T tokens, T >= 1).  Stores the states at ``slots`` (int32 [B])."""
        B, T, _ = x.shape
        W = self.conv_size
        pre = self._qkv_in(x)                                        # [B, T, C], before the conv
        mixed = F.conv1d(F.pad(pre.transpose(1, 2), (W - 1, 0)), self.conv_weight[:, None, :],
                         groups=self.conv_channels).transpose(1, 2)
        q, k, v = self._split(F.silu(mixed))
        g, beta = self._gates(x)
        o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=pool is not None,
                                                use_qk_l2norm_in_kernel=True)
        if pool is not None:
            rows = slots.long()
            pool.recurrent[rows] = ht.transpose(-1, -2).to(pool.recurrent.dtype)
            tail = F.pad(pre.transpose(1, 2), (W - 1, 0))[..., -(W - 1):]   # zeros in front of short prompts
            pool.conv[rows] = tail.to(pool.conv.dtype)
        return self._out(x, o)

    # -- decode: a few new tokens per request -------------------------------------------------------

    def decode(self, x: torch.Tensor, pool: GDNStatePool, slots: torch.Tensor, use_custom_op: bool = False):
        """x ``[B, T, hidden]`` with small T (1 for decode, more for a verify step); ``slots`` int32 [B], -1 for
        a padded row.  Both pools are updated in place at the live slots.  ``use_custom_op``: call the
        ``torch.library`` op (what a ``torch.compile``'d step needs) instead of the eager function."""
        W = self.conv_size
        conv_rows = torch.where(slots >= 0, slots, pool.num_slots).long()   # padded rows -> scratch row
        pre = self._qkv_in(x).transpose(1, 2)                               # [B, C, T]
        window = torch.cat([pool.conv[conv_rows].to(pre.dtype), pre], -1)  # [B, C, W - 1 + T]
        mixed = F.conv1d(window, self.conv_weight[:, None, :], groups=self.conv_channels).transpose(1, 2)
        pool.conv.index_copy_(0, conv_rows, window[..., -(W - 1):].to(pool.conv.dtype))
        q, k, v = self._split(F.silu(mixed))
        g, beta = self._gates(x)
        decode = library.gated_delta_rule_decode if use_custom_op else gated_delta_rule_decode
        o = decode(q, k, v, g, beta, pool.recurrent, slots, use_qk_l2norm_in_kernel=True, state_layout="VK")
        return self._out(x, o)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compile", action="store_true", help="also run a decode step under torch.compile")
    ap.add_argument("--bf16-state", action="store_true", help="keep the recurrent pool in bfloat16")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layer = GatedDeltaNet().to(dev)
    hidden = layer.q_proj.in_features
    B, T_prompt, P = 3, 20, 8
    steps = [1, 1, 2, 1]                             # tokens per decode call (2 = a verify step)
    T_total = T_prompt + sum(steps)
    x = torch.randn(B, T_total, hidden, device=dev)
    slots = torch.tensor([5, 1, 3], dtype=torch.int32, device=dev)
    pool = GDNStatePool(P, layer, torch.bfloat16 if args.bf16_state else torch.float32, dev)

    with torch.no_grad():
        reference = layer.prefill(x)                 # the whole sequences in one prefill, no cache
        outs = [layer.prefill(x[:, :T_prompt], pool, slots)]
        t = T_prompt
        for i, n in enumerate(steps):
            xs, sl = x[:, t:t + n], slots
            if i == 1:  # one step with a padded batch row: slot -1 is skipped (zeros out, pools untouched)
                xs = torch.cat([xs, torch.randn(1, n, hidden, device=dev)], 0)
                sl = torch.cat([slots, slots.new_tensor([-1])])
            y = layer.decode(xs, pool, sl)
            outs.append(y[:B])
            t += n
        served = torch.cat(outs, 1)
        err = ((served - reference).norm() / reference.norm()).item()
        tol = 2e-2 if args.bf16_state else 1e-4
        print(f"device {dev}: prefill {T_prompt} tokens x {B} requests, then decode steps {steps}")
        print(f"relative L2 error of prefill+decode vs one prefill over all {T_total} tokens: {err:.2e} "
              f"(tolerance {tol:g})")
        ok = err <= tol

        if args.compile:
            step = torch.compile(lambda xx, ss: layer.decode(xx, pool, ss, use_custom_op=True), fullgraph=True)
            xn = torch.randn(B, 1, hidden, device=dev)
            pool_copy = GDNStatePool(P, layer, pool.recurrent.dtype, dev)
            pool_copy.recurrent.copy_(pool.recurrent)
            pool_copy.conv.copy_(pool.conv)
            y_eager = layer.decode(xn, pool_copy, slots)
            y_comp = step(xn, slots)
            cerr = ((y_comp - y_eager).norm() / y_eager.norm()).item()
            print(f"torch.compile(fullgraph=True) decode step vs eager: {cerr:.2e}")
            ok = ok and cerr <= 1e-5 and torch.allclose(pool.recurrent.float(), pool_copy.recurrent.float(),
                                                        atol=1e-5)
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
