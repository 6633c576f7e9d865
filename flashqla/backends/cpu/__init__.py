"""Backend "cpu": the chunked gated delta rule in C++17 (pybind11 + OpenMP), forward and backward.

Algorithm.  The chunked (chunk 64) UT/WY form of :mod:`flashqla.reference`, in fp32 with the gate
cumsum and every gate difference in float64 before exponentiation (only ``G_r - G_j`` with ``r >= j``
is exponentiated, so strong decay underflows to 0 and never overflows).  Per chunk:
``A = diag(beta) (k k^T) o D``, ``Tm = (I + A)^-1`` by forward substitution, ``[W | U] = Tm [beta
Gamma k | beta v]``, ``Vn = U - W S``, ``o = scale (Gamma q S + ((q k^T) o D) Vn)``, ``S <- Gamma_C S +
(lambda k)^T Vn``.  The backward is the hand-derived gradient of exactly that form (derivation in
``csrc/kernels.h``): a state pass recomputes each chunk's start state and ``Vn``, then the chunks run
in reverse carrying ``dS``; d(q, k) are produced per value head in fp32 and a second pass sums the GVA
group and applies the L2-norm backward.  Inputs q/k/v in fp32, bf16 or fp16 (g and beta each in any
of the three), converted to fp32 on load; o and the gradients are written in the inputs' dtypes,
states in fp32.  float64 is refused (``auto`` then picks the reference).

Threading.  One work item per (sequence, value head), sorted longest first, OpenMP dynamic schedule
on ``torch.get_num_threads()`` threads; the GIL is released for the whole native call.  Each chunk's
products are small row-major GEMMs on a register-blocked micro-kernel (4 rows x up to 4 vectors),
compiled three times (baseline, AVX2+FMA, AVX-512) and chosen at import by CPU feature
(``FLASHQLA_CPU_ISA=generic|avx2|avx512`` or ``_native.set_isa(name)`` overrides; ``_native.isa()``
reports).  With fewer (sequence, head) items than threads the spare threads idle: a single
sequence with a single value head runs on one core.

Memory.  Forward: ~1.4 MiB of scratch per thread (K = V = 128), nothing saved beyond the inputs.
Backward: per thread, the chunk start states and ``Vn`` of the sequence being processed
(``ceil(T/64) * (K*V + 64*V)`` fp32, e.g. 12 MiB for T = 8192, K = V = 128), plus fp32 per-value-head
d(q, k) buffers ``[tokens, Hv, K]`` (skipped for fp32 without GVA or L2 norm).  No ``T*K*V`` buffer.
"""

from __future__ import annotations

from ...dispatch.registry import Backend, register_backend

_DT_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
_mod = None  # the imported native module (not named _native: that is the submodule's own name)
_import_error = None


def _load():
    global _mod, _import_error
    if _mod is None and _import_error is None:
        try:
            import importlib
            _mod = importlib.import_module(__name__ + "._native")  # built by CMake (pip install -e .)
        except Exception as exc:  # pragma: no cover - depends on the build
            _import_error = f"{type(exc).__name__}: {exc}"
    return _mod


def _code(dtype) -> int:
    return _DT_CODES[str(dtype).replace("torch.", "")]


def _seq_offsets(x_varlen, B: int, T: int) -> list:
    if x_varlen is not None:
        return list(x_varlen.cu_seqlens_cpu)
    return [b * T for b in range(B + 1)]


def _threads() -> int:
    import torch
    return max(1, torch.get_num_threads())


