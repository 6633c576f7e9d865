"""Tensors past 2^31 elements (issue #11, item 1) and the memory benchmark's harness (item 5).

At T = 1,048,576 tokens, Hv = 32, K = V = 128 the token-major v / o hold 2^32 elements, q / k (Hqk = 16)
2^31, and a training forward's per-chunk states [16384 chunks, 32, 128, 128] 2^33: every offset into them
past 2^31 must be computed in 64 bits.

CPU checks (no GPU needed):

* host metadata (``prepare_varlen``) and the backends' size limits at that size;
* ``triton``: every kernel of the backend and the decode kernel is compiled for sm_90 (TTIR) and an interval
  analysis of its integer ops at T = 2^20 tokens, <= 64 heads, K = V = 128 finds no 32-bit value that leaves
  the int32 range (a 32-bit ``t * stride`` would; the analysis is shown to catch one);
* ``tilelang``: the lowered CUDA source of kernels that read / write large buffers with plain loads / stores
  computes every such index in 64 bits (TileLang widens them; TMA copies take per-dimension coordinates);
* ``cutlass``: the CuTe DSL computes ``coordinate * stride`` in the stride's type, so the tensors the kernels
  access with plain loads / stores carry ``_sm90.wide`` (Int64) strides: a compiled probe shows the 64-bit
  multiply (and the kept 128-bit stores), and a source check that no such tensor lost its wide stride.

GPU checks (``gpu`` marker, one per backend, on an H200: ~50 GB for the forward, ~80 GB for the saving
forward, ~110 GB for the backward): the forward at T = 1M as 256 x 4096 varlen, Hqk / Hv = 16 / 32, bf16,
against the float64 oracle on single sequences on both sides of element 2^31 (and the final states); the
training forward (per-chunk states saved) the same way; forward + backward at 512k tokens (per-chunk states
2^32 elements) with gradients of single sequences against the oracle's.

The memory benchmark (``benchmarks/bench_memory.py``): argument parsing, one row on the CPU with its simple
accounting, the table / JSON writer, error cells and the "<= FlashQLA" column.

Audit behind these tests (T = 2^20, Hqk / Hv = 16 / 32, K = V = 128, per-chunk states 2^33 elements):

* triton (chunk kernels): already 64-bit where it matters (token rows, state and inverse bases, gate planes
  are int64 before any product); per-tile ``tl.arange`` offsets stay 32-bit.  Nothing changed.
* triton_decode: the token loop's ``t * stride`` (q, k, v, g, beta, o) was 32-bit: it wraps for one call
  over >= 2^31 / (Hv V) tokens (524,288 at 32 x 128).  The counter is int64 now.
* tilelang: TileLang 0.1.15 widens every plain global index of buffers with symbolic shapes to int64
  (``ConfigIndexBitwidth`` after ``FlattenBuffer``) and the host builds TMA descriptors with 64-bit
  strides; TMA coordinates are per dimension (all < 2^31 here).  The few ``int`` locals (bos, chunk
  offsets) are token / chunk counts.  Nothing changed.
* cutlass: CuTe computes ``coordinate * stride`` in the stride's type: o, dq / dk / dv, the chunk-major
  workspaces (-w, u^T, Aqk, T, chunk states, v_new) and h0 / ht had static or Int32 strides and wrapped
  (supports() refused > ~2^31 / 128 elements for that reason, and counted T instead of B * T).  Their
  strides are ``_sm90.wide`` (Int64) now; TMA-read tensors are unchanged; supports() keeps only the limit
  of the remaining 32-bit quantities ((B T + 64 N) Hv 2 < 2^31).
* host (varlen.py, ops): cu_seqlens / chunk offsets / chunk indices are token and chunk counts (int32 is
  ample); every buffer size is a Python int.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import flashqla
from flashqla.dispatch import fake_device, get_backend
from flashqla.validation import validate
from flashqla.varlen import prepare_varlen

ROOT = Path(__file__).resolve().parent.parent
TOK = 2 ** 20              # the T_total
INT32_MAX = 2 ** 31 - 1
HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None
HAVE_CUTE = importlib.util.find_spec("cutlass") is not None
HAVE_TRITON = importlib.util.find_spec("triton") is not None


# ======================================================================================== host metadata

def test_varlen_metadata_at_1m_tokens():
    """256 x 4096 and 1 x 2^20 tokens: the int32 metadata stays tiny while the tensors pass 2^31 elements."""
    for seqlen in (4096, TOK):
        cu = torch.arange(0, TOK + 1, seqlen, dtype=torch.int32)
        m = prepare_varlen(cu)
        n = TOK // seqlen
        assert m.total_tokens == TOK and m.num_seqs == n
        assert m.total_chunks == TOK // 64 == 16384
        assert m.chunk_offsets.dtype == torch.int32 and m.chunk_indices.dtype == torch.int32
        assert int(m.chunk_offsets[-1]) == 16384
        assert m.chunk_indices[-1].tolist() == [n - 1, seqlen // 64 - 1]
        assert int(m.chunk_indices.max()) < 2 ** 20 and int(m.cu_seqlens.max()) == TOK
    # what the kernels index: the last sequence's v rows lie between element 2^31 + 2^31 - 2^24 and 2^32
    # (Hv = 32, V = 128); a training forward's per-chunk states [16384, 32, 128, 128] hold 2^33
    assert 2 ** 31 < (TOK - 4096) * 32 * 128 < TOK * 32 * 128 == 2 ** 32
    assert 16384 * 32 * 128 * 128 == 2 ** 33


def _spec(B, T, Hqk=16, Hv=32, needs_grad=False):
    with fake_device("cuda", (9, 0)):
        q = torch.empty(B, T, Hqk, 128, dtype=torch.bfloat16, device="meta")
        v = torch.empty(B, T, Hv, 128, dtype=torch.bfloat16, device="meta")
        g = torch.empty(B, T, Hv, dtype=torch.float32, device="meta")
        return validate(q, q, v, g, g.to(torch.bfloat16), output_final_state=True, needs_grad=needs_grad)[0]


@pytest.mark.parametrize("B,T", [(1, TOK), (256, 4096)])
def test_every_gpu_backend_serves_1m_tokens(B, T):
    """No backend refuses the issue's size (cutlass used to: 32-bit indexing)."""
    for needs_grad in (False, True):
        spec = _spec(B, T, needs_grad=needs_grad)
        for name in ("triton", "tilelang", "cutlass"):
            ok, why = get_backend(name).supports(spec)
            assert ok, f"{name}: {why}"


