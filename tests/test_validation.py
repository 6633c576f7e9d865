"""Every malformed input gets a TypeError/ValueError naming the argument (never a crash or wrong answer)."""

from __future__ import annotations

import pytest
import torch

import flashqla
from flashqla.testing import Case, make_inputs


def _args(**kw):
    case = Case("v", 2, 4, 16, 16, B=1, T=20, seqlens=kw.pop("seqlens", None))
    x = make_inputs(case, torch.float32)
    a = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
             cu_seqlens=x["cu_seqlens"], output_final_state=True)
    a.update(kw)
    return a


def _call(**kw):
    a = _args(**kw)
    return flashqla.chunk_gated_delta_rule(**a)


T = 20


@pytest.mark.parametrize("kw,exc,match", [
    (dict(q=torch.randn(1, T, 2)), ValueError, r"q must be 4-D"),
    (dict(k=torch.randn(1, T, 2, 8)), ValueError, r"k must have shape"),
    (dict(v=torch.randn(1, T, 4)), ValueError, r"v must be 4-D"),
    (dict(v=torch.randn(1, T + 1, 4, 16)), ValueError, r"v must have shape \[B, T, Hv, V\]"),
    (dict(g=torch.randn(1, T, 3)), ValueError, r"g must have shape \[B, T, Hv\]"),
    (dict(beta=torch.rand(1, T - 1, 4)), ValueError, r"beta must have shape"),
    (dict(v=torch.randn(1, T, 3, 16), g=torch.randn(1, T, 3), beta=torch.rand(1, T, 3), initial_state=None),
     ValueError, r"multiple of the query/key heads"),
    (dict(q=torch.randn(1, T, 2, 300), k=torch.randn(1, T, 2, 300), initial_state=None), ValueError,
     r"unsupported head dim K"),
    (dict(v=torch.randn(1, T, 4, 512), initial_state=None), ValueError, r"unsupported head dim V"),
    (dict(g=torch.randint(0, 3, (1, T, 4))), TypeError, r"g must be a floating tensor"),
    (dict(beta=torch.ones(1, T, 4, dtype=torch.int32)), TypeError, r"beta must be a floating tensor"),
    (dict(q=torch.randn(1, T, 2, 16, dtype=torch.float64)), TypeError, r"share one dtype"),
    (dict(q="not a tensor"), TypeError, r"q must be a torch.Tensor"),
    (dict(initial_state=torch.zeros(2, 4, 16, 16)), ValueError, r"initial_state must have shape \[N, Hv, K, V\]"),
    (dict(initial_state=torch.zeros(1, 4, 16, 8)), ValueError, r"initial_state must have shape"),
    (dict(initial_state=torch.zeros(1, 4, 16, 16, dtype=torch.bfloat16)), TypeError, r"initial_state must be float32"),
    (dict(scale="0.5"), TypeError, r"scale must be a Python float"),
    (dict(scale=float("nan")), ValueError, r"scale must be finite"),
    (dict(backend=3), TypeError, r"backend must be a string"),
    (dict(backend="nope"), ValueError, r"unknown backend 'nope'"),
])
def test_malformed_dense(kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(**kw)


@pytest.mark.parametrize("cu,exc,match", [
    (torch.tensor([0, 5, 20], dtype=torch.int64), TypeError, r"cu_seqlens must be int32"),
    (torch.tensor([1, 5, 20], dtype=torch.int32), ValueError, r"cu_seqlens must start at 0"),
    (torch.tensor([0, 12, 5, 20], dtype=torch.int32), ValueError, r"cu_seqlens must be non-decreasing"),
    (torch.tensor([0, 5, 19], dtype=torch.int32), ValueError, r"cu_seqlens\[-1\] must equal the number of tokens"),
    (torch.tensor([[0, 5, 20]], dtype=torch.int32), ValueError, r"cu_seqlens must be 1-D"),
    ([0, 5, 20], TypeError, r"cu_seqlens must be an int32 torch.Tensor"),
])
def test_malformed_cu_seqlens(cu, exc, match):
    with pytest.raises(exc, match=match):
        _call(seqlens=(5, 15), cu_seqlens=cu)


def test_cu_seqlens_needs_packed_batch():
    a = _args(initial_state=None)
    a.update({n: torch.cat([a[n], a[n]], 0) for n in ("q", "k", "v", "g", "beta")})
    a["cu_seqlens"] = torch.tensor([0, 5, T], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"B = 1"):
        flashqla.chunk_gated_delta_rule(**a)


def test_initial_state_matches_number_of_sequences():
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, Hv, K, V\] = \(2, 4, 16, 16\)"):
        _call(seqlens=(5, 15), initial_state=torch.zeros(1, 4, 16, 16))


def test_tensors_on_different_devices():
    meta = torch.randn(1, T, 4, device="meta")
    with pytest.raises(ValueError, match=r"g is on meta but q is on cpu"):
        _call(g=meta)
    with pytest.raises(ValueError, match=r"initial_state is on meta"):
        _call(initial_state=torch.zeros(1, 4, 16, 16, device="meta"))
    with pytest.raises(ValueError, match=r"cu_seqlens is on meta"):
        _call(seqlens=(5, 15), cu_seqlens=torch.tensor([0, 5, T], dtype=torch.int32, device="meta"))


def test_zero_tokens_passes_state_through():
    a = _args()
    a.update({n: a[n][:, :0] for n in ("q", "k", "v", "g", "beta")})
    o, ht = flashqla.chunk_gated_delta_rule(**a)
    assert o.shape == (1, 0, 4, 16)
    torch.testing.assert_close(ht, a["initial_state"])


def test_varlen_meta_reuse_and_mismatch():
    a = _args(seqlens=(5, 15))
    meta = flashqla.prepare_varlen(a["cu_seqlens"])
    o1, h1 = flashqla.chunk_gated_delta_rule(**a)
    a2 = dict(a, cu_seqlens=None)
    o2, h2 = flashqla.chunk_gated_delta_rule(**a2, varlen_meta=meta)
    torch.testing.assert_close(o1, o2)
    with pytest.raises(TypeError, match="varlen_meta must come from flashqla.prepare_varlen"):
        flashqla.chunk_gated_delta_rule(**a2, varlen_meta=(0, 5, 20))
    with pytest.raises(ValueError, match="different batches"):
        flashqla.chunk_gated_delta_rule(**dict(a, cu_seqlens=torch.tensor([0, 20], dtype=torch.int32)),
                                        varlen_meta=meta)
