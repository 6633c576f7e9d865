#!/usr/bin/env bash
# Device run 8 (2026-12-02), the session's last: ws forward with early slot release / 3-slot ring,
# forward bench of every backend (cutlass stacked from run 8a), triton crash bisection, backward v2 check.
# carry: [".gpu"]; run 8a just before it unpacked the cutedsl bundle into /tmp/site (same machine).
source .gpu/setup.sh
export PYTHONPATH=$PWD:$PYTHONPATH
T="timeout -s INT -k 5"
tl=tests/test_backend_tilelang.py
python -c "import cutlass" 2>/dev/null && echo "cutlass importable (stacked bundle)" || echo "cutlass NOT importable"
echo "== tilelang tests (ws forward, default layouts)"
$T 60 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "forward_matches_oracle or 1e4" 2>&1 | grep -v INFO | tail -4
echo "== bench fwd (every backend)"
$T 130 python -m flashqla bench --preset qwen35-fwd --filter 16/32 --backends tilelang,cutlass,triton --baselines fla,flashqla --out $OUT/bench --no-plot --no-progress 2>&1 | grep -v INFO | tail -12
echo "== triton crash bisection"
$T 70 python benchmarks/check_triton_gpu.py --bisect-only 2>&1 | grep -v INFO | grep -E "^--|^==|FAIL|BAD|rc=" | head -30
echo "== tilelang backward v2 (tests, then check script)"
FLASHQLA_TILELANG_BWD_PAR=v2 $T 40 python -m pytest -m gpu -q -p no:cacheprovider $tl -k "backward_matches_oracle" 2>&1 | tail -3
$T 45 python benchmarks/check_bwd_par_sm90.py 2>&1 | grep -v INFO | tail -14
echo "== first call with the precompiled cache (fresh process)"
$T 30 python benchmarks/first_call.py --backend tilelang --heads 8/32 2>&1 | grep first_call
echo "== tilelang forward V-block / layout sweep (per-kernel)"
for cfg in "32:" "64:" "128:" "64:3,1"; do bv=${cfg%%:*}; ws=${cfg#*:}; FLASHQLA_TILELANG_BV=$bv FLASHQLA_TILELANG_WS=$ws $T 20 python benchmarks/profile_kernels.py --impls tilelang --rows 16/32:1x32768,16/32:4x8192 --modes fwd --iters 3 2>&1 | grep -A1 "^## " | grep -v "^--" | sed "s/^/bv=$bv ws=$ws /"; done
echo "== bench fwd+bwd"
$T 60 python -m flashqla bench --preset qwen35-bwd --filter 16/32 --max-rows 2 --backends tilelang --baselines fla,flashqla --out $OUT/bench --no-plot --no-progress 2>&1 | grep -v INFO | tail -6
ls $OUT/bench
