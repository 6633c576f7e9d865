"""In-kernel context parallelism of the tilelang forward (``backends/tilelang/segments.py``): the split, the
segment tables, the halo search (torch and Triton), the exactness of a halo walk in float64 on the CPU, the
kernel variant's lowering, and on an sm_90 GPU the split forward against the oracle and the unsplit one."""

import math
import os

import pytest
import torch

import flashqla
from flashqla.backends.tilelang import segments as sg
from flashqla.reference import l2norm as ref_l2norm
from flashqla.testing import Case, make_gate, rel_l2

try:
    import tilelang  # noqa: F401
    HAVE_TILELANG = True
except Exception:
    HAVE_TILELANG = False


# ---- the split -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lengths,seg", [([32768], 32), ([28672, 4096], 150), ([0, 1, 63, 64, 65, 700], 3),
                                         ([130], 1), ([4096 + 17], 7)])
def test_split_lengths_cover_each_sequence_in_whole_chunks(lengths, seg):
    parts = sg.split_lengths(lengths, seg)
    for n, segs in zip(lengths, parts):
        assert sum(segs) == n
        nc = -(-n // 64)
        assert len(segs) == max(1, -(-nc // seg))
        # every segment but the last is whole chunks; balanced to a chunk
        assert all(s % 64 == 0 for s in segs[:-1])
        chunks = [-(-s // 64) for s in segs]
        assert max(chunks) - min(chunks) <= 1 and max(chunks) <= max(seg, 1)


def test_segment_tables():
    t = sg.segment_tables([130, 0, 300], 2, "cpu")
    # 130 -> 128 + 2 (chunks 2 + 1), 0 -> one empty segment, 300 -> 5 chunks in 3 segments (2, 2, 1)
    assert t.cu_seqlens.tolist() == [0, 128, 130, 130, 258, 386, 430]
    assert t.chunk_offsets.tolist() == [0, 2, 3, 3, 5, 7, 8]
    assert t.seg_table.tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [1, 3, 1, 0], [2, 3, 0, 0], [2, 3, 0, 0],
                                    [2, 3, 1, 0]]
    # the backward's table: (sequence, its end chunk, is-first, its end token)
    assert t.seg_table_bwd.tolist() == [[0, 3, 1, 130], [0, 3, 0, 130], [1, 3, 1, 130], [2, 8, 1, 430],
                                        [2, 8, 0, 430], [2, 8, 0, 430]]
    assert t.num_segments == 6 and t.split_seqs == 2
    assert sg.segment_tables([130, 0, 300], 2, "cpu") is t      # cached


def test_segment_plan_splits_few_long_walks_only(monkeypatch):
    monkeypatch.delenv("FLASHQLA_TILELANG_SEGMENTS", raising=False)
    p = sg.segment_plan([32768], 8, 128, 132, 32)
    assert p is not None and p.bv == 128 and 8 * p.num_segments * (128 // p.bv) <= 132
    assert p.num_segments >= 8 and p.est_us < 0.5 * p.est_plain_us
    assert "segments" in p.describe()
    p = sg.segment_plan([32768], 32, 128, 132, 32)
    assert p is not None and 32 * p.num_segments * (128 // p.bv) <= 132
    # unequal lengths: the long one is cut (run 1: 64-chunk segments in two waves beat 150-chunk ones in one)
    p = sg.segment_plan([28672, 4096], 32, 128, 132, 32)
    assert p is not None and p.seg_chunks <= 150 and 32 * p.num_segments * (128 // p.bv) <= 3 * 132
    # enough walks already, or too short to pay for a halo
    assert sg.segment_plan([8192] * 4, 32, 128, 132, 128) is None
    assert sg.segment_plan([300, 300], 4, 128, 132, 32) is None
    assert sg.segment_plan([2048], 8, 128, 132, 32) is None        # run 1: no gain at 32 chunks
    assert sg.segment_plan([64], 1, 128, 132, 32) is None
    assert sg.segment_plan([], 4, 128, 132, 32) is None


def test_segment_mode_env(monkeypatch):
    # the backward's split: auto by default (session 19), following the forward's setting; off turns it off, a
    # number forces it
    monkeypatch.delenv("FLASHQLA_TILELANG_SEGMENTS", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD_SEGMENTS", raising=False)
    assert sg.mode() == "auto" and sg.mode(backward=True) == "auto"
    assert sg.segment_plan([32768], 8, 128, 132, 32, backward=True) is not None
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "off")
    assert sg.segment_plan([32768], 8, 128, 132, 32, backward=True) is None
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "auto")
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "7")
    assert sg.mode(backward=True) == "7"
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "3")
    assert sg.mode(backward=True) == "3"
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "off")
    assert sg.mode(backward=True) == "off"
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD_SEGMENTS")
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "off")
    assert sg.segment_plan([32768], 8, 128, 132, 32) is None
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "5")
    p = sg.segment_plan([640, 64], 2, 128, 132, 32)
    assert p.seg_chunks == 5 and p.num_segments == 3 and "forced" in p.describe()
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", bad)
        with pytest.raises(ValueError, match="FLASHQLA_TILELANG_SEGMENTS"):
            sg.mode()


# ---- the halo search ---------------------------------------------------------------------------------------

def _packed(lengths, Hqk, Hv, K, gate="logsigmoid", seed=0, normalize=True):
    gen = torch.Generator().manual_seed(seed)
    NT = sum(lengths)
    k = torch.randn(NT, Hqk, K, generator=gen)
    if normalize:
        k = torch.nn.functional.normalize(k, dim=-1)
    g = make_gate((NT, Hv), gate, gen).float()
    beta = torch.sigmoid(torch.randn(NT, Hv, generator=gen))
    return k, g, beta


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("gate", ["logsigmoid", "strong", "zero", "mixed", "nan", "edge"])
@pytest.mark.parametrize("l2norm", [False, True])
def test_walk_starts_kernel_matches_ref(gate, l2norm, reverse):
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [0, 1, 700, 64 * 9 + 5, 4000]
    Hqk, Hv, K = 2, 4, 32
    k, g, beta = _packed(lengths, Hqk, Hv, K, "logsigmoid" if gate in ("mixed", "nan") else gate,
                         normalize=not l2norm)
    if gate == "mixed":
        g[:, 1] = 0.0                       # a head without decay: its walks start at the sequence start
        g[:, 2] *= 0.01                     # a slow one: a long halo, or none within the search
    if gate == "nan":
        g[1000, 3] = float("nan")           # one poisoned token: no halo across it for that head
    if gate == "edge":
        # every chunk adds exactly -150 / 3.5 to the bound (|1 - beta ||k||^2| <= 1 adds nothing): a halo needs 4
        # chunks, so a segment with 2 or 3 chunks between it and its sequence's edge has none, while the search's
        # kernel loads 4 chunks per iteration, the 4th one across that edge
        g.fill_(-150.0 / (3.5 * 64))
    t = sg.segment_tables(lengths, 3, dev)
    k, g, beta = k.to(dev), g.to(dev), beta.to(dev)
    ref = sg.walk_starts_ref(k, g, beta, t, l2norm, max_halo=16, reverse=reverse)
    got = sg.walk_starts(k, g, beta, t, l2norm, max_halo=16, force_kernel=True, reverse=reverse)
    assert torch.equal(got.cpu(), ref.cpu())
    co = t.chunk_offsets.cpu()
    if reverse:
        # every end lies between the segment's end chunk and the sequence's; a last segment ends at its own
        tb = t.seg_table_bwd.cpu()
        ref = ref.cpu()
        assert bool(((ref >= co[1:, None]) & (ref <= tb[:, 1:2])).all())
        last = co[1:] == tb[:, 1]
        assert bool((ref[last] == co[1:][last][:, None]).all())
        if gate == "zero":
            assert bool((ref == tb[:, 1:2]).all())
        if gate == "strong":
            assert bool(((ref[:, -1] - co[1:]) <= 1).all())
        if gate == "mixed":
            assert bool((ref[:, 1] == tb[:, 1]).all())
        return
    tab = t.seg_table.cpu()
    ref = ref.cpu()
    # every start lies between the sequence's first chunk and the segment's
    assert bool(((ref >= tab[:, 1:2]) & (ref <= co[:-1, None])).all())
    first = co[:-1] == tab[:, 1]
    assert bool((ref[first] == co[:-1][first][:, None]).all())
    if gate == "zero":
        assert bool((ref == tab[:, 1:2]).all())
    if gate == "strong":
        # the strongest head (A = 16, g ~ -13 per token): one chunk of halo at most
        assert bool(((co[:-1] - ref[:, -1]) <= 1).all())
    if gate == "mixed":
        assert bool((ref[:, 1] == tab[:, 1]).all())


_WALK_AOT = r'''
import os, re, shutil, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashqla.backends.tilelang import segments as sg
sig = {"k_ptr": "*bf16", "g_ptr": "*fp32", "b_ptr": "*bf16", "cu_ptr": "*i32", "co_ptr": "*i32", "tab_ptr": "*i32",
       "out_ptr": "*i32", "threshold": "fp32", "max_halo": "i32", "stride_kt": "i32", "stride_kh": "i32",
       "stride_gt": "i32", "stride_bt": "i32", "Hv": "i32"}
for rev in (False, True):
    for l2 in (False, True):
        consts = dict(RATIO=4, R_P=4, K=128, L2=l2, C=64, REVERSE=rev, CPI=sg.WALK_SEARCH_CHUNKS)
        ck = triton.compile(ASTSource(sg._kernel(), dict(sig, **{c: "constexpr" for c in consts}), constexprs=consts),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        ptx = ck.asm["ptx"]
        assert "ld.global" in ptx and "st.global" in ptx
        if shutil.which("ptxas"):
            with tempfile.TemporaryDirectory() as d:
                open(os.path.join(d, "k.ptx"), "w").write(ptx)
                r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o",
                                    os.path.join(d, "k.cubin")], capture_output=True, text=True)
            assert r.returncode == 0, r.stderr[-500:]
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", r.stderr)]
            assert spills and max(spills) == 0, (rev, l2, r.stderr[-500:])
print("ALL OK")
'''


def test_walk_starts_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The halo search's kernel (CPI chunks per iteration, k's norms by column blocks) compiles for sm_90 without a
    GPU and, where ptxas is here, spills nothing (a whole [CPI * 64, 128] k tile spilled ~1.3 KB per thread)."""
    from test_cp import run_compile_script
    run_compile_script(_WALK_AOT, tmp_path)


def _states_at(k, v, g, beta, S0, t0, t1):
    # the recurrence in float64 over tokens [t0, t1) of one head from S0
    S = S0.clone()
    for t in range(t0, t1):
        kt, vt = k[t], v[t]
        S = math.exp(g[t]) * S
        S = S + beta[t] * torch.outer(kt, vt - S.T @ kt)
    return S


def _grads_at(k, q, do, g, beta, dS_end, t0, t1):
    # the state-gradient recurrence of one head in float64 over tokens [t0, t1), backwards from dS_end (its
    # state-independent terms reduced to q_t do_t^T, which is all the halo argument needs)
    dS = dS_end.clone()
    for t in range(t1 - 1, t0 - 1, -1):
        kt = k[t]
        dS = dS + torch.outer(q[t], do[t])
        dS = math.exp(g[t]) * (dS - beta[t] * torch.outer(kt, kt @ dS))
    return dS


@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("gate", ["logsigmoid", "strong"])
def test_halo_walk_reaches_the_true_state(gate, reverse):
    # each segment's walk from zero at its halo's far end reaches the segment's edge with the true state (forward:
    # at its start) or state gradient (backward: at its end) to within exp(-150) of its size (float64 shows it;
    # fp32 cannot): the claim the kernels rely on
    lengths = [64 * 12 + 9, 64 * 7]
    Hqk, Hv, K, V = 1, 2, 16, 8
    k, g, beta = _packed(lengths, Hqk, Hv, K, gate, seed=5 if reverse else 3)
    gen = torch.Generator().manual_seed(6 if reverse else 4)
    NT = sum(lengths)
    q = torch.randn(NT, K, generator=gen).double()
    x = torch.randn(NT, Hv, V, generator=gen).double()        # v (forward) or do (backward)
    t = sg.segment_tables(lengths, 2, "cpu")
    walk = sg.walk_starts_ref(k, g, beta, t, False, reverse=reverse)
    cu, co = t.cu_seqlens.tolist(), t.chunk_offsets.tolist()
    tab, tb = t.seg_table.tolist(), t.seg_table_bwd.tolist()
    seq_bos = [0, lengths[0]]
    kd, gd, bd = k.double()[:, 0], g.double(), beta.double()
    zero = torch.zeros(K, V, dtype=torch.float64)
    used = 0
    for e in range(t.num_segments):
        s = tab[e][0]
        for h in range(Hv):
            c = int(walk[e, h])
            if reverse:
                seq_eos, t_edge = tb[e][3], cu[e + 1]
                t_far = min(t_edge + (c - co[e + 1]) * 64, seq_eos)
                true = _grads_at(kd, q, x[:, h], gd[:, h], bd[:, h], zero, t_edge, seq_eos)
                halo = _grads_at(kd, q, x[:, h], gd[:, h], bd[:, h], zero, t_edge, t_far)
                used += c < tb[e][1]
            else:
                t_edge = cu[e]
                t_far = seq_bos[s] + (c - tab[e][1]) * 64
                true = _states_at(kd, x[:, h], gd[:, h], bd[:, h], zero, seq_bos[s], t_edge)
                halo = _states_at(kd, x[:, h], gd[:, h], bd[:, h], zero, t_far, t_edge)
                used += t_far > seq_bos[s]
            err = (true - halo).abs().max().item()
            assert err <= 1e-60 * max(1.0, true.abs().max().item()), (e, h, c, err)
    assert used > 0, "no walk started in a halo short of its sequence's edge: the test checked nothing"


# ---- the kernel variant ------------------------------------------------------------------------------------

@pytest.mark.compile
@pytest.mark.parametrize("kind,args", [
    # the forward: fused inference at BV 128 (psplit, ostage), its pscores form at BV 32 with L2 norm and h0, and
    # the training forward (states saved) at BV 64
    ("fwd", ("bfloat16", 128, 128, 128, False, False, True, False, 0, 0, True, True, False, False, True, True, False,
             False, True)),
    ("fwd", ("bfloat16", 128, 128, 32, True, True, True, False, 0, 0, True, False, False, False, True, True, True,
             False, True)),
    ("fwd", ("float16", 128, 128, 64, True, True, True, True, 0, 0, True, True, False, False, False, True, False,
             False, True)),
    # the fused training forward over segments at BV 128: its v_new saves under the chain's halo branch spilled and
    # serialised every wgmma (40 waits for 40) until the output warpgroup took them over (session 20)
    ("fwd", ("bfloat16", 128, 128, 128, False, False, True, True, 0, 0, True, True, False, False, True, True, False,
             False, True)),
    # both at BV 128 with h0: an if / else around the start state's load serialised all 40 wgmma (a 512-byte stack)
    # until it became a select (session 24)
    ("fwd", ("bfloat16", 128, 128, 128, False, True, True, False, 0, 0, True, True, False, False, True, True, False,
             False, True)),
    ("fwd", ("bfloat16", 128, 128, 128, False, True, True, True, 0, 0, True, True, False, False, True, True, False,
             False, True)),
    # the backward's gradient walk, with dht at BV 64 and with the L2 norm at BV 32
    ("bwd", ("bfloat16", 128, 128, 64, False, True, True, True)),
    ("bwd", ("float16", 128, 128, 32, True, False, True, True)),
], ids=["fwd-fused-bv128", "fwd-pscores-bv32-l2-h0", "fwd-train-bv64-fp16", "fwd-fused-train-bv128",
         "fwd-fused-bv128-h0", "fwd-fused-train-bv128-h0", "bwd-bv64-dht", "bwd-bv32-l2"])
def test_halo_kernels_lower_for_sm90a(kind, args):
    if not HAVE_TILELANG:
        pytest.skip("tilelang is not importable here")
    import tilelang
    from flashqla.backends.tilelang._compile import TARGET
    from flashqla.backends.tilelang.chunk_bwd_state_ws_sm90 import build_bwd_state_ws
    from flashqla.backends.tilelang.chunk_fwd_ws_sm90 import build_fwd_ws
    from test_backend_tilelang import assert_wgmma_pipelined, resource_usage

    builder = build_fwd_ws if kind == "fwd" else build_bwd_state_ws
    kern = tilelang.compile(builder(*args), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "wgmma" in src and ("tma_load" in src or "cp.async.bulk.tensor" in src)
    usage = resource_usage(kern)
    print(usage)
    assert "LOCAL:0" in usage or "unavailable" in usage, f"register spills: {usage}"
    assert_wgmma_pipelined(kern, str(args))
    # each walk's start (forward) or end (backward) and the segment's sequence come from the two tables
    assert ("walk_from" if kind == "fwd" else "walk_end") in src and "seg_table" in src


def test_halo_is_in_the_compile_key_only_when_on():
    from flashqla.backends.tilelang import ops
    from flashqla.backends.tilelang._compile import record_keys
    with record_keys() as rec:
        ops.fwd_ws_kernel(torch.bfloat16, 128, 128, False, False, True, False, 128, fused=True)
        ops.fwd_ws_kernel(torch.bfloat16, 128, 128, False, False, True, False, 128, fused=True, halo=True)
    plain, halo = rec[0][2], rec[1][2]
    assert halo[:len(plain)] == plain and halo[-1] is True and len(halo) > len(plain)
    with record_keys() as rec:
        ops.bwd_state_ws_kernel(torch.bfloat16, 128, 128, False, True, True, 64)
        ops.bwd_state_ws_kernel(torch.bfloat16, 128, 128, False, True, True, 64, True)
    assert rec[0][2] == ("bfloat16", 128, 128, 64, False, True, True) and rec[1][2] == rec[0][2] + (True,)


# ---- on the GPU --------------------------------------------------------------------------------------------

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")

_GPU_SEG_CASES = [
    Case("long_logsigmoid", 2, 4, 128, 128, B=1, T=64 * 40 + 17),
    Case("dense_h0_ht", 2, 4, 128, 128, B=2, T=64 * 9),
    Case("varlen_len1_tail", 1, 2, 128, 128, seqlens=(1, 63, 64, 65, 64 * 11 + 3, 0, 7)),
    Case("varlen_l2norm", 2, 4, 128, 128, seqlens=(33, 0, 64 * 14 + 6), l2norm=True),
    Case("strong_decay", 1, 2, 128, 128, seqlens=(64 * 12 + 8, 7), gate="strong"),
    Case("no_decay", 1, 2, 128, 128, B=1, T=64 * 8 + 40, gate="zero"),
]


def _oracle_run(case, grads, seg, monkeypatch, bwd="auto"):
    from flashqla.testing import run_case
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", seg)
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "auto")    # (the backward's split follows)
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", bwd)
    return run_case(flashqla.chunk_gated_delta_rule, case, "tilelang", torch.bfloat16, "cuda", grads=grads,
                    exact_fp32=False, seed=0)


def _outputs(case, seg, monkeypatch):
    from flashqla.testing import make_inputs
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", seg)
    x = make_inputs(case, torch.bfloat16, "cuda", 0)
    with torch.no_grad():
        return flashqla.chunk_gated_delta_rule(
            x["q"], x["k"], x["v"], x["g"], x["beta"], scale=case.scale, initial_state=x["initial_state"],
            output_final_state=case.ht, use_qk_l2norm_in_kernel=case.l2norm, cu_seqlens=x["cu_seqlens"],
            backend="tilelang")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("grads", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("case", _GPU_SEG_CASES, ids=lambda c: c.name)
def test_gpu_split_forward_matches_oracle(case, grads, monkeypatch):
    # segments of 2 chunks: most walks start in a halo (or at their sequence start where none exists)
    from flashqla.backends.tilelang import _compile
    res = _oracle_run(case, grads, "2", monkeypatch)
    print(case.name, grads, {k: f"{v:.2e}" for k, v in res.errors.items()})
    assert res.ok, f"{case.name}: {res.failures} (all {res.errors})"
    assert any(name == "fwd_recurrent_ws_sm90" and key[-1] is True for name, key in _compile.cached_kernels())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("bwd", ["ws", "whole"])
@pytest.mark.parametrize("case", _GPU_SEG_CASES, ids=lambda c: c.name)
def test_gpu_split_backward_matches_oracle(case, bwd, monkeypatch):
    # the gradient walk in segments of 2 chunks with a halo past each one's end, in the split backward's state
    # kernel or in the whole-V kernel (which does not serve the L2 norm: that case takes the split backward)
    from flashqla.backends.tilelang import _compile
    res = _oracle_run(case, True, "2", monkeypatch, bwd)
    print(case.name, bwd, {k: f"{v:.2e}" for k, v in res.errors.items()})
    assert res.ok, f"{case.name}: {res.failures} (all {res.errors})"
    name = "bwd_whole_sm90" if bwd == "whole" and not case.l2norm else "bwd_state_ws_sm90"
    assert any(n == name and key[-1] is True for n, key in _compile.cached_kernels())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", [c for c in _GPU_SEG_CASES if not c.l2norm], ids=lambda c: c.name)
def test_gpu_fused_training_forward_over_segments(case, monkeypatch):
    # FLASHQLA_TILELANG_TRAIN_FUSED=all: the fused training forward walks segments of 2 chunks (its v_new saves from
    # the output warpgroup, session 20), then the whole-V backward over segments; the gradients against the oracle
    from flashqla.backends.tilelang import _compile
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "all")
    monkeypatch.setenv("FLASHQLA_TILELANG_FWD", "fused")
    res = _oracle_run(case, True, "2", monkeypatch, "whole")
    print(case.name, {k: f"{v:.2e}" for k, v in res.errors.items()})
    assert res.ok, f"{case.name}: {res.failures} (all {res.errors})"
    built = set(_compile.cached_kernels())
    assert any(n == "fwd_intra_tbx_sm90" for n, _ in built)
    # the fused recurrence with its saves over segments: key entries 7 (save_states), 14 (fused) and the last (halo)
    assert any(n == "fwd_recurrent_ws_sm90" and k[7] and len(k) > 14 and k[14] and k[-1] is True for n, k in built)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _GPU_SEG_CASES, ids=lambda c: c.name)
def test_gpu_split_forward_agrees_with_unsplit(case, monkeypatch):
    o1, h1 = _outputs(case, "2", monkeypatch)
    o0, h0 = _outputs(case, "off", monkeypatch)
    d = rel_l2(o1.float(), o0.float())
    print(case.name, f"o {d:.2e}", f"ht {rel_l2(h1, h0):.2e}" if h1 is not None else "")
    assert d <= 2e-3
    if case.ht:
        assert rel_l2(h1, h0) <= 2e-3


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", [_GPU_SEG_CASES[0], _GPU_SEG_CASES[2]], ids=lambda c: c.name)
def test_gpu_halo_stream_is_bitwise_the_default(case, monkeypatch):
    # FLASHQLA_TILELANG_HALO_STREAM=1 (the default since session 24): the halo searches on a side stream beside
    # stage 1; o, ht and the gradients bitwise those of the searches on the caller's stream (=0), eager and replayed
    # from a CUDA graph
    from flashqla.testing import make_inputs
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "2")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "auto")
    x = make_inputs(case, torch.bfloat16, "cuda", 0)
    meta = flashqla.prepare_varlen(x["cu_seqlens"]) if x["cu_seqlens"] is not None else None
    do = torch.randn_like(x["v"])

    def run(leaves):
        o, ht = flashqla.chunk_gated_delta_rule(
            *leaves, x["g"], x["beta"], scale=case.scale, initial_state=x["initial_state"], output_final_state=True,
            cu_seqlens=x["cu_seqlens"], varlen_meta=meta, backend="tilelang")
        return [o.detach(), ht.detach(), *torch.autograd.grad(o, leaves, do)]

    def new_leaves():
        return [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]

    monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STREAM", "0")
    want = [t.clone() for t in run(new_leaves())]
    monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STREAM", "1")
    got = run(new_leaves())
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # the graph's leaves are first used on the warm-up stream (as in test_cp's graph test): leaves that had met the
    # legacy stream would make the captured backward sync with it, which a capture refuses
    from flashqla.testing import warm_up_for_capture
    leaves = new_leaves()
    warm_up_for_capture(lambda: run(leaves), reps=2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        held = run(leaves)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(held, want):
        assert torch.equal(a, b)


def test_forward_splits_short_walks_of_few_heads(monkeypatch):
    # session 24 (H100): FlashQLA's 1x2048 rows ran faster split at 8 and 16 heads (modelled gains 13 and 6 us, under
    # the shared MIN_GAIN_US), and slower or equal at 32-64 heads; the tilelang forward's own threshold splits the
    # first and leaves the second whole, while the other planners (backward, cutlass, triton) keep MIN_GAIN_US
    from flashqla.backends.tilelang import ops
    monkeypatch.delenv("FLASHQLA_TILELANG_SEGMENTS", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_BV", raising=False)
    dev = torch.device("cpu")
    monkeypatch.setattr(ops, "detect", lambda d: type("S", (), {"sm_count": 132})())
    monkeypatch.setattr(ops, "fwd_ws_bv", lambda n, Hv, V, d: sg.plain_bv_for(n * Hv, V, 132))
    for Hv, want in ((8, (4, 64)), (16, (8, 64))):
        plan = ops.fwd_segment_plan([2048], Hv, 128, dev, variant="ws")
        assert plan is not None and (plan.seg_chunks, plan.bv) == want, (Hv, plan)
        assert plan.est_plain_us - plan.est_us < sg.MIN_GAIN_US
        assert sg.segment_plan([2048], Hv, 128, 132, sg.plain_bv_for(Hv, 128, 132), forced="auto") is None
    for Hv in (32, 48, 64):
        assert ops.fwd_segment_plan([2048], Hv, 128, dev, variant="ws") is None
    # a long walk's plan is the same under either threshold
    long_plan = ops.fwd_segment_plan([32768], 32, 128, dev, variant="ws")
    assert long_plan == sg.segment_plan([32768], 32, 128, 132, sg.plain_bv_for(32, 128, 132), forced="auto")


def test_few_waves_search_splits_two_uneven_waves(monkeypatch):
    # FLASHQLA_TILELANG_FEW_WAVES=1: 192 whole 128-chunk walks at BV 128 (16/48 4x8192) are two waves on 132 SMs;
    # the planner then takes 64-chunk segments (three waves of short walks, the plan 16/48 1x32768 runs), and it
    # leaves batches past two waves (16/64 4x8192: 256 CTAs at a whole wave and a bit) and short walks alone
    from flashqla.backends.tilelang import ops
    monkeypatch.delenv("FLASHQLA_TILELANG_SEGMENTS", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_BV", raising=False)
    dev = torch.device("cpu")
    monkeypatch.setattr(ops, "detect", lambda d: type("S", (), {"sm_count": 132})())
    monkeypatch.setenv("FLASHQLA_TILELANG_FEW_WAVES", "0")
    assert ops.fwd_segment_plan([8192] * 4, 48, 128, dev, variant="ws") is None
    monkeypatch.setenv("FLASHQLA_TILELANG_FEW_WAVES", "1")
    for lengths in ([8192] * 4, [16384] * 2):
        plan = ops.fwd_segment_plan(lengths, 48, 128, dev, variant="ws")
        assert plan is not None and (plan.seg_chunks, plan.bv, plan.num_segments) == (64, 128, 8), plan
        assert plan.est_us < 0.9 * plan.est_plain_us
    assert ops.fwd_segment_plan([8192] * 4, 64, 128, dev, variant="ws") is None
    assert ops.fwd_segment_plan([1024] * 8, 32, 128, dev, variant="ws") is None
    monkeypatch.setenv("FLASHQLA_TILELANG_FEW_WAVES", "2")
    with pytest.raises(ValueError, match="FLASHQLA_TILELANG_FEW_WAVES"):
        ops.fwd_few_waves()


def test_halo_searches_inline_off_the_gpu(monkeypatch):
    # the switch only moves the searches to a side stream on CUDA; elsewhere (and off) they run inline, into the
    # tensors the helper allocates, equal to walk_starts' own
    from flashqla.backends.tilelang import ops
    monkeypatch.delenv("FLASHQLA_TILELANG_HALO_STREAM", raising=False)
    assert ops.halo_stream()            # (the default since session 24)
    monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STREAM", "0")
    assert not ops.halo_stream()
    monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STREAM", "1")
    gen = torch.Generator().manual_seed(0)
    NT, Hqk, Hv = 64 * 9 + 5, 1, 2
    k = torch.nn.functional.normalize(torch.randn(NT, Hqk, 128, generator=gen), dim=-1)
    g = torch.nn.functional.logsigmoid(torch.randn(NT, Hv, generator=gen))
    beta = torch.rand(NT, Hv, generator=gen)
    fwd, bwd, join = ops._halo_searches(k, g, beta, [NT], 2, 2, False, torch.device("cpu"))
    join()
    t = sg.segment_tables([NT], 2, "cpu")
    assert fwd[0] is t and torch.equal(fwd[1], sg.walk_starts(k, g, beta, t, False))
    assert torch.equal(bwd[1], sg.walk_starts(k, g, beta, t, False, reverse=True))
    fwd, bwd, join = ops._halo_searches(k, g, beta, [NT], None, None, False, torch.device("cpu"))
    assert fwd is None and bwd is None
    monkeypatch.setenv("FLASHQLA_TILELANG_HALO_STREAM", "2")
    with pytest.raises(ValueError, match="FLASHQLA_TILELANG_HALO_STREAM"):
        ops.halo_stream()


# ---- the host path with simulated kernels (CPU) -------------------------------------------------------------

from test_backend_tilelang import host_backend_inputs, simulated_kernels  # noqa: E402,F401

_HOST_SEG_CASES = [
    Case("host_seg_varlen_h0", 1, 2, 128, 128, seqlens=(1, 70, 0, 64 * 6 + 9, 129), gate="strong"),
    Case("host_seg_gva_l2", 2, 4, 128, 128, seqlens=(64 * 5, 3), l2norm=True),
    Case("host_seg_dense_no_state", 1, 2, 128, 128, B=2, T=64 * 4 + 1, h0=False, ht=False, gate="zero"),
    # GVA without the L2 norm (the whole-V kernel serves it), the benchmarks' gates: halos of ~3 chunks
    Case("host_seg_gva_logsigmoid", 2, 4, 128, 128, seqlens=(64 * 7 + 9, 1, 130)),
]


@pytest.mark.parametrize("grads", [False, "ws", "whole", "whole-gvapair"],
                         ids=["inference", "training_ws", "training_whole", "training_whole_gvapair"])
@pytest.mark.parametrize("case", _HOST_SEG_CASES, ids=lambda c: c.name)
def test_host_path_split_forward(case, grads, simulated_kernels, monkeypatch):
    # the backend's glue with segments of one chunk: segment tables, the halo search (torch on the CPU), the
    # halo variant's arguments checked against its prim_func, the per-head walk starts simulated; against the
    # oracle (and the gradients through the states the split forward saved, by the split backward or the whole-V
    # one, whose walks are split too; the whole-V kernel does not serve the L2 norm: the split backward does;
    # "whole-gvapair": the whole-V one summing GVA pairs in the kernel, FLASHQLA_TILELANG_GVA=pair)
    from flashqla.testing import TOLERANCES, poisoned_outputs
    # (the pair sum is the default since session 23: "whole" asks for the host sum)
    pair = grads == "whole-gvapair"
    monkeypatch.setenv("FLASHQLA_TILELANG_GVA", "pair" if pair else "host")
    if pair:
        grads = "whole"
    monkeypatch.setenv("FLASHQLA_TILELANG_SEGMENTS", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "auto")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", grads or "ws")
    bwd, grads = grads, bool(grads)
    be, inp, ref, spec, x = host_backend_inputs(case, needs_grad=grads)
    with poisoned_outputs("cpu"):
        o, ht, saved, aux = be.forward(spec, x)
        errs = {"o": rel_l2(o, ref["o"])}
        if case.ht:
            errs["ht"] = rel_l2(ht, ref["ht"])
        if grads:
            g = be.backward(spec, saved, aux, inp["do"], inp["dht"] if case.ht else None)
            for name, t in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), g):
                if name in ref:
                    errs[name] = rel_l2(t, ref[name])
    assert "fwd_recurrent_ws_sm90" in simulated_kernels
    if grads:
        # the backward's gradient walk is split too (its tables and walk ends come from the forward)
        variant = "whole" if bwd == "whole" and not case.l2norm else "ws"
        assert aux["bwd_split"] is not None and aux["bwd_split"][0] == variant
        assert ("bwd_whole_sm90" if variant == "whole" else "bwd_state_ws_sm90") in simulated_kernels
        if variant == "whole":
            # (key entries 10 and 11: the walk over segments, and the in-kernel GVA pair sum where asked for)
            key = [k for n, k in simulated_kernels.keys if n == "bwd_whole_sm90"][0]
            assert key[9] and (key[10:11] == (True,)) == (pair and case.Hv == 2 * case.Hqk), key
        _, bv, tables, ends = aux["bwd_split"]
        assert tables.num_segments > len(case.seqlens or [0] * case.B)
        co = tables.chunk_offsets
        assert bool((ends.cpu() > co[1:, None].cpu()).any()), "no gradient walk ran a halo"
    tol = TOLERANCES["bfloat16"]
    bad = {n: e for n, e in errs.items() if not e <= tol[n]}
    assert not bad, (bad, errs)


def test_backward_plan_splits_the_whole_backward_where_walks_are_few(monkeypatch):
    # with the backward's split on, the whole-V kernel walks segments too: on one 32k sequence at 16/32 it is
    # modelled ~4x faster split than unsplit, and faster than the split backward split; the plan is bwd_choice's
    # where no split pays (a walk per SM already), the split backward's under FLASHQLA_TILELANG_BWD=ws or the L2
    # norm (which the whole-V kernel does not serve), none with the switch off
    from flashqla.backends.tilelang import ops
    from flashqla.dispatch.device import fake_device
    cpu = torch.device("cpu")
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_SEGMENTS", raising=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "auto")
    with fake_device("cuda", (9, 0)):
        variant, plan, why = ops.bwd_plan([32768], 32, 128, 128, False, cpu, explain=True)
        assert variant == "whole" and plan is not None and plan.bv == 128
        assert 32 * plan.num_segments <= 132 and plan.est_us < 0.3 * plan.est_plain_us, plan
        assert why.startswith("whole-V fused backward, its gradient walk in-kernel CP: split: "), why
        assert ops.bwd_plan([8192] * 4, 32, 128, 128, False, cpu) == ("whole", None, "")
        variant, plan, _ = ops.bwd_plan([32768], 32, 128, 128, True, cpu)
        assert variant == "ws" and plan is not None and plan.bv in ops.BWD_WS_BVS
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "ws")
        variant, plan, _ = ops.bwd_plan([32768], 32, 128, 128, False, cpu)
        assert variant == "ws" and plan is not None
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "whole")
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "16")
        variant, plan, _ = ops.bwd_plan([32768], 8, 128, 128, False, cpu)
        assert variant == "whole" and plan.seg_chunks == 16 and plan.bv == 128 and plan.num_segments == 32
        monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "off")
        assert ops.bwd_plan([32768], 32, 128, 128, False, cpu)[:2] == ("whole", None)


def test_whole_backward_halo_is_in_its_key_only_when_on(monkeypatch):
    from flashqla.backends.tilelang import ops
    from flashqla.backends.tilelang._compile import record_keys
    monkeypatch.delenv("FLASHQLA_TILELANG_EX2", raising=False)
    with record_keys() as rec:
        ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, True, True)
        ops.bwd_whole_kernel(torch.bfloat16, torch.bfloat16, 128, 128, True, True, True)
    plain, halo = rec[0][2], rec[1][2]
    # (trace, nregs, hw_ex2 as the default builds it, then halo)
    assert plain == ("bfloat16", "bfloat16", 128, 128, True, True, False, None, True)
    assert halo == plain + (True,)


def test_explain_notes(monkeypatch):
    # explain()'s forward note (the split of the forward walk) and the backward note's gradient-walk split
    from types import SimpleNamespace

    from flashqla.api import _tilelang_backward_note, _tilelang_forward_note
    monkeypatch.delenv("FLASHQLA_TILELANG_SEGMENTS", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD_SEGMENTS", raising=False)
    spec = SimpleNamespace(Hv=8, Hqk=2, K=128, V=128, use_qk_l2norm=False)
    q = torch.empty(1, 32768, 2, 128)
    note = _tilelang_forward_note(q, spec, None)
    assert note.startswith("in-kernel CP: split: 16 segments"), note
    assert _tilelang_forward_note(torch.empty(4, 8192, 8, 128), SimpleNamespace(Hv=32, K=128, V=128), None) \
        .startswith("state walk per (sequence, head): no segment split")
    assert "its gradient walk in-kernel CP: split: " in _tilelang_backward_note(q, spec, None)   # auto by default
    # stage 1: persistent on equal lengths (512 chunks at 8 heads: the fewest CTAs at 8 chunks each), per chunk on
    # unequal ones and under FLASHQLA_TILELANG_INTRA_PERSIST=0
    for var in ("FLASHQLA_TILELANG_INTRA_PERSIST", "FLASHQLA_TILELANG_INTRA_PERSIST_CTAS", "FLASHQLA_TILELANG_INTRA_INV",
                "FLASHQLA_TILELANG_INTRA_UNIFORM"):
        monkeypatch.delenv(var, raising=False)
    from flashqla.dispatch.device import fake_device
    with fake_device(sm_count=132):
        assert "stage 1: persistent, 64 CTAs per value head (4 per SM at most), 8 chunks each" in \
            _tilelang_forward_note(q, spec, None)
        from flashqla.varlen import prepare_varlen
        meta = prepare_varlen(torch.tensor([0, 28672, 32768], dtype=torch.int32))
        assert "stage 1: one CTA per (chunk, value head) (sequences of unequal lengths" in \
            _tilelang_forward_note(q, spec, meta)
        monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_PERSIST", "0")
        assert "stage 1: one CTA per (chunk, value head) (FLASHQLA_TILELANG_INTRA_PERSIST=0)" in \
            _tilelang_forward_note(q, spec, None)
        monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_PERSIST")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD_SEGMENTS", "off")
    assert "gradient walk" not in _tilelang_backward_note(q, spec, None)
    # a training call's note says which form its forward takes (FLASHQLA_TILELANG_TRAIN_FUSED, ahead of whole-V)
    train = SimpleNamespace(Hv=32, K=128, V=128, use_qk_l2norm=False, needs_grad=True)
    q4 = torch.empty(4, 8192, 8, 128)
    monkeypatch.delenv("FLASHQLA_TILELANG_FWD", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_TRAIN_FUSED", raising=False)
    assert "training forward: fused (Tb and X" in _tilelang_forward_note(q4, train, None)   # 128 walks: whole-V
    # (one long sequence at few heads: the walk is split; under TRAIN_FUSED=1 the training forward stays unfused)
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
    assert "training forward: unfused (its walk runs in segments" in _tilelang_forward_note(
        q, SimpleNamespace(Hv=8, K=128, V=128, use_qk_l2norm=False, needs_grad=True), None)
    monkeypatch.delenv("FLASHQLA_TILELANG_TRAIN_FUSED")      # (all, the default: split forwards fused as well)
    monkeypatch.delenv("FLASHQLA_TILELANG_BWD_SEGMENTS")            # (the whole-V backward over segments)
    assert "training forward: fused (Tb and X" in _tilelang_forward_note(
        q, SimpleNamespace(Hv=8, K=128, V=128, use_qk_l2norm=False, needs_grad=True), None)
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "0")
    assert "training forward: unfused (w, u and X" in _tilelang_forward_note(q4, train, None)
    monkeypatch.setenv("FLASHQLA_TILELANG_TRAIN_FUSED", "1")
    monkeypatch.setenv("FLASHQLA_TILELANG_BWD", "ws")
    assert "training forward: unfused (the split backward" in _tilelang_forward_note(q4, train, None)
    assert "training forward" not in _tilelang_forward_note(q4, SimpleNamespace(Hv=32, K=128, V=128), None)
    d = flashqla.explain(*(torch.randn(1, 64, 2, 128) for _ in range(3)), torch.zeros(1, 64, 2),
                         torch.ones(1, 64, 2))
    d.forward = "in-kernel CP: why"
    assert "forward: in-kernel CP: why" in str(d)
