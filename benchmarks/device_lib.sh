# Helpers for the device-run scripts (source it from the repository root on the device machine):
#   source benchmarks/device_lib.sh      # sets START/DEADLINE from BUDGET_S (default 560 s), restores the
#                                        # carried compile cache, sources .gpu/setup.sh
#   run_step NAME WANT CMD...            # CMD under min(WANT, time left - 40 s); log in $OUT/logs/NAME.log,
#                                        # its last $TAIL lines (default 25) printed
#   save_kcache                          # the TileLang/flashqla cache as $OUT/kcache.tar.xz (triton's left
#                                        # out: it outgrows the return limit); carry it as .gpu/kcache.tar.xz
# Every step gets a timeout from what is left, so the cache is always packed before the 10-minute limit.
START=$(date +%s); BUDGET_S=${BUDGET_S:-560}; DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
mkdir -p "$OUT/logs" /tmp/kcache
run_step() {
  local name=$1 want=$2; shift 2
  local t=$(( $(left) - 40 )); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -lt 15 ]; then echo "== $name: SKIPPED (no time left)"; return; fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START ))s elapsed)"
  local log=$OUT/logs/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-40).log
  timeout -s INT -k 5 "$t" "$@" > "$log" 2>&1
  echo "exit $?"
  grep -v "TileLang:tilelang.jit.kernel:INFO" "$log" | tail -${TAIL:-25}
}
save_kcache() {
  tar cf - -C /tmp/kcache --exclude=.restored --exclude=./triton . | xz -T16 -6 > "$OUT/kcache.tar.xz"
  ls -la "$OUT/kcache.tar.xz"
  echo "total $(( $(date +%s) - START ))s"
}
if [ -f .gpu/kcache.tar.xz ] && [ ! -f /tmp/kcache/.restored ]; then
  tar xJf .gpu/kcache.tar.xz -C /tmp/kcache && touch /tmp/kcache/.restored
fi
# whichever bundles this call carried (.gpu: tilelang + peers; .gpu_cute: the CuTe DSL)
for _d in .gpu .gpu_cute; do [ -f "$_d/setup.sh" ] && source "$_d/setup.sh"; done
export PYTHONPATH=$PWD:${PYTHONPATH:-}
