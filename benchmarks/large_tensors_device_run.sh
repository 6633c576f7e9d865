#!/usr/bin/env bash
# Issue #11 on the H200: tensors past 2^31 elements (tests/test_large_tensors.py, gpu marker) and the
# peak-memory table (benchmarks/bench_memory.py).  carry: [".gpu"].  From the repository root, one step
# per device call (each fits the 10-minute command limit; compilation is most of the time):
#   bash benchmarks/large_tensors_device_run.sh tests        # 9 GPU tests (3 per backend), ~3-6 min
#   bash benchmarks/large_tensors_device_run.sh memory-fwd   # forward grid (25 rows x 5 impls), ~3-6 min
#   bash benchmarks/large_tensors_device_run.sh memory-bwd   # fwd+bwd grid (20 rows x 5 impls), ~3-7 min
# Back on the CPU, one table from the two memory runs:
#   python benchmarks/bench_memory.py --merge RUN1/memory/bench_memory.json RUN2/memory/bench_memory.json \
#       --out benchmarks/results/h200_memory
set -u
STEP=${1:-tests}
START=$(date +%s); BUDGET_S=${BUDGET_S:-570}; DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
mkdir -p $OUT/logs
# run_step NAME WANT CMD...: CMD under a timeout of min(WANT, time left - 30 s); full log in $OUT/logs
run_step() {
  local name=$1 want=$2; shift 2
  local t=$(( $(left) - 30 )); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -lt 15 ]; then echo "== $name: SKIPPED (no time left)"; return; fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START ))s elapsed)"
  local log=$OUT/logs/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-40).log
  timeout -s INT -k 5 "$t" "$@" > "$log" 2>&1
  echo "exit $?"
  grep -v "TileLang:tilelang.jit.kernel:INFO" "$log" | tail -${TAIL:-30}
}
mkdir -p /tmp/kcache
if [ -f .gpu/kcache.tar.xz ] && [ ! -f /tmp/kcache/.restored ]; then
  tar xJf .gpu/kcache.tar.xz -C /tmp/kcache && touch /tmp/kcache/.restored
fi
source .gpu/setup.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
case "$STEP" in
  tests)
    TAIL=40 run_step "large tensor GPU tests" 540 \
      python -m pytest -q -p no:cacheprovider -m gpu -rfEs -s --tb=short tests/test_large_tensors.py ;;
  memory-fwd)
    TAIL=45 run_step "bench_memory fwd" 540 python benchmarks/bench_memory.py --modes fwd --out $OUT/memory ;;
  memory-bwd)
    TAIL=40 run_step "bench_memory fwdbwd" 540 python benchmarks/bench_memory.py --modes fwdbwd --out $OUT/memory ;;
  *) echo "unknown step $STEP (tests | memory-fwd | memory-bwd)"; exit 2 ;;
esac
# the tilelang compile cache (carried next time; triton's is left out: it outgrows the return limit)
tar cf - -C /tmp/kcache --exclude=.restored --exclude=./triton . | xz -T16 -6 > $OUT/kcache.tar.xz
ls -la $OUT/kcache.tar.xz
echo "total $(( $(date +%s) - START ))s"
