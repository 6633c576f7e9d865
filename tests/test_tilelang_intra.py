"""CPU proof of the blocked inverse in ``flashqla/backends/tilelang/chunk_intra_sm90.py``.

The kernel computes ``X = (I + A)^-1`` of each chunk's 64x64 strictly lower ``A`` in five phases (P1:
16x16 diagonal inverses by substitution; P2a/P2b: the 32x32 diagonal halves; P3a/P3b: the 32x32
lower-left block), each thread owning fixed rows / columns and the intermediates living in scratch
parts of the shared tiles.  ``emulate_blocked_inverse`` replays exactly those steps: the same
per-thread index formulas (vectorised over the 128 threads with gathers), the same summation order,
the same shared tiles (row stride 72, Y scratch in the upper triangle of ``A_s``) -- and records, per
phase, which shared elements are read and written, so the tests also prove that no phase reads what
another thread writes in the same phase (the ``__syncthreads`` between phases are the only ordering).

Checked against ``torch.linalg.solve_triangular`` in float64 on chunks built like the kernel builds
them: random / L2-normalised keys, beta in (0, 1) and in {0, 1}, mild to strong decay (``g`` down to
``-16 softplus``), and chunks with padded tail rows (``g = beta = 0``).
"""

from __future__ import annotations

import math

import pytest
import torch

C = 64
PAD = 72          # row stride of A_s / X_s in the kernel
THREADS = 128


class _Tile:
    """A shared fp32 tile ``[B, 64, PAD]`` whose reads and writes are recorded per phase."""

    def __init__(self, name, B, dtype):
        self.name = name
        self.buf = torch.zeros(B, C, PAD, dtype=dtype)
        self.written = torch.zeros(C, PAD, dtype=torch.bool)   # ever written (initialised)
        self.reads = set()
        self.writes = []

    def rd(self, r, c):
        r = torch.as_tensor(r).expand(THREADS if torch.as_tensor(c).dim() == 0 else torch.as_tensor(c).shape)
        c = torch.as_tensor(c).expand(r.shape)
        assert bool(self.written[r, c].all()), f"{self.name}: read of an element never written"
        self.reads.update((r * PAD + c).tolist())
        return self.snap[:, r, c]

    def wr(self, r, c, val):
        r = torch.as_tensor(r)
        c = torch.as_tensor(c).expand(r.shape)
        self.writes.extend((r * PAD + c).tolist())
        self.buf[:, r, c] = val
        self.written[r, c] = True

    def begin(self):
        self.snap = self.buf.clone()      # what every thread sees during the phase
        self.reads, self.writes = set(), []

    def end(self, phase):
        assert len(self.writes) == len(set(self.writes)), f"{phase}: {self.name} element written twice"
        clash = self.reads & set(self.writes)
        assert not clash, f"{phase}: {self.name} read and written in the same phase ({len(clash)} elements)"


