"""Backend "triton": chunked GDN forward and backward in Triton, for every CUDA GPU from SM80.

Kernels (one file per stage, each opens with its grid / roles / memory budget):

* ``chunk_prep.py``       fused intra-chunk prep: gate cumsum, A, (I + A)^-1, w, u  (chunks x Hv)
                          (inference: only Tb = (I + A)^-1 diag(beta), see ops.use_tb_forward)
* ``chunk_state.py``      serial state recurrence, state in fp32 registers, with the
                          chunk output fused in when there are enough programs        (N*Hv x V-blocks)
* ``chunk_output.py``     chunk outputs, for the unfused forward                      (chunks x Hv)
* ``chunk_bwd_state.py``  serial backward state recurrence: dh, dv_new, dh0          (N*Hv x V-blocks)
* ``chunk_bwd_grads.py``  per-chunk gradients: dq + dk part, then the WY part         (chunks x Hv)
                          (dk, dv, dbeta, dg)
* ``aot.py``              compile-only check for GPU targets (registers, spills, shared memory)

Features: q/k/v in bf16 / fp16 (fp32 too, computed with full-fp32 dots: the accuracy path for tests),
g and beta in fp32 / bf16 / fp16, K and V in {64, 128}, chunk 64, varlen from the device metadata of
``flashqla.varlen.VarlenMeta`` (no host sync: CUDA-graph capturable), GVA (the q/k head of value head h
is indexed in-kernel), fp32 initial / final state, fused q/k L2 norm.  Deterministic: no atomics.

Launch configurations: ``ops._DEFAULTS`` (from compile-only register / shared-memory surveys);
``FLASHQLA_TRITON_TUNE="kernel.key=int,..."`` overrides them for tuning (see ``ops.tune``).

On a CPU device the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, slow: tests only);
there the inputs must be float32 (the interpreter mis-computes bf16 dots and reductions).
"""

from __future__ import annotations

import os

from ...dispatch.registry import Backend, register_backend

_HEAD_DIMS = (64, 128)
_QKV_DTYPES_CUDA = ("bfloat16", "float16", "float32")
_GATE_DTYPES = ("float32", "bfloat16", "float16")
# GPUs with ~99 KB of shared memory per block (consumer Ampere / Ada / Blackwell): bf16/fp16 kernels need
# at most ~87 KB, but fp32 inputs at head dim 128 need up to ~104 KB even with one pipeline stage.
_SMALL_SMEM = ((8, 6), (8, 9))


def _small_smem(cap) -> bool:
    return tuple(cap) in _SMALL_SMEM or cap[0] == 12


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class TritonBackend(Backend):
    name = "triton"
    description = "Triton chunked kernels (SM80+; CPU only under TRITON_INTERPRET=1)"
    priorities = {"sm_80+": 10}
    has_backward = True

    def available(self):
        try:
            import triton  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            return False, f"triton is not importable ({type(exc).__name__}: {exc})"
        if _interpreting():
            return True, "triton (interpreter mode)"
        try:
            import torch
            if torch.cuda.is_available():
                return True, f"triton {triton.__version__}"
        except Exception as exc:
            return False, f"torch.cuda check raised {type(exc).__name__}: {exc}"
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels in the interpreter)"

    def version(self) -> str:
        try:
            import triton
            return triton.__version__
        except Exception:
            return ""

    def supports(self, spec):
        dev = spec.device
        if dev.type == "cuda":
            if dev.capability is None or tuple(dev.capability) < (8, 0):
                return False, f"needs a CUDA GPU of compute capability >= 8.0, got {dev.arch}"
            if spec.dtype not in _QKV_DTYPES_CUDA:
                return False, f"q/k/v dtype {spec.dtype} unsupported (bfloat16, float16 or float32)"
            if spec.dtype == "float32" and max(spec.K, spec.V) > 64 and _small_smem(dev.capability):
                return False, (f"float32 inputs with head dim {max(spec.K, spec.V)} need more shared memory per "
                               f"block than {dev.arch} offers (~99 KB); use bfloat16/float16 inputs")
        elif dev.type == "cpu":
            if not _interpreting():
                return False, "a CPU device is served only in Triton's interpreter (TRITON_INTERPRET=1)"
            if spec.dtype != "float32":
                return False, (f"q/k/v dtype {spec.dtype} unsupported on the CPU interpreter (float32 only: "
                               "the interpreter mis-computes bf16/fp16 dots)")
        else:
            return False, f"device type {dev.type!r} unsupported (CUDA, or CPU under TRITON_INTERPRET=1)"
        if spec.K not in _HEAD_DIMS:
            return False, f"head dim K = {spec.K} unsupported (64 or 128)"
        if spec.V not in _HEAD_DIMS:
            return False, f"head dim V = {spec.V} unsupported (64 or 128)"
        if spec.g_dtype not in _GATE_DTYPES:
            return False, f"g dtype {spec.g_dtype} unsupported (float32 recommended; bf16/fp16 accepted)"
        if spec.beta_dtype not in _GATE_DTYPES:
            return False, f"beta dtype {spec.beta_dtype} unsupported (float32, bfloat16 or float16)"
        if spec.state_dtype not in (None, "float32"):
            return False, f"initial_state dtype {spec.state_dtype} unsupported (float32)"
        if spec.state_layout != "KV":
            return False, f"state layout {spec.state_layout} unsupported ([N, Hv, K, V] only)"
        return True, f"K={spec.K} V={spec.V} {spec.dtype}"

    def forward(self, spec, x):
        from . import ops

        o, ht, Tm = ops.forward(x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.varlen,
                                x.output_final_state, x.use_qk_l2norm, inference=not spec.needs_grad, keep=True)
        if spec.needs_grad:
            saved = (x.q, x.k, x.v, x.g, x.beta, x.initial_state, Tm)
        else:
            saved = ()
        return o, ht, saved, (x.scale, x.varlen)

    def backward(self, spec, saved, aux, do, dht):
        from . import ops

        scale, meta = aux
        q, k, v, g, beta, h0, Tm = saved
        return ops.backward(q, k, v, g, beta, scale, h0, meta, do, dht, spec.use_qk_l2norm, Tm=Tm)



register_backend(TritonBackend())
