#!/usr/bin/env bash
# Session 4, device run 2: the tilelang decode kernel (tests + bench vs triton and FLA fused_recurrent),
# the new defaults (ws forward fastexp+psplit, triton decode blocks), the tilelang and triton GPU suites,
# the 100-run determinism test.  carry: [".gpu"].  From the repository root:
#   bash benchmarks/next_device_run.sh
# Steps run in priority order under one deadline (BUDGET_S, default 560 s), each with a timeout from what is
# left, so the compile cache is always packed into $OUT at the end.
set -u
START=$(date +%s); BUDGET_S=${BUDGET_S:-560}; DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
# run_step NAME WANT CMD...: CMD under a timeout of min(WANT, time left - 40 s)
run_step() {
  local name=$1 want=$2; shift 2
  local t=$(( $(left) - 40 )); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -lt 15 ]; then echo "== $name: SKIPPED (no time left)"; return; fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START ))s elapsed)"
  timeout -s INT -k 5 "$t" "$@" 2>&1 | grep -v "TileLang:tilelang.jit.kernel:INFO" | tail -${TAIL:-25}
}
mkdir -p /tmp/kcache
if [ -f .gpu/kcache.tar.xz ] && [ ! -f /tmp/kcache/.restored ]; then
  tar xJf .gpu/kcache.tar.xz -C /tmp/kcache && touch /tmp/kcache/.restored
fi
source .gpu/setup.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
PYT="python -m pytest -q -p no:cacheprovider -m gpu -rfE"
TAIL=40 run_step "decode GPU tests (triton + tilelang)" 120 $PYT tests/test_decode.py
TAIL=16 run_step "decode bench vs FLA fused_recurrent" 150 python -m flashqla bench --preset decode --out $OUT/decode \
    --backends "triton,tilelang"
run_step "tilelang GPU suite (new ws defaults), forward + backward" 150 $PYT tests/test_backend_tilelang.py tests/test_tilelang_bwd_par.py
run_step "determinism, 100 forward+backward runs" 100 $PYT tests/test_reliability.py -k "deterministic and (tilelang or triton)"
run_step "triton GPU suite (L2 separate default)" 200 $PYT -x tests/test_backend_triton.py
tar cf - -C /tmp/kcache --exclude=.restored . | xz -T16 -6 > $OUT/kcache.tar.xz; ls -la $OUT/kcache.tar.xz
echo "total $(( $(date +%s) - START ))s"