def emulate_blocked_inverse(A: torch.Tensor) -> torch.Tensor:
    """``A [B, 64, 64]`` strictly lower (dtype float32 or float64: the compute dtype).  Returns ``X``
    computed with the kernel's steps, in the same dtype."""
    B, dt = A.shape[0], A.dtype
    A_s, X_s = _Tile("A_s", B, dt), _Tile("X_s", B, dt)
    tiles = (A_s, X_s)

    def phase(name, body):
        for t in tiles:
            t.begin()
        body()
        for t in tiles:
            t.end(name)

    # A-build (fragment -> A_s[r, j], zero on and above the diagonal) and T.clear(X_s)
    r_, j_ = torch.meshgrid(torch.arange(C), torch.arange(C), indexing="ij")
    A_s.buf[:, :, :C] = torch.where(r_ > j_, A, torch.zeros((), dtype=dt))
    A_s.written[:, :C] = True
    X_s.written[:, :] = True

    tx = torch.arange(THREADS)
    warp, lane = tx // 32, tx % 32

    def p1():
        t = tx[tx < 64]
        d0, cc = (t // 16) * 16, t % 16
        x = torch.zeros(B, len(t), 16, dtype=dt)
        for m in range(16):
            x[:, :, m] = (cc == m).to(dt)
        for m in range(16):
            for r in range(m + 1, 16):
                x[:, :, r] = x[:, :, r] - A_s.rd(d0 + r, d0 + m) * x[:, :, m]
        for r in range(16):
            X_s.wr(d0 + r, d0 + cc, x[:, :, r])

    p0, ri, c2 = (tx // 64) * 32, (tx % 64) // 16, tx % 16

    def p2a():
        y = [torch.zeros(B, THREADS, dtype=dt) for _ in range(4)]
        for m in range(16):
            for i in range(4):
                y[i] = y[i] + A_s.rd(p0 + 16 + ri + 4 * i, p0 + m) * X_s.rd(p0 + m, p0 + c2)
        for i in range(4):
            A_s.wr(p0 + ri + 4 * i, p0 + 16 + c2, y[i])

    def p2b():
        y = [torch.zeros(B, THREADS, dtype=dt) for _ in range(4)]
        for m in range(16):
            for i in range(4):
                y[i] = y[i] - X_s.rd(p0 + 16 + ri + 4 * i, p0 + 16 + m) * A_s.rd(p0 + m, p0 + 16 + c2)
        for i in range(4):
            X_s.wr(p0 + 16 + ri + 4 * i, p0 + c2, y[i])

    r3, c3 = tx // 16, tx % 16

    def p3a():
        ya = [torch.zeros(B, THREADS, dtype=dt) for _ in range(4)]
        yb = [torch.zeros(B, THREADS, dtype=dt) for _ in range(4)]
        for m in range(16):
            for i in range(4):
                ya[i] = ya[i] + A_s.rd(32 + r3 + 8 * i, m) * X_s.rd(m, c3)
        for m in range(16, 32):
            for i in range(4):
                ya[i] = ya[i] + A_s.rd(32 + r3 + 8 * i, m) * X_s.rd(m, c3)
                yb[i] = yb[i] + A_s.rd(32 + r3 + 8 * i, m) * X_s.rd(m, 16 + c3)
        for i in range(4):
            A_s.wr(r3 + 8 * i, 32 + c3, ya[i])
            A_s.wr(r3 + 8 * i, 48 + c3, yb[i])

    def p3b():
        za = [torch.zeros(B, THREADS, dtype=dt) for _ in range(4)]
        zb = [torch.zeros(B, THREADS, dtype=dt) for _ in range(4)]
        for m in range(16):
            for i in range(4):
                za[i] = za[i] - X_s.rd(32 + warp + 4 * i, 32 + m) * A_s.rd(m, 32 + lane)
                zb[i] = zb[i] - X_s.rd(48 + warp + 4 * i, 32 + m) * A_s.rd(m, 32 + lane)
        for m in range(16, 32):
            for i in range(4):
                zb[i] = zb[i] - X_s.rd(48 + warp + 4 * i, 32 + m) * A_s.rd(m, 32 + lane)
        for i in range(4):
            X_s.wr(32 + warp + 4 * i, lane, za[i])
            X_s.wr(48 + warp + 4 * i, lane, zb[i])

    for name, body in (("P1", p1), ("P2a", p2a), ("P2b", p2b), ("P3a", p3a), ("P3b", p3b)):
        phase(name, body)
    return X_s.buf[:, :, :C].clone()


def substitution_inverse(A: torch.Tensor) -> torch.Tensor:
    """The former kernel's algorithm (column-per-thread right-looking substitution), in A's dtype."""
    B = A.shape[0]
    x = torch.eye(C, dtype=A.dtype).expand(B, C, C).clone()      # x[:, r, col]
    for m in range(C):
        x[:, m + 1:, :] -= A[:, m + 1:, m, None] * x[:, m, None, :]
    return x


# ----------------------------------------------------------------------------------------------------
# Chunks built the way the kernel builds A
# ----------------------------------------------------------------------------------------------------

def make_chunks(B, *, decay, beta_kind, l2norm, pad_from=None, seed=0, K=128, corr=0.0):
    """Returns (k, g, beta) for ``B`` chunks: k [B, 64, K] (bf16-representable), g, beta [B, 64];
    rows >= pad_from are padded (g = beta = 0, k arbitrary as in the kernel's tile).  ``corr``: the
    share of a common direction in every key (0: nearly orthogonal keys and X close to I; 0.9: cosines
    near 0.8 and an X far from I, the hard case for the inverse)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(B, C, K, generator=gen, dtype=torch.float64)
    if not l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
    if corr:
        k = k / k.norm(dim=-1, keepdim=True)
        common = torch.randn(B, 1, K, generator=gen, dtype=torch.float64)
        common = common / common.norm(dim=-1, keepdim=True)
        sign = torch.where(torch.rand(B, C, 1, generator=gen) < 0.5, -1.0, 1.0).to(torch.float64)
        k = math.sqrt(1 - corr ** 2) * k + corr * sign * common
        k = k * (1 + 0.5 * torch.rand(B, C, 1, generator=gen, dtype=torch.float64))   # norms 1..1.5
    k = k.to(torch.bfloat16).to(torch.float64)
    if beta_kind == "uniform":
        beta = torch.rand(B, C, generator=gen, dtype=torch.float64)
    else:                                                    # {0, 1}
        beta = (torch.rand(B, C, generator=gen) < 0.7).to(torch.float64)
    sp = torch.nn.functional.softplus(torch.randn(B, C, generator=gen, dtype=torch.float64))
    g = -decay * sp
    if pad_from is not None:
        g[:, pad_from:] = 0.
        beta[:, pad_from:] = 0.
    return k, g, beta


def build_A(k, g, beta, l2norm, dtype):
    """Step 4 of the kernel: ``A[r, j] = beta_r n_r n_j (k_r . k_j) exp(G_r - G_j)`` for j < r."""
    k, g, beta = k.to(dtype), g.to(dtype), beta.to(dtype)
    G = g.cumsum(-1)
    KK = k @ k.transpose(-1, -2)
    n = torch.rsqrt(torch.diagonal(KK, dim1=-2, dim2=-1) + 1e-6) if l2norm else torch.ones_like(g)
    idx = torch.arange(C)
    strict = idx[:, None] > idx[None, :]
    e = torch.exp(torch.where(strict, G[:, :, None] - G[:, None, :], torch.zeros((), dtype=dtype)))
    A = torch.where(strict, KK * beta[:, :, None] * n[:, :, None] * n[:, None, :] * e,
                    torch.zeros((), dtype=dtype))
    return A, G, n


def exact_inverse(A64):
    eye = torch.eye(C, dtype=torch.float64)
    return torch.linalg.solve_triangular(eye + A64, eye.expand_as(A64), upper=False, unitriangular=True)


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rel_rows(a, b):
    """Worst per-chunk relative error (Frobenius)."""
    return float(((a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1).clamp_min(1e-30)).max())


CASES = [
    # decay, beta kind, l2norm, padded from row, key correlation
    (0.0, "uniform", False, None, 0.0),
    (1.0, "uniform", True, None, 0.0),
    (16.0, "binary", True, None, 0.0),
    (0.0, "uniform", True, None, 0.9),
    (0.0, "binary", True, None, 0.9),
    (0.02, "binary", True, None, 0.95),
    (0.02, "uniform", False, None, 0.9),
    (1.0, "binary", True, None, 0.9),
    (16.0, "uniform", True, None, 0.9),
    (16.0, "binary", True, 20, 0.9),
    (0.05, "binary", True, 37, 0.9),
    (4.0, "uniform", True, 1, 0.9),
    (0.5, "uniform", True, 63, 0.9),
]


@pytest.mark.parametrize("decay,beta_kind,l2norm,pad,corr", CASES)
def test_blocked_inverse_matches_exact(decay, beta_kind, l2norm, pad, corr):
    k, g, beta = make_chunks(3, decay=decay, beta_kind=beta_kind, l2norm=l2norm, pad_from=pad,
                             seed=int(decay * 10) + 7 * (pad or 0), corr=corr)
    A64, _, _ = build_A(k, g, beta, l2norm, torch.float64)
    X_ref = exact_inverse(A64)

    # float64: the algebra of the blocking is exact (round-off only)
    X64 = emulate_blocked_inverse(A64)
    assert rel_rows(X64, X_ref) < 1e-12

    # float32, as the kernel computes (A built in fp32 too): close to the exact inverse of the
    # fp32 A, and no worse than the former substitution
    A32, _, _ = build_A(k, g, beta, l2norm, torch.float32)
    X32 = emulate_blocked_inverse(A32)
    X_ref32 = exact_inverse(A32.double())
    e_new = rel_rows(X32.double(), X_ref32)
    e_old = rel_rows(substitution_inverse(A32).double(), X_ref32)
    assert e_new < 1e-5, (e_new, e_old)
    eye = torch.eye(C, dtype=torch.float64)
    assert rel_rows(X32.double() - eye, X_ref32 - eye) < 1e-5 or float(A32.abs().max()) == 0
    assert e_new < 4 * e_old + 1e-6, (e_new, e_old)
    # exact structure: unit diagonal, zero upper triangle, padded rows/cols are identity
    idx = torch.arange(C)
    assert bool((torch.diagonal(X32, dim1=-2, dim2=-1) == 1).all())
    assert bool((X32[:, idx[:, None] < idx[None, :]] == 0).all())
    if pad is not None:
        assert torch.equal(X32[:, pad:, :], torch.eye(C)[pad:].expand(3, -1, -1))


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_w_u_within_16bit_rounding(dt):
    """w, u from the blocked X (fp32, then the kernel's 16-bit copies of X diag(.)) sit within the
    16-bit rounding of the exact float64 w, u -- like those from the former substitution."""
    k, g, beta = make_chunks(4, decay=2.0, beta_kind="uniform", l2norm=True, pad_from=50, seed=3)
    gen = torch.Generator().manual_seed(5)
    v = torch.randn(4, C, 128, generator=gen, dtype=torch.float64).to(dt).to(torch.float64)
    k = k.to(dt).to(torch.float64)
    A32, G32, n32 = build_A(k, g, beta, True, torch.float32)
    A64, G64, n64 = build_A(k, g, beta, True, torch.float64)
    X64 = exact_inverse(A64)
    w_ref = (X64 * (beta * torch.exp(G64) * n64)[:, None, :]) @ k
    u_ref = (X64 * beta[:, None, :]) @ v

    def wu(X):
        cw = (beta.float() * torch.exp(G32) * n32)
        Xw = (X * cw[:, None, :]).to(dt).double()
        Xu = (X * beta.float()[:, None, :]).to(dt).double()
        return (Xw @ k).to(dt).double(), (Xu @ v).to(dt).double()

    w_new, u_new = wu(emulate_blocked_inverse(A32))
    w_old, u_old = wu(substitution_inverse(A32))
    unit = 2.0 ** -8 if dt == torch.bfloat16 else 2.0 ** -11     # 16-bit unit roundoff
    for new, old, ref in ((w_new, w_old, w_ref), (u_new, u_old, u_ref)):
        e_new, e_old = rel(new, ref), rel(old, ref)
        assert e_new < 2 * unit, (e_new, e_old)
        assert e_new < 1.25 * e_old + 1e-7, (e_new, e_old)
        # new and old differ by at most a few 16-bit roundings
        assert rel(new, old) < 2 * unit


def test_kernel_source_matches_emulated_mapping():
    """The emulation's constants are the kernel's (row stride, thread count)."""
    from flashqla.backends.tilelang import chunk_intra_sm90 as m
    assert m.PAD == PAD and m.CHUNK == C
    assert math.gcd(PAD, 32) == 8      # neighbouring rows start 8 banks apart


@pytest.mark.parametrize("inv_mma", [False, True], ids=["fma", "mma"])
@pytest.mark.parametrize("save_x,l2norm", [(False, False), (True, False), (False, True)],
                         ids=["tb", "tbx", "tb-l2norm"])
def test_compact_stage1_lowers_with_a_over_k(save_x, l2norm, inv_mma):
    """``build_intra(compact=True)`` (FLASHQLA_TILELANG_INTRA_COMPACT): lowers for sm_90a with its wgmma and TMA, A
    shares the k tile's space, ~33 KB of shared memory (53 unpadded), no local memory; and every A / X access of the
    builder goes through the swizzle (a missed one would read another entry of the row)."""
    import re
    import sys
    from pathlib import Path
    pytest.importorskip("tilelang")
    import tilelang
    from flashqla.backends.tilelang import chunk_intra_sm90 as m
    from flashqla.backends.tilelang._compile import TARGET
    sys.path.insert(0, str(Path(__file__).parent))
    from test_backend_tilelang import assert_resources
    src_py = Path(m.__file__).read_text()
    code = [ln for ln in src_py.splitlines() if not ln.lstrip().startswith("#")]
    unswizzled = [ln for ln in code if re.search(r"\b[AX]_s\[", ln) and "sw(" not in ln]
    assert not unswizzled, unswizzled
    kern = tilelang.compile(m.build_intra("bfloat16", "bfloat16", 128, 128, l2norm, save_x, tb_only=True,
                                         compact=True, inv_mma=inv_mma), out_idx=None, target=TARGET)
    src = kern.get_kernel_source()
    assert "wgmma" in src and "tma_load" in src
    # (the tensor-core inverse reads the swizzled tiles through its own index helper, flq_at<true>)
    assert ("flq_inv64_mma_sw((&(((float*)A_s)[0])), (&(((float*)X_s)[0])));" in src) == inv_mma
    offs = dict(re.findall(r"void\* (\w+_s) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", src))
    assert offs.get("A_s") == offs.get("k_s"), offs
    assert_resources(kern, max_regs=102, max_dyn_smem_kb=36)     # (five CTAs of 128 threads per SM)


def test_compact_swizzle_is_a_row_permutation_that_keeps_the_banks_apart():
    """The swizzle ``j ^ 8 (r & 3)`` permutes each row's 64 columns, and on the inverse's read patterns (two rows
    r, r + 1 at one column; the two 16-column blocks of P1) it gives distinct banks, as the pad of 8 did."""
    sw = lambda r, j: j ^ ((r & 3) * 8)      # noqa: E731
    for r in range(64):
        assert sorted(sw(r, j) for j in range(64)) == list(range(64))
    for r in range(63):
        for j in range(64):
            assert (r * 64 + sw(r, j)) % 32 != ((r + 1) * 64 + sw(r + 1, j)) % 32
    for r in range(16):
        for m_ in range(16):
            assert (r * 64 + sw(r, m_)) % 32 != ((16 + r) * 64 + sw(16 + r, 16 + m_)) % 32


def test_compact_key_only_when_asked(monkeypatch):
    """The compact form is a compile-key option at the end: the default keys (and carried caches) are unchanged,
    and the scores form never takes it."""
    from flashqla.backends.tilelang import ops
    seen = []
    monkeypatch.setattr(ops, "get_kernel", lambda name, builder, key: seen.append((name, key)))
    monkeypatch.delenv("FLASHQLA_TILELANG_INTRA_COMPACT", raising=False)
    monkeypatch.delenv("FLASHQLA_TILELANG_EX2", raising=False)
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_INV", "fma")      # (the compact tiles are the CUDA-core inverse's)
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False)
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False, save_x=True)
    assert [len(k) for _, k in seen] == [7, 7]
    monkeypatch.setenv("FLASHQLA_TILELANG_INTRA_COMPACT", "1")
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False)
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False, save_x=True)
    ops.intra_tb_kernel(torch.bfloat16, torch.bfloat16, 128, False, scores=True)
    assert [k[-1] for _, k in seen[2:4]] == [True, True] and len(seen[2][1]) == 12
    assert len(seen[4][1]) == 8       # (scores: its own flag last, no compact)
