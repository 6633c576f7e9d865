#!/usr/bin/env bash
# Session 4, device run 4: decode + prefill in one CUDA graph, torch.compile on the GPU, FLA's own op,
# the CP engine without host syncs (GPU tests + check_cp), tensors past 2^31 elements.
# carry: [".gpu"].  From the repository root:  bash benchmarks/next_device_run.sh
set -u
START=$(date +%s); BUDGET_S=${BUDGET_S:-560}; DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
# run_step NAME WANT CMD...: CMD under a timeout of min(WANT, time left - 40 s); full log in $OUT/logs
mkdir -p $OUT/logs
run_step() {
  local name=$1 want=$2; shift 2
  local t=$(( $(left) - 40 )); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -lt 15 ]; then echo "== $name: SKIPPED (no time left)"; return; fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START ))s elapsed)"
  local log=$OUT/logs/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-40).log
  timeout -s INT -k 5 "$t" "$@" > "$log" 2>&1
  grep -v "TileLang:tilelang.jit.kernel:INFO" "$log" | tail -${TAIL:-25}
}
mkdir -p /tmp/kcache
if [ -f .gpu/kcache.tar.xz ] && [ ! -f /tmp/kcache/.restored ]; then
  tar xJf .gpu/kcache.tar.xz -C /tmp/kcache && touch /tmp/kcache/.restored
fi
source .gpu/setup.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PYT="python -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=short"
TAIL=12 run_step "decode and library GPU tests" 150 $PYT tests/test_decode.py tests/test_library.py tests/test_state_layout.py
TAIL=14 run_step "large tensor GPU tests" 150 $PYT -s tests/test_large_tensors.py -k "not cutlass"
TAIL=12 run_step "CP GPU tests" 100 $PYT tests/test_cp.py
TAIL=40 run_step "check_cp" 200 python benchmarks/check_cp.py --deadline-s 150 --heads 2/8 --out $OUT/cp
tar cf - -C /tmp/kcache --exclude=.restored --exclude=./triton . | xz -T16 -6 > $OUT/kcache.tar.xz
ls -la $OUT/kcache.tar.xz
echo "total $(( $(date +%s) - START ))s"
