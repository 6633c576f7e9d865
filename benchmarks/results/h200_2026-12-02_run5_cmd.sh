#!/usr/bin/env bash
# Device run 5 (2026-12-02): warp-specialised tilelang forward / state-gradient kernels on the H200.
# carry: [".gpu"] (tilelang + peers bundles, kcache.tar.gz); run from the repository root.
source .gpu/setup.sh
export PYTHONPATH=$PWD:$PYTHONPATH
T="timeout -s INT -k 10"
tl=tests/test_backend_tilelang.py
echo "== tests, V-block by the call-time rule"
$T 180 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "forward_matches_oracle or forward_fp16 or 1e4 or recompile or backward_matches_oracle" 2>&1 | grep -v INFO | tail -30
echo "== tests, BV=128"
FLASHQLA_TILELANG_BV=128 $T 70 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "forward_matches_oracle and (dense_h0_ht or varlen_l2norm or gva_16_64)" 2>&1 | tail -4
echo "== tests, BV=64"
FLASHQLA_TILELANG_BV=64 $T 80 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "(forward_matches_oracle and (len1_tail or strong)) or (backward_matches_oracle and (l2norm or strong))" 2>&1 | tail -4
echo "== V-block sweep (per-kernel profile)"
for bv in 32 64 128; do FLASHQLA_TILELANG_BV=$bv $T 60 python benchmarks/profile_kernels.py --impls tilelang --rows 16/32:1x32768,16/32:4x8192,16/32:8x1024 --modes fwd --iters 3 2>&1 | grep -A3 "^## " | sed "s/^/bv=$bv /"; done
echo "== bench"
$T 170 python -m flashqla bench --preset qwen35-fwd --filter 16/32 --backends tilelang --baselines fla,flashqla --out $OUT/bench --no-plot --no-progress 2>&1 | grep -v INFO | tail -14
tar czf $OUT/kcache_tilelang.tar.gz -C /tmp/kcache tilelang; ls -la $OUT
