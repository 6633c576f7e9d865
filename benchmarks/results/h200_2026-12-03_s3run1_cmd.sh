#!/usr/bin/env bash
# Session 3, device run 1: the ws-forward option A/B, the decode bench and GPU tests, CP on few heads.
# carry: [".gpu"] (tilelang + peers bundles + kcache.tar.xz).  Run from the repository root:
#   bash benchmarks/next_device_run.sh
# The compile cache travels as xz (a third of the gz size; the carry limit is 64 MiB): it is unpacked here
# before setup.sh (which then finds it restored) and packed the same way into $OUT at the end.
set -u
mkdir -p /tmp/kcache
if [ -f .gpu/kcache.tar.xz ] && [ ! -f /tmp/kcache/.restored ]; then
  tar xJf .gpu/kcache.tar.xz -C /tmp/kcache && touch /tmp/kcache/.restored
fi
source .gpu/setup.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
T="timeout -s INT -k 5"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
echo "== A/B of the ws forward options (per-kernel ms)"
for opts in "" fastexp psplit fastexp,psplit; do
  FLASHQLA_TILELANG_WS_OPTS=$opts $T 60 python benchmarks/profile_kernels.py --impls tilelang \
      --rows 16/32:1x32768,16/32:4x8192,16/32:8x1024 --modes fwd --iters 3 2>&1 | grep -A1 "^## " | grep -v "^--" | sed "s/^/opts=$opts /"
done
echo "== forward tests with both options"
FLASHQLA_TILELANG_WS_OPTS=fastexp,psplit $T 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_backend_tilelang.py -k "forward_matches_oracle or 1e4" 2>&1 | tail -3
echo "== decode bench vs FLA fused_recurrent"
$T 150 python -m flashqla bench --preset decode --out $OUT/decode \
    --backends "triton,triton[bv=8,warps=1],triton[bv=16,warps=1],triton[bv=16,warps=2],triton[bv=64,warps=4],triton[bv=128,warps=8]" 2>&1 | tail -16
echo "== decode GPU tests"
$T 90 python -m pytest -m gpu -q -p no:cacheprovider tests/test_decode.py 2>&1 | tail -3
echo "== CP on few heads (2/8): tilelang plain vs forced segments vs the automatic plan"
$T 150 python -m flashqla bench --preset qwen35-fwd --filter "2/8" --no-progress --out $OUT/cp \
    --backends tilelang,tilelang@cp4,tilelang@cp8,tilelang@cp16,tilelang@cp --baselines fla 2>&1 | tail -14
tar cf - -C /tmp/kcache --exclude=.restored . | xz -T16 -6 > $OUT/kcache.tar.xz; ls -la $OUT/kcache.tar.xz
