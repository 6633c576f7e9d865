"""Host side of the "triton" backend: buffer allocation and kernel launches (no host syncs).

Forward (2 or 3 launches)::

    chunk_prep_kernel      (chunks, Hv)          -> w, u, G                     [+ Tinv for the backward]
                                                 or Tb, G  (TB_ONLY: inference, see use_tb_forward)
    chunk_state_fwd_kernel (N*Hv, V/BV)          -> o, final state              (fused: enough programs)
      or                                         -> h (chunk states), v_new, final state
    chunk_output_kernel    (chunks, Hv, V/BVo)   -> o                           (unfused path only)

Backward (6 launches, + the group sum of dq/dk under GVA): prep (with Tinv) and the state pass are
recomputed, then chunk_state_bwd_kernel (serial: dh, dv_new, dh0), chunk_bwd_dqk_kernel and
chunk_bwd_wy_kernel (parallel: dq, dk, dv, dbeta, dg).

Every size a launch needs is known on the host without reading device memory (the number of chunks
comes from ``chunk_indices.shape``), so forward and backward can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from ..._build_notice import build_notice
from ..._env import env_choice
from ..gva import gva_sum
from .common import CHUNK


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _fix_interpreter_index() -> None:
    """Work around triton-lang/triton#9171 (Triton <= 3.6 interpreter + numpy >= 2.4).

    The interpreter turns a scalar tensor into a Python int with ``int(ndarray_of_shape_1)``, which
    numpy 2.4 refuses, so ``range(n)`` over a runtime ``n`` fails inside interpreted kernels.  The fix
    (merged upstream) takes the single element explicitly.  Applied only in interpreter mode, and only
    once; it changes nothing about compiled kernels.
    """
    try:
        import triton.runtime.interpreter as interp
    except Exception:  # pragma: no cover - layout of a future triton
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_flashqla_index_fix", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._flashqla_index_fix = True
    interp._patch_lang_tensor = patched


if interpreting():
    _fix_interpreter_index()


class Geometry:
    """Sizes and chunk metadata of one call (host ints and device tensors only)."""

    def __init__(self, q, v, meta):
        B, T, Hqk, K = q.shape
        self.B, self.T, self.Hqk, self.K = B, T, Hqk, K
        self.Hv, self.V = v.shape[2], v.shape[3]
        self.TT = B * T
        self.varlen = meta is not None
        if meta is not None:
            self.N = meta.num_seqs
            self.busy = meta.busy_seqs        # what the launch heuristics count (see VarlenMeta.busy_seqs)
            self.NT = 0                       # unused by varlen kernels
            self.chunks = int(meta.chunk_indices.shape[0])
            self.cu, self.coff, self.cidx = meta.cu_seqlens, meta.chunk_offsets, meta.chunk_indices
        else:
            self.N = B
            self.busy = float(B)
            self.NT = triton.cdiv(T, CHUNK)
            self.chunks = B * self.NT
            # never dereferenced when IS_VARLEN is False; any device tensor will do
            self.cu = self.coff = self.cidx = q
        self.meta = meta
        self.ieee = q.dtype == torch.float32


def _sm_count(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 0


# Launch configurations.  Chosen from compile-only register / spill / shared-memory surveys
# (sm_80, sm_86, sm_89, sm_90 targets, bf16, K = V = 64 and 128): 8 warps for the chunk-parallel
# kernels (fewer spills than 4), 4 warps for the serial ones, two pipeline stages (the largest
# kernel then needs ~82 KB of shared memory, under the 99 KB of sm_86 / sm_89).  ``bv`` is the
# V-block; 0 means "choose" (see _state_bv).  Override for tuning, without editing code, with
# FLASHQLA_TRITON_TUNE="state.bv=32,output.warps=4,dqk.stages=3" (kernel.key=int, comma separated).
_DEFAULTS = {
    "fwd": dict(fuse=-1, tb=1, savet=1),         # fuse -1: fuse_forward_output decides; tb: see use_tb_forward;
                                                 # savet: the training forward keeps the inverse (prep_from_t)
    "fused": dict(warps=4, stages=2, bv=32, t=0),    # the state kernel with FUSE_OUTPUT; t: TRANSPOSED (chunk_state)
    "prep": dict(warps=0, stages=2, bv=64, maxnreg=0),  # warps 0: 4 (8 for fp32); bv: w/u column block
    "state": dict(warps=0, stages=0, bv=0, t=0),  # warps 0: 4 at bv <= 32, else 8; stages 0: _state_stages;
                                                  # t=1: transposed state
    "output": dict(warps=4, stages=2, bv=0),     # bv 0: V; 4 warps: H200 sweep s6 (16/32 1x32768 0.903 -> 0.528 ms
                                                 # against 8 warps; 2/8 1x8192 0.058 -> 0.035)
    "bstate": dict(warps=0, stages=0, bv=0, t=0, ldv=1),  # 0s: _bstate_cfg; t=1: transposed state gradient
                                                  # (chunk_bwd_state); ldv: the intra-chunk dv_new from the
                                                  # kept-inverse prep (LOCAL_DV)
    "serial": dict(order=0, seg=0, bseg=0),      # order=1: the serial walks launch longest first (_serial_grid);
                                                 # seg / bseg: the forward / state-gradient walk in segments with a
                                                 # halo (segment_split)
    "dqk": dict(warps=0, stages=2, bv=64),        # warps 0: _grads_warps
    "wy": dict(warps=0, stages=2, bv=64),         # warps 0: _grads_warps
}
_tune_cache: dict = {}


def tune(kernel: str) -> dict:
    """The launch configuration of ``kernel`` (defaults above, FLASHQLA_TRITON_TUNE on top)."""
    raw = os.environ.get("FLASHQLA_TRITON_TUNE", "")
    key = (kernel, raw)
    if key not in _tune_cache:
        cfg = dict(_DEFAULTS[kernel])
        for item in raw.replace(";", ",").split(","):
            item = item.strip()
            if not item:
                continue
            try:
                name, val = item.split("=")
                kname, field = name.strip().split(".")
                if kname not in _DEFAULTS or field not in _DEFAULTS[kname]:
                    raise KeyError(name)
                if kname == kernel:
                    cfg[field] = int(val)
            except (ValueError, KeyError) as exc:
                raise ValueError(f"FLASHQLA_TRITON_TUNE: cannot parse {item!r} (kernel.key=int with kernel in "
                                 f"{sorted(_DEFAULTS)}, keys warps/stages/bv, fwd.fuse, fwd.tb, fwd.savet, "
                                 "prep.maxnreg, state.t, fused.t, bstate.t, bstate.ldv, serial.order, serial.seg, serial.bseg)") from exc
        _tune_cache[key] = cfg
    return _tune_cache[key]


def _launch(cfg: dict, geo: "Geometry" = None) -> dict:
    # fp32 inputs (the accuracy path: full-fp32 dots) double every shared-memory tile; one stage
    # keeps them within an A100's 163 KB
    stages = 1 if geo is not None and geo.ieee else cfg["stages"]
    out = dict(num_warps=cfg["warps"], num_stages=stages)
    if cfg.get("maxnreg") and not interpreting():
        out["maxnreg"] = cfg["maxnreg"]    # register cap (occupancy) for tuning runs
    return out


# (kernel, constexprs and launch options) launched before.  The first launch of a new one may compile, and
# gets the build notice, which prints only if it runs past FLASHQLA_BUILD_NOTICE_S.  Best effort, kept cheap
# (no sort, no scan of the tensor arguments): a second dtype of a known signature compiles without a notice.
_LAUNCHED: set = set()


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)``, retried with one pipeline stage if the compiled kernel needs
    more shared memory than this GPU has (the error is raised before anything runs)."""
    sig = (id(kernel), tuple(kwargs.items()))
    try:
        hash(sig)
    except TypeError:           # an unhashable launch option: no notice, just the launch
        sig = None
    try:
        if sig is None or sig in _LAUNCHED:
            return kernel[grid](*args, **kwargs)
        if interpreting():          # nothing compiles
            _LAUNCHED.add(sig)
            return kernel[grid](*args, **kwargs)
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        key = tuple(sorted(kwargs.items()))
        try:
            with build_notice("triton", name, key):
                out = kernel[grid](*args, **kwargs)
        except CompilationError as exc:
            # name the kernel and its constexprs (dispatch then names the backend and the call's shape)
            from ...dispatch.registry import KernelBuildError
            raise KernelBuildError("triton", name, key, exc) from exc
        _LAUNCHED.add(sig)
        return out
    except OutOfResources as exc:
        if kwargs.get("num_stages", 2) <= 1:
            raise RuntimeError(f"flashqla triton backend: {kernel.fn.__name__ if hasattr(kernel, 'fn') else kernel} "
                               f"does not fit this GPU ({exc}); try FLASHQLA_TRITON_TUNE with a smaller bv "
                               "or fewer stages, or bf16/fp16 inputs") from exc
        return kernel[grid](*args, **dict(kwargs, num_stages=1))


