"""The public op: validation -> dispatch -> one backend, and back through one autograd Function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .dispatch.registry import (Backend, BackendRuntimeError, BackendUnavailableError, Decision, FwdInputs,
                                decide, record_runtime_failure, select)
from .dispatch.spec import CallSpec
from .validation import check_state_layout, validate
from .varlen import VarlenMeta


@dataclass
class GDNContext:
    """What :func:`chunk_gated_delta_rule_bwd` needs from :func:`chunk_gated_delta_rule_fwd`."""

    backend: Backend
    spec: CallSpec
    saved: Sequence[Any]
    aux: Any
    input_dtypes: tuple  # dtypes of q, k, v, g, beta, initial_state (None when absent)
    state_layout: str = "KV"  # the caller's layout of initial_state / final state / dht / dh0


class _SwapStateLayout(torch.autograd.Function):
    """``[..., K, V] <-> [..., V, K]`` as a contiguous copy; the gradient is swapped back (contiguous too)."""

    @staticmethod
    def forward(ctx, x):
        return x.transpose(-1, -2).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return grad.transpose(-1, -2).contiguous()


def _swap_state(x: Optional[torch.Tensor], state_layout: str) -> Optional[torch.Tensor]:
    """A state between the caller's layout and the backends' ``[N, Hv, K, V]`` (the same swap both ways);
    ``x`` itself for ``"KV"`` or None."""
    if x is None or state_layout == "KV":
        return x
    return _SwapStateLayout.apply(x)


def _empty_call(spec: CallSpec, v, initial_state):
    """T == 0 (or B == 0): nothing to compute; the state passes through unchanged."""
    B, T, Hv, V = v.shape
    o = v.new_zeros(B, T, Hv, V)
    if initial_state is not None:
        ht = initial_state.clone()
    else:
        sd = torch.float64 if v.dtype == torch.float64 else torch.float32
        ht = torch.zeros(spec.num_seqs, Hv, spec.K, V, dtype=sd, device=v.device)
    return o, ht


def _run_forward(be: Backend, spec: CallSpec, q, k, v, g, beta, scale, initial_state, meta, options):
    inputs = FwdInputs(q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(),
                       beta=beta.contiguous(), scale=scale,
                       initial_state=None if initial_state is None else initial_state.contiguous(),
                       cu_seqlens=None if meta is None else meta.cu_seqlens, varlen=meta,
                       output_final_state=spec.output_final_state, use_qk_l2norm=spec.use_qk_l2norm,
                       options=dict(options or {}))
    return be.forward(spec, inputs)


def _dispatch(spec: CallSpec, backend: str, run):
    """``(backend, run(backend))`` for the backend dispatch picks.  A run-time failure of its kernels is
    recorded; under ``"auto"`` the next backend in order then serves the call (explain() shows why), a
    backend asked for by name raises BackendRuntimeError naming itself and the configuration."""
    while True:
        be, d = select(spec, backend)
        try:
            return be, run(be)
        except (BackendUnavailableError, TypeError, ValueError):
            raise  # the caller's input, not the kernels
        except Exception as exc:
            why = record_runtime_failure(be.name, spec, exc)
            if d.requested != "auto":
                raise BackendRuntimeError(f"flashqla backend {be.name!r} {why} ({spec.summary()})") from exc


def _cast_grads(grads, dtypes):
    out = []
    for gr, dt in zip(grads, dtypes):
        out.append(None if gr is None or dt is None else gr.to(dt))
    return tuple(out)


class _ChunkGatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, be, spec, scale, meta, options):
        o, ht, saved, aux = _run_forward(be, spec, q, k, v, g, beta, scale, initial_state, meta, options)
        ctx.save_for_backward(*saved)
        ctx.be, ctx.spec, ctx.aux = be, spec, aux
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                      None if initial_state is None else initial_state.dtype)
        if ht is None:
            ht = o.new_empty(0)
            ctx.mark_non_differentiable(ht)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        saved = ctx.saved_tensors
        if dht is not None and dht.numel() == 0:
            dht = None
        grads = ctx.be.backward(ctx.spec, saved, ctx.aux, do.contiguous(),
                                None if dht is None else dht.contiguous())
        return _cast_grads(grads, ctx.dtypes) + (None,) * 5


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
    *,
    state_layout: str = "KV",
    varlen_meta: Optional[VarlenMeta] = None,
    backend_options: Optional[dict] = None,
    context_parallel=False,
):
    """Chunked gated delta rule (GDN) with autograd; returns ``(o, final_state)``.

    Args (FLA's names and layouts):
        q, k: ``[B, T, Hqk, K]``; v: ``[B, T, Hv, V]`` with ``Hv % Hqk == 0`` (value head ``h`` reads
            query/key head ``h // (Hv // Hqk)``).  One dtype for the three.
        g: ``[B, T, Hv]`` log-space decay (float32 recommended); beta: ``[B, T, Hv]``.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` float32, N = B or the number of sequences.
        output_final_state: also return the ``[N, Hv, K, V]`` float32 state after the last token.
        use_qk_l2norm_in_kernel: L2-normalise q and k over K inside the op.
        cu_seqlens: int32 ``[N+1]`` sequence offsets of a packed batch (then B must be 1).
        backend: ``"auto"`` or a backend name (see ``flashqla.explain``); a named backend never falls back.
        state_layout: ``"KV"`` (default, FLA's ``[N, Hv, K, V]``) or ``"VK"``: ``initial_state`` and the
            final state are ``[N, Hv, V, K]``, the layout of serving engines' state pools (and of
            ``gated_delta_rule_decode(..., state_layout="VK")``).  The op transposes the state in and out
            (one state copy each way; gradients exact); the backends compute in ``[N, Hv, K, V]``.
        varlen_meta: ``flashqla.prepare_varlen(cu_seqlens)``, to keep the op free of host syncs.
        backend_options: backend-specific switches (documented by each backend).
        context_parallel: exact context parallelism (:mod:`flashqla.cp`): ``False`` (default) off,
            ``"auto"``/``True`` lets the cost model split long sequences, an int forces that many segments.
            ``explain()`` shows what ``"auto"`` would decide.  A CP call computes on the device how much of
            each segment can change the result in fp32 (windows, see :mod:`flashqla.cp`) and reads those
            lengths on the host once, after its kernels are launched (one sync per call); a plan's first call
            and calls under CUDA-graph capture run the fixed structure instead.

    Returns:
        ``o`` ``[B, T, Hv, V]`` in v's dtype, and the final state (None unless ``output_final_state``).

    Non-finite inputs are not scanned (that would cost a pass over the inputs and a host sync): a NaN or Inf
    reaches the outputs and state of the sequence (and head) it sits in, never those of another sequence.
    """
    state_layout = check_state_layout(state_layout)
    if context_parallel is not False and context_parallel is not None and context_parallel != 1:
        from .cp import chunk_gated_delta_rule_cp
        if state_layout != "KV" and initial_state is not None:
            # check the state in the caller's layout (the messages name [N, Hv, V, K]); the VarlenMeta
            # built here is handed on, so cp does not read cu_seqlens on the host a second time
            _, _, varlen_meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta,
                                         state_layout=state_layout)
        segments = None if context_parallel in (True, "auto") else context_parallel
        o, ht = chunk_gated_delta_rule_cp(q, k, v, g, beta, scale, _swap_state(initial_state, state_layout),
                                          output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, backend,
                                          segments, varlen_meta=varlen_meta)
        return o, _swap_state(ht, state_layout)
    spec, scale, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta, state_layout=state_layout)
    h0 = _swap_state(initial_state, state_layout)
    if q.shape[0] == 0 or q.shape[1] == 0:
        o, ht = _empty_call(spec, v, h0)
    else:
        def run(be):
            if not spec.needs_grad:
                # nothing to differentiate: the autograd node is pure host cost (~20% of a small call's)
                return _run_forward(be, spec, q, k, v, g, beta, scale, h0, meta, backend_options)[:2]
            return _ChunkGatedDeltaRule.apply(q, k, v, g, beta, h0, be, spec, scale, meta, backend_options)

        _, (o, ht) = _dispatch(spec, backend, run)
    return o, (_swap_state(ht, state_layout) if output_final_state else None)


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto", *,
                               state_layout="KV", varlen_meta=None, backend_options=None,
                               for_backward: bool = True):
    """Forward only, for callers that manage their own autograd: returns ``(o, final_state, ctx)``.

    Pass ``ctx`` to :func:`chunk_gated_delta_rule_bwd`.  With ``for_backward=True`` dispatch only picks a
    backend that has a backward.  ``state_layout`` as in :func:`chunk_gated_delta_rule`; the backward then
    takes ``dht`` and returns ``dh0`` in that layout too.
    """
    spec, scale, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                                 use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta, needs_grad=for_backward,
                                 state_layout=state_layout)
    if q.shape[0] == 0 or q.shape[1] == 0:
        raise ValueError("chunk_gated_delta_rule_fwd needs at least one token (q.shape[0] and q.shape[1] > 0)")
    with torch.no_grad():
        h0 = _swap_state(initial_state, state_layout)
        be, (o, ht, saved, aux) = _dispatch(spec, backend, lambda be: _run_forward(
            be, spec, q, k, v, g, beta, scale, h0, meta, backend_options))
        ht = _swap_state(ht, state_layout)
    ctx = GDNContext(be, spec, tuple(saved), aux, (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                                                    None if initial_state is None else initial_state.dtype),
                     state_layout)
    return o, ht, ctx


def chunk_gated_delta_rule_bwd(ctx: GDNContext, do: torch.Tensor, dht: Optional[torch.Tensor] = None):
    """Backward of :func:`chunk_gated_delta_rule_fwd`: returns ``(dq, dk, dv, dg, dbeta, dh0)``.

    ``dht`` and ``dh0`` are in the forward's ``state_layout``."""
    if not isinstance(ctx, GDNContext):
        raise TypeError(f"ctx must be the GDNContext returned by chunk_gated_delta_rule_fwd, got {type(ctx).__name__}")
    if not ctx.spec.needs_grad:
        raise ValueError("this forward ran with for_backward=False; run it again with for_backward=True")
    if dht is not None and not ctx.spec.output_final_state:
        raise ValueError("dht given but the forward did not output the final state")
    with torch.no_grad():
        dht = _swap_state(dht, ctx.state_layout)
        dq, dk, dv, dg, dbeta, dh0 = ctx.backend.backward(ctx.spec, ctx.saved, ctx.aux, do.contiguous(),
                                                           None if dht is None else dht.contiguous())
    return _cast_grads((dq, dk, dv, dg, dbeta, _swap_state(dh0, ctx.state_layout)), ctx.input_dtypes)


def _tilelang_backward_note(q, spec, varlen_meta) -> str:
    """The tilelang backend's backward choice for this call (split, or the whole-V fused kernel) and its reason;
    ``varlen_meta`` is the one ``validate`` returned (None: B sequences of T tokens)."""
    from .backends.tilelang.ops import bwd_plan, gva_in_kernel
    from .cp import _seq_bounds
    _, lens = _seq_bounds(q.shape[0], q.shape[1], varlen_meta)
    why = bwd_plan(lens, spec.Hv, spec.K, spec.V, spec.use_qk_l2norm, q.device, explain=True)[2]
    if spec.Hv != spec.Hqk:
        why += f"; {gva_in_kernel(spec.Hv // spec.Hqk)[1]}"
    return why


def _tilelang_stage1_note(lens, Hv: int, device) -> str:
    """How the tilelang forward's stage 1 (the chunk-local inverse) runs for these sequence lengths, as ``forward``
    decides it."""
    from .backends.tilelang.ops import (ChunkMeta, intra_inv_mma, intra_persist, intra_persist_ctas_per_sm,
                                        intra_persist_programs, stage1_forms)
    chunks = ChunkMeta.of_lengths(lens).num_chunks
    equal = len(set(lens)) == 1
    _, persist = stage1_forms(equal, chunks)
    if persist:
        nprog = intra_persist_programs(chunks, Hv, device)
        return (f"stage 1: persistent, {nprog} CTAs per value head ({intra_persist_ctas_per_sm()} per SM at most), "
                f"{-(-chunks // nprog)} chunks each at most (FLASHQLA_TILELANG_INTRA_PERSIST)")
    if not chunks:
        why = "no chunks"
    elif not intra_inv_mma():
        why = "the persistent form needs the tensor-core inverse (FLASHQLA_TILELANG_INTRA_INV)"
    elif not intra_persist(True):
        why = "FLASHQLA_TILELANG_INTRA_PERSIST=0"
    elif not equal:
        why = ("sequences of unequal lengths: the persistent form waits for its multi-chunk GPU test there; "
               "FLASHQLA_TILELANG_INTRA_PERSIST=1 takes it")
    else:
        why = "FLASHQLA_TILELANG_INTRA_UNIFORM=0: the automatic persistent form needs the chunk-number lookup"
    return f"stage 1: one CTA per (chunk, value head) ({why})"


def _tilelang_forward_note(q, spec, varlen_meta) -> str:
    """Whether the tilelang forward splits its state walk into segments with a halo (in-kernel CP) for this call,
    and why."""
    from .backends.tilelang.ops import fwd_segment_plan
    from .cp import _seq_bounds
    _, lens = _seq_bounds(q.shape[0], q.shape[1], varlen_meta)
    plan = fwd_segment_plan(lens, spec.Hv, spec.V, q.device)
    if plan is None:
        note = ("state walk per (sequence, head): no segment split (enough walks, or too short to pay for a halo; "
                "FLASHQLA_TILELANG_SEGMENTS)")
    else:
        note = (f"in-kernel CP: {plan.describe()}; each walk starts in a halo where the gates' decay bound allows "
                "(decided on the device), else at its sequence start")
    note += "; " + _tilelang_stage1_note(lens, spec.Hv, q.device)
    if getattr(spec, "needs_grad", False):
        from .backends.tilelang.ops import bwd_plan, bwd_whole_ok, fwd_variant, train_fused, train_fused_mode
        if fwd_variant() != "fused":
            form = f"the {fwd_variant()} form (FLASHQLA_TILELANG_FWD)"
        elif not train_fused():
            form = "unfused (w, u and X for either backward; FLASHQLA_TILELANG_TRAIN_FUSED=0)"
        elif plan is not None and train_fused_mode() != "all":
            form = "unfused (its walk runs in segments; FLASHQLA_TILELANG_TRAIN_FUSED=1)"
        elif bwd_whole_ok(spec.K, spec.V, spec.use_qk_l2norm) and \
                bwd_plan(lens, spec.Hv, spec.K, spec.V, spec.use_qk_l2norm, q.device)[0] == "whole":
            form = "fused (Tb and X; the whole-V backward reads no w or u)"
        else:
            form = "unfused (the split backward reads w)"
        note += f"; training forward: {form}"
    return note


def _cutlass_forward_note(q, spec, varlen_meta) -> str:
    """The cutlass forward's recurrence for this call (one-warpgroup or warp-specialised, its V block, over
    segments or not) and why."""
    from .backends.cutlass import forced_num_wg, fwd_mode, fwd_plan, segments_mode
    from .cp import _seq_bounds
    _, lens = _seq_bounds(q.shape[0], q.shape[1], varlen_meta)
    return fwd_plan(lens, spec.Hv, spec.V, spec.device.sm_count, fwd_mode(), forced_num_wg(), segments_mode(),
                    training=bool(spec.needs_grad)).describe()


def explain(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
            use_qk_l2norm_in_kernel=False, cu_seqlens=None, backend="auto", *, state_layout="KV",
            varlen_meta=None, needs_grad: Optional[bool] = None, print_it: bool = False) -> Decision:
    """Which backend this call would use, and every backend's verdict with its reason.

    Takes the op's arguments (nothing is computed).  ``str(result)`` is a readable table; ``result.chosen``
    the chosen name (None if none can serve), ``result.candidates`` the verdicts.  With
    ``state_layout="VK"`` the verdicts are for the ``[N, Hv, K, V]`` state the op hands the backends (the
    note says so; ``result.spec.state_layout`` stays ``"KV"``).
    """
    spec, _, meta = validate(q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta, needs_grad=needs_grad,
                             state_layout=state_layout)
    d = decide(spec, backend)
    if state_layout != "KV":
        layout_note = "state_layout='VK': the state is transposed to [N, Hv, K, V] around the backend"
        d.note = f"{d.note}; {layout_note}" if d.note else layout_note
        if initial_state is not None:
            initial_state = initial_state.transpose(-1, -2)  # what cp_plan checks, as the backends see it
    if q.shape[0] and q.shape[1]:
        from .cp import auto_declined, cp_plan
        try:
            why = auto_declined(d.chosen, q.device) if d.chosen else None
            if why:
                d.context_parallel = f"context_parallel='auto' would stay off on {d.chosen}: {why}"
            else:
                plan = cp_plan(q, k, v, g, beta, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel, cu_seqlens, varlen_meta=varlen_meta, needs_grad=needs_grad)
                d.context_parallel = (f"context_parallel='auto' would: {plan.describe()} "
                                      "(the op's default is off)")
        except Exception as exc:  # the plan is advice; never let it break explain()
            d.context_parallel = f"no plan ({type(exc).__name__}: {exc})"
        if d.chosen in ("tilelang", "cutlass"):
            try:
                note = _tilelang_forward_note if d.chosen == "tilelang" else _cutlass_forward_note
                d.forward = note(q, spec, meta)
            except Exception as exc:  # advice too
                d.forward = f"no plan ({type(exc).__name__}: {exc})"
        if d.chosen == "tilelang" and spec.needs_grad:
            try:
                d.backward = _tilelang_backward_note(q, spec, meta)
            except Exception as exc:  # advice too
                d.backward = f"no plan ({type(exc).__name__}: {exc})"
    if print_it:
        print(d)
    return d
