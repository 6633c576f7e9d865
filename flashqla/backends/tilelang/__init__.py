"""Backend "tilelang": TileLang kernels for Hopper (sm_90: wgmma, TMA, warp-specialised pipelines).

Forward = two kernels (see their module docstrings):

* ``chunk_intra_sm90`` — per (chunk, value head): gate cumsum, ``A = beta (k k^T) exp(G_i - G_j)``,
  the unit-lower inverse X, then ``w`` and ``u`` (training forwards), or only ``Tb = X diag(beta)``, 64 x 64
  per chunk (inference forwards, ``tb_only``);
* ``chunk_fwd_ws_sm90`` (default; ``chunk_fwd_sm90`` is the one-warpgroup form) — per (sequence, value head,
  V block): the serial state recurrence with the chunk output computed in the same pass, so chunk states
  touch HBM only when a backward needs them.  Its ``fused`` form (inference) reads v and Tb and forms
  ``v_new = Tb (v - exp(G) k S)`` on the chain instead of reading w and u.

Compile keys hold the head dims, dtypes and flags only; token counts, batch, sequences and head counts
are symbolic, so new shapes never recompile (``_compile.compile_count()`` counts builds).  Compiled
kernels are cached in memory and on disk by TileLang (``TILELANG_CACHE_DIR``).

Backward = three kernels: ``chunk_bwd_state_sm90`` (reverse state-gradient recurrence),
``chunk_bwd_dqk_v2_sm90`` (per-chunk gradients that need the chunk states) and ``chunk_bwd_wy_v2_sm90``
(back through the WY representation, the gate cumsum and the L2 norm).  With ``needs_grad`` the forward
also writes the 16-bit chunk states, ``v_new`` and the fp32 ``(I + A)^-1`` for them.

Serves: a CUDA device of capability exactly 9.0, K = V = 128, q/k/v bfloat16 or float16, g and beta
of any float dtype (g is computed in fp32), varlen, GVA, initial/final state, fused q/k L2 norm.
"""

from __future__ import annotations

import importlib.util

from ...dispatch.registry import Backend, register_backend

_SUPPORTED_DTYPES = ("bfloat16", "float16")
_FLOATS = ("float16", "bfloat16", "float32", "float64")
# The recurrence kernel puts sequences on grid.z.
_MAX_SEQS = 65535


class TileLangBackend(Backend):
    name = "tilelang"
    description = "TileLang kernels for Hopper (wgmma, TMA, warp specialisation)"
    priorities = {"sm_90": 30}
    has_backward = True

    _import_verdict = None

    def _tilelang_importable(self):
        if TileLangBackend._import_verdict is None:
            if importlib.util.find_spec("tilelang") is None:
                TileLangBackend._import_verdict = (False, "the tilelang package is not installed "
                                                          "(pip install tilelang==0.1.15)")
            else:
                try:
                    import tilelang  # noqa: F401
                    TileLangBackend._import_verdict = (True, f"tilelang {tilelang.__version__}")
                except Exception as exc:  # a broken install must not break dispatch
                    TileLangBackend._import_verdict = (False, f"importing tilelang failed: "
                                                              f"{type(exc).__name__}: {exc}")
        return TileLangBackend._import_verdict

    def available(self):
        try:
            import torch
            if not torch.cuda.is_available():
                return False, "no CUDA device (the tilelang kernels need an sm_90 GPU)"
        except Exception as exc:
            return False, f"torch.cuda check failed: {exc}"
        return self._tilelang_importable()

    def version(self) -> str:
        ok, why = self._tilelang_importable()
        return why if ok else ""

    def supports(self, spec):
        dev = spec.device
        if dev.type != "cuda":
            return False, f"needs a CUDA device, got {dev.type}"
        if dev.capability is None or tuple(dev.capability) != (9, 0):
            return False, (f"the kernels are built for sm_90a (Hopper, capability 9.0); this device is "
                           f"{dev.arch}")
        if spec.K != 128 or spec.V != 128:
            return False, f"head dims K = V = 128 only, got K = {spec.K}, V = {spec.V}"
        if spec.dtype not in _SUPPORTED_DTYPES:
            return False, f"q/k/v must be bfloat16 or float16, got {spec.dtype}"
        if spec.g_dtype not in _FLOATS or spec.beta_dtype not in _FLOATS:
            return False, f"g and beta must be floating, got {spec.g_dtype} / {spec.beta_dtype}"
        if spec.state_layout != "KV":
            return False, f"state layout [N, Hv, K, V] only, got {spec.state_layout}"
        if spec.num_seqs > _MAX_SEQS:
            return False, f"at most {_MAX_SEQS} sequences per call, got {spec.num_seqs}"
        return True, "sm_90, K = V = 128, 16-bit q/k/v"

    def forward(self, spec, x):
        from . import ops

        save = bool(spec.needs_grad)
        res = ops.forward(x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.varlen,
                          x.output_final_state, x.use_qk_l2norm, save)
        if not save:
            return res.o, res.ht, (), None
        B, T, Hqk, K = x.q.shape
        Hv, V = x.v.shape[2], x.v.shape[3]
        saved = (res.q, res.k, res.v, res.beta, res.w, res.G, res.X, res.h, res.v_new)
        aux = dict(meta=res.meta, shape=(B, T, Hqk, Hv, K, V), scale=x.scale, l2norm=x.use_qk_l2norm,
                   has_h0=x.initial_state is not None, bwd_split=res.bwd_split, bwd_fixed=res.bwd_fixed)
        return res.o, res.ht, saved, aux

    def backward(self, spec, saved, aux, do, dht):
        from . import ops

        q, k, v, beta, w, G, X, hs, vn = saved
        return ops.backward(q, k, v, beta, w, G, X, hs, vn, aux["meta"], aux["shape"], aux["scale"],
                            aux["l2norm"], aux["has_h0"], do, dht, aux.get("bwd_split"),
                            aux.get("bwd_fixed"))


register_backend(TileLangBackend())