def _state_bv(geo: Geometry, device, from_tb: bool = False) -> int:
    """V-block of the serial forward state kernel: 64 when (sequences x heads x V/64) programs already
    fill the GPU, else 32 (twice the programs for the latency-bound long-sequence / few-head case), and 16
    while even the 16-column programs fit one per SM.

    H200 session 12 run 4 (``benchmarks/sweep_variants.py``, Tb form): 2/8 1x32768 (64 programs at 16)
    1.032 -> 0.850 ms (state kernel 0.736 -> 0.553; FLA's whole forward 0.909), 2/8 28672+4096 0.975 -> 0.786
    (FLA 0.837); 8 warps or 4 stages were slower there.  The w/u path (training forward and the backward's
    recompute), session 14 run 4 (fwd+bwd, the kernel's two calls): 2/8 1x32768 1.213 -> 0.996 ms, 4/16 1x32768
    (128 programs) 1.216 -> 0.985; at 16/64 1x32768 (512 programs) 16 doubles it (2.21 -> 4.44)."""
    cfg = tune("state")
    if cfg["bv"]:
        return min(cfg["bv"], geo.V)
    sms = _sm_count(device)
    if sms and geo.busy * geo.Hv * (geo.V // 64) < 2 * sms:
        if geo.busy * geo.Hv * triton.cdiv(geo.V, 16) <= sms and (from_tb or not geo.ieee):
            return 16
        return 32
    return 64


_STATE3_SMEM = 109 * 1024     # the unfused state kernel at BV <= 32 with three stages (bf16/fp16, K = V = 128, sm_90)


def _serial_grid(geo: Geometry, BV: int):
    """(grid, ord tensor, ORDERED) of a serial state kernel: the 2-D ``(N * Hv, V / BV)`` grid, or with
    ``serial.order=1`` and a varlen batch, the 1-D grid that launches the longest walks first
    (``common.serial_program`` over ``VarlenMeta.walk_order``; not yet measured, off by default)."""
    nv = triton.cdiv(geo.V, BV)
    if geo.varlen and geo.N > 1 and tune("serial")["order"]:
        return (geo.N * geo.Hv * nv,), geo.meta.walk_order, True
    return (geo.N * geo.Hv, nv), geo.cu, False


def _smem_per_block(device) -> int:
    """Opt-in shared memory per block in bytes (0 off CUDA or when torch does not say)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def _bstate_cfg(geo: Geometry, device, walks: int = 0) -> dict:
    """Launch of the serial state-gradient kernel (``bstate.*`` knobs left at 0 are chosen here): the widest
    V-block whose programs still fit one per SM, from 16 up to 32; BV 64 on 8 warps once the BV-32 programs
    would not (a second wave of 32-column walks costs more than the wider step).

    H200 session 13 run 2 (``benchmarks/sweep_variants.py``, fwd+bwd, the kernel's own time): where the BV-32
    programs fit one per SM the walk is a latency chain and a third stage hides the next chunk's loads (16/32
    1x32768, 128 programs: 1.168 -> 0.788 ms; 2/8 1x32768: 1.034 -> 0.790), at 154 KB of shared memory, one
    program per SM; where the BV-32 programs are many, BV 64 on 8 warps (8/32 4x8192, 512 of them: 1.211 ->
    0.820; it was 1.613 at 16/32 1x32768, where 128 BV-32 programs fit).  Session 14 run 4: 16/64 1x32768 (256
    BV-32 programs) BV 64 2.371 -> 1.818 ms, 16/64 1x8192 0.600 -> 0.466; 4/16 1x32768 (128 BV-16 programs) BV 16
    0.747 -> 0.637, 2/8 1x32768 0.777 -> 0.645 (BV 64 there: 1.43).  ``walks``: their number when the walk is
    split (``segment_split``), else one per (busy sequence, value head)."""
    cfg = dict(tune("bstate"))
    sms = _sm_count(device)
    walks = walks or geo.busy * geo.Hv
    if not cfg["bv"]:
        if geo.ieee or not sms:
            cfg["bv"] = 32
        elif walks * triton.cdiv(geo.V, 16) <= sms:
            cfg["bv"] = 16
        elif walks * triton.cdiv(geo.V, 32) <= sms:
            cfg["bv"] = 32
        else:
            cfg["bv"] = 64
    cfg["bv"] = min(cfg["bv"], geo.V)
    cfg["warps"] = cfg["warps"] or (8 if cfg["bv"] >= 64 else 4)
    if not cfg["stages"]:
        programs = walks * triton.cdiv(geo.V, cfg["bv"])
        deep = sms and cfg["bv"] <= 32 and programs <= sms and _smem_per_block(device) >= 160 * 1024
        cfg["stages"] = 3 if deep else 2
    return cfg


def _grads_warps(name: str, geo: Geometry, device) -> dict:
    """Launch of the chunk-parallel gradient kernels (``dqk``, ``wy``): 4 warps on sm_90 (two programs per SM
    at 255 registers), 8 elsewhere and for fp32 inputs (their full-fp32 dots spill at 4 warps: ~21 KB per thread
    for wy, ~19 KB for dqk, against ~13 and ~2 KB at 8, sm_90; the sm_80 builds spill ~440 / 232 B at 4, not
    measured there).

    H200, fwd+bwd, the kernel's own time: wy (session 13 run 2) 2.25 -> 1.31 ms at 16/32 1x32768 and 8/32
    4x8192, 0.558 -> 0.324 at 2/8 1x32768; dqk (session 14 run 4) 2.874 -> 2.108 at 16/64 1x32768, 0.712 ->
    0.520 at 4/16 1x32768, 0.357 -> 0.261 at 2/8 1x32768 (gradients within 1.5e-6 of the 8-warp ones)."""
    cfg = dict(tune(name))
    if not cfg["warps"]:
        cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)
        cfg["warps"] = 4 if cap[0] >= 9 and not geo.ieee else 8
    return cfg


def _state3_per_sm(device) -> int:
    """How many three-stage state programs fit in one SM's shared memory (2 on sm_90's 228 KB, 1 on
    sm_80's 164 KB; 0 off CUDA)."""
    if device.type != "cuda":
        return 0
    props = torch.cuda.get_device_properties(device)
    smem = getattr(props, "shared_memory_per_multiprocessor", 0)
    return max(1, smem // _STATE3_SMEM) if smem else 1


def _state_stages(programs: int, BV: int, device, from_tb: bool = False) -> int:
    """Pipeline depth of the unfused serial state kernel: 3 at BV <= 32 while its programs stay few per SM,
    else 2 (at BV 64 the third stage would not fit the 99 KB of sm_86 / sm_89).

    H200 sweeps (``benchmarks/sweep_variants.py``; ``programs`` counts the sequences in flight over the
    longest walk).  Session 5 run 10, 16/32 heads: with one program per SM or fewer the kernel is a latency
    chain and a third stage hides the next chunk's loads (1x32768, 128 programs: 0.955 -> 0.670 ms; 2/8
    1x8192, 32 programs: 0.200 -> 0.173 ms); with 512 programs the extra shared memory costs occupancy
    (4x8192: 0.632 -> 0.890 ms).  Session 12 run 2, between one and two programs per SM (two 109 KB
    three-stage programs fit in sm_90's 228 KB): at 146 (16/32 28672+4096) three stages win on both paths
    (w/u 0.957 -> 0.800 ms, Tb 1.004 -> 0.932); at 256 (16/64 1x32768) they win for the Tb form (1.263 ->
    1.082), whose chain has one more product per chunk, and lose for the w/u path (1.190 -> 1.344).  Hence
    up to 2 programs per SM for the Tb form, 1.5 for the w/u path, 1 where only one three-stage program
    fits (sm_80)."""
    sms = _sm_count(device)
    fit = _state3_per_sm(device) if sms else 0
    per_sm = min(fit, 2.0 if from_tb else 1.5) if fit >= 2 else fit
    return 3 if sms and BV <= 32 and programs <= sms * per_sm else 2


def _prep_cfg(geo: Geometry) -> dict:
    # 4 warps: two programs per SM at ~228 registers (bf16, K = V = 128, sm_90); fp32 inputs (full-fp32
    # FMA dots) spill ~15 KB per thread at 4 warps, ~1 KB at 8
    cfg = dict(tune("prep"))
    cfg["warps"] = cfg["warps"] or (8 if geo.ieee else 4)
    return cfg


def _run_prep(geo: Geometry, k, v, g, beta, w, u, G, Tm, use_l2: bool, store_t: bool, tb_only: bool,
              load_t: bool = False, local_dv=None):
    # the one launch of chunk_prep_kernel behind prep, prep_tb and prep_from_t (Tm: Tinv or Tb, or G as a
    # stand-in); local_dv = (q, dO, dvl, scale) to form the intra-chunk part of dv_new too (DV_LOCAL)
    from .chunk_prep import chunk_prep_kernel

    q, do, dvl, scale = local_dv if local_dv is not None else (k, v, u, 1.0)
    launch(chunk_prep_kernel, (geo.chunks, geo.Hv),
        k, v, g, beta, w, u, G, Tm, geo.cu, geo.cidx, q, do, dvl, float(scale),
        geo.T, geo.NT, geo.TT, geo.Hqk, geo.Hv,
        K=geo.K, V=geo.V, IS_VARLEN=geo.varlen, USE_L2=use_l2, STORE_T=store_t, IEEE=geo.ieee,
        BW=min(tune("prep")["bv"], geo.K, geo.V), TB_ONLY=tb_only, LOAD_T=load_t, DV_LOCAL=local_dv is not None,
        **_launch(_prep_cfg(geo), geo))


def _wu_buffers(geo: Geometry, k, v):
    """w, u and G (its (hi, lo) fp32 planes) as chunk_prep_kernel writes them."""
    dev = k.device
    return (torch.empty(geo.B, geo.T, geo.Hv, geo.K, dtype=k.dtype, device=dev),
            torch.empty(geo.B, geo.T, geo.Hv, geo.V, dtype=v.dtype, device=dev),
            torch.empty(2, geo.Hv, geo.TT, dtype=torch.float32, device=dev))


def prep(geo: Geometry, k, v, g, beta, use_l2: bool, store_t: bool):
    w, u, G = _wu_buffers(geo, k, v)
    Tm = torch.empty(geo.chunks, geo.Hv, CHUNK, CHUNK, dtype=k.dtype, device=k.device) if store_t else None
    _run_prep(geo, k, v, g, beta, w, u, G, Tm if store_t else G, use_l2, store_t, False)
    return w, u, G, Tm


def prep_from_t(geo: Geometry, k, v, g, beta, Tm, use_l2: bool, local_dv=None):
    """The backward's prep when the training forward kept the inverse ``Tm`` (``fwd.savet``): G, w and u
    only, without k k^T and the inverse (FLA's backward does the same with its saved A: recompute_w_u).
    ``local_dv = (q, dO, scale)``: also returns ``dvl = scale P^T dO`` (``chunk_prep``'s DV_LOCAL), else None."""
    w, u, G = _wu_buffers(geo, k, v)
    dvl = None
    if local_dv is not None:
        q, do, scale = local_dv
        dvl = torch.empty(geo.B, geo.T, geo.Hv, geo.V, dtype=q.dtype, device=q.device)
        local_dv = (q, do, dvl, scale)
    _run_prep(geo, k, v, g, beta, w, u, G, Tm, use_l2, False, False, load_t=True, local_dv=local_dv)
    return w, u, G, dvl


def prep_tb(geo: Geometry, k, g, beta, use_l2: bool):
    """The prep of the inference forward: ``(Tb, G)`` with ``Tb = Tinv diag(beta)`` ``[chunks, Hv, 64, 64]``
    in k's dtype, instead of w and u (see ``use_tb_forward``)."""
    dev = k.device
    G = torch.empty(2, geo.Hv, geo.TT, dtype=torch.float32, device=dev)   # (hi, lo) planes
    Tb = torch.empty(geo.chunks, geo.Hv, CHUNK, CHUNK, dtype=k.dtype, device=dev)
    # v, w and u are neither read nor written: k stands in for them (w's dtype is the kernel's DT)
    _run_prep(geo, k, k, g, beta, k, k, G, Tb, use_l2, False, True)
    return Tb, G


def use_tb_forward(inference: bool) -> bool:
    """Whether a forward runs the Tb form of the recurrence: prep writes only ``Tb = Tinv diag(beta)`` and G
    (8 KB per chunk and head in bf16 instead of w and u, 32 KB at K = V = 128: prep took 0.88 ms of a 2.08 ms
    forward on the H200 at 16/32 heads x 32k tokens), and the state kernel forms
    ``v_new = u - w S = Tb (v - diag(exp(G)) k S)`` itself, one more 64 x BV x 64 dot per chunk on its
    serial chain.  Only for forwards no backward follows: the backward recomputes w and u (it needs them),
    and the training forward keeps the same path so its o is the one the backward's recompute sees.
    On by default since its H200 sweep (session 12 run 2, ``benchmarks/sweep_variants.py --mode fwd``, kernel
    sums): 16/32 1x32768 2.081 -> 1.898 ms, 16/32 28672+4096 2.210 -> 2.100, 16/64 4x8192 3.971 -> 3.562,
    16/64 1x32768 4.008 -> 3.400 (against the w/u path at its best stage count), 4/16 8x1024 0.255 -> 0.233;
    2/8 28672+4096 equal (0.964 / 0.969).  Its outputs differ from the w/u path's by 1.3-1.7e-3 relative L2
    in bf16 (two roundings of the same products; the oracle tests hold it to the same tolerance).
    ``FLASHQLA_TRITON_TUNE=fwd.tb=0`` turns it off."""
    return inference and bool(tune("fwd")["tb"])


def segment_split(geo: Geometry, k, g, beta, use_l2: bool, BV: int, backward: bool = False):
    """In-kernel context parallelism of the forward walk (``chunk_state_fwd_kernel`` with ``HALO``; the split,
    tables and halo search of ``backends/tilelang/segments.py``): ``(tables, walk starts)`` or None.
    ``FLASHQLA_TRITON_TUNE=serial.seg=N`` cuts sequences into segments of N chunks, ``serial.seg=-1`` lets the
    tilelang backend's model choose; 0, the default, is off (not yet measured on a GPU).  ``backward``: the same
    for the state-gradient walk (``chunk_state_bwd_kernel`` with ``HALO``, ``serial.bseg``), whose walks *end* in
    a halo past their segment (``walk_starts(reverse=True)``: the returned tensor holds the walks' end chunks)."""
    seg = tune("serial")["bseg" if backward else "seg"]
    if seg == 0 or geo.TT == 0:
        return None
    from ..tilelang import segments as sg
    lengths = geo.meta.seqlens if geo.varlen else [geo.T] * geo.B
    if seg < 0:
        # (the tilelang model's step tables start at BV 32: a BV-16 walk is modelled as a BV-32 one)
        plan = sg.segment_plan(lengths, geo.Hv, geo.V, _sm_count(k.device) or 132, max(BV, 32), forced="auto",
                               backward=backward)
        if plan is None:
            return None
        seg = plan.seg_chunks
    tables = sg.segment_tables(lengths, seg, k.device)
    if tables.split_seqs == 0:
        return None
    kf = k.reshape(geo.TT, geo.Hqk, geo.K)
    gf = g.reshape(geo.TT, geo.Hv).to(torch.float32).contiguous()
    bf = beta.reshape(geo.TT, geo.Hv).contiguous()
    return tables, sg.walk_starts(kf if kf.stride(-1) == 1 else kf.contiguous(), gf, bf, tables, use_l2,
                                  reverse=backward)


def state_fwd(geo: Geometry, q, k, w, u, G, h0, output_final_state: bool, use_l2: bool, scale: float = 1.0,
              fuse_output: bool = False, from_tb: bool = False, split_from=None):
    """Serial state pass.  ``fuse_output``: also computes o (returned in place of h) and stores neither
    the chunk states nor v_new; otherwise returns (h, v_new, final state).  ``from_tb``: ``w`` is Tb and
    ``u`` is v (``prep_tb``, ``use_tb_forward``).  ``split_from``: ``(g, beta)`` of the call, for
    :func:`segment_split` (the walk in segments with a halo, when it is on)."""
    from .chunk_state import chunk_state_fwd_kernel

    dev = k.device
    if fuse_output:
        o = torch.empty(geo.B, geo.T, geo.Hv, geo.V, dtype=u.dtype, device=dev)
        h = vn = None
    else:
        o = None
        h = torch.empty(geo.chunks, geo.Hv, geo.K, geo.V, dtype=k.dtype, device=dev)
        vn = torch.empty_like(u)
    ht = torch.empty(geo.N, geo.Hv, geo.K, geo.V, dtype=torch.float32, device=dev) if output_final_state else None
    if fuse_output:
        cfg = tune("fused")
        BV = min(cfg["bv"], geo.V)
    else:
        BV = _state_bv(geo, dev, from_tb)
        cfg = dict(tune("state"))
        cfg["warps"] = cfg["warps"] or (4 if BV <= 32 else 8)
        cfg["stages"] = cfg["stages"] or _state_stages(geo.busy * geo.Hv * triton.cdiv(geo.V, BV), BV, dev,
                                                       from_tb)
    dummy = u
    split = segment_split(geo, k, *split_from, use_l2, BV) if split_from is not None else None
    if split is not None:
        tables, starts = split
        grid = (tables.num_segments * geo.Hv, triton.cdiv(geo.V, BV))
        cu, coff, order, seg, walk, varlen, ordered = (tables.cu_seqlens, tables.chunk_offsets, tables.cu_seqlens,
                                                       tables.seg_table, starts, True, False)
    else:
        grid, order, ordered = _serial_grid(geo, BV)
        cu, coff, seg, walk, varlen = geo.cu, geo.coff, order, order, geo.varlen
    launch(chunk_state_fwd_kernel, grid,
        q, k, w, u, G, h0 if h0 is not None else dummy, ht if ht is not None else dummy,
        h if h is not None else dummy, vn if vn is not None else dummy, o if o is not None else dummy,
        cu, coff, order, seg, walk, float(scale), geo.T, geo.NT, geo.TT, geo.Hqk, geo.Hv,
        K=geo.K, V=geo.V, BV=BV, IS_VARLEN=varlen, USE_L2=use_l2, HAS_H0=h0 is not None,
        STORE_HT=ht is not None, STORE_H=not fuse_output, FUSE_OUTPUT=fuse_output, IEEE=geo.ieee,
        TRANSPOSED=bool(cfg.get("t")), FROM_TB=from_tb, ORDERED=ordered, HALO=split is not None,
        **_launch(cfg, geo))
    return (o if fuse_output else h), vn, ht


def fuse_forward_output(geo: Geometry, device) -> bool:
    """Fused state+output forward once the serial programs outnumber the SMs about twice over.

    Fused, every serial step also loads q and computes the output: about 2.7x the work of a bare state
    step, all of it on the serial chain of one program, but the chunk states and v_new never go through
    HBM.  With few programs the chain's latency dominates and the unfused path (bare state kernel +
    parallel output kernel) wins; with many, the kernel is throughput-bound and saving the traffic wins.
    H200 sweep (session 5 run 10, 16/32 heads, programs at the fused BV = 32): 2/8 1x8192 (32 programs)
    unfused 0.316 / fused 0.503 ms; 1x32768 (128) 2.748 / 2.719; 4x8192 (512) 2.430 / 1.959.  Hence the
    threshold at 2 programs per SM (it was 4, which left 4x8192 unfused).  ``FLASHQLA_TRITON_TUNE=fwd.fuse=0|1``
    forces either (``fwd.fuse=-1``, the default, decides)."""
    forced = tune("fwd")["fuse"]
    if forced >= 0:
        return bool(forced)
    sms = _sm_count(device)
    if not sms:
        return True
    return geo.busy * geo.Hv * triton.cdiv(geo.V, min(tune("fused")["bv"], geo.V)) >= 2 * sms


def output(geo: Geometry, q, k, G, h, vn, scale: float, use_l2: bool, out_dtype):
    from .chunk_output import chunk_output_kernel

    o = torch.empty(geo.B, geo.T, geo.Hv, geo.V, dtype=out_dtype, device=q.device)
    cfg = dict(tune("output"))
    BV = min(cfg["bv"] or (64 if geo.ieee else geo.V), geo.V)
    launch(chunk_output_kernel, (geo.chunks, geo.Hv, triton.cdiv(geo.V, BV)),
        q, k, G, h, vn, o, geo.cu, geo.cidx, float(scale),
        geo.T, geo.NT, geo.TT, geo.Hqk, geo.Hv,
        K=geo.K, V=geo.V, BV=BV, IS_VARLEN=geo.varlen, USE_L2=use_l2, IEEE=geo.ieee, **_launch(cfg, geo))
    return o


def _device_guard(x):
    """Triton launches on the *current* CUDA device; make it the tensors' one (multi-GPU callers)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def l2_mode(device=None) -> str:
    """Where the q/k L2 norm of ``use_qk_l2norm_in_kernel`` is applied.

    ``separate`` (default): q and k are normalised once up front (fp32 math, rounded to their dtype), the
    kernels run without the option and the backward maps dq/dk through the norm's Jacobian.  ``fused``:
    inside every kernel, on fp32 products (normalised q/k never rounded).  The fused form is the default no
    longer because on the H200 (triton 3.6, device run 8) the serial state kernels compiled with it gave
    non-finite output or an illegal memory access on a packed and on a dense case (K = 128, Hqk/Hv 2/8),
    while the same kernels without it passed every stage on the same inputs; the interpreter runs it
    correctly, so this looks like a miscompilation we have not pinned down.  ``FLASHQLA_TRITON_L2``
    overrides, ``fused`` on the CPU interpreter only: on a GPU it raises rather than risk the fault (session 13
    run 2 met it again, in the kept-inverse test)."""
    mode = env_choice("FLASHQLA_TRITON_L2", ("fused", "separate"), "separate")
    if mode == "fused" and device is not None and device.type == "cuda":
        raise ValueError("FLASHQLA_TRITON_L2=fused (the q/k L2 norm inside the triton kernels) faults on the GPU "
                         "(a miscompilation under triton 3.6, see backends/triton/ops.l2_mode); unset it to use the "
                         "default 'separate' form")
    return mode


def _l2_normalise(x):
    from ...reference import l2norm
    return l2norm(x.float()).to(x.dtype)


def _l2_backward(x, dy):
    """dx of y = x * rsqrt(|x|^2 + eps) (row-wise over the last dim, eps of ``reference.l2norm``), fp32."""
    from ...reference import L2NORM_EPS
    xf, dyf = x.float(), dy.float()
    r = torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)
    return r * dyf - xf * (r * r * r) * (xf * dyf).sum(-1, keepdim=True)


def keeps_inverse(inference: bool) -> bool:
    """Whether a training forward keeps its UT inverse for the backward (``prep_from_t``): one [64, 64] tile
    per chunk and head in the input dtype (a quarter of w's bytes at K = 128), held from the forward to the
    backward, against recomputing k k^T and the inverse there (the prep kernel, 0.88 ms at 16/32 x 32k on the
    H200, of which the w / u products are the smaller part).  The backward's peak is unchanged: the
    recomputed inverse was alive at its peak (the wy kernel) as well.  ``FLASHQLA_TRITON_TUNE=fwd.savet=0``
    turns it off."""
    return not inference and bool(tune("fwd")["savet"])


def forward(q, k, v, g, beta, scale, h0, meta, output_final_state: bool, use_l2: bool, inference: bool = False,
            keep: bool = False):
    """Returns ``(o, final_state or None)``, and with ``keep`` a third item for ``backward`` (the kept inverse
    or None, see ``keeps_inverse``).  ``inference``: no backward follows (``use_tb_forward``)."""
    with _device_guard(q):
        if use_l2 and l2_mode(q.device) == "separate":
            res = _forward(_l2_normalise(q), _l2_normalise(k), v, g, beta, scale, h0, meta,
                           output_final_state, False, inference)
        else:
            res = _forward(q, k, v, g, beta, scale, h0, meta, output_final_state, use_l2, inference)
    return res if keep else res[:2]


def _forward(q, k, v, g, beta, scale, h0, meta, output_final_state: bool, use_l2: bool, inference: bool = False):
    geo = Geometry(q, v, meta)
    from_tb = use_tb_forward(inference)
    Tm = None
    if from_tb:
        w, G = prep_tb(geo, k, g, beta, use_l2)
        u = v
    else:
        w, u, G, Tm = prep(geo, k, v, g, beta, use_l2, store_t=keeps_inverse(inference))
    if fuse_forward_output(geo, q.device):
        o, _, ht = state_fwd(geo, q, k, w, u, G, h0, output_final_state, use_l2, scale, fuse_output=True,
                             from_tb=from_tb, split_from=(g, beta))
        return o, ht, Tm
    h, vn, ht = state_fwd(geo, q, k, w, u, G, h0, output_final_state, use_l2, from_tb=from_tb,
                          split_from=(g, beta))
    # the output pass reads neither: free them before o is allocated (the backward recomputes its own), so
    # the forward's peak is max(w + u, o) + h + v_new instead of w + u + h + v_new + o
    del w, u
    o = output(geo, q, k, G, h, vn, scale, use_l2, v.dtype)
    return o, ht, Tm


def state_bwd(geo: Geometry, q, k, w, G, do, dht, need_dh0: bool, scale: float, use_l2: bool, dvl=None,
              split_from=None):
    """``dvl``: the intra-chunk part of dv_new from ``prep_from_t``; completed in place into dv_new (LOCAL_DV).
    ``split_from``: ``(g, beta)`` of the call, for :func:`segment_split` (the walk in segments, when it is on)."""
    from .chunk_bwd_state import chunk_state_bwd_kernel

    dev = q.device
    dh = torch.empty(geo.chunks, geo.Hv, geo.K, geo.V, dtype=q.dtype, device=dev)
    dvn = dvl if dvl is not None else torch.empty(geo.B, geo.T, geo.Hv, geo.V, dtype=q.dtype, device=dev)
    dh0 = torch.empty(geo.N, geo.Hv, geo.K, geo.V, dtype=torch.float32, device=dev) if need_dh0 else None
    cfg = _bstate_cfg(geo, dev)
    split = segment_split(geo, k, *split_from, use_l2, cfg["bv"], backward=True) if split_from is not None else None
    if split is not None:
        tables, ends = split
        cfg = _bstate_cfg(geo, dev, walks=tables.num_segments * geo.Hv)
        grid = (tables.num_segments * geo.Hv, triton.cdiv(geo.V, cfg["bv"]))
        cu, coff, order, seg, walk, varlen, ordered = (tables.cu_seqlens, tables.chunk_offsets, tables.cu_seqlens,
                                                       tables.seg_table_bwd, ends, True, False)
    else:
        grid, order, ordered = _serial_grid(geo, cfg["bv"])
        cu, coff, seg, walk, varlen = geo.cu, geo.coff, order, order, geo.varlen
    launch(chunk_state_bwd_kernel, grid,
        q, k, w, G, do, dht if dht is not None else dh, dh0 if dh0 is not None else dh, dh, dvn,
        cu, coff, order, seg, walk, float(scale), geo.T, geo.NT, geo.TT, geo.Hqk, geo.Hv,
        K=geo.K, V=geo.V, BV=cfg["bv"], IS_VARLEN=varlen, USE_L2=use_l2, HAS_DHT=dht is not None,
        STORE_DH0=dh0 is not None, IEEE=geo.ieee, TRANSPOSED=bool(cfg["t"]), LOCAL_DV=dvl is not None,
        ORDERED=ordered, HALO=split is not None, **_launch(cfg, geo))
    return dh, dvn, dh0


def grads(geo: Geometry, q, k, v, beta, G, Tm, w, u, h, dh_box: list, vn, dvn, do, scale: float, use_l2: bool,
          gva_dtype=None):
    """``dh_box``: a one-element list holding the state gradients; it is emptied once the kernel that reads
    them is launched, so that (with the caller holding no other reference) their block is free before the
    wy kernel's outputs are allocated: the peak of the backward is in that kernel.  ``gva_dtype``: the dtype
    of dq and dk after the GVA group sum (default q's; fp32 when the L2 norm's backward follows)."""
    from .chunk_bwd_grads import chunk_bwd_dqk_kernel, chunk_bwd_wy_kernel

    dev = q.device
    per_vhead = geo.Hv != geo.Hqk
    r = geo.Hv // geo.Hqk
    # (GVA: one slot per value head, summed over the group after the launch: deterministic, no atomics)
    # per value head in the output dtype (fp32 only when the L2 norm's backward follows), summed over each
    # group in fp32 by gva_sum: half the bytes of fp32 slots, FlashQLA's rounding point (session 10)
    slot_dtype = gva_dtype or q.dtype
    dq = torch.empty(geo.B, geo.T, geo.Hv, geo.K, dtype=slot_dtype, device=dev) if per_vhead else \
        torch.empty_like(q)
    dk_a = torch.empty(geo.B, geo.T, geo.Hv, geo.K, dtype=torch.float32, device=dev)
    dG_a = torch.empty(geo.B, geo.T, geo.Hv, dtype=torch.float32, device=dev)
    grid = (geo.chunks, geo.Hv)
    common = dict(K=geo.K, V=geo.V, IS_VARLEN=geo.varlen, USE_L2=use_l2, GRAD_PER_VHEAD=per_vhead,
                  IEEE=geo.ieee)
    cfg = _grads_warps("dqk", geo, dev)
    launch(chunk_bwd_dqk_kernel, grid,
        q, k, G, h, dh_box.pop(), vn, do, dq, dk_a, dG_a, geo.cu, geo.cidx, float(scale),
        geo.T, geo.NT, geo.TT, geo.Hqk, geo.Hv, BV=min(cfg["bv"], geo.V), **common, **_launch(cfg, geo))
    if per_vhead:
        dq = gva_sum(dq.view(geo.TT, geo.Hv, geo.K), r, slot_dtype).view(geo.B, geo.T, geo.Hqk, geo.K)
    dk = torch.empty(geo.B, geo.T, geo.Hv, geo.K, dtype=slot_dtype, device=dev) if per_vhead else \
        torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty(geo.B, geo.T, geo.Hv, dtype=torch.float32, device=dev)
    dg = torch.empty(geo.B, geo.T, geo.Hv, dtype=torch.float32, device=dev)
    cfg = _grads_warps("wy", geo, dev)
    launch(chunk_bwd_wy_kernel, grid,
        k, v, beta, G, Tm, w, u, h, dvn, dk_a, dG_a, dk, dv, dbeta, dg, geo.cu, geo.cidx,
        geo.T, geo.NT, geo.TT, geo.Hqk, geo.Hv, BV=min(cfg["bv"], geo.V), **common, **_launch(cfg, geo))
    if per_vhead:
        del dk_a, dG_a
        dk = gva_sum(dk.view(geo.TT, geo.Hv, geo.K), r, slot_dtype).view(geo.B, geo.T, geo.Hqk, geo.K)
    return dq, dk, dv, dbeta, dg


def backward(q, k, v, g, beta, scale, h0, meta, do, dht, use_l2: bool, Tm=None):
    """Returns ``(dq, dk, dv, dg, dbeta, dh0 or None)``; recomputes w, u and the chunk states rather than
    keeping them from the forward (6 launches, + the group sum under GVA), and the inverse too unless the
    forward kept it (``Tm``, ``keeps_inverse``).  ``Tm`` must come from the forward of the same call, with the
    same L2-norm mode."""
    with _device_guard(q):
        if use_l2 and l2_mode(q.device) == "separate":
            dqn, dkn, dv, dg, dbeta, dh0 = _backward(_l2_normalise(q), _l2_normalise(k), v, g, beta, scale, h0,
                                                     meta, do, dht, False, gva_dtype=torch.float32, Tm=Tm)
            return _l2_backward(q, dqn), _l2_backward(k, dkn), dv, dg, dbeta, dh0
        return _backward(q, k, v, g, beta, scale, h0, meta, do, dht, use_l2, Tm=Tm)


def _backward(q, k, v, g, beta, scale, h0, meta, do, dht, use_l2: bool, gva_dtype=None, Tm=None):
    geo = Geometry(q, v, meta)
    dvl = None
    if Tm is not None:
        # (the intra-chunk part of dv_new comes from this prep when bstate.ldv is on: see chunk_bwd_state)
        w, u, G, dvl = prep_from_t(geo, k, v, g, beta, Tm, use_l2,
                                   local_dv=(q, do, scale) if tune("bstate")["ldv"] else None)
    else:
        w, u, G, Tm = prep(geo, k, v, g, beta, use_l2, store_t=True)
    h, vn, _ = state_fwd(geo, q, k, w, u, G, h0, False, use_l2, split_from=(g, beta))
    dh, dvn, dh0 = state_bwd(geo, q, k, w, G, do, dht, h0 is not None, scale, use_l2, dvl=dvl,
                             split_from=(g, beta))
    dh_box = [dh]
    del dh      # (grads frees it after its first launch)
    dq, dk, dv, dbeta, dg = grads(geo, q, k, v, beta, G, Tm, w, u, h, dh_box, vn, dvn, do, scale, use_l2,
                                  gva_dtype)
    return dq, dk, dv, dg, dbeta, dh0