class CpuBackend(Backend):
    name = "cpu"
    description = "C++17 chunked kernels (OpenMP over sequence x value head, fp32 math)"
    priorities = {"cpu": 20}

    def available(self):
        mod = _load()
        if mod is None:
            return False, f"native module flashqla.backends.cpu._native failed to import ({_import_error})"
        return True, f"native module ({mod.isa()} kernels, openmp={'on' if mod.openmp else 'off'})"

    def version(self) -> str:
        mod = _load()
        return "" if mod is None else mod.isa()

    def supports(self, spec):
        if spec.device.type != "cpu":
            return False, f"runs on CPU tensors only, got a {spec.device.arch} device"
        for what, dt in (("q/k/v", spec.dtype), ("g", spec.g_dtype), ("beta", spec.beta_dtype)):
            if dt not in _DT_CODES:
                return False, f"{what} dtype {dt} unsupported (float32, bfloat16, float16; float64 -> reference)"
        if spec.state_dtype is not None and spec.state_dtype != "float32":
            return False, f"initial_state dtype {spec.state_dtype} unsupported (float32 only)"
        if spec.state_layout != "KV":
            return False, f"state layout {spec.state_layout} unsupported (KV only)"
        if not (1 <= spec.K <= 256 and 1 <= spec.V <= 256):
            return False, f"head dims K={spec.K}, V={spec.V} unsupported (1..256)"
        return True, "fp32/bf16/fp16, any head dim up to 256, varlen, GVA, states, L2 norm"

    def forward(self, spec, x):
        import torch
        mod = _load()
        q, k, v, g, beta = x.q, x.k, x.v, x.g, x.beta
        B, T, Hqk, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        cu = _seq_offsets(x.varlen, B, T)
        N = len(cu) - 1
        h0 = x.initial_state
        if h0 is not None:
            h0 = h0.to(torch.float32).contiguous()
        o = torch.empty_like(v)
        ht = torch.empty(N, Hv, K, V, dtype=torch.float32) if x.output_final_state else None
        mod.fwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                _code(q.dtype), _code(g.dtype), _code(beta.dtype),
                0 if h0 is None else h0.data_ptr(), 0 if ht is None else ht.data_ptr(), o.data_ptr(),
                cu, Hqk, Hv, K, V, float(x.scale), bool(x.use_qk_l2norm), _threads())
        saved = (q, k, v, g, beta, h0) if spec.needs_grad else ()
        return o, ht, saved, (float(x.scale), cu, bool(x.use_qk_l2norm))

    def backward(self, spec, saved, aux, do, dht):
        import torch
        mod = _load()
        scale, cu, l2norm = aux
        q, k, v, g, beta, h0 = saved
        B, T, Hqk, K = q.shape
        Hv, V = v.shape[2], v.shape[3]
        do = do.to(v.dtype).contiguous()
        if dht is not None:
            dht = dht.to(torch.float32).contiguous()
        dv = torch.empty_like(v)
        dg = torch.empty_like(g)
        dbeta = torch.empty_like(beta)
        dh0 = torch.empty_like(h0) if h0 is not None else None
        # d(q, k) come out per value head in fp32; when that already is the answer (fp32, no GVA, no
        # L2 norm) the kernel writes the outputs directly, else a second pass reduces and converts.
        direct = q.dtype == torch.float32 and Hv == Hqk and not l2norm
        if direct:
            dq, dk = torch.empty_like(q), torch.empty_like(k)
            acc_q, acc_k = dq, dk
        else:
            acc_q = torch.empty(B, T, Hv, K, dtype=torch.float32)
            acc_k = torch.empty(B, T, Hv, K, dtype=torch.float32)
        nt = _threads()
        mod.bwd(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                _code(q.dtype), _code(g.dtype), _code(beta.dtype), 0 if h0 is None else h0.data_ptr(),
                do.data_ptr(), 0 if dht is None else dht.data_ptr(), acc_q.data_ptr(), acc_k.data_ptr(),
                dv.data_ptr(), dg.data_ptr(), dbeta.data_ptr(), 0 if dh0 is None else dh0.data_ptr(),
                cu, Hqk, Hv, K, V, float(scale), bool(l2norm), nt)
        if not direct:
            dq, dk = torch.empty_like(q), torch.empty_like(k)
            mod.finalize_qk(acc_q.data_ptr(), q.data_ptr(), dq.data_ptr(), _code(q.dtype), B * T, Hqk, Hv, K,
                            bool(l2norm), nt)
            mod.finalize_qk(acc_k.data_ptr(), k.data_ptr(), dk.data_ptr(), _code(k.dtype), B * T, Hqk, Hv, K,
                            bool(l2norm), nt)
        return dq, dk, dv, dg, dbeta, dh0


register_backend(CpuBackend())
