"""Backend "reference": the chunked PyTorch form of :mod:`flashqla.reference`, any device, any dtype.

Computes in float32 (float64 for float64 inputs).  Its backward recomputes the forward under autograd.
It is the last resort of ``backend="auto"`` (a warning says so once on a CUDA device) and the oracle's
sibling in tests; it is never hidden inside another backend.
"""

from __future__ import annotations

import warnings

import torch

from ..dispatch.registry import Backend
from ..reference import chunk_gated_delta_rule_ref


class ReferenceBackend(Backend):
    name = "reference"
    description = "PyTorch chunked reference (slow; any device)"
    priorities = {"cpu": 10, "cuda": 0}
    _warned = False

    def supports(self, spec):
        return True, "any device, dtype and head dim"

    def _run(self, spec, q, k, v, g, beta, scale, h0, cu, out_final):
        cd = torch.float64 if torch.float64 in (q.dtype, g.dtype, beta.dtype) else torch.float32
        return chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=scale, initial_state=h0,
                                          output_final_state=out_final,
                                          use_qk_l2norm_in_kernel=spec.use_qk_l2norm,
                                          cu_seqlens=None if cu is None else cu.cu_seqlens_cpu,
                                          compute_dtype=cd)

    def forward(self, spec, x):
        if spec.device.type == "cuda" and not ReferenceBackend._warned:
            ReferenceBackend._warned = True
            warnings.warn("flashqla: no GPU backend serves this call; using the slow PyTorch reference "
                          "(flashqla.explain(...) says why)", RuntimeWarning, stacklevel=3)
        o, ht = self._run(spec, x.q, x.k, x.v, x.g, x.beta, x.scale, x.initial_state, x.varlen,
                          x.output_final_state)
        saved = (x.q, x.k, x.v, x.g, x.beta, x.initial_state) if spec.needs_grad else ()
        return o, ht, saved, (x.scale, x.varlen)

    def backward(self, spec, saved, aux, do, dht):
        scale, meta = aux
        q, k, v, g, beta, h0 = saved
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_() for t in (q, k, v, g, beta, h0)]
            o, ht = self._run(spec, *leaves[:5], scale, leaves[5], meta, dht is not None)
            outs, gouts = [o], [do]
            if dht is not None:
                outs.append(ht)
                gouts.append(dht)
            need = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(outs, need, gouts, allow_unused=True))
            res = [None if t is None else next(grads) for t in leaves]
        return tuple(r if r is not None or t is None else torch.zeros_like(t) for r, t in zip(res, leaves))
