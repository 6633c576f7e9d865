#!/usr/bin/env bash
# The first device run of the next session, prepared at the end of session 2 (nothing here has run yet).
# carry: [".gpu"] (tilelang + peers + kcache; precompile the WS_OPTS variants first, see below), after a
# stacked `.gpu_cute` call if cutlass should be in the benches.  Run from the repository root.
#
# Precompile on the CPU machine first (bf16 bench flags), for each option set:
#   FLASHQLA_TILELANG_WS_OPTS=fastexp python -m flashqla precompile --dtypes bfloat16 --beta-dtypes bfloat16 \
#       --flags h0=0,l2norm=0,dht=0,varlen=1 --kernels fwd_recurrent_ws --modes fwd
#   (and psplit, fastexp,psplit), then pack $FLASHQLA_CACHE_DIR/tilelang into .gpu/kcache.tar.gz (tilelang/...).
source .gpu/setup.sh
export PYTHONPATH=$PWD:$PYTHONPATH
T="timeout -s INT -k 5"
echo "== A/B of the ws forward options (per-kernel ms)"
for opts in "" fastexp psplit fastexp,psplit; do
  FLASHQLA_TILELANG_WS_OPTS=$opts $T 40 python benchmarks/profile_kernels.py --impls tilelang \
      --rows 16/32:1x32768,16/32:4x8192,16/32:8x1024 --modes fwd --iters 3 2>&1 | grep -A1 "^## " | grep -v "^--" | sed "s/^/opts=$opts /"
done
echo "== forward tests with both options"
FLASHQLA_TILELANG_WS_OPTS=fastexp,psplit $T 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backend_tilelang.py -k "forward_matches_oracle or 1e4" 2>&1 | tail -3
echo "== triton GPU suite with the L2 norm up front (default since session 2)"
$T 150 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backend_triton.py 2>&1 | tail -4
echo "== determinism (100 runs per GPU backend)"
$T 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_reliability.py -k deterministic 2>&1 | tail -3