def test_cutlass_refuses_what_its_32bit_coordinates_cannot_hold():
    """The remaining 32-bit quantities (TMA coordinates, per-chunk-row indices) bound (tokens + 64 N) Hv 2;
    total tokens count every batch row (B * T), not T alone."""
    ok, why = get_backend("cutlass").supports(_spec(8192, 4096))          # 2^25 tokens x 32 heads
    assert not ok and "32-bit" in why
    ok, why = get_backend("cutlass").supports(_spec(1, 2 ** 25 - 2 ** 21))
    assert ok, why


# ======================================================================================== triton: TTIR ranges

_NAME = r"%[\w$.-]+"
_I32 = (-2 ** 31, 2 ** 31 - 1)


def _strip_loc(line: str) -> str:
    """Drop every ``loc(...)`` group (they nest: ``loc(callsite(#loc1 at #loc2))``)."""
    out, i = [], 0
    while True:
        j = line.find(" loc(", i)
        if j < 0:
            out.append(line[i:])
            return "".join(out)
        out.append(line[i:j])
        depth, k = 0, j + 4
        while k < len(line):
            depth += {"(": 1, ")": -1}.get(line[k], 0)
            k += 1
            if depth == 0:
                break
        i = k


def _elem(ty: str) -> str:
    """Element type of an MLIR type ('i32', 'tensor<64x1xi64>' -> 'i64', '!tt.ptr<f32>' -> 'ptr')."""
    if "!tt.ptr" in ty:
        return "ptr"
    m = re.findall(r"\b(i\d+|f\d+|bf16)\b", ty.replace("x", " "))
    return m[-1] if m else "?"


def _hull(*ivs):
    ivs = [x for x in ivs if x is not None]
    return (min(x[0] for x in ivs), max(x[1] for x in ivs)) if ivs else None


def _corners(f, a, b):
    c = [f(a[0], b[0]), f(a[0], b[1]), f(a[1], b[0]), f(a[1], b[1])]
    return (min(c), max(c))


def _div(a, b):
    if b[0] <= 0 <= b[1]:   # a divisor range through 0: the quotient is at most |a|
        m = max(abs(a[0]), abs(a[1]))
        return (-m, m)
    return _corners(lambda x, y: int(x / y), a, b)


def ttir_int_ranges(ttir: str, arg_ranges: dict, pid_ranges: dict, load_range, loop_range, default_arg=(0, INT32_MAX)):
    """Interval analysis of the integer arithmetic of one kernel's TTIR.

    Sources: constants; ``tt.make_range``; program ids (``pid_ranges``); integer kernel arguments
    (``arg_ranges`` by name, else ``default_arg``); integer loads (``load_range``: token offsets, chunk ids);
    loop-carried integers (``loop_range`` joined with their initial value).  Returns ``(overflows,
    unknown_ops)``: every 32-bit result whose interval leaves the int32 range (a value that wraps at these
    sizes), and the integer-producing ops the analysis does not model (their results get the full range).
    """
    R, over, unknown = {}, [], set()
    sig = re.search(r"tt\.func public @\w+\((.*)\) attributes", ttir)
    for name, ty in re.findall(rf"({_NAME}): ([^ ,]+)", _strip_loc(sig.group(1))):
        if _elem(ty).startswith("i"):
            R[name] = arg_ranges.get(name[1:], default_arg)
    for raw in ttir.splitlines():
        line = _strip_loc(raw).strip()
        m = re.match(rf"^{_NAME}(?::\d+)? = scf\.for ({_NAME}) = ({_NAME}) to ({_NAME}) step {_NAME}(.*)", line)
        if m:
            iv, lb, ub, rest = m.groups()
            R[iv] = _hull(R.get(lb, loop_range), R.get(ub, loop_range))
            for a, init in re.findall(rf"({_NAME}) = ({_NAME})", rest):
                if init in R:
                    R[a] = _hull(R[init], loop_range)
            continue
        m = re.match(rf"^{_NAME}(?::\d+)? = scf\.while \((.*?)\) :", line)
        if m:
            for a, init in re.findall(rf"({_NAME}) = ({_NAME})", m.group(1)):
                if init in R:
                    R[a] = _hull(R[init], loop_range)
            continue
        m = re.match(r"^\^bb\d+\((.*)\):$", line)
        if m:   # block arguments (loop bodies, reductions): loop-carried
            for a, ty in re.findall(rf"({_NAME}): ([\w<>x!.]+)", m.group(1)):
                if _elem(ty).startswith("i") and a not in R:
                    R[a] = loop_range
            continue
        m = re.match(rf"^({_NAME})(?::\d+)? = (\"?[\w.]+\"?)(.*)$", line)
        if not m:
            continue
        res, op, rest = m.groups()
        op = op.strip('"')
        if rest.endswith("({"):          # region ops (reduce, scan): float results in these kernels
            continue
        ops = re.findall(_NAME, rest)
        sigty = rest.rsplit(" : ", 1)[-1] if " : " in rest else ""
        rty = sigty.split("->")[-1] if "->" in sigty else sigty.split(" to ")[-1]
        ety = _elem(rty.replace("!tt.ptr<", "<") if op == "tt.load" else rty)
        if op in ("arith.cmpi", "arith.cmpf") or not ety.startswith("i") or ety == "i1":
            continue
        g = [R.get(o) for o in ops]
        iv = None
        if op == "arith.constant":
            c = re.search(r"(?:dense<)?(-?\d+)>? :", rest)
            iv = (int(c.group(1)),) * 2 if c else None
        elif op == "tt.make_range":
            iv = (int(re.search(r"start = (-?\d+)", rest).group(1)), int(re.search(r"end = (-?\d+)", rest).group(1)) - 1)
        elif op == "tt.get_program_id":
            iv = pid_ranges[rest.split()[0]]
        elif op == "tt.load":
            iv = load_range
        elif op == "arith.select":
            iv = _hull(g[1], g[2]) if len(g) > 2 and g[1] and g[2] else None
        elif not g or g[0] is None or (len(g) > 1 and g[1] is None and op not in (
                "arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast")):
            iv = None
        elif op in ("arith.extsi", "arith.extui", "arith.index_cast", "arith.trunci", "tt.splat", "tt.broadcast",
                    "tt.expand_dims", "tt.reshape", "tt.trans"):
            iv = g[0]
        elif op == "arith.addi":
            iv = (g[0][0] + g[1][0], g[0][1] + g[1][1])
        elif op == "arith.subi":
            iv = (g[0][0] - g[1][1], g[0][1] - g[1][0])
        elif op == "arith.muli":
            iv = _corners(lambda x, y: x * y, g[0], g[1])
        elif op == "arith.divsi":
            iv = _div(g[0], g[1])
        elif op == "arith.remsi":
            d = max(abs(g[1][0]), abs(g[1][1])) - 1
            iv = (max(-d, min(g[0][0], 0)), min(d, max(g[0][1], 0)))
        elif op == "arith.minsi":
            iv = (min(g[0][0], g[1][0]), min(g[0][1], g[1][1]))
        elif op == "arith.maxsi":
            iv = (max(g[0][0], g[1][0]), max(g[0][1], g[1][1]))
        elif op == "arith.andi" and g[0][0] >= 0 and g[1][0] >= 0:
            iv = (0, min(g[0][1], g[1][1]))
        elif op in ("arith.ori", "arith.xori") and g[0][0] >= 0 and g[1][0] >= 0:
            iv = (0, (1 << max(g[0][1], g[1][1], 1).bit_length()) - 1)
        elif op == "arith.shli" and g[1][0] >= 0:
            iv = (g[0][0] << g[1][1], g[0][1] << g[1][1])
        elif op in ("arith.shrsi", "arith.shrui") and g[1][0] >= 0:
            iv = (g[0][0] >> g[1][0], g[0][1] >> g[1][0])
        if iv is None:
            unknown.add(op)
            iv = _I32 if ety == "i32" else (-2 ** 63, 2 ** 63 - 1)
        R[res] = iv
        if ety == "i32" and (iv[0] < _I32[0] or iv[1] > _I32[1]):
            over.append((res, op, iv, _strip_loc(raw).strip()[:160]))
    return over, unknown


