#!/usr/bin/env bash
# Device run 6 (2026-12-02): double-buffered ws forward, new intra kernel, reworked triton backend.
# carry: [".gpu"] (tilelang + peers bundles, kcache.tar.gz); run from the repository root.
source .gpu/setup.sh
export PYTHONPATH=$PWD:$PYTHONPATH
T="timeout -s INT -k 10"
tl=tests/test_backend_tilelang.py
echo "== tilelang tests, V-block by the call-time rule"
$T 150 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "forward_matches_oracle or backward_matches_oracle or recompile or 1e4" 2>&1 | grep -v INFO | tail -25
echo "== tilelang tests, BV=128"
FLASHQLA_TILELANG_BV=128 $T 50 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "forward_matches_oracle and (dense_h0_ht or varlen_l2norm or gva_16_64)" 2>&1 | tail -4
echo "== triton check"
$T 100 python benchmarks/check_triton_gpu.py 2>&1 | grep -v INFO | tail -45
echo "== bench fwd"
$T 150 python -m flashqla bench --preset qwen35-fwd --filter 16/32 --backends tilelang,triton --baselines fla,flashqla --out $OUT/bench --no-plot --no-progress 2>&1 | grep -v INFO | tail -12
echo "== bench fwd+bwd"
$T 110 python -m flashqla bench --preset qwen35-bwd --filter 16/32 --backends tilelang --baselines fla,flashqla --out $OUT/bench --no-plot --no-progress 2>&1 | grep -v INFO | tail -10
tar czf $OUT/kcache_tilelang.tar.gz -C /tmp/kcache tilelang; ls -la $OUT $OUT/bench
