#!/usr/bin/env bash
# Rebuild the carried TileLang compile cache on the CPU machine (no GPU needed) and pack it as
# .gpu/kcache.tar.xz, which benchmarks/device_lib.sh restores on the device.  The cache is git-ignored and a new
# checkout starts without it; a device run without it spends 10-30 s per kernel variant on JIT.
#
#   bash benchmarks/rebuild_kcache.sh            # bench variants first, then the whole backward, then the rest
#   KC=/tmp/kc QUICK=1 bash benchmarks/rebuild_kcache.sh   # only what the benchmarks and the backward trace need
#   KC=/tmp/kc PACK_ONLY=1 bash benchmarks/rebuild_kcache.sh   # pack $KC as it is (e.g. a device run's returned
#                                                            # kcache.tar.xz unpacked there, or a precompile's output)
#
# Packed with xz -9e: its 64 MiB dictionary spans many entries, whose executable.so files share most of their
# bytes (session 21: 582 entries 11.0 MB, against 19.9 MB with -6's 8 MiB dictionary; 86 s on two cores).  The
# device's save_kcache keeps -6 (fast on 16 cores, where -9e would not split into parallel blocks): repack what
# comes back here before carrying it (.gpu is under the 64 MiB a call carries only with the tree beside it).
#
# Session 15, 2 cores: the whole backward's 8 variants ~4 min + its traced variant 30 s; session 12: the 23 bench
# variants (bf16, no h0, no L2 norm) 107 s, all fwd/bwd variants ~12 min; packed ~12 MB with FlashQLA's kernels.
# FlashQLA's own kernels are not rebuilt here (their keys differ between this machine and the H200, see
# benchmarks/README.md "Warming FlashQLA's cache"): a device run's `memwarm` / `flqwarm` step builds them
# (49 in 75 s with 16 jobs) and its `save` step returns them; unpack that kcache.tar.xz into $KC before packing.
set -euo pipefail
cd "$(dirname "$0")/.."
KC=${KC:-/tmp/kc}
JOBS=${JOBS:-2}
mkdir -p "$KC/tilelang" .gpu
export TILELANG_CACHE_DIR=$KC/tilelang
pre() { python -m flashqla precompile --cache-dir "$KC/tilelang" --jobs "$JOBS" "$@"; }
if [ "${PACK_ONLY:-0}" != 1 ]; then
pre --dtypes bfloat16 --beta-dtypes bfloat16 --flags h0=0,l2norm=0 --modes fwd,bwd
for dt in bfloat16 float16; do
  FLASHQLA_TILELANG_BWD=whole pre --modes bwd --flags l2norm=0 --kernels bwd_whole --dtypes $dt --beta-dtypes $dt
  # the ex2.approx experiment (next_device_run.sh bwdex2)
  FLASHQLA_TILELANG_EX2=approx FLASHQLA_TILELANG_BWD=whole pre --modes bwd --flags l2norm=0 \
      --kernels bwd_whole --dtypes $dt --beta-dtypes $dt
done
FLASHQLA_TILELANG_EX2=approx pre --modes fwd --dtypes bfloat16 --beta-dtypes bfloat16 --flags h0=0,l2norm=0,grad=0 \
    --kernels fwd_intra_tb,fwd_recurrent_ws
# the X-and-beta training forward (FLASHQLA_TILELANG_TRAIN_XBETA=1, off until its GPU test has run: xbetatests);
# the other forward keys this records are the defaults' and already built above
FLASHQLA_TILELANG_TRAIN_XBETA=1 pre --modes fwd --flags l2norm=0 --kernels fwd_intra_tb,fwd_recurrent_ws
python - <<'PY'
# the traced whole backward (benchmarks/trace_bwd_fused.py), built the way ops.bwd_whole_kernel builds it
from flashqla.backends.tilelang._compile import get_kernel
from flashqla.backends.tilelang.chunk_bwd_whole_sm90 import build_bwd_whole
get_kernel("bwd_whole_sm90", build_bwd_whole, ("bfloat16", "bfloat16", 128, 128, False, False, True))
PY
[ "${QUICK:-0}" = 1 ] || pre --modes fwd,bwd
fi
# (FLA's autotuning results under triton/ are kept, the rest of Triton's cache is not: device_lib.sh save_kcache)
( cd "$KC" && { find . -mindepth 1 -maxdepth 1 ! -name .restored ! -name triton -print0
                [ -d triton ] && find triton -name '*.autotune.json' -print0; } \
    | tar cf - --exclude='*/cuda-binaries' --exclude='./tilelang/0.1.15/.staging' --null -T - ) \
    | xz -T"$JOBS" -9e > .gpu/kcache.tar.xz.new
mv .gpu/kcache.tar.xz.new .gpu/kcache.tar.xz
ls -la .gpu/kcache.tar.xz