# value ranges at the size, generously: T_total = 2^20 tokens, <= 64 heads, K = V = 128
_CHUNK_ARGS = dict(T=(0, TOK), TT=(0, TOK), NT=(0, TOK // 64 + 1), Hqk=(1, 64), Hv=(1, 64))
_DECODE_ARGS = dict(T=(0, TOK), P=(0, TOK),
                    # per-token strides (heads x head dim; one value per head for g / beta), per-head strides
                    sq_t=(0, 2 ** 13), sk_t=(0, 2 ** 13), sv_t=(0, 2 ** 13), so_t=(0, 2 ** 13), sg_t=(0, 64),
                    sbt_t=(0, 64), sq_h=(0, 256), sk_h=(0, 256), sv_h=(0, 256), so_h=(0, 256), sg_h=(0, 1),
                    sbt_h=(0, 1), ss_h=(0, 2 ** 15))
_PIDS = {"x": (0, TOK), "y": (0, 64), "z": (0, 128)}   # chunks or sequences x heads or rows; heads; V blocks

_BAD_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def bad_kernel(x_ptr, o_ptr, T, stride_t, BLOCK: tl.constexpr):
    """what the analysis must flag: a 32-bit token offset t * stride_t"""
    offs = tl.arange(0, BLOCK)
    t = 0
    while t < T:
        tl.store(o_ptr + t * stride_t + offs, tl.load(x_ptr + t * stride_t + offs))
        t += 1
'''

_TTIR_DUMP = r'''
import importlib.util, os, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from flashqla.backends.triton import aot
from flashqla.backends.triton_decode import compile_for_target

out = sys.argv[1]
target = GPUTarget("cuda", 90, 32)

def save(label, ck):
    with open(os.path.join(out, label + ".ttir"), "w") as f:
        f.write(ck.asm["ttir"])
    print("compiled", label, flush=True)

for i, (label, kern, consts, launch) in enumerate(aot._variants(128, 128, False)):
    sig, attrs = aot._signature(kern, consts, "bf16")
    save(f"chunk{i}", triton.compile(ASTSource(kern, sig, constexprs=consts, attrs=attrs), target=target,
                                     options=launch))
save("decode_vk", compile_for_target((9, 0)))
save("decode_kv", compile_for_target((9, 0), state_vk=False, has_indices=False))
spec = importlib.util.spec_from_file_location("bad_mod", os.path.join(out, "bad_mod.py"))
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
save("bad", triton.compile(ASTSource(mod.bad_kernel, {"x_ptr": "*bf16", "o_ptr": "*bf16", "T": "i32",
                                                      "stride_t": "i32", "BLOCK": "constexpr"},
                                     constexprs={"BLOCK": 128}), target=target))
print("ALL OK")
'''


@pytest.fixture(scope="module")
def triton_ttir(tmp_path_factory):
    """TTIR of every triton kernel (sm_90, bf16, K = V = 128, all features on), the decode kernel and a
    deliberately wrong probe.  In a subprocess: a process with TRITON_INTERPRET=1 cannot compile."""
    if not HAVE_TRITON:
        pytest.skip("triton is not installed")
    d = tmp_path_factory.mktemp("ttir")
    (d / "bad_mod.py").write_text(_BAD_KERNEL)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _TTIR_DUMP, str(d)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0 and "ALL OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
    return {p.stem: p.read_text() for p in d.glob("*.ttir")}


@pytest.mark.compile
def test_triton_chunk_kernels_index_arithmetic_fits_at_1m_tokens(triton_ttir):
    labels = [k for k in triton_ttir if k.startswith("chunk")]
    assert len(labels) >= 8
    for label in labels:
        over, unknown = ttir_int_ranges(triton_ttir[label], _CHUNK_ARGS, _PIDS, (0, TOK), (0, TOK))
        name = re.search(r"tt\.func public @(\w+)", triton_ttir[label]).group(1)
        assert not over, f"{name}: 32-bit values that wrap at 2^20 tokens: {over[:4]}"
        assert not unknown, f"{name}: integer ops the analysis does not model: {unknown}"


@pytest.mark.compile
def test_triton_decode_kernel_index_arithmetic_fits_at_1m_tokens(triton_ttir):
    """One decode call over T = 2^20 tokens: t * stride is 64-bit (it was 32-bit before issue #11)."""
    for label in ("decode_vk", "decode_kv"):
        over, unknown = ttir_int_ranges(triton_ttir[label], _DECODE_ARGS, _PIDS, (0, TOK), (0, TOK))
        assert not over, f"{label}: 32-bit values that wrap: {over[:4]}"
        assert not unknown, f"{label}: unmodelled integer ops {unknown}"


@pytest.mark.compile
def test_ttir_range_analysis_catches_a_32bit_token_offset(triton_ttir):
    over, _ = ttir_int_ranges(triton_ttir["bad"], dict(T=(0, TOK), stride_t=(0, 2 ** 13)), _PIDS, (0, TOK), (0, TOK))
    assert over and all(op == "arith.muli" for _, op, _, _ in over), over
    assert max(iv[1] for _, _, iv, _ in over) == TOK * 2 ** 13


def test_ttir_range_analysis_on_handwritten_ir():
    """The analysis itself (no compiler): an int32 product of a program id and an argument wraps, the same
    product after a widening does not, and a loop counter carries its bound."""
    ir = """
  tt.func public @k(%x_ptr: !tt.ptr<bf16> {tt.divisibility = 16 : i32} loc("x_ptr"(#loc)), %T: i32 loc("T"(#loc))) attributes {noinline = false} {
    %c4096_i32 = arith.constant 4096 : i32 loc(#loc1)
    %c4096_i64 = arith.constant 4096 : i64 loc(#loc1)
    %c0_i32 = arith.constant 0 : i32 loc(#loc1)
    %c1_i32 = arith.constant 1 : i32 loc(#loc1)
    %pid = tt.get_program_id x : i32 loc(#loc2)
    %bad = arith.muli %pid, %c4096_i32 : i32 loc(#loc3)
    %p64 = arith.extsi %pid : i32 to i64 loc(#loc4)
    %good = arith.muli %p64, %c4096_i64 : i64 loc(#loc5)
    %r = tt.make_range {end = 64 : i32, start = 0 : i32} : tensor<64xi32> loc(#loc6)
    %small = arith.muli %r, %r : tensor<64xi32> loc(#loc7)
    %0 = scf.for %i = %c0_i32 to %T step %c1_i32 iter_args(%acc = %c0_i32) -> (i32)  : i32 {
      %t = arith.muli %i, %c4096_i32 : i32 loc(#loc8)
      scf.yield %t : i32 loc(#loc9)
    } loc(#loc10)
    tt.return loc(#loc11)
  } loc(#loc)
"""
    over, unknown = ttir_int_ranges(ir, {"T": (0, TOK)}, _PIDS, (0, TOK), (0, TOK))
    assert sorted(name for name, *_ in over) == ["%bad", "%t"], over
    assert not unknown


# ======================================================================================== tilelang: lowered source

_CAST = r"\(\s*(?:int64_t|int|uint|unsigned int|long long|int32_t|uint64_t|uint32_t)\s*\)"
_TOKEN = re.compile(rf"\s*({_CAST}|[A-Za-z_][A-Za-z_0-9.]*|\d+|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^()\[\]<>?:!])")


def _c_tokens(s: str) -> list:
    out, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if not m:
            if not s[pos:].strip():
                break
            raise ValueError(f"cannot read {s[pos:pos + 40]!r}")
        out.append(m.group(1).replace(" ", ""))
        pos = m.end()
    return out


def _c_parse(toks: list):
    """Parse TVM's CUDA codegen expressions: every binary op parenthesised, casts as ``(type)x``."""
    pos = [0]

    def take():
        pos[0] += 1
        return toks[pos[0] - 1]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else None

    def expr():
        t = take()
        if len(t) > 2 and t.startswith("(") and t.endswith(")"):
            return ("cast", t[1:-1], expr())
        if t == "(":
            lhs = expr()
            if peek() == ")":
                take()
                return lhs
            op = take()
            rhs = expr()
            if op == "?":                 # (c ? a : b)
                assert take() == ":", "bad ternary"
                other = expr()
                assert take() == ")", "unbalanced"
                return ("sel", lhs, rhs, other)
            assert take() == ")", "unbalanced"
            return ("bin", op, lhs, rhs)
        if t == "!":
            return ("not", expr())
        if t[0].isdigit():
            return ("lit", int(t))
        if peek() == "[":
            take()
            idx = expr()
            assert take() == "]"
            return ("load", t, idx)
        return ("id", t)

    return expr()


def _c_type(n) -> str:
    if n[0] == "cast":
        return "i64" if n[1] in ("int64_t", "longlong", "uint64_t") else "i32"
    if n[0] == "bin":
        if n[1] in ("<", ">", "<=", ">=", "==", "!=", "&&", "||"):
            return "bool"
        return "i64" if "i64" in (_c_type(n[2]), _c_type(n[3])) else "i32"
    if n[0] == "sel":
        return "i64" if "i64" in (_c_type(n[2]), _c_type(n[3])) else "i32"
    return "i32"


def _narrow_ops(n, out):
    """Binary + - * << nodes computed in 32 bits (neither side 64-bit; two literals do not count)."""
    if n[0] == "bin":
        _narrow_ops(n[2], out)
        _narrow_ops(n[3], out)
        if n[1] in ("*", "+", "-", "<<") and _c_type(n) == "i32" and not (n[2][0] == "lit" and n[3][0] == "lit"):
            out.append(n)
    elif n[0] == "cast":
        _narrow_ops(n[2], out)
    elif n[0] == "sel":
        for c in n[1:]:
            _narrow_ops(c, out)
    elif n[0] == "not":
        _narrow_ops(n[1], out)
    return out


def _inside(src: str, start: int, open_ch: str, close_ch: str) -> str:
    depth = 0
    for j in range(start, len(src)):
        depth += {open_ch: 1, close_ch: -1}.get(src[j], 0)
        if depth == 0:
            return src[start + 1:j]
    raise ValueError("unbalanced")


def global_index_exprs(src: str):
    """(pointer parameters, [(pointer, index expression)]) of a TileLang kernel's plain global accesses:
    ``p[...]`` and ``(p + ...)`` (vector accesses) of its pointer parameters (TMA descriptors excluded)."""
    sig = re.search(r"__global__ void __launch_bounds__\([^)]*\)\s*\w+\(([^)]*)\)", src)
    params = re.findall(r"\*\s*__restrict__\s+(\w+)", sig.group(1))
    body = src[sig.end():]
    acc = []
    for p in params:
        for m in re.finditer(rf"(?<![\w.]){p}\[", body):
            acc.append((p, _inside(body, m.end() - 1, "[", "]")))
        for m in re.finditer(rf"\({p} \+ ", body):
            acc.append((p, _inside(body, m.start(), "(", ")")[len(p) + 3:]))
    return params, acc


def narrow_global_indices(src: str) -> list:
    """[(pointer, expression)] of global accesses whose index has a 32-bit product or sum."""
    _, acc = global_index_exprs(src)
    return [(p, e[:200]) for p, e in acc if _narrow_ops(_c_parse(_c_tokens(e)), [])]


def test_c_index_checker_flags_a_32bit_product():
    good = ("*(float4*)(X + ((((int64_t)((int)blockIdx.y)) * (int64_t)4096) + ((((int64_t)((int)blockIdx.x)) * "
            "((int64_t)Hv)) * (int64_t)4096)))")
    bad = "*(float4*)(X + ((int64_t)((((int)blockIdx.x) * Hv) * 4096)))"
    sig = "extern \"C\" __global__ void __launch_bounds__(128, 1) k(float* __restrict__ X, int Hv) {\n"
    assert narrow_global_indices(sig + good + " = v;\n}") == []
    assert [p for p, _ in narrow_global_indices(sig + bad + " = v;\n}")] == ["X"]
    shared_only = sig + "((float*)buf)[((((int)threadIdx.x) >> 4) * 72)] = 0.f;\n}"
    assert narrow_global_indices(shared_only) == []


def _tilelang_kernels():
    # (id, builder module, builder name, args, pointer parameters whose accesses must be there)
    return [
        ("intra_save_x", "chunk_intra_sm90", "build_intra", ("bfloat16", "bfloat16", 128, 128, False, True),
         {"X_out", "G_out", "g", "beta"}),
        ("fwd_ws_bv128_save", "chunk_fwd_ws_sm90", "build_fwd_ws",
         ("bfloat16", 128, 128, 128, False, True, True, True, 2, 1, True, True), {"o", "h0", "ht"}),
        ("bwd_wy_v2", "chunk_bwd_wy_v2_sm90", "build_bwd_wy_v2", ("bfloat16", "bfloat16", 128, 128, False),
         {"X", "dkp", "dk_out", "dv_out", "dg_out", "db_out", "beta"}),
    ]


@pytest.mark.compile
@pytest.mark.skipif(not HAVE_TILELANG, reason="tilelang is not installed")
@pytest.mark.parametrize("kid,module,builder,args,expected", _tilelang_kernels(), ids=[k[0] for k in _tilelang_kernels()])
def test_tilelang_global_indices_are_64bit(kid, module, builder, args, expected):
    """Lowered for sm_90a: every plain global load / store index is computed in 64 bits (TileLang widens the
    indices of buffers with symbolic shapes); TMA copies (per-dimension 32-bit coordinates) are not plain."""
    import importlib

    import tilelang
    from flashqla.backends.tilelang._compile import TARGET

    build = getattr(importlib.import_module(f"flashqla.backends.tilelang.{module}"), builder)
    src = tilelang.compile(build(*args), out_idx=None, target=TARGET).get_kernel_source()
    params, acc = global_index_exprs(src)
    assert expected <= {p for p, _ in acc}, f"accesses of {expected - {p for p, _ in acc}} not found"
    assert narrow_global_indices(src) == []


# ======================================================================================== cutlass (CuTe DSL)

_CUTE_PROBE_DIRS: dict = {}


def _cute_probe_ptx(wide_stride: bool, tmp: Path) -> str:
    """PTX of a probe kernel shaped like the prep kernel's ``-w`` store: a 64-row tile at row ``chunk * hv +
    head`` of a (rows * 64, 128) bf16 tensor, 128-bit stores, and one element store, with the row stride
    static (as before issue #11) or ``_sm90.wide``."""
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from flashqla.backends.cutlass import _ptr
    from flashqla.backends.cutlass._sm90 import wide

    BT, K = 64, 128
    rs = (lambda x, d: wide(x, d)) if wide_stride else (lambda x, d: x)

    class Probe:
        @cute.jit
        def __call__(self, w_ptr: cute.Pointer, total_chunks: cutlass.Int32, hv: cutlass.Int32,
                     stream: cuda.CUstream):
            rows = total_chunks * hv
            mW = cute.make_tensor(w_ptr, cute.make_layout((rows * BT, K), stride=(rs(K, K), 1)))
            self.kernel(mW, hv).launch(grid=(total_chunks, hv, 1), block=(128, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mW: cute.Tensor, hv: cutlass.Int32):
            tidx, _, _ = cute.arch.thread_idx()
            chunk, head, _ = cute.arch.block_idx()
            row = chunk * hv + head
            mW[row * BT + tidx // 2, tidx % 2] = cutlass.BFloat16(2.0)
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=128)
            cp = cute.make_tiled_copy_tv(atom, cute.make_layout((8, 16), stride=(16, 1)), cute.make_layout((1, 8)))
            thr = cp.get_slice(tidx)
            dst = thr.partition_D(cute.local_tile(mW, (BT, K), (row, 0)))
            r = cute.make_rmem_tensor(dst.shape, cutlass.BFloat16)
            r.fill(1.0)
            cute.copy(cp, r, dst)

    d = tmp / ("wide" if wide_stride else "static")
    d.mkdir(parents=True, exist_ok=True)
    fn = cute.compile(Probe(), _ptr("bfloat16", 1 << 12, 16), cutlass.Int32(1), cutlass.Int32(2), cuda.CUstream(0),
                      options=f"--gpu-arch sm_90a --keep-ptx --dump-dir {d}")
    ptx = fn.__ptx__
    if ptx and os.path.exists(str(ptx).strip()):
        ptx = Path(str(ptx).strip()).read_text()
    if not ptx or ".entry" not in ptx:
        ptx = "\n".join(p.read_text() for p in d.glob("*.ptx"))
    return ptx


@pytest.mark.compile
@pytest.mark.skipif(not HAVE_CUTE, reason="nvidia-cutlass-dsl is not installed")
def test_cute_wide_stride_makes_offsets_64bit(tmp_path, monkeypatch):
    """With a static stride CuTe multiplies the row by it in 32 bits (``row * 8192`` wraps past 2^31 at 2^18
    rows); with ``wide`` the product is 64-bit and the 128-bit stores stay vectorised."""
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    static = _cute_probe_ptx(False, tmp_path)
    widened = _cute_probe_ptx(True, tmp_path)
    body = lambda p: p[p.index(".entry"):]  # noqa: E731
    assert "mul.lo.s64" not in body(static) and "mul.lo.s64" in body(widened)
    assert body(static).count("st.global.v4") == body(widened).count("st.global.v4") == 8


# tensors of the cutlass kernels that may stay 32-bit: their offsets are bounded by what supports() admits
# ((tokens + 64 N) * Hv * 2 < 2^31): per-token gates [tokens, Hv], per-chunk-row vectors [rows * 64],
# cu_seqlens / chunk offsets [N + 1], chunk indices [chunks, 2], the segment tables of the forward's walk over
# segments [segments, 4] and [segments, Hv] (at most a segment per chunk)
_SMALL_SHAPES = ("(total_tokens, hv)", "(rows * BT,)", "(num_seqs + 1,)", "(total_chunks, 2)", "(num_seqs, 4)",
                 "(num_seqs, hv)")


def test_cutlass_plain_access_tensors_have_wide_strides():
    """Source check of every cutlass kernel: a global tensor that is not only a TMA source and is not one
    of the small ones above is built with a ``wide(...)`` (Int64) stride.  The forward kernels' shared tensors are
    built in ``_sm90.fwd_global_tensors`` (``name=cute.make_tensor(...)``); how the kernels use them decides."""
    kdir = ROOT / "flashqla" / "backends" / "cutlass"
    kernels = {path: path.read_text() for path in sorted(kdir.glob("chunk_*_sm90.py"))}
    helper = kdir / "_sm90.py"
    sites = []       # (file, its source, name, layout, the sources that use the tensor)
    for path, src in kernels.items():
        for m in re.finditer(r"^\s+(\w+) = cute\.make_tensor\(\w+_ptr, cute\.make_layout\(", src, flags=re.M):
            sites.append((path, src, m.group(1), _inside(src, m.end() - 1, "(", ")"), [src]))
    hsrc = helper.read_text()
    users = [src for src in kernels.values() if "fwd_global_tensors(" in src]
    assert len(users) >= 2, "the forward kernels build their shared tensors in _sm90.fwd_global_tensors"
    for m in re.finditer(r"^\s+(\w+)=cute\.make_tensor\(\w+_ptr, cute\.make_layout\(", hsrc, flags=re.M):
        sites.append((helper, hsrc, m.group(1), _inside(hsrc, m.end() - 1, "(", ")"), users))
    checked = 0
    for path, src, name, layout, used_in in sites:
        layout = " ".join(layout.split())

        def tma_only(u):
            tma = set(re.findall(r"make_tiled_tma_atom\(\w+, (\w+),", u))
            return name in tma and not re.search(rf"\b{name}\[", u) and f"local_tile({name}," not in u \
                and f"domain_offset((tok, 0), {name}" not in u

        if all(tma_only(u) for u in used_in):
            continue    # read by TMA only
        if layout.startswith(_SMALL_SHAPES):
            continue
        assigns = dict(re.findall(r"^\s+(\w+) = (.+)$", src, flags=re.M))
        stride = layout.split("stride=", 1)[1] if "stride=" in layout else ""
        names = re.findall(r"\b([a-z_]\w*)\b", stride)
        ok = "wide(" in stride or any("wide(" in assigns.get(n, "") for n in names)
        assert ok, f"{path.name}: {name} = make_tensor(..., {layout.strip()[:100]}) has no 64-bit stride"
        checked += 1
    assert checked >= 15, checked


# ======================================================================================== GPU: the real thing

GPU_BACKENDS = ("triton", "tilelang", "cutlass")
HQK, HV, D = 16, 32, 128


def _need_backend(name: str):
    """Skip unless ``name`` is available and serves a bf16 16/32, K = V = 128 call on this GPU."""
    be = get_backend(name)
    ok, why = be.available()
    if not ok:
        pytest.skip(f"{name} unavailable: {why}")
    dev = torch.device("cuda")
    q = torch.zeros(1, 64, HQK, D, dtype=torch.bfloat16, device=dev)
    v = torch.zeros(1, 64, HV, D, dtype=torch.bfloat16, device=dev)
    g = torch.zeros(1, 64, HV, dtype=torch.float32, device=dev)
    d = flashqla.explain(q, q, v, g, g.to(torch.bfloat16), output_final_state=True, backend=name)
    if d.chosen != name:
        why = next((c.reason for c in d.candidates if c.name == name), "cannot serve")
        pytest.skip(f"{name} cannot serve this device: {why}")


def _need_memory(gb: float):
    import gc
    gc.collect()
    torch.cuda.empty_cache()      # what an earlier test left in PyTorch's cache counts as free
    free, _ = torch.cuda.mem_get_info()
    if free < gb * 1e9:
        pytest.skip(f"needs ~{gb:.0f} GB of free GPU memory, {free / 1e9:.0f} GB free")


def _big_inputs(nseq: int, seqlen: int, seed: int = 0, dtype=torch.bfloat16, device="cuda"):
    """Packed inputs of nseq x seqlen tokens, generated in slices (no T-sized fp32 temporaries)."""
    from flashqla.reference import l2norm
    dev = torch.device(device)
    T = nseq * seqlen
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    q = torch.empty(1, T, HQK, D, dtype=dtype, device=dev)
    k = torch.empty_like(q)
    v = torch.empty(1, T, HV, D, dtype=dtype, device=dev)
    step = 1 << 16
    for s in range(0, T, step):
        e = min(T, s + step)
        q[:, s:e] = l2norm(torch.randn(1, e - s, HQK, D, generator=gen, device=dev)).to(dtype)
        k[:, s:e] = l2norm(torch.randn(1, e - s, HQK, D, generator=gen, device=dev)).to(dtype)
        v[:, s:e] = torch.randn(1, e - s, HV, D, generator=gen, device=dev).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(1, T, HV, generator=gen, device=dev))
    beta = torch.sigmoid(torch.randn(1, T, HV, generator=gen, device=dev)).to(dtype)
    cu = torch.arange(0, T + 1, seqlen, dtype=torch.int32, device=dev)
    return q, k, v, g, beta, cu


def _seq(x, n: int, seqlen: int):
    return x[:, n * seqlen:(n + 1) * seqlen].detach().clone()


def _oracle(q, k, v, g, beta, do=None):
    """float64 chunked oracle of one sequence (on its tensors' device): (o, final state[, dq, dk, dv, dg,
    dbeta])."""
    from flashqla.reference import chunk_gated_delta_rule_ref
    leaves = [t.double().requires_grad_(do is not None) for t in (q, k, v, g, beta)]
    with torch.set_grad_enabled(do is not None):
        o, ht = chunk_gated_delta_rule_ref(*leaves, output_final_state=True)
        if do is None:
            return o.detach(), ht[0].detach()
        grads = torch.autograd.grad(o, leaves, do.double())
    return (o.detach(), ht[0].detach(), *grads)


def _check(name, got, ref, tol):
    from flashqla.testing import rel_l2
    err = rel_l2(got, ref)
    assert err <= tol, f"{name}: rel-L2 {err:.2e} > {tol:.0e}"
    return err


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def forward_check(backend: str, nseq: int, L: int, seqs, device="cuda", training: bool = False, seed: int = 0,
                  dtype=torch.bfloat16) -> dict:
    """Forward over nseq x L packed tokens (no grad, or the training forward that keeps what the backward
    needs); o and the final state of sequences ``seqs`` against the oracle run on each of them alone.
    Returns {sequence: (o error, state error)}."""
    from flashqla.testing import TOLERANCES
    tol = TOLERANCES[str(dtype).replace("torch.", "")]
    q, k, v, g, beta, cu = _big_inputs(nseq, L, seed=seed, dtype=dtype, device=device)
    if training:
        o, ht, ctx = flashqla.chunk_gated_delta_rule_fwd(q, k, v, g, beta, output_final_state=True,
                                                         cu_seqlens=cu, backend=backend, for_backward=True)
    else:
        ctx = None
        with torch.no_grad():
            o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu,
                                                    backend=backend)
    _sync(device)
    assert o.shape == v.shape and ht.shape == (nseq, HV, D, D)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(ht).all())
    picked = {n: ([_seq(t, n, L) for t in (q, k, v, g, beta)], _seq(o, n, L), ht[n].clone()) for n in seqs}
    del q, k, v, g, beta, o, ht, ctx
    _sync(device)
    errs = {}
    for n, (ins, o_n, ht_n) in picked.items():
        o_ref, ht_ref = _oracle(*ins)
        errs[n] = (_check(f"{backend} o of sequence {n}", o_n, o_ref, tol["o"]),
                   _check(f"{backend} final state of sequence {n}", ht_n, ht_ref, tol["ht"]))
        print(f"{backend} sequence {n}: o {errs[n][0]:.2e}  final state {errs[n][1]:.2e}")
    return errs


def backward_check(backend: str, nseq: int, L: int, seqs, device="cuda", seed: int = 2,
                   dtype=torch.bfloat16) -> dict:
    """Forward + backward over nseq x L packed tokens; o and the gradients of sequences ``seqs`` against
    the oracle's on each of them alone.  Returns {sequence: {name: error}}."""
    from flashqla.testing import TOLERANCES
    tol = TOLERANCES[str(dtype).replace("torch.", "")]
    names = ("dq", "dk", "dv", "dg", "dbeta")
    q, k, v, g, beta, cu = _big_inputs(nseq, L, seed=seed, dtype=dtype, device=device)
    leaves = [t.requires_grad_() for t in (q, k, v, g, beta)]
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed + 1)
    do = torch.randn(v.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
    o, _ = flashqla.chunk_gated_delta_rule(*leaves, cu_seqlens=cu, backend=backend)
    grads = torch.autograd.grad(o, leaves, do)
    _sync(device)
    for name, gr in zip(names, grads):
        assert bool(torch.isfinite(gr).all()), f"{backend}: non-finite {name}"
    picked = {n: ([_seq(t, n, L) for t in leaves], _seq(do, n, L), _seq(o, n, L), [_seq(t, n, L) for t in grads])
              for n in seqs}
    del q, k, v, g, beta, leaves, do, o, grads
    _sync(device)
    errs = {}
    for n, (ins, do_n, o_n, grads_n) in picked.items():
        o_ref, _, *ref = _oracle(*ins, do=do_n)
        errs[n] = {"o": _check(f"{backend} o of sequence {n}", o_n, o_ref, tol["o"])}
        for name, got, r in zip(names, grads_n, ref):
            errs[n][name] = _check(f"{backend} {name} of sequence {n}", got, r, tol[name])
        print(f"{backend} sequence {n}: " + "  ".join(f"{k} {e:.2e}" for k, e in errs[n].items()))
    return errs


def test_large_tensor_checks_on_cpu_reference():
    """The GPU checks' machinery (inputs, slicing, oracle, tolerances), small and on the CPU: 3 sequences of
    100 tokens (a partial last chunk), 16/32 heads, the reference backend, fp32."""
    for training in (False, True):
        errs = forward_check("reference", 3, 100, (0, 2), device="cpu", training=training, dtype=torch.float32)
        assert set(errs) == {0, 2} and all(e < 1e-5 for pair in errs.values() for e in pair), errs
    errs = backward_check("reference", 2, 100, (1,), device="cpu", dtype=torch.float32)
    assert set(errs[1]) == {"o", "dq", "dk", "dv", "dg", "dbeta"} and max(errs[1].values()) < 1e-5, errs


# sequences around element 2^31 of v / o (token 2^19 = the start of sequence 128) and the last two
SEQS_1M = (0, 127, 128, 254, 255)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_forward_past_2pow31_elements(backend):
    """Forward at T = 2^20 tokens (256 x 4096, 16/32 heads, bf16; v and o hold 2^32 elements): o and the
    final state of sequences on both sides of element 2^31 and up to the last (2^32 - 1) match the oracle
    on that sequence."""
    _need_backend(backend)
    _need_memory(60)
    forward_check(backend, 256, 4096, SEQS_1M)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_training_forward_past_2pow31_elements(backend):
    """The forward that keeps what the backward needs (per-chunk states [16384, 32, 128, 128] = 2^33
    elements for tilelang / cutlass) at T = 2^20: o and the final states match."""
    _need_backend(backend)
    _need_memory(90)
    forward_check(backend, 256, 4096, (0, 254, 255), training=True, seed=1)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_backward_chunk_states_past_2pow31_elements(backend):
    """Forward + backward at 2^19 tokens (128 x 4096, 16/32 heads): per-chunk states and their gradients
    [8192, 32, 128, 128] hold 2^32 elements, the token-major tensors 2^31.  o and the gradients of the first
    and last sequences match the oracle's."""
    _need_backend(backend)
    _need_memory(115)
    backward_check(backend, 128, 4096, (0, 127))


# ======================================================================================== bench_memory harness

def _bench_memory():
    spec = importlib.util.spec_from_file_location("bench_memory", ROOT / "benchmarks" / "bench_memory.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_memory_arguments_and_grid():
    bm = _bench_memory()
    a = bm.parse_args([])
    assert a.modes == ["fwd", "fwdbwd"] and a.backends is None and a.baselines is None and a.out is None
    a = bm.parse_args(["--modes", "fwd", "--filter", "16/32", "--backends", "triton", "--out", "x"])
    assert a.modes == ["fwd"] and a.filter == "16/32" and a.backends == "triton" and a.out == "x"
    with pytest.raises(SystemExit):
        bm.parse_args(["--modes", "bwd"])
    rows = bm.grid(["fwd", "fwdbwd"])
    fwd = [r for m, r in rows if m == "fwd"]
    bwd = [r for m, r in rows if m == "fwdbwd"]
    assert len(fwd) == 25 and len(bwd) == 20            # 5 head configs x 5 shapes; x {8k, 32k} x {1, 4}
    assert {r.heads for r in fwd} == {"2/8", "4/16", "8/32", "16/32", "16/64"}
    assert {r.shape for r in fwd if r.heads == "16/32"} == {"1x32768", "1x8192", "28672+4096", "4x8192", "8x1024"}
    assert {r.shape for r in bwd if r.heads == "2/8"} == {"1x8k", "4x2k", "1x32k", "4x8k"}
    assert [r.name() for m, r in bm.grid(["fwd"], "16/32 4x")] == ["16/32 4x8192"]


def test_bench_memory_row_on_cpu_and_outputs(tmp_path):
    """One row through the harness on the CPU (reference backend, the CPU accounting), an implementation
    that fails (an error cell, the run goes on), the '<= FlashQLA' column and the writers."""
    from flashqla.cli.bench import Impl, build_impls
    from flashqla.cli.cases import BenchRow
    bm = _bench_memory()
    impls = build_impls(["reference"], [])

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    impls.append(Impl("broken", "backend", broken))
    dev = torch.device("cpu")
    rows = [bm.measure_row(BenchRow(1, 2, (40, 70)), impls, mode, torch.float32, dev) for mode in ("fwd", "fwdbwd")]
    for rec in rows:
        r = rec["results"]["reference"]
        assert r["status"] == "ok", r
        # the call's outputs are part of its peak
        assert r["peak_bytes"] >= rec["out_bytes"] > 0, (r, rec["out_bytes"])
        assert rec["results"]["broken"]["status"] == "error" and "boom" in rec["results"]["broken"]["error"]
        assert rec["le_flashqla"] == {}
    # a FlashQLA result on the row: each backend is compared with it
    fake = dict(rows[0], results=dict(rows[0]["results"], flashqla={"status": "ok", "peak_bytes": 1}))
    impls_fq = impls + [Impl("flashqla", "baseline", broken)]
    bm.compare_to_flashqla(fake, impls_fq)
    assert fake["le_flashqla"] == {"reference": False}
    fake["results"]["flashqla"]["peak_bytes"] = 10 ** 12
    bm.compare_to_flashqla(fake, impls_fq)
    assert fake["le_flashqla"] == {"reference": True}

    meta = {"device": {"type": "cpu", "name": "cpu"}, "dtype": "float32", "modes": ["fwd", "fwdbwd"],
            "method": "test", "impls": [{"name": im.name, "kind": im.kind, "version": im.version,
                                         "skipped": im.skip_reason} for im in impls_fq]}
    bm.write_outputs(tmp_path, meta, rows + [fake], impls_fq)
    doc = json.loads((tmp_path / "bench_memory.json").read_text())
    assert len(doc["rows"]) == 3 and doc["rows"][0]["results"]["reference"]["status"] == "ok"
    md = (tmp_path / "bench_memory.md").read_text()
    assert "## forward (no grad, output_final_state=True)" in md and "## forward + backward" in md
    assert "| reference peak MB | broken peak MB | flashqla peak MB | reference <= FlashQLA |" in md
    assert "| 1/2 | 40+70 | 110 |" in md and "ERR" in md and "| yes |" in md
    assert "broken error on fwd 1/2 40+70: RuntimeError: boom" in md


def test_bench_memory_cli_on_cpu(tmp_path):
    """The script end to end on the CPU (two tiny rows, both modes)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_memory.py"), "--device", "cpu", "--tiny",
                          "--filter", "1x64", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=str(ROOT))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    doc = json.loads((tmp_path / "bench_memory.json").read_text())
    assert [(r["mode"], r["label"]) for r in doc["rows"]] == [("fwd", "1/2 1x64"), ("fwdbwd", "1/2 1x64")]
    assert all(r["results"]["reference"]["status"] == "ok" for r in doc["rows"])
    # two runs (the device run measures fwd and fwdbwd in separate calls) merged into one table
    bm = _bench_memory()
    assert bm.main(["--merge", str(tmp_path / "bench_memory.json"), str(tmp_path / "bench_memory.json"),
                    "--out", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "bench_memory.json").read_text())
    assert len(merged["rows"]) == 4 and merged["meta"]["modes"] == ["fwd", "fwdbwd"]
    assert (tmp_path / "merged" / "bench_memory.md").read_text().count("| 1/2 | 1x64 | 64 |") == 4


def _small_triton_inputs(T, Hv, K, Hqk=1):
    """A small packed-free GVA call (seeded) for the CPU memory-meter tests of the triton backend."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    q = torch.randn(1, T, Hqk, K)
    k = F.normalize(torch.randn(1, T, Hqk, K), dim=-1)
    v = torch.randn(1, T, Hv, K)
    g = F.logsigmoid(torch.randn(1, T, Hv))
    beta = torch.rand(1, T, Hv)
    return q, k, v, g, beta


def test_bench_memory_cpu_meter_under_the_triton_interpreter():
    """The CPU meter counts the triton backend's buffers under the interpreter, whose launches copy_ into
    tensors the meter has already seen (it raised there: a WeakSet compares tensors with ==), and the
    triton backward's peak stays under the buffers of the session-9 layout.  The bound is what that layout
    allocates at its peak (the wy kernel), in units of one fp32 [T, Hv, K] slice; before the state
    gradients and the per-value-head dq were freed ahead of it the same call measured 13.1 units."""
    bm = _bench_memory()
    if not flashqla.get_backend("triton").available()[0]:
        pytest.skip("triton backend unavailable here")
    T, Hv, K = 256, 2, 64
    q, k, v, g, beta = _small_triton_inputs(T, Hv, K)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
    o, _ = flashqla.chunk_gated_delta_rule(*leaves, backend="triton")
    do = torch.randn_like(o)
    with bm.CpuMeter() as m:
        grads = torch.autograd.grad(o, leaves, do)
        del grads
    unit = T * Hv * K * 4
    assert 0 < m.peak <= 12.0 * unit, m.peak / unit


def test_triton_unfused_forward_frees_w_and_u_before_the_output(monkeypatch):
    """The triton forward's unfused path (state pass, then the output pass: the H200's choice for few
    sequences x heads) drops w and u before allocating o.  Peak in units of one fp32 [T, Hv, K] slice
    (K = V): w, u, the chunk states and v_new are one each, o one, the final state 0.25: 5.25 units before
    session 10, 4.25 now (+ the small gate planes).  This call measures 6.28 units on the old order and 5.28
    now: under the interpreter one more unit than the buffers count is alive at the peak, in both orders."""
    bm = _bench_memory()
    if not flashqla.get_backend("triton").available()[0]:
        pytest.skip("triton backend unavailable here")
    monkeypatch.setenv("FLASHQLA_TRITON_TUNE", "fwd.fuse=0")
    T, Hv, K = 256, 2, 64
    q, k, v, g, beta = _small_triton_inputs(T, Hv, K)
    with torch.no_grad(), bm.CpuMeter() as m:
        o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend="triton")
    unit = T * Hv * K * 4
    assert m.peak <= 5.5 * unit, m.peak / unit
    ref, _ = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, backend="reference")
    assert (o - ref).norm() <= 1e-4 * ref.norm()
