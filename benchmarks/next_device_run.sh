#!/usr/bin/env bash
# Next device runs (prepared in session 4).  From the repository root on the device:
#   bash benchmarks/next_device_run.sh flashqla   carry [".gpu"]: warm FlashQLA's kernels for every
#                                                 qwen35-fwd head configuration on the device (the CPU-warmed
#                                                 keys do not match the device's: benchmarks/README.md), then
#                                                 the whole qwen35-fwd preset with both baselines (issue #7)
#   bash benchmarks/next_device_run.sh cutlass    carry [".gpu_cute"]: the cutlass GPU suite, the 2^31-element
#                                                 tests and the 100-run determinism test for cutlass (#5, #11)
#   bash benchmarks/next_device_run.sh memory     carry [".gpu"]: the memory table on the whole Step 2 grid (#11)
#   bash benchmarks/next_device_run.sh ncu        carry [".gpu"]: Nsight Compute on the tilelang ws forward
#                                                 recurrence (stall reasons, pipe use) at 16/32 4x8192 and
#                                                 2/8 1x32768: where its ~4 us per chunk goes (#4, #8)
#   bash benchmarks/next_device_run.sh firstcall  carry [".gpu"] with a CPU-precompiled kcache: first-call latency of
#                                                 a fresh process with an empty cache, again on the cache it
#                                                 filled, and on the precompiled cache for a new head configuration (#7)
#   bash benchmarks/next_device_run.sh profile    per-kernel times of triton, tilelang and FLA, fwd and fwd+bwd (#3, #4)
#   bash benchmarks/next_device_run.sh sweep      triton launch-configuration sweep, forward (#3)
#   bash benchmarks/next_device_run.sh tritongrid the forward and forward+backward Step 2 grids, triton vs FLA (#3)
#   bash benchmarks/next_device_run.sh tritontests the triton forward-form GPU tests (Tb, half precision, graphs)
#   bash benchmarks/next_device_run.sh tritonshared the shared suite on triton, then all triton GPU tests (#3's last item)
#   bash benchmarks/next_device_run.sh sweeporder  triton serial walks longest-first (serial.order=1) on mixed lengths
#   bash benchmarks/next_device_run.sh accept8fwd  #8's acceptance, forward: FlashQLA's forward-grid rows with Hv x seqs <= 40
#                                                 (46), FlashQLA's kernels for them warmed first, tilelang vs FlashQLA, FLA
#   bash benchmarks/next_device_run.sh accept8bwd  the same for FlashQLA's backward grid (20 rows, fwd+bwd)
#   bash benchmarks/next_device_run.sh flqfwdgrid FlashQLA's own forward grid, tilelang vs FlashQLA and FLA (#4;
#                                                 FLQ_FILTER splits it over calls)
#   bash benchmarks/next_device_run.sh cutlasshostile  carry [".gpu_cute"]: cutlass hostile-value GPU tests (#11)
#   bash benchmarks/next_device_run.sh cutlassseg carry [".gpu_cute"]: the cutlass forward over segments (#5, #8)
#   bash benchmarks/next_device_run.sh cutlassws  carry [".gpu_cute"]: the warp-specialised cutlass forward (session 19,
#                                                 FLASHQLA_CUTLASS_FWD=ws): GPU tests, then serial / ws A/B (#5)
#   bash benchmarks/next_device_run.sh cutlassprep carry [".gpu_cute"]: the cutlass prep's tests, kernel times, ncu
#   bash benchmarks/next_device_run.sh cutlassgrid  FlashQLA's forward grid, cutlass (and tilelang) against FlashQLA
#                                                 and FLA (#5's acceptance).  Needs both bundles: a call carrying
#                                                 .gpu that only runs `source .gpu/setup.sh`, then within 30 s this
#                                                 one carrying .gpu_cute (CGRID_FWD=ws|serial, CGRID_FILTER)
#   bash benchmarks/next_device_run.sh cutlassaot carry [".gpu_cute"] (benchmarks/make_gpu_cute.sh): the cutlass
#                                                 on-disk cache on the GPU, and the first call cold / warm (#5)
#   bash benchmarks/next_device_run.sh tchain     tilelang forward with the register-only state chain vs now (#4)
#   bash benchmarks/next_device_run.sh trace      per-role clock64 timeline of the tilelang ws recurrence (#4)
#   bash benchmarks/next_device_run.sh fused      the fused tilelang inference forward: GPU tests, sweep, trace (#4)
#   bash benchmarks/next_device_run.sh gpusuite   the tilelang / triton / shared / gating GPU tests (run it first after
#                                                 a kernel change)
#   bash benchmarks/next_device_run.sh cpw        windowed exact CP: GPU tests, then the long-sequence rows against
#                                                 FlashQLA (#8)
#   bash benchmarks/next_device_run.sh hostprof   eager host time per call and cProfile's top functions
#                                                 (HOSTPROF_IMPLS, HOSTPROF_ROWS)
#   bash benchmarks/next_device_run.sh cpgraph    the windowed CP passes captured in a CUDA graph, with and without
#                                                 the input copies and the window check, against eager CP (#8)
#   bash benchmarks/next_device_run.sh bwdtests memfwd   the tilelang backward GPU tests and the hostile-value GPU tests
#                                                 (session 9's changes), then the forward memory table (#11)
#   bash benchmarks/next_device_run.sh bwdcheck   after a tilelang backward change: its GPU tests and determinism,
#                                                 part of the backward grid against FlashQLA, the profile
#   bash benchmarks/next_device_run.sh gvasum     the Triton GVA-sum kernel: bitwise vs the PyTorch forms, times
#   bash benchmarks/next_device_run.sh bwdwhole   the whole-V fused backward: GPU tests, A/B against the split one
#                                                 (BWDW_ROWS, BWDW_VARIANTS), role trace, flashqla-bwd rows (#4)
#   bash benchmarks/next_device_run.sh ncubwd     the whole-V fused backward under Nsight Compute (stalls, pipes,
#                                                 bank conflicts, hottest SASS) at 16/32 4x8192 (#4)
#   bash benchmarks/next_device_run.sh ncusrc     the same, stall samples per SASS instruction (CSV, summed per
#                                                 role, the hottest instructions: benchmarks/ncu_lines.py)
#   bash benchmarks/next_device_run.sh bwdex2     ex2.approx exponentials (FLASHQLA_TILELANG_EX2, session 16): GPU tests,
#                                                 then the A/B against exp2f, whole backward and inference forward
#   bash benchmarks/next_device_run.sh segments   in-kernel CP of the tilelang forward (segments with a halo): GPU tests,
#                                                 then the A/B against the unsplit walk, inference and training (#8)
#   bash benchmarks/next_device_run.sh trainfused the fused training forward ahead of the whole-V backward (session 19,
#                                                 FLASHQLA_TILELANG_TRAIN_FUSED): GPU tests, then the fwd+bwd A/B (#4)
#   bash benchmarks/next_device_run.sh intrainv   FLASHQLA_TILELANG_INTRA_INV=mma: stage 1's inverse on the tensor cores (session 25,
#                                                 the default now): GPU test, kernel-time A/B on #8's rows (S1_ROWS, S1_MODES,
#                                                 S1_VARIANTS, S1_K), S1_NCU=1
#   bash benchmarks/next_device_run.sh intrapersist FLASHQLA_TILELANG_INTRA_PERSIST=1 (persistent stage-1 CTAs that prefetch their
#                                                 next chunk) and FLASHQLA_TILELANG_INTRA_COMPACT=1 with the mma inverse (five CTAs
#                                                 per SM), session 25, both off: the same steps
#   bash benchmarks/next_device_run.sh persistwalk the persistent stage 1 (the default since session 26 on equal-length calls):
#                                                 GPU tests incl. CTAs that walk several chunks, then the CUDA-graph A/B
#                                                 (PW_ROWS, PW_MODES): off / auto / 3 CTAs per SM / halo searches inline
#   bash benchmarks/next_device_run.sh pairzero   FLASHQLA_TILELANG_GVA_ZERO=kernel (session 30): the GVA pair rows zeroed in the
#                                                 whole-V backward: GPU tests, then the fwd+bwd graph A/B (PZ_ROWS); pzab: the A/B alone,
#                                                 pztests: the tests alone (PZ_K)
#   bash benchmarks/next_device_run.sh halolight  FLASHQLA_TILELANG_HALO_STEP=light (session 34): the whole-V backward's halo steps run
#                                                 only the chain's dS: the fwd+bwd graph A/B (HL_ROWS), then its GPU tests (hltests alone)
#   bash benchmarks/next_device_run.sh trainbv    the fused training forward's V-block forced to 64 / 32 against its plan, fwd+bwd
#                                                 kernel times on #8's rows (session 25)
#   bash benchmarks/next_device_run.sh intracompact   FLASHQLA_TILELANG_INTRA_COMPACT=1: stage 1 at five CTAs per SM
#                                                 (session 20): GPU test, A/B (IC_MODE=fwd|fwdbwd) (#8)
#   bash benchmarks/next_device_run.sh trainfusedall  FLASHQLA_TILELANG_TRAIN_FUSED=all: the fused training forward over
#                                                 segments (its saves fixed in session 20): GPU test, fwd+bwd A/B (#8)
#   bash benchmarks/next_device_run.sh newswitches the GPU tests of the three switches written blind (INTRA_COMPACT=1,
#                                                 TRAIN_FUSED=all, GVA=pair) in one pytest, then one fwd A/B and one
#                                                 fwd+bwd A/B over them and their combination (#8; session 21)
#   bash benchmarks/next_device_run.sh halostream FLASHQLA_TILELANG_HALO_STREAM=1 (session 23): the halo searches beside
#                                                 stage 1 on a side stream: GPU test, wall-clock A/B on #8's rows
#   bash benchmarks/next_device_run.sh tlshort    the tilelang forward on FlashQLA's 1x2048 rows with the walk forced into
#                                                 segments of 8 / 4 chunks against its plan (session 24)
#   bash benchmarks/next_device_run.sh fewwaves   FLASHQLA_TILELANG_FEW_WAVES=1 (session 24, off): forward A/B on the rows whose
#                                                 walks fill the SMs in two uneven waves (16/48 4x8192, 8/24 4x8192)
#   bash benchmarks/next_device_run.sh s37        session 37: TRAIN_XBETA=0 / 1 fwd+bwd graph A/B (S37_ROWS, S37_VARIANTS; the
#                                                 cluster zeroing it also took was removed in session 38), then xbetatests
#   bash benchmarks/next_device_run.sh xbetatests the TRAIN_XBETA GPU tests alone (XB_K, XB_TEST_S)
#   bash benchmarks/next_device_run.sh dsmem      cycles per 4 KB DSMEM hand-off between a cluster's two CTAs (#8 lever 3)
#   bash benchmarks/next_device_run.sh astore     WS option astore (session 24, off; measured no faster in session 36): the fwd+bwd
#                                                 graph A/B (AS_ROWS), then its GPU tests (AS_K)
#   bash benchmarks/next_device_run.sh h0split    the split walks' start state as a select (session 24): the segment GPU
#                                                 tests, then the forward with / without h0 (bench --initial-state)
#   bash benchmarks/next_device_run.sh cutlassshared  carry [".gpu_cute"]: the shared suite and the GPU suite on cutlass (#5)
#   bash benchmarks/next_device_run.sh flqgridwarm FlashQLA's kernels for its forward grid, built on the device, and the
#                                                 cache returned (repack it: PACK_ONLY=1 benchmarks/rebuild_kcache.sh)
#   bash benchmarks/next_device_run.sh gvapair    FLASHQLA_TILELANG_GVA=pair: the backward kernels sum GVA pairs themselves
#                                                 (bf16x2 reductions; session 21): GPU tests, fwd+bwd A/B host / pair (#8)
#   bash benchmarks/next_device_run.sh tritonseg  the triton walks in segments (serial.seg, serial.bseg): GPU tests, A/B (#8)
#   bash benchmarks/next_device_run.sh bwdtrace   the whole backward's per-role clock64 timeline, then the backward tests
#   bash benchmarks/next_device_run.sh bwdcp      the op-level exact CP on the backward's 1-sequence 32k rows
#   bash benchmarks/next_device_run.sh det        the 100-run determinism tests (DET_K=tilelang or "tilelang or cutlass")
#   bash benchmarks/next_device_run.sh memwarm membwd    FlashQLA's fwd+bwd kernels for the Step 2 heads, then the
#                                                 fwd+bwd memory table (MEM_BACKENDS, MEM_FILTER, MEMBWD_S)
# Several steps may be given in one call (a warm machine keeps /tmp/kcache between calls as well).
# BENCH_ARGS adds options to the bench steps' `flashqla bench` (bwdbench, flqfwdgrid, cutlassgrid), e.g.
# "--min-time 0.1 --max-reps 100" to shorten a long grid: session 20's cutlassgrid ran 24 rows in one 470 s step,
# 185 s of it first-call compiles (up to ~12 s a row beside them), so FlashQLA's 108-row forward grid may need
# ~21 min of calls, close to a session's 30 min of device time.
# Each prints a short log and returns $OUT/logs, the bench files and (tilelang steps) $OUT/kcache.tar.xz.
set -u
STEPS=${*:-flashqla}
STEPS=${STEPS//flashqla/flqwarm fwdbench save}     # the whole #7 run as one word
# FlashQLA's forward grid (the flashqla-fwd preset's heads and length mixes) and its backward grid's heads
FLQ_GRID_HEADS=2/8,4/16,8/32,16/64,16/32,8/24,16/48,16/16,32/32
FLQ_GRID_SEQS="32768;16384;8192;4096;2048;28672+4096;16384+16384;4096+28672;8192x4;4096x8;2048x4;1024x8"
FLQ_BWD_GRID_HEADS=16/32,8/16,4/8,2/4
source benchmarks/device_lib.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PYT="python -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short"
for STEP in $STEPS; do
case "$STEP" in
  gpusuite)
    # first after a kernel change: the tilelang GPU tests (its kernels come precompiled in the kcache), CP and
    # gating.  Session 7 ran this with triton and the shared suite in one 420 s step: the triton compiles cut
    # it after 122 of ~175 tests; those are the gpusuite2 step now.
    TAIL=12 run_step "GPU suite (tilelang, CP, gating)" 420 $PYT tests/test_backend_tilelang.py tests/test_cp.py \
        tests/test_gating.py ;;
  gpusuite2)
    # the triton GPU tests and the shared suite on every GPU backend (triton compiles on the device: ~7 min)
    TAIL=12 run_step "GPU suite (triton, shared suite)" 500 $PYT tests/test_backend_triton.py \
        tests/test_correctness.py ;;
  firstcall)
    # one process per line; the cold one gets caches of its own so the carried kcache does not help it
    TAIL=3 run_step "first call cold cache 8-32" 150 env TILELANG_CACHE_DIR=/tmp/cold/tilelang \
        FLASHQLA_CACHE_DIR=/tmp/cold/flashqla python benchmarks/first_call.py --heads 8/32
    TAIL=3 run_step "first call same config again 8-32" 60 env TILELANG_CACHE_DIR=/tmp/cold/tilelang \
        FLASHQLA_CACHE_DIR=/tmp/cold/flashqla python benchmarks/first_call.py --heads 8/32
    TAIL=3 run_step "first call precompiled 4-16" 60 python benchmarks/first_call.py --heads 4/16
    TAIL=3 run_step "first call precompiled again 4-16" 60 python benchmarks/first_call.py --heads 4/16 ;;
  profile)
    TAIL=${PROFILE_TAIL:-80} run_step "profile" 150 python benchmarks/profile_kernels.py \
        --impls ${PROFILE_IMPLS:-triton} --rows ${PROFILE_ROWS:-16/32:1x32768,16/32:4x8192} \
        --modes ${PROFILE_MODES:-fwdbwd} --out $OUT/profile.json ;;
  cpgraph)
    # would a CUDA graph of the windowed CP passes beat FlashQLA (0.513 ms eager at 2/8 1x32768)? (#8)
    TAIL=12 run_step "CP passes in a CUDA graph (probe)" 200 python benchmarks/cp_graph_probe.py \
        --rows ${CPGRAPH_ROWS:-2/8:1x32768,4/16:1x32768,2/8:1x8192,16/32:1x32768} --segments ${CPGRAPH_SEGS:-16} \
        --out $OUT/cp_graph_probe.json ;;
  hostprof)
    # eager host time per call and cProfile's top functions (is an eager call host-bound? where?)
    TAIL=${HOSTPROF_TAIL:-200} run_step "host profile" 150 python benchmarks/host_profile.py \
        --impls ${HOSTPROF_IMPLS:-tilelang,tilelang@cpw16} --rows ${HOSTPROF_ROWS:-2/8:1x32768,8/32:1x8192} ;;
  sweep)
    # triton forward: the Tb form of the inference forward (fwd.tb=1, session 6, not measured yet) against the
    # w/u path, with and without the fused output (#3)
    X=FLASHQLA_TRITON_TUNE
    # (session 7: triton lost most on 28672+4096, 0.81-0.86x FLA, and at 16/64, 0.83-0.88x; SWEEP_ROWS).  Those
    # rows run the unfused state kernel with 129-264 programs.  Session 12 run 2 settled the Tb form and the stage
    # count; FLA's fwd_h is still 0.595 ms against our state kernel's 0.93 at 16/32 28672+4096, so the sweep now
    # varies the state kernel's warps, stages and V-block (SWEEP_VARIANTS replaces the list)
    R=${SWEEP_ROWS:-16/32:28672+4096,16/64:4x8192,16/64:1x32768,2/8:28672+4096,16/32:1x32768,4/16:8x1024}
    TAIL=40 run_step "triton sweep fwd" ${SWEEP_S:-220} python benchmarks/sweep_variants.py --backend triton \
        --mode fwd --rows $R --out $OUT/sweep_fwd.json --variants \
        "${SWEEP_VARIANTS:-default;$X=state.warps=8;$X=state.warps=2;$X=state.stages=4;$X=state.bv=16;$X=state.bv=64;$X=fwd.tb=0}"
    # FLA's kernels on the same rows, summed the same way (FLA_FLASH_QLA=0: its Triton path)
    TAIL=30 run_step "FLA profile fwd" ${SWEEP_FLA_S:-150} env FLA_FLASH_QLA=0 python benchmarks/profile_kernels.py \
        --impls fla --rows $R --modes fwd --out $OUT/profile_fla_fwd.json ;;
  sweepbwd)
    # the backward's launch choices still open after session 13 (run 2 set wy on 4 warps and _bstate_cfg): BV 16 for
    # the w/u state recurrence and the state gradient on the few-head long rows (the Tb forward's BV 16 cut its
    # state kernel 0.736 -> 0.553 ms at 2/8 1x32768), BV 64 for the state gradient at 16/64, and the rows where
    # fwd+bwd is below FLA (16/64 1x8k / 1x32k: 0.98-0.99x)
    X=FLASHQLA_TRITON_TUNE
    TAIL=14 run_step "triton sweep fwdbwd" 200 python benchmarks/sweep_variants.py --backend triton --mode fwdbwd \
        --rows ${SWEEPBWD_ROWS:-2/8:1x32768,4/16:1x32768,16/64:1x32768,16/64:1x8192} --out $OUT/sweep_fwdbwd.json --variants \
        "${SWEEPBWD_VARIANTS:-default;$X=state.bv=16;$X=bstate.bv=16;$X=state.bv=16,bstate.bv=16;$X=bstate.bv=64;$X=dqk.warps=4;$X=fwd.savet=0}" ;;
  sweeporder)
    # serial.order=1 (ops._serial_grid, off by default): the serial walks launched longest first, on the mixed-length
    # rows where session 13's forward lost to FLA (28672+4096: 0.97-0.99x) and their mirror / a 4-sequence mix
    X=FLASHQLA_TRITON_TUNE
    for m in fwd fwdbwd; do
      TAIL=12 run_step "triton sweep order $m" ${SWEEPORDER_S:-120} python benchmarks/sweep_variants.py --backend triton \
          --mode $m --rows ${SWEEPORDER_ROWS:-16/32:28672+4096,8/32:28672+4096,16/64:28672+4096,16/32:4096+28672,16/32:10237+4573+12813+5145} \
          --out $OUT/sweep_order_$m.json --variants "default;$X=serial.order=1"
    done ;;
  tchain)
    # the register-only state chain of the tilelang forward (BV = 64) against the current kernels
    B=FLASHQLA_TILELANG_BV; O=FLASHQLA_TILELANG_WS_OPTS
    TAIL=6 run_step "tchain GPU tests" 150 $PYT tests/test_backend_tilelang.py -k tchain
    TAIL=40 run_step "tilelang tchain sweep" 200 python benchmarks/sweep_variants.py --backend tilelang \
        --mode fwd --rows 16/32:1x32768,16/32:4x8192,2/8:1x32768,16/32:8x1024 --out $OUT/sweep_tchain.json \
        --variants "default;$B=64;$B=64 $O=fastexp,psplit,tchain;$B=64 $O=fastexp,tchain" ;;
  fused)
    # the fused inference forward (Tb-only stage 1; v_new formed in the recurrence) against the unfused pair (#4)
    TAIL=8 run_step "fused GPU tests" 240 $PYT tests/test_backend_tilelang.py -k "fused or trace_stamps or ostage or pscores"
    TAIL=40 run_step "tilelang fused sweep" 200 python benchmarks/sweep_variants.py --backend tilelang --mode fwd \
        --rows 16/32:1x32768,16/32:4x8192,2/8:1x32768,16/64:1x32768,16/64:4x8192,8/32:8x1024 \
        --out $OUT/sweep_fused.json \
        --variants "default;FLASHQLA_TILELANG_FWD=ws;FLASHQLA_TILELANG_WS_OPTS=fastexp,psplit,ostage;FLASHQLA_TILELANG_WS_OPTS=fastexp,pscores;FLASHQLA_TILELANG_WS_OPTS=fastexp,pscores,ostage"
    TAIL=60 run_step "fused role trace" 120 python benchmarks/trace_ws.py --rows 16/32:1x32768,16/32:4x8192 \
        --env FLASHQLA_TILELANG_FWD=fused --out $OUT/trace_fused.json ;;
  fusedquick)
    # the fused forward's oracle tests at the auto V-block only (before a benchmark of changed kernels)
    TAIL=6 run_step "fused GPU tests (auto BV)" 150 $PYT tests/test_backend_tilelang.py \
        -k "(fused_matches and bvauto) or ostage or pscores" ;;
  trace)
    # where the ws recurrence's ~3 us per chunk goes: per-role clock64 timeline of one CTA (#4)
    TAIL=60 run_step "ws role trace" 150 python benchmarks/trace_ws.py --rows 16/32:1x32768,16/32:4x8192,2/8:1x32768 \
        --out $OUT/trace.json
    TAIL=30 run_step "ws role trace bv64" 90 python benchmarks/trace_ws.py --rows 16/32:1x32768 \
        --env FLASHQLA_TILELANG_BV=64 --out $OUT/trace_bv64.json ;;
  flqwarm)
    TAIL=20 run_step "flashqla rekey check" 40 python benchmarks/check_flashqla_warm.py --rekey --no-calls \
        --dump-keys $OUT/flq_keys
    TAIL=10 run_step "flashqla device warm-up" 300 python benchmarks/warm_flashqla_cache.py \
        --cache-dir "$TILELANG_CACHE_DIR" --jobs 16 --heads 2/8,4/16,8/32,16/32,16/64 ${FLQ_WARM_ARGS:-}
    save_kcache ;;
  fwdbench)
    TAIL=40 run_step "qwen35-fwd preset, both baselines" 480 python -m flashqla bench --preset qwen35-fwd \
        --no-progress --backends tilelang,triton --baselines fla,flashqla ${FWD_EAGER:+--eager-too} --out $OUT/fwd ;;
  cutlasshostile)
    # carry [".gpu_cute"] (cutedsl + peers): #11 item 2 on the cutlass backend (its hostile-value and NaN-confinement
    # GPU tests; session 10 ran them for triton and tilelang only)
    TAIL=8 run_step "cutlass hostile values" ${CUTH_S:-200} $PYT tests/test_reliability.py -k "cutlass and (hostile or nonfinite)" ;;
  tritontests)
    # the triton GPU tests of the forward paths (the Tb inference forward is the default since session 12)
    TAIL=8 run_step "triton GPU tests (forward forms)" ${TTEST_S:-200} $PYT tests/test_backend_triton.py \
        -k "${TTEST_K:-tb_forward or half_precision_forward_backward or cuda_graph or kept_inverse or local_dv}" ;;
  flqgridwarm)
    # FlashQLA's kernels for its whole forward grid, built on the device (CPU-warmed entries get other keys there:
    # benchmarks/README.md), then the cache packed: carry the returned kcache (repacked with
    # PACK_ONLY=1 benchmarks/rebuild_kcache.sh) and the cutlassgrid / flqfwdgrid calls start warm
    TAIL=6 run_step "flashqla fwd warm-up (its grid's heads)" ${FLQWARM_S:-200} python benchmarks/warm_flashqla_cache.py \
        --cache-dir "$TILELANG_CACHE_DIR" --jobs 16 --heads ${FLQ_HEADS:-$FLQ_GRID_HEADS} \
        --seqs "${FLQ_SEQS:-$FLQ_GRID_SEQS}" --no-xz
    save_kcache ;;
  flqfwdgrid)
    # #4's forward acceptance: FlashQLA's own forward grid (9 head configurations x 12 length mixes, 108 rows),
    # tilelang against FlashQLA and FLA.  FlashQLA's kernels for its heads are warmed first (16 jobs; its CP
    # variants that depend on g's values still compile on first use).  Too long for one call: FLQ_FILTER splits
    # the grid (e.g. "2/8 |4/16 |8/32 " then "16/64|16/32|8/24" then "16/48|16/16|32/32"); merge the JSONs after.
    # FLQ_SEQS narrows the warm-up to the length mixes FLQ_FILTER keeps (e.g. 32768 for "/32 1x32768").
    TAIL=6 run_step "flashqla fwd warm-up (its grid's heads)" ${FLQWARM_S:-200} python benchmarks/warm_flashqla_cache.py \
        --cache-dir "$TILELANG_CACHE_DIR" --jobs 16 --heads ${FLQ_HEADS:-$FLQ_GRID_HEADS} \
        --seqs "${FLQ_SEQS:-$FLQ_GRID_SEQS}" --no-xz
    TAIL=40 run_step "flashqla-fwd preset ${FLQ_FILTER:-all}" ${FLQGRID_S:-400} python -m flashqla bench \
        --preset flashqla-fwd --no-progress --backends tilelang --baselines flashqla,fla ${BENCH_ARGS:-} \
        ${FLQ_FILTER:+--filter "$FLQ_FILTER"} --out $OUT/flqfwd ;;
  accept8fwd|accept8bwd)
    # #8's acceptance rows in one run: every row of FlashQLA's forward grid (46) or backward grid (20) with value
    # heads x sequences <= 40, tilelang against FlashQLA and FLA.  FlashQLA's kernels for exactly those rows are
    # warmed first (40 forward kernels, 48 backward ones: warm_flashqla_cache.py --list --max-walks 40); the bench's
    # summary gives the geometric mean, the lowest row and the rows under 1.1x.  A8_S / A8WARM_S: the step budgets.
    # On one warm lease: accept8fwd in one call, accept8bwd in the next (/tmp/kcache stays between the calls).
    # FLA autotunes each head configuration it has not seen (~60-80 s each; benchmarks/fla_autotune_h200 holds
    # 2/8, 4/16, 8/32, 16/32): the forward rows add 8/24, 16/16 and 32/32, so give accept8fwd BUDGET_S=590 A8_S=480,
    # or A8_BASELINES=flashqla; the cache is saved again after the bench, with FLA's new autotuning results.
    # benchmarks/kcache/kcache.tar.xz (session 29) holds FlashQLA's kernels for both steps' rows and FLA's tuning
    # for all their heads: session 29 (H100), before they were cached, took 530 s (bwd) and 379 s (fwd), ~115 s of it
    # FlashQLA's compiles.  A8_FILTER keeps the rows whose label holds one of its '|'-separated parts (the rows
    # nearest 1.1x, e.g. A8_FILTER='16/32 32k in 1' for the backward) where a lease is too short for the grid.
    # Even on a warm machine with every kernel cached, a one-row call needs A8WARM_S=60 A8_S=150 or so: the warm-up
    # process takes ~35 s to start and the bench's first row loads every kernel (session 33).
    if [ "$STEP" = accept8fwd ]; then
      A8_PRESET=flashqla-fwd; A8_WARM=(--heads "$FLQ_GRID_HEADS" --seqs "$FLQ_GRID_SEQS")
    else
      A8_PRESET=flashqla-bwd; A8_WARM=(--heads "$FLQ_BWD_GRID_HEADS" --seqs none --bwd-preset flashqla-bwd)
    fi
    TAIL=8 run_step "flashqla warm-up, $A8_PRESET rows with Hv x seqs <= 40" ${A8WARM_S:-200} \
        python benchmarks/warm_flashqla_cache.py --cache-dir "$TILELANG_CACHE_DIR" --jobs 16 --max-walks 40 \
        "${A8_WARM[@]}" --no-xz
    save_kcache
    TAIL=60 run_step "$A8_PRESET, Hv x seqs <= 40, against FlashQLA and FLA" ${A8_S:-420} python -m flashqla bench \
        --preset $A8_PRESET --max-walks 40 --no-progress --backends tilelang --baselines ${A8_BASELINES:-flashqla,fla} \
        ${BENCH_ARGS:---min-time 0.1 --max-reps 100} ${A8_FILTER:+--filter "$A8_FILTER"} --out $OUT/$STEP
    save_kcache ;;
  tritonshared)
    # #3's last open item: the shared suite (tests/test_correctness.py) on the triton backend at the current kernels
    # (bf16 K=128 and fp16 K=64 over the standard cases; the triton compiles happen here), then the triton GPU tests
    TAIL=10 run_step "shared suite, triton" ${TSHARED_S:-400} $PYT tests/test_correctness.py -k triton
    TAIL=6 run_step "triton GPU tests" ${TTEST_S:-150} $PYT tests/test_backend_triton.py ;;
  tritongrid)
    # #3's acceptance: the Step 2 forward grid (25 rows) and forward+backward grid (20 rows), triton against FLA's
    # Triton (FLA_FLASH_QLA=0), both in one lease; TGRID_FILTER picks rows, TGRID_MODES=fwd|bwd one preset
    for m in ${TGRID_MODES:-fwd bwd}; do
      TAIL=32 run_step "qwen35-$m, triton vs FLA" ${TGRID_S:-280} python -m flashqla bench --preset qwen35-$m \
          --no-progress --backends triton --baselines fla ${TGRID_FILTER:+--filter "$TGRID_FILTER"} --out $OUT/tgrid_$m
    done ;;
  eagerbench)
    # our plain op timed eagerly beside its graph time, against FlashQLA (always eager): what a caller without
    # CUDA graphs gets (session 9's host trims: no autograd node without grad, a shorter dispatch)
    TAIL=30 run_step "qwen35-fwd, eager too" 300 python -m flashqla bench --preset qwen35-fwd --no-progress \
        --filter "${EAGER_FILTER:-1x8192|1024x8}" --backends tilelang --baselines flashqla --eager-too --out $OUT/eager ;;
  cutlassaot)
    # carry [".gpu_cute"] built by benchmarks/make_gpu_cute.sh (it adds the apache-tvm-ffi the disk cache needs):
    # the cutlass on-disk cache (session 14): its two-process GPU test (the second process loads every kernel,
    # bitwise equal), then the first call of a fresh process twice on one cache directory (cold: compiles and
    # starts the background library builds; warm: loads) (#5, #7)
    TAIL=6 run_step "cutlass disk cache test" ${CUTAOT_TEST_S:-200} $PYT -s tests/test_backend_cutlass.py -k disk_cache
    for i in 1 2; do
      TAIL=2 run_step "cutlass first call 8-32 ($i)" 90 env FLASHQLA_CACHE_DIR=/tmp/flq_fc python \
          benchmarks/first_call.py --backend cutlass --heads 8/32
      [ $i = 1 ] && sleep 30    # the libraries are built by detached children of the first process
    done ;;
  cutlassseg)
    # carry [".gpu_cute"]: the cutlass forward over segments with a halo (session 18, FLASHQLA_CUTLASS_SEGMENTS, off by
    # default): its GPU tests, then the A/B against the unsplit walk on FlashQLA's CP rows and one with a walk per
    # SM, and num_wg 2 at 16/32 4x8192 (#5, #8)
    TAIL=6 run_step "cutlass segment tests" ${CSEG_TEST_S:-240} $PYT tests/test_backend_cutlass.py -k over_segments
    case $RUN_RC in 0) ;; *) echo "== cutlassseg: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=40 run_step "cutlass fwd, segments off / auto" ${CSEG_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend cutlass --mode fwd --out $OUT/sweep_cutlass_seg_fwd.json \
        --rows ${CSEG_ROWS:-2/8:1x32768,4/16:1x32768,8/32:1x32768,16/32:1x32768,16/32:28672+4096,16/32:4x8192,2/8:1x8192} \
        "--variants=FLASHQLA_CUTLASS_SEGMENTS=off;FLASHQLA_CUTLASS_SEGMENTS=auto;FLASHQLA_CUTLASS_SEGMENTS=32"
    # (the default takes one consumer warpgroup below a (sequence, head) pair per SM: two waves of CTAs at 128 pairs)
    TAIL=20 run_step "cutlass fwd, num_wg 1 / 2" ${CSEG_WG_S:-120} python benchmarks/sweep_variants.py \
        --backend cutlass --mode fwd --out $OUT/sweep_cutlass_numwg_fwd.json \
        --rows ${CSEG_WG_ROWS:-16/32:4x8192,8/16:4x8192,16/32:2x8192,8/32:4x4096} \
        "--variants=FLASHQLA_CUTLASS_NUM_WG=1;FLASHQLA_CUTLASS_NUM_WG=2" ;;
  cutlassws)
    # carry [".gpu_cute"]: the warp-specialised cutlass forward recurrence (session 19, chunk_fwd_ws_sm90, off by
    # default): its GPU tests (oracle, agreement with the one-warpgroup walk, each kernel against the emulation, over
    # segments; the fused inference form), then serial / ws / fused / fused over segments where the model splits (#5;
    # CWS_MODE=fwd measures inference forwards, where fused applies; fwdbwd the training ones, where it is ws)
    TAIL=8 run_step "cutlass ws tests" ${CWS_TEST_S:-300} $PYT tests/test_backend_cutlass.py \
        -k "ws_forward or fused_forward or one_by_one or over_segments"
    case $RUN_RC in 0) ;; *) echo "== cutlassws: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=40 run_step "cutlass fwd, serial / ws" ${CWS_SWEEP_S:-240} python benchmarks/sweep_variants.py \
        --backend cutlass --mode ${CWS_MODE:-fwd} --out $OUT/sweep_cutlass_ws_${CWS_MODE:-fwd}.json \
        --rows ${CWS_ROWS:-16/32:1x32768,16/32:4x8192,16/32:8x1024,8/32:1x8192,2/8:1x32768,32/32:8x4096} \
        "--variants=FLASHQLA_CUTLASS_FWD=serial;FLASHQLA_CUTLASS_FWD=ws;FLASHQLA_CUTLASS_FWD=fused;FLASHQLA_CUTLASS_FWD=fused FLASHQLA_CUTLASS_SEGMENTS=auto" ;;
  cutlassprep)
    # carry [".gpu_cute"]: the cutlass prep.  Session 20 ran it for Aqk staged for 128-bit stores and tb at three CTAs
    # per SM (tb prep 0.604 -> 0.388 ms at 16/32 4x8192); session 23 for the inverse on register tiles (bitwise the
    # scalar one's T, 0.391 -> 0.384 ms), the only form since.  Now: its kernel-by-kernel and fused-forward GPU
    # tests, the fused forward's kernel times (CPREP_ROWS), then Nsight Compute on one prep launch
    TAIL=8 run_step "cutlass prep tests" ${CPREP_TEST_S:-200} \
        $PYT tests/test_backend_cutlass.py -k "one_by_one or fused_forward"
    case $RUN_RC in 0) ;; *) echo "== cutlassprep: tests did not pass; the rest skipped"; continue ;; esac
    TAIL=12 run_step "cutlass prep kernel times" 150 python benchmarks/sweep_variants.py \
        --backend cutlass --mode ${CPREP_SWEEP_MODE:-fwd} --out $OUT/sweep_cutlass_prep.json \
        --rows ${CPREP_ROWS:-16/32:4x8192,2/8:1x32768,16/32:8x1024} "--variants=-"
    [ -n "${CPREP_NCU:-1}" ] && TAIL=90 run_step "ncu cutlass prep" ${CPREP_NCU_S:-150} \
        ncu --clock-control none \
        -k regex:ChunkPrepSm90 --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis_Tables \
        python benchmarks/profile_kernels.py --impls cutlass --rows 16/32:4x8192 --modes fwd --iters 3 ;;
  cutlassgrid)
    # #5's acceptance: FlashQLA's forward grid with the cutlass backend against FlashQLA and FLA (tilelang too).
    # FlashQLA needs tilelang: run a call carrying .gpu (`source .gpu/setup.sh`) first, this one within 30 s after
    # it, carrying .gpu_cute.  CGRID_FWD picks the recurrence (FLASHQLA_CUTLASS_FWD), CGRID_FILTER a part of the grid
    TAIL=40 run_step "flashqla-fwd preset, cutlass ${CGRID_FILTER:-all}" \
        ${CGRID_S:-420} env FLASHQLA_CUTLASS_FWD=${CGRID_FWD:-fused} python -m flashqla bench --preset flashqla-fwd --no-progress \
        --backends ${CGRID_BACKENDS:-cutlass,tilelang} --baselines flashqla,fla ${BENCH_ARGS:-} \
        ${CGRID_FILTER:+--filter "$CGRID_FILTER"} --out $OUT/cutlass_flqfwd ;;
  cutlassshared)
    # carry [".gpu_cute"]: #5's correctness on the H200 after a cutlass change: the shared suite (float64 oracle,
    # forward and backward) on cutlass, then the cutlass GPU suite, as session 19 ran them (left out: the on-disk cache
    # test, and the kernel-by-kernel emulation test that cutlassprep runs)
    TAIL=14 run_step "shared suite and GPU suite, cutlass" ${CSHARED_S:-450} $PYT tests/test_correctness.py \
        tests/test_backend_cutlass.py -k "cutlass and not disk_cache and not kernels_match_emulation" ;;
  cutlass)
    TAIL=12 run_step "cutlass GPU suite" 300 $PYT tests/test_backend_cutlass.py
    TAIL=12 run_step "cutlass 2^31 and determinism" 200 $PYT -s tests/test_large_tensors.py \
        tests/test_reliability.py -k "cutlass" ;;
  memory)
    # FlashQLA's backward kernels compile on first use, minutes per head configuration: warm them first
    # (bash benchmarks/next_device_run.sh memwarm membwd save, then memfwd in a second call)
    TAIL=30 run_step "memory fwd" 250 python benchmarks/bench_memory.py --modes fwd --out $OUT/memfwd
    TAIL=30 run_step "memory fwdbwd" 250 python benchmarks/bench_memory.py --modes fwdbwd --out $OUT/membwd
    save_kcache ;;
  memwarm)
    # FlashQLA's forward and backward kernels for the Step 2 heads (the memory grid), without the rekey check
    # (--no-xz: session 10 run 3 lost the step to the archive-size report after the compiles had finished)
    TAIL=10 run_step "flashqla fwd+bwd warm-up" ${MEMWARM_S:-300} python benchmarks/warm_flashqla_cache.py \
        --cache-dir "$TILELANG_CACHE_DIR" --jobs 16 --heads ${MEM_HEADS:-2/8,4/16,8/32,16/32,16/64} --with-backward \
        --no-xz ;;
  bwdtests)
    # after a change to the backwards' host code (session 9: buffers freed before the wy kernel): the tilelang
    # backward tests, then the hostile-value tests of every GPU backend carried
    # (triton's host change runs under the interpreter in CPU CI; its device compiles would take minutes)
    TAIL=4 run_step "tilelang backward GPU tests" 150 $PYT tests/test_backend_tilelang.py -k backward
    TAIL=8 run_step "hostile values on the GPU" 150 $PYT tests/test_reliability.py -k "hostile or nonfinite" ;;
  bwdcheck)
    # after a change to the tilelang backward (session 10: dv / dbeta written in their final dtype by the wy
    # kernel, the GVA sum and cast in one pass): its GPU tests and 100-run determinism, then part of the
    # backward grid against FlashQLA (kcache from a bwdbench run) and the per-kernel profile
    TAIL=4 run_step "tilelang backward GPU tests" 150 $PYT tests/test_backend_tilelang.py \
        tests/test_reliability.py -k "backward or (deterministic and tilelang)"
    TAIL=22 run_step "flashqla-bwd rows against FlashQLA" ${BWDCHECK_S:-150} python -m flashqla bench \
        --preset flashqla-bwd --no-progress --filter "${BWD_FILTER:-16/32|4/8 32k}" --backends tilelang \
        --baselines flashqla --out $OUT/bwd
    TAIL=30 run_step "profile fwd+bwd" 90 python benchmarks/profile_kernels.py --impls tilelang \
        --rows ${PROFILE_ROWS:-16/32:32768,4/8:32768} --modes fwdbwd --out $OUT/profile.json ;;
  bwdwhole)
    # the whole-V fused backward (FLASHQLA_TILELANG_BWD=whole, chunk_bwd_whole_sm90, session 14; its 8 variants in
    # the carried kcache): its GPU tests first (a protocol bug would hang: the step's timeout ends it), then the
    # A/B against the split backward, its role trace, and the flashqla-bwd rows against
    # FlashQLA (#4)
    TAIL=8 run_step "whole backward GPU tests" ${BWDW_TEST_S:-180} $PYT tests/test_tilelang_bwd_whole.py
    case $RUN_RC in 0) ;; *) echo "== whole backward: tests did not pass; later steps skipped"; continue ;; esac
    TAIL=12 run_step "backward variants sweep" ${BWDW_SWEEP_S:-150} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --rows ${BWDW_ROWS:-16/32:1x32768,16/32:4x8192,4/8:1x32768,8/16:1x8192} \
        --out $OUT/sweep_bwd_whole.json --variants "${BWDW_VARIANTS:-FLASHQLA_TILELANG_BWD=ws;FLASHQLA_TILELANG_BWD=whole}"
    TAIL=60 run_step "whole backward trace" ${BWDW_TRACE_S:-90} python benchmarks/trace_bwd_fused.py \
        --rows ${BWDW_TRACE_ROWS:-16/32:4x8192,16/32:1x32768} --out $OUT/trace_bwd_whole.json
    # last: FlashQLA's backward kernels compile on first use unless a carried kcache holds them (memwarm)
    TAIL=45 run_step "flashqla-bwd rows, whole backward" ${BWDW_BENCH_S:-200} env FLASHQLA_TILELANG_BWD=whole \
        python -m flashqla bench --preset flashqla-bwd --no-progress --filter "${BWDW_FILTER:-16/32}" \
        --backends tilelang --baselines flashqla --out $OUT/bwdwhole ;;
  bwdex2)
    # exponentials as one ex2.approx.ftz each (FLASHQLA_TILELANG_EX2=approx, session 16: ~400 fewer instructions
    # in the whole backward's value role; also stage 1's Tb form and the ws recurrence; not yet run): the whole
    # backward's GPU tests with it, then the A/B against exp2f in one process, backward and inference forward (the
    # sweep prints each variant's difference from exp2f's outputs: beyond rounding is a bug) (#4); if it is faster
    # and passes, make it the default and run the forward GPU tests with it
    TAIL=8 run_step "whole backward GPU tests, ex2.approx" ${BWDEX2_TEST_S:-180} env FLASHQLA_TILELANG_EX2=approx \
        $PYT tests/test_tilelang_bwd_whole.py
    case $RUN_RC in 0) ;; *) echo "== ex2.approx: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=8 run_step "whole backward, exp2f vs ex2.approx" ${BWDEX2_SWEEP_S:-120} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --rows ${BWDEX2_ROWS:-16/32:4x8192,4/16:8x4096} --out $OUT/sweep_bwd_ex2.json \
        --variants "FLASHQLA_TILELANG_BWD=whole;FLASHQLA_TILELANG_BWD=whole FLASHQLA_TILELANG_EX2=approx"
    TAIL=8 run_step "inference forward, exp2f vs ex2.approx" 90 python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwd --rows ${BWDEX2_FWD_ROWS:-16/32:4x8192,16/64:4x8192,2/8:1x32768} \
        --out $OUT/sweep_fwd_ex2.json --variants "-;FLASHQLA_TILELANG_EX2=approx" ;;
  segments)
    # in-kernel CP of the forward (session 17, backends/tilelang/segments.py: segments with a halo): its GPU tests,
    # then the A/B against the unsplit walk on the long-sequence rows (auto and forced segment lengths), inference
    # and training forwards; the training A/B also with the backward's split (FLASHQLA_TILELANG_BWD_SEGMENTS=auto:
    # the split backward's state walk or, session 18, the whole-V backward's walk over segments; off by default
    # until these GPU tests have passed with it: the tests force it, both backwards) (#8)
    TAIL=12 run_step "segment GPU tests" ${SEG_TEST_S:-360} $PYT tests/test_tilelang_segments.py
    case $RUN_RC in 0) ;; *) echo "== segments: tests did not pass; the sweep skipped"; continue ;; esac
    # (SEG_INFER=0: only the training A/B, the inference one was measured in session 17)
    [ "${SEG_INFER:-1}" = 0 ] || TAIL=80 run_step "inference forward, segments off / auto / forced" ${SEG_SWEEP_S:-240} python \
        benchmarks/sweep_variants.py --backend tilelang --mode fwd --out $OUT/sweep_fwd_segments.json \
        --rows ${SEG_ROWS:-2/8:1x32768,4/16:1x32768,8/24:1x32768,16/32:1x32768,16/64:1x32768,16/32:28672+4096,2/8:4096+28672,16/48:4096+28672,8/32:1x16384,2/8:2x16384,16/32:1x4096,2/8:1x2048,16/32:4x8192} \
        --variants "${SEG_VARIANTS:-FLASHQLA_TILELANG_SEGMENTS=off;-;FLASHQLA_TILELANG_SEGMENTS=16;FLASHQLA_TILELANG_SEGMENTS=32;FLASHQLA_TILELANG_SEGMENTS=64;FLASHQLA_TILELANG_SEGMENTS=128}"
    [ "${SEG_TRAIN:-1}" = 0 ] && continue
    TAIL=12 run_step "training forward+backward, segments off / auto" ${SEG_TRAIN_S:-200} python \
        benchmarks/sweep_variants.py --backend tilelang --mode fwdbwd --out $OUT/sweep_fwdbwd_segments.json \
        --rows ${SEG_TRAIN_ROWS:-2/8:1x32768,16/32:1x32768,4/8:1x8192,2/4:1x32768,16/32:28672+4096} \
        --variants "FLASHQLA_TILELANG_SEGMENTS=off;-;FLASHQLA_TILELANG_BWD_SEGMENTS=auto;FLASHQLA_TILELANG_BWD_SEGMENTS=auto FLASHQLA_TILELANG_BWD=ws" ;;
  trainfused)
    # the fused training forward ahead of the whole-V backward (session 19, FLASHQLA_TILELANG_TRAIN_FUSED, off by
    # default): its GPU tests (oracle in bf16 / fp16, determinism), then the fwd+bwd A/B on rows where the whole-V
    # backward runs (unsplit, and over segments with FLASHQLA_TILELANG_BWD_SEGMENTS=auto) (#4)
    TAIL=8 run_step "fused training forward GPU tests" ${TF_TEST_S:-240} $PYT tests/test_tilelang_bwd_whole.py \
        -k "fused_training or whole_backward"
    case $RUN_RC in 0) ;; *) echo "== trainfused: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=30 run_step "fwd+bwd, training forward unfused / fused" ${TF_SWEEP_S:-240} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --out $OUT/sweep_fwdbwd_train_fused.json \
        --rows ${TF_ROWS:-16/32:4x8192,16/32:8x4096,32/32:8x4096,4/16:8x4096,16/32:1x32768,2/4:1x32768} \
        "--variants=FLASHQLA_TILELANG_TRAIN_FUSED=0;FLASHQLA_TILELANG_TRAIN_FUSED=1;FLASHQLA_TILELANG_BWD_SEGMENTS=auto;FLASHQLA_TILELANG_TRAIN_FUSED=1 FLASHQLA_TILELANG_BWD_SEGMENTS=auto" ;;
  halostream)
    # FLASHQLA_TILELANG_HALO_STREAM=1 (session 23, off): the halo searches of a split walk on a side stream beside
    # stage 1 (~11 us each at 16/32 1x32768).  Its GPU test, then a wall-clock A/B (flashqla bench, CUDA graphs: a
    # kernel-time sum cannot show an overlap) on the forward grid's one-sequence rows and the backward grid's
    # 32k-in-1 rows, FlashQLA beside (its kernels should be in the kcache: flqgridwarm / bwdbench warm them)
    TAIL=8 run_step "halo stream, GPU test" ${HS_TEST_S:-200} $PYT tests/test_tilelang_segments.py -k "halo_stream"
    case $RUN_RC in 0) ;; *) echo "== halostream: tests did not pass; the A/B skipped"; continue ;; esac
    for HS in 0 1; do
      TAIL=14 run_step "halo stream $HS, forward rows" ${HS_FWD_S:-150} env FLASHQLA_TILELANG_HALO_STREAM=$HS \
          python -m flashqla bench --preset flashqla-fwd --no-progress --backends tilelang \
          --baselines ${HS_BASELINES:-flashqla} --filter "${HS_FWD_FILTER:-1x32768}" ${BENCH_ARGS:-} \
          --out $OUT/halo_stream_fwd_$HS
      TAIL=8 run_step "halo stream $HS, fwd+bwd rows" ${HS_BWD_S:-120} env FLASHQLA_TILELANG_HALO_STREAM=$HS \
          python -m flashqla bench --preset flashqla-bwd --no-progress --backends tilelang \
          --baselines ${HS_BASELINES:-flashqla} --filter "${HS_BWD_FILTER:-32k in 1 }" ${BENCH_ARGS:-} \
          --out $OUT/halo_stream_bwd_$HS
    done ;;
  tlshort)
    # tilelang's plan leaves the 32-chunk walks of FlashQLA's 1x2048 rows whole (the split's modelled gain is under
    # MIN_GAIN_US), where cutlass splits them and wins (session 24's grid): the same rows with the walk forced into
    # segments of 8 and 4 chunks, wall-clock in CUDA graphs (TLS_FILTER, TLS_SEGS)
    for S in ${TLS_SEGS:-auto 8 4}; do
      TAIL=12 run_step "tilelang segments $S, short rows" ${TLS_S:-60} env FLASHQLA_TILELANG_SEGMENTS=$S \
          python -m flashqla bench --preset flashqla-fwd --no-progress --backends tilelang --baselines none \
          --filter "${TLS_FILTER:-1x2048}" ${BENCH_ARGS:-} --out $OUT/tlshort_$S
    done ;;
  dsmem)
    # the DSMEM hand-off between the two CTAs of a cluster (benchmarks/dsmem_handoff.py, session 36): cycles per 4 KB
    # hand-off with nothing hiding it, 1 pair and 64 pairs at once, before #8's lever 3 (the GVA pair sums through
    # DSMEM instead of a memset and reductions) is written; ~0.63 us a step is what the memset costs
    for P in 1 64; do
      TAIL=6 run_step "DSMEM hand-off, $P pairs" ${DSM_S:-60} python benchmarks/dsmem_handoff.py --pairs $P \
          --iters ${DSM_ITERS:-4000} --json $OUT/dsmem_handoff_$P.json
    done ;;
  astore)
    # WS option astore (session 24, off): the o stores and the chain's state / v_new saves wait for their shared
    # reads a chunk later.  The fwd+bwd CUDA-graph A/B (the sweep's diff column compares the astore arm's outputs and
    # gradients with the waiting stores'), then its GPU tests (AS_K selects; "async_store and 128" for the BV-128
    # cases that failed in session 25).  Session 36 (H100): bitwise and no faster (training walk 0.662 against 0.657
    # ms at 16/32 1x32768), the BV-128 cases passed
    TAIL=30 run_step "astore graph A/B fwdbwd" ${AS_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --graph --out $OUT/sweep_astore_graph_fwdbwd.json \
        --rows ${AS_ROWS:-16/32:1x32768,16/32:2x16384} \
        "--variants=FLASHQLA_TILELANG_WS_OPTS=fastexp,psplit,ostage;FLASHQLA_TILELANG_WS_OPTS=fastexp,psplit,ostage,astore"
    TAIL=40 run_step "astore GPU tests" ${AS_TEST_S:-240} $PYT -x tests/test_backend_tilelang.py -k "${AS_K:-async_store}" ;;
  h0split)
    # session 24: the split walks' start state is a select (an if / else serialised the BV-128 forward's wgmma).  The
    # segment GPU tests (their cases carry h0), then FlashQLA's 1x32768 forward rows without and with an initial
    # state (a continued prefill), the second against the baselines (their kernels should be warm: flqgridwarm)
    TAIL=8 run_step "segment GPU tests" ${H0_TEST_S:-240} $PYT tests/test_tilelang_segments.py
    TAIL=12 run_step "forward rows without h0" ${H0_S:-60} python -m flashqla bench --preset flashqla-fwd \
        --no-progress --backends tilelang --baselines none --filter "${H0_FILTER:-1x32768}" ${BENCH_ARGS:-} \
        --out $OUT/h0_none
    TAIL=14 run_step "forward rows with h0 against the baselines" ${H0_BENCH_S:-150} python -m flashqla bench \
        --preset flashqla-fwd --no-progress --backends tilelang --baselines ${H0_BASELINES:-flashqla,fla} \
        --initial-state --filter "${H0_FILTER:-1x32768}" ${BENCH_ARGS:-} --out $OUT/h0_fwd ;;
  fewwaves)
    # FLASHQLA_TILELANG_FEW_WAVES=1 (session 24, off): the forward's planner also splits walks that fill the SMs in
    # at most two waves (16/48 4x8192: 192 whole walks -> 384 of 64 chunks).  Forward rows 0 / 1, wall-clock in CUDA
    # graphs (FW_FILTER), then (FW_TEST=1) the segment GPU tests under it
    for W in 0 1; do
      TAIL=12 run_step "few waves $W" ${FW_S:-45} env FLASHQLA_TILELANG_FEW_WAVES=$W python -m flashqla bench \
          --preset flashqla-fwd --no-progress --backends tilelang --baselines none ${BENCH_ARGS:-} \
          --filter "${FW_FILTER:-16/48 4x8192|16/48 2x16384|16/48 1x32768|8/24 4x8192|8/24 8x4096}" --out $OUT/fewwaves_$W
    done
    [ "${FW_TEST:-0}" = 1 ] && TAIL=8 run_step "few waves, segment GPU tests" ${FW_TEST_S:-200} env \
        FLASHQLA_TILELANG_FEW_WAVES=1 $PYT tests/test_tilelang_segments.py ;;
  intrainv|intrapersist)
    # stage-1 switches of session 25, each: its GPU tests, then the kernel-time A/B on #8's rows (S1_ROWS, S1_MODES,
    # S1_VARIANTS), then (S1_NCU=1) Nsight Compute on the switched form at 16/32 1x32768.
    # intrainv: FLASHQLA_TILELANG_INTRA_INV=mma, the inverse as 3xTF32 mma.sync products (its shared-memory pipe was
    #   at 89%, 1828 of 2618 wavefronts per CTA in the CUDA-core inverse: ncuintra; the default since run 2)
    # intrapersist: the two answers to run 3's Nsight Compute (a third of the stall samples wait on each CTA's
    #   prologue loads, four CTAs per SM), both off until measured: FLASHQLA_TILELANG_INTRA_PERSIST=1, persistent CTAs
    #   that load the next chunk while forming this one; FLASHQLA_TILELANG_INTRA_COMPACT=1 with the tensor-core
    #   inverse, five CTAs per SM (A over the k tile, swizzled tiles)
    if [ "$STEP" = intrainv ]; then
      S1_VAR=FLASHQLA_TILELANG_INTRA_INV=mma; S1_DEF_K=intra_inv_mma
      S1_DEF_VARIANTS="FLASHQLA_TILELANG_INTRA_INV=fma;FLASHQLA_TILELANG_INTRA_INV=mma"
    else
      S1_VAR=FLASHQLA_TILELANG_INTRA_PERSIST=1; S1_DEF_K="intra_persist or intra_compact"
      # (persistent by default on equal-length calls since session 26; compact applies to the per-chunk form only)
      S1_DEF_VARIANTS="FLASHQLA_TILELANG_INTRA_PERSIST=0;-;FLASHQLA_TILELANG_INTRA_PERSIST=0 FLASHQLA_TILELANG_INTRA_COMPACT=1"
    fi
    TAIL=10 run_step "$STEP, GPU tests" ${S1_TEST_S:-220} $PYT tests/test_backend_tilelang.py -k "${S1_K:-$S1_DEF_K}"
    case $RUN_RC in 0) ;; *) echo "== $STEP: tests did not pass; the A/B skipped"; continue ;; esac
    for M in ${S1_MODES:-fwd fwdbwd}; do
      TAIL=30 run_step "$STEP A/B, $M" ${S1_SWEEP_S:-120} python benchmarks/sweep_variants.py \
          --backend tilelang --mode $M --out $OUT/sweep_${STEP}_$M.json \
          --rows ${S1_ROWS:-16/32:1x32768,32/32:1x32768,8/32:1x32768,16/32:4x8192,2/8:1x32768} \
          "--variants=${S1_VARIANTS:-$S1_DEF_VARIANTS}"
    done
    if [ "${S1_NCU:-0}" = 1 ]; then
      TAIL=60 run_step "ncu stage 1, $S1_VAR" 120 env $S1_VAR ncu --clock-control none -k regex:gdn_fwd_intra_tb \
          --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section Occupancy \
          python benchmarks/profile_kernels.py --impls tilelang --rows 16/32:1x32768 --modes fwd --iters 3
    fi ;;
  persistwalk)
    # the persistent stage 1 (FLASHQLA_TILELANG_INTRA_PERSIST=auto, the default since session 26 on equal-length
    # calls): its GPU tests, the new one first (CTAs that walk several chunks, varlen chunk tables: what auto waits
    # for before it takes varlen calls too), then the CUDA-graph A/B (a kernel-time sum counts the side-stream halo
    # searches' wait for SMs, not the overlap): off, auto, three CTAs per SM, the halo searches on the caller's stream
    TAIL=10 run_step "persist GPU tests" ${PW_TEST_S:-300} $PYT tests/test_backend_tilelang.py \
        -k "intra_persist_walks_several_chunks or intra_persist_is_bitwise"
    case $RUN_RC in 0) ;; *) echo "== persistwalk: tests did not pass; the A/B skipped"; continue ;; esac
    P=FLASHQLA_TILELANG_INTRA_PERSIST
    for M in ${PW_MODES:-fwd fwdbwd}; do
      TAIL=40 run_step "persist graph A/B $M" ${PW_SWEEP_S:-150} python benchmarks/sweep_variants.py --backend tilelang \
          --mode $M --graph --out $OUT/sweep_persist_graph_$M.json \
          --rows ${PW_ROWS:-16/32:1x32768,32/32:1x32768,8/32:1x32768} \
          "--variants=$P=0;-;FLASHQLA_TILELANG_INTRA_PERSIST_CTAS=3;FLASHQLA_TILELANG_HALO_STREAM=0"
    done ;;
  pairzero)
    # FLASHQLA_TILELANG_GVA_ZERO=kernel (session 30): the whole-V backward zeroes the GVA pair-sum rows of dq / dk
    # itself (one CTA of a pair, two steps ahead, a flag per chunk for the other) instead of the host memset
    # (0.083 ms at 16/32 1x32768, H100 session 29).  Its GPU test (oracle, bitwise vs the memset build on NaN-poisoned
    # memory, more CTAs than SMs, segments with halos, 20 runs), then the fwd+bwd CUDA-graph A/B (PZ_ROWS)
    TAIL=12 run_step "pair zero GPU tests" ${PZ_TEST_S:-240} $PYT tests/test_tilelang_bwd_whole.py -k "${PZ_K:-pair_zero}"
    case $RUN_RC in 0) ;; *) echo "== pairzero: tests did not pass; the A/B skipped"; continue ;; esac
    ;&
  pztests)
    # the pair-zero GPU tests alone, after the A/B (PZ_K selects, e.g. "pair_zero and bfloat16")
    TAIL=12 run_step "pair zero GPU tests" ${PZ_TEST_S:-240} $PYT tests/test_tilelang_bwd_whole.py -k "${PZ_K:-pair_zero}" ;;
  pzab)
    # the A/B alone (pzab): worth its GPU tests only if the in-kernel zeroing is not slower than the memset
    # (PZ_VARIANTS replaces the list; session 31's store form was removed in session 33: wrong and slower)
    TAIL=30 run_step "pair zero graph A/B fwdbwd" ${PZ_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --graph --out $OUT/sweep_pair_zero_graph_fwdbwd.json \
        --rows ${PZ_ROWS:-16/32:1x32768,8/16:1x32768,16/32:4x8192,8/32:1x32768,16/32:2x16384} \
        "--variants=${PZ_VARIANTS:--;FLASHQLA_TILELANG_GVA_ZERO=kernel}" ;;
  s37)
    # session 37's training forward on X and beta (FLASHQLA_TILELANG_TRAIN_XBETA) in a fwd+bwd graph A/B (S37_ROWS; the
    # cluster pair zeroing it also took was removed in session 38: +0.22 ms), then its GPU tests (xbetatests; session 30's
    # global-flag zeroing is S37_VARIANTS=...;FLASHQLA_TILELANG_GVA_ZERO=kernel)
    TAIL=40 run_step "session 37 graph A/B fwdbwd" ${S37_SWEEP_S:-300} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --graph --out $OUT/sweep_s37_graph_fwdbwd.json \
        --rows ${S37_ROWS:-16/32:1x32768,16/32:2x16384} \
        "--variants=${S37_VARIANTS:-FLASHQLA_TILELANG_TRAIN_XBETA=0;FLASHQLA_TILELANG_TRAIN_XBETA=1}" ;&
  xbetatests)
    # the GPU tests of FLASHQLA_TILELANG_TRAIN_XBETA=1 (bf16 and f16, unsplit and over 2-chunk segments; XB_K
    # selects), before it becomes the default: s37's, or alone (session 37's s37 call ran out of time in them)
    TAIL=30 run_step "x_beta GPU tests" ${XB_TEST_S:-200} $PYT tests/test_tilelang_bwd_whole.py -k "${XB_K:-xbeta}" ;;
  xbetaon)
    # after xbetatests: the steps after this one run with FLASHQLA_TILELANG_TRAIN_XBETA=1 where those tests passed
    if [ "${RUN_RC:-1}" = 0 ]; then export FLASHQLA_TILELANG_TRAIN_XBETA=1; echo "== TRAIN_XBETA=1 from here on"
    else echo "== the x_beta tests did not pass (exit ${RUN_RC:-none}): TRAIN_XBETA stays off"; fi ;;
  halolight)
    # FLASHQLA_TILELANG_HALO_STEP=light (session 34): the whole-V backward's halo chunks run only the chain's dS
    # (chain and part of the value role; the key role waits), ~4 halo chunks a segment at 16/32 1x32768.  The
    # fwd+bwd CUDA-graph A/B first (HL_ROWS), then its GPU tests (bitwise vs whole steps on NaN-poisoned memory,
    # halos of every kind, 20 runs, the segment suite's oracle cases; HL_K selects)
    TAIL=30 run_step "light halo graph A/B fwdbwd" ${HL_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --graph --out $OUT/sweep_light_halo_graph_fwdbwd.json \
        --rows ${HL_ROWS:-16/32:1x32768,8/16:1x32768,4/16:1x32768,16/32:2x16384} \
        "--variants=${HL_VARIANTS:--;FLASHQLA_TILELANG_HALO_STEP=light}" ;&
  hltests)
    TAIL=12 run_step "light halo GPU tests" ${HL_TEST_S:-240} $PYT tests/test_tilelang_bwd_whole.py -k "${HL_K:-light_halo}" ;;
  trainbv)
    # the fused training forward's V-block (session 25): at 16/32 1x32768 its walk takes 0.661 ms against the inference
    # walk's 0.407 (H100), the state / v_new saves on the chain's cycle; at BV 128 the walk has one S buffer (nb = 1),
    # at BV 64 two, so a save has a chunk to drain.  fwd+bwd kernel times with the V-block forced (TB_ROWS)
    TAIL=30 run_step "training forward V-block A/B" ${TB_S:-150} python benchmarks/sweep_variants.py --backend tilelang \
        --mode fwdbwd --out $OUT/sweep_train_bv.json --rows ${TB_ROWS:-16/32:1x32768,32/32:1x32768,8/16:1x32768} \
        "--variants=-;FLASHQLA_TILELANG_BV=64;FLASHQLA_TILELANG_BV=32" ;;
  intracompact)
    # FLASHQLA_TILELANG_INTRA_COMPACT=1 (session 20): stage 1's Tb forms with XOR-swizzled unpadded A / X tiles, A over
    # the k tile (33 KB of shared memory instead of 53: five CTAs per SM instead of four).  Its GPU test, then the A/B
    # on the forward (#8's forward rows: 16/32 1x32768 at 1.02x FlashQLA, stage 1 0.23 of the 0.62 ms at 4x8192) and
    # on fwd+bwd (the fused training forward's Tb and X form)
    TAIL=8 run_step "compact stage 1, GPU tests" ${IC_TEST_S:-200} $PYT tests/test_backend_tilelang.py \
        -k "intra_compact"
    case $RUN_RC in 0) ;; *) echo "== intracompact: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=20 run_step "stage 1 compact A/B" ${IC_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend tilelang --mode ${IC_MODE:-fwd} --out $OUT/sweep_intra_compact.json \
        --rows ${IC_ROWS:-16/32:4x8192,16/32:1x32768,32/32:1x32768,2/8:1x32768,16/32:8x1024} \
        "--variants=FLASHQLA_TILELANG_INTRA_COMPACT=0;FLASHQLA_TILELANG_INTRA_COMPACT=1" ;;
  trainfusedall)
    # FLASHQLA_TILELANG_TRAIN_FUSED=all (session 20): the fused training forward over segments, whose v_new saves
    # moved to the output warpgroup (they spilled and serialised every wgmma under the chain's halo branch; session
    # 19 run 3 measured that walk at 0.75 against 0.52 ms at 16/32 1x32768).  Its GPU test, then the fwd+bwd A/B on
    # the rows whose forward splits (#8: 16/32 32k in one sequence is the backward grid's lowest row)
    TAIL=8 run_step "fused training forward over segments, GPU tests" ${TFA_TEST_S:-200} $PYT \
        tests/test_tilelang_segments.py -k "fused_training_forward_over_segments"
    case $RUN_RC in 0) ;; *) echo "== trainfusedall: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=20 run_step "fwd+bwd, TRAIN_FUSED 1 / all" ${TFA_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --out $OUT/sweep_fwdbwd_train_fused_all.json \
        --rows ${TFA_ROWS:-16/32:1x32768,8/16:1x32768,2/4:1x32768,16/32:28672+4096} \
        "--variants=FLASHQLA_TILELANG_TRAIN_FUSED=1;FLASHQLA_TILELANG_TRAIN_FUSED=all" ;;
  newswitches)
    # One call for what sessions 20-21 wrote without a GPU (each switch also has its own step): their GPU tests in one
    # process, then the A/B sweeps.  Each switch's kernels are in the carried kcache (precompiled on the CPU in
    # session 21), so the steps should not spend minutes in JIT.  A failing test skips its switch in the sweeps.
    TAIL=14 run_step "new switches, GPU tests" ${NS_TEST_S:-240} $PYT tests/test_backend_tilelang.py \
        tests/test_tilelang_segments.py tests/test_tilelang_bwd_whole.py \
        -k "intra_compact or fused_training_forward_over_segments or gva_pair"
    NS_FWD="FLASHQLA_TILELANG_INTRA_COMPACT=0;FLASHQLA_TILELANG_INTRA_COMPACT=1"
    NS_BWD="-;FLASHQLA_TILELANG_TRAIN_FUSED=all;FLASHQLA_TILELANG_GVA=pair;FLASHQLA_TILELANG_TRAIN_FUSED=all FLASHQLA_TILELANG_GVA=pair;FLASHQLA_TILELANG_TRAIN_FUSED=all FLASHQLA_TILELANG_GVA=pair FLASHQLA_TILELANG_INTRA_COMPACT=1"
    case $RUN_RC in 0) ;; *) echo "== newswitches: a test failed (see the log); sweeping anyway, read the diffs"; ;; esac
    TAIL=16 run_step "fwd A/B, compact stage 1" ${NS_FWD_S:-150} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwd --out $OUT/sweep_fwd_new_switches.json \
        --rows ${NS_FWD_ROWS:-8/32:1x32768,16/32:1x32768,32/32:1x32768,16/32:4x8192,2/8:1x32768} "--variants=$NS_FWD"
    TAIL=30 run_step "fwd+bwd A/B, new switches" ${NS_BWD_S:-240} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --out $OUT/sweep_fwdbwd_new_switches.json \
        --rows ${NS_BWD_ROWS:-16/32:1x32768,16/32:4x8192,8/16:1x32768,2/4:1x32768} "--variants=$NS_BWD" ;;
  gvapair)
    # FLASHQLA_TILELANG_GVA=pair (session 21): the whole-V backward adds each value head's dq / dk rows into its GVA
    # pair's row (red.global.add.noftz.bf16x2 into zeroed outputs) instead of the separate sum kernel, 0.19 ms of
    # 2.92 at 16/32 1x32768 (#8's lowest backward row).  Its GPU tests (oracle, against the host sum, 20 runs
    # bitwise), then the fwd+bwd A/B; both kernels of the A/B must compile (~40 s each on a cold kcache)
    TAIL=8 run_step "GVA pair sum, GPU tests" ${GVP_TEST_S:-240} $PYT tests/test_tilelang_bwd_whole.py -k "gva_pair"
    case $RUN_RC in 0) ;; *) echo "== gvapair: tests did not pass; the sweep skipped"; continue ;; esac
    TAIL=20 run_step "fwd+bwd, GVA host / pair" ${GVP_SWEEP_S:-200} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --out $OUT/sweep_fwdbwd_gva_pair.json \
        --rows ${GVP_ROWS:-16/32:1x32768,16/32:4x8192,8/16:1x32768,2/4:1x32768} \
        "--variants=FLASHQLA_TILELANG_GVA=host;FLASHQLA_TILELANG_GVA=pair"
    # (the split backward's dqk / wy kernels with the pair sum: the path of calls with the fused L2 norm)
    TAIL=12 run_step "fwd+bwd split backward, GVA host / pair" ${GVP_SWEEP_S:-120} python benchmarks/sweep_variants.py \
        --backend tilelang --mode fwdbwd --out $OUT/sweep_fwdbwd_gva_pair_ws.json --rows ${GVP_WS_ROWS:-16/32:4x8192} \
        "--variants=FLASHQLA_TILELANG_BWD=ws FLASHQLA_TILELANG_GVA=host;FLASHQLA_TILELANG_BWD=ws FLASHQLA_TILELANG_GVA=pair" ;;
  tritonseg)
    # the triton forward walk in segments with a halo (session 17, serial.seg, off by default) and the state-gradient
    # walk's (session 18, serial.bseg): their tests on the GPU, then the A/B against the plain walks, inference and
    # training (#8 item 3)
    TAIL=6 run_step "triton segment tests" ${TSEG_TEST_S:-200} $PYT tests/test_backend_triton.py -k segments_with_halo
    case $RUN_RC in 0) ;; *) echo "== tritonseg: tests did not pass; the sweep skipped"; continue ;; esac
    for m in fwd fwdbwd; do
      TAIL=12 run_step "triton $m, serial.seg off / auto / 32" ${TSEG_SWEEP_S:-150} python benchmarks/sweep_variants.py \
          --backend triton --mode $m --out $OUT/sweep_triton_seg_$m.json \
          --rows ${TSEG_ROWS:-2/8:1x32768,16/32:1x32768,16/32:28672+4096} \
          "--variants=FLASHQLA_TRITON_TUNE=serial.seg=0;FLASHQLA_TRITON_TUNE=serial.seg=-1;FLASHQLA_TRITON_TUNE=serial.seg=32"
    done
    TAIL=12 run_step "triton fwdbwd, serial.bseg off / auto / 32" ${TSEG_SWEEP_S:-150} python benchmarks/sweep_variants.py \
        --backend triton --mode fwdbwd --out $OUT/sweep_triton_bseg_fwdbwd.json \
        --rows ${TSEG_ROWS:-2/8:1x32768,16/32:1x32768,16/32:28672+4096} \
        "--variants=FLASHQLA_TRITON_TUNE=serial.seg=-1,serial.bseg=0;FLASHQLA_TRITON_TUNE=serial.seg=-1,serial.bseg=-1;FLASHQLA_TRITON_TUNE=serial.seg=-1,serial.bseg=32" ;;
  bwdtrace)
    # the whole backward's role timeline (clock64 stamps of CTA 0; its traced kernel precompiled in the carried
    # kcache), then the tilelang backward / determinism GPU tests of the default path (#4)
    TAIL=60 run_step "whole backward trace" ${BWDT_S:-120} python benchmarks/trace_bwd_fused.py \
        --rows ${BWDT_ROWS:-16/32:4x8192,16/32:1x32768} --out $OUT/trace_bwd_fused.json
    # (BWDT_TESTS=0 skips them: a fresh kcache without every test variant would spend the step on JIT)
    [ "${BWDT_TESTS:-1}" = 0 ] && continue
    TAIL=4 run_step "tilelang backward GPU tests" 150 $PYT tests/test_backend_tilelang.py \
        tests/test_reliability.py tests/test_tilelang_bwd_whole.py -k "backward or (deterministic and tilelang)" ;;
  bwdcp)
    # the existing op-level exact CP on the backward's single-sequence 32k rows, captured in a CUDA graph (fixed
    # structure) and eager with windows: does splitting the latency-bound state-gradient walk pay at few
    # walks (4/8 1x32k: bwd_state_ws 1.67 of 3.58 ms, session 10 run 3)?  (#4, #8)
    TAIL=22 run_step "flashqla-bwd 1-sequence rows with CP" ${BWDCP_S:-240} python -m flashqla bench \
        --preset flashqla-bwd --no-progress --filter "${BWDCP_FILTER:-32k in 1 }" \
        --backends ${BWDCP_BACKENDS:-tilelang,tilelang@cp4,tilelang@cp8,tilelang@cpw8} --baselines flashqla \
        --out $OUT/bwdcp ;;
  gvasum)
    # the Triton GVA-sum kernel (backends/gva.py) on the GPU: bitwise against the torch forms, and their times
    # (then make it the default in backends/gva.py if it is bitwise equal and faster)
    TAIL=12 run_step "GVA sum kernel" 60 python benchmarks/check_gva_sum.py --out $OUT/gva_sum.json ;;
  memfwd)
    TAIL=40 run_step "memory fwd" ${MEMFWD_S:-250} python benchmarks/bench_memory.py --modes fwd \
        --backends ${MEM_BACKENDS:-triton,tilelang} ${MEMFWD_FILTER:+--filter "$MEMFWD_FILTER"} --out $OUT/memfwd ;;
  membwd)
    # (session 9: the 2/8 rows took 131 s with their compiles, then a FlashQLA variant the warm-up had not listed
    # compiled for minutes at 4/16; MEM_FILTER, e.g. "4/16", measures a part)
    TAIL=40 run_step "memory fwdbwd" ${MEMBWD_S:-300} python benchmarks/bench_memory.py --modes fwdbwd \
        --backends ${MEM_BACKENDS:-triton,tilelang} ${MEM_FILTER:+--filter "$MEM_FILTER"} --out $OUT/membwd ;;
  ncu)
    for row in 16/32:4x8192 2/8:1x32768; do
      TAIL=60 run_step "ncu $row" 200 ncu --clock-control none -k regex:gdn_fwd_recurrent_ws --launch-skip 2 \
          --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
          --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
          python benchmarks/profile_kernels.py --impls tilelang --rows $row --modes fwd --iters 3
    done
    save_kcache ;;
  ncubwd)
    # the whole-V fused backward under Nsight Compute at 16/32 4x8192 (one launch): pipe use, issue slots, warp
    # stall reasons, shared-memory bank conflicts and the source counters' hottest SASS, to see where its ~45 K
    # cycles per step go when its GEMMs need ~6 K (#4)
    TAIL=${NCUBWD_TAIL:-140} run_step "ncu whole backward" ${NCUBWD_S:-200} env FLASHQLA_TILELANG_BWD=whole ncu \
        --clock-control none -k regex:gdn_bwd_whole --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SourceCounters \
        python benchmarks/run_fwdbwd.py --row ${NCUBWD_ROW:-16/32:4x8192} --iters 2 ;;
  ncusrc)
    # the whole-V fused backward's stall samples per SASS instruction (session 16): the report and its source page
    # as CSV, summed per role with the hottest instructions by benchmarks/ncu_lines.py (the CUDA-line view stays
    # empty: TileLang compiles from a temporary file that ncu cannot open afterwards)
    TAIL=20 run_step "ncu whole backward, source counters" ${NCUSRC_S:-200} env FLASHQLA_TILELANG_BWD=whole ncu \
        --clock-control none -k regex:gdn_bwd_whole --launch-skip 1 --launch-count 1 --section SourceCounters \
        --section WarpStateStats --section SchedulerStats --import-source yes -f -o $OUT/ncu_whole \
        python benchmarks/run_fwdbwd.py --row ${NCUBWD_ROW:-16/32:4x8192} --iters 2
    ncu -i $OUT/ncu_whole.ncu-rep --page source --csv --print-source sass > $OUT/ncu_whole_sass.csv 2> $OUT/logs/ncu_sass.err
    ls -la $OUT/ncu_whole*
    TAIL=60 run_step "hottest instructions" 60 python benchmarks/ncu_lines.py $OUT/ncu_whole_sass.csv ;;
  ncuintra)
    # the fused forward's stage 1 (0.225 ms of the 0.648 at 16/32 1x32768 on the H200, over three times its
    # bandwidth floor): stall reasons, pipes, bank conflicts and the hottest SASS (session 25: before rewriting it, #8)
    TAIL=${NCUI_TAIL:-120} run_step "ncu stage 1 (Tb only)" ${NCUI_S:-200} ncu --clock-control none \
        -k regex:gdn_fwd_intra_tb --launch-skip 2 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section InstructionStats --section SourceCounters \
        --import-source yes -f -o $OUT/ncu_intra \
        python benchmarks/profile_kernels.py --impls tilelang --rows ${NCUI_ROW:-16/32:1x32768} --modes fwd --iters 3
    ncu -i $OUT/ncu_intra.ncu-rep --page details > $OUT/ncu_intra_details.txt 2> $OUT/logs/ncu_intra_details.err
    head -c 20000 $OUT/ncu_intra_details.txt
    ncu -i $OUT/ncu_intra.ncu-rep --page source --csv --print-source sass > $OUT/ncu_intra_sass.csv \
        2> $OUT/logs/ncu_intra_sass.err
    TAIL=50 run_step "stage 1 hottest instructions" 60 python benchmarks/ncu_lines.py $OUT/ncu_intra_sass.csv ;;
  cpw)
    # windowed exact CP (session 7, not measured yet): the CP GPU tests, then the rows where FlashQLA runs its
    # CP (one long sequence), plain tilelang against tilelang with windowed CP, both against FlashQLA (#8, #4)
    TAIL=8 run_step "CP GPU tests" 200 $PYT tests/test_cp.py -k "windows or window_count or bench_style"
    # (session 8: automatic CP is declined on tilelang, so forced counts: @cpwN eager with windows, @cp8 the
    # fixed structure in a CUDA graph, whose capture failed in s8 run 3 before a plan's first call ran it)
    TAIL=40 run_step "CP rows: plain, windowed CP, FlashQLA" 330 python -m flashqla bench --preset qwen35-fwd \
        --no-progress --filter "${CPW_FILTER:-1x32768|28672+4096|1x8192}" \
        --backends ${CPW_BACKENDS:-tilelang,tilelang@cpw8,tilelang@cpw16,tilelang@cp8} --baselines flashqla --out $OUT/cpw
    # slowly decaying gates (x 0.01): no window is negligible, CP runs its fixed structure (the honest worst case)
    TAIL=8 run_step "CP rows, slow gates" 120 python -m flashqla bench --preset qwen35-fwd --no-progress \
        --filter "2/8 1x32768|16/32 1x32768" --g-scale 0.01 --backends tilelang,tilelang@cpw8 \
        --baselines flashqla --out $OUT/cpw_slow
    # triton: its automatic CP is declined (the fixed structure measured slower, session 4); with windows?
    TAIL=8 run_step "triton CP rows with windows" 120 python -m flashqla bench --preset qwen35-fwd --no-progress \
        --filter "2/8 1x32768|8/32 1x32768" --backends triton,triton@cpw8 --baselines fla --out $OUT/cpw_triton ;;
  intraorder)
    # stage 1 launched head-major (the value heads of one chunk together: k tiles shared in L2 by the GVA
    # heads), session 7, not measured yet; tests first (#4)
    TAIL=6 run_step "head-major stage 1 GPU tests" 150 $PYT tests/test_backend_tilelang.py -k head_major
    TAIL=20 run_step "stage 1 grid order sweep" 150 python benchmarks/sweep_variants.py --backend tilelang \
        --mode fwd --rows 16/64:4x8192,16/32:4x8192,16/64:1x32768,8/32:8x1024,2/8:1x32768 \
        --out $OUT/sweep_intra_order.json --variants "default;FLASHQLA_TILELANG_INTRA_ORDER=head" ;;
  bwdbench)
    # the backward grid (#4: FlashQLA's, 16/32 .. 2/4 x 8k/32k x 1..8 random sequences): tilelang against FlashQLA
    # (BWD_BACKENDS adds others, e.g. tilelang@cpw8).  FlashQLA's backward kernels compile on first use, and the
    # preset's random splits pick variants the qwen35-bwd rows do not: warm exactly its rows first.
    # BWD_FILTER picks rows; BWD_BASELINES=flashqla,fla adds FLA's Triton (#4 item 5 asks for both ratios).
    # BWD_SEQS (e.g. 32768 for the "32k in 1 " rows) warms those rows only instead of the whole preset.
    TAIL=10 run_step "flashqla bwd warm-up" ${BWDWARM_S:-300} python benchmarks/warm_flashqla_cache.py \
        --cache-dir "$TILELANG_CACHE_DIR" --jobs 16 --heads ${BWD_HEADS:-$FLQ_BWD_GRID_HEADS} --seqs none \
        ${BWD_SEQS:+--with-backward --bwd-seqs "$BWD_SEQS"} ${BWD_SEQS:---bwd-preset flashqla-bwd} --no-xz
    save_kcache
    TAIL=45 run_step "flashqla-bwd grid against FlashQLA" 420 python -m flashqla bench \
        --preset flashqla-bwd --no-progress --filter "${BWD_FILTER:- in }" --backends ${BWD_BACKENDS:-tilelang} \
        --baselines ${BWD_BASELINES:-flashqla} ${BENCH_ARGS:-} --out $OUT/bwd ;;
  det)
    # #4 item 4 under the current defaults: 100 forward + backward runs bitwise equal, packed short sequences and
    # one long sequence that the automatic plans split into segments (DET_K picks backends)
    TAIL=12 run_step "100-run determinism" ${DET_S:-200} $PYT tests/test_reliability.py \
        -k "bitwise_deterministic and (${DET_K:-tilelang})" ;;
  save) save_kcache ;;
  *) echo "unknown step $STEP (gpusuite | gpusuite2 | tritonshared | sweeporder | cpw | intraorder | bwdbench | det | bwdcheck | bwdtrace | bwdex2 | ncubwd | ncusrc | bwdcp | tritongrid | flqfwdgrid | cutlasshostile | tritontests | gvasum | fused | fusedquick | ncuintra | firstcall | profile | hostprof | eagerbench | cpgraph | sweep | sweepbwd | tchain | trace | flashqla | trainfused | trainfusedall | intrainv | intrapersist | persistwalk | trainbv | intracompact | gvapair | newswitches | halostream | tlshort | fewwaves | astore | h0split | flqgridwarm | cutlassaot | cutlassseg | cutlassws | cutlassprep | cutlassgrid | cutlassshared | cutlass | memory | accept8fwd | accept8bwd | pairzero | pzab | pztests | halolight | hltests | dsmem | s37 | bwdtests | memwarm | memfwd | membwd | ncu | save)"; exit 2 ;;
esac
done
pack_results
