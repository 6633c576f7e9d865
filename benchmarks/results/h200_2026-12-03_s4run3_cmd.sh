#!/usr/bin/env bash
# Session 4, device run 3: the tilelang decode kernel with its [K, V] mapping rewritten (lanes along V),
# both pool layouts against triton and FLA fused_recurrent; the chunk op's VK state option on CUDA.
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
PYT="python -m pytest -q -p no:cacheprovider -m gpu -rfE --tb=line"
TAIL=12 run_step "decode GPU tests" 120 $PYT tests/test_decode.py
TAIL=16 run_step "decode bench" 200 python -m flashqla bench --preset decode --out $OUT/decode \
    --backends "triton,tilelang,triton[layout=VK],tilelang[layout=VK]"
TAIL=8 run_step "state layout GPU test" 60 $PYT tests/test_state_layout.py
# the compile caches: tilelang (carried next time) and triton (kept apart: it outgrows the return limit)
tar cf - -C /tmp/kcache --exclude=.restored --exclude=./triton . | xz -T16 -6 > $OUT/kcache.tar.xz
ls -la $OUT/kcache.tar.xz
echo "total $(( $(date +%s) - START ))s"
