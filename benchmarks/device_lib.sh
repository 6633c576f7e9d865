# Helpers for the device-run scripts (source it from the repository root on the device machine):
#   source benchmarks/device_lib.sh      # sets START/DEADLINE from BUDGET_S (default 560 s), restores the
#                                        # carried compile cache, sources .gpu/setup.sh
#   run_step NAME WANT CMD...            # CMD under min(WANT, time left - 40 s); log in $OUT/logs/NAME.log,
#                                        # its last $TAIL lines (default 25) printed
#   save_kcache                          # the TileLang/flashqla cache as $OUT/kcache.tar.xz (triton's and
#                                        # TileLang's cuda-binaries left out); carry it as .gpu/kcache.tar.xz
#   pack_results                         # everything else in $OUT as one results.tar.xz (8 files come back)
# Every step gets a timeout from what is left, so the cache is always packed before the 10-minute limit.
START=$(date +%s); BUDGET_S=${BUDGET_S:-560}; DEADLINE=$((START + BUDGET_S))
left() { echo $((DEADLINE - $(date +%s))); }
KCACHE=${KCACHE:-/tmp/kcache}         # the compile caches (setup.sh points TileLang's and flashqla's here)
KCACHE_SPLIT=${KCACHE_SPLIT:-15M}     # a packed cache above this comes back in parts (16 MiB per file)
mkdir -p "$OUT/logs" "$KCACHE"
run_step() {
  local name=$1 want=$2; shift 2
  local t=$(( $(left) - 40 )); [ "$t" -gt "$want" ] && t=$want
  if [ "$t" -lt 15 ]; then echo "== $name: SKIPPED (no time left)"; RUN_RC=125; return; fi
  echo "== $name (timeout ${t}s, $(( $(date +%s) - START ))s elapsed)"
  local log=$OUT/logs/$(echo "$name" | tr -c 'a-zA-Z0-9\n' '_' | cut -c1-40).log
  timeout -s INT -k 5 "$t" "$@" > "$log" 2>&1
  RUN_RC=$?                             # the step's exit status (124 / 130 / 137: it ran out of time)
  echo "exit $RUN_RC"
  grep -v "TileLang:tilelang.jit.kernel:INFO" "$log" | tail -${TAIL:-25}
}
save_kcache() {
  # files come back at most 16 MiB each (session 9: a 19.7 MiB cache was left out): past 15 MiB the archive
  # comes back in parts, kcache.tar.xz.part-aa, -ab, ...; copy them (or the one file) into .gpu/
  # (TileLang's cuda-binaries, its nvcc-output cache, stays behind: every kernel-cache entry embeds its cubin
  # in executable.so, so a carried entry loads without it; leaving it out took the session-10 cache from
  # 21.9 to 12.6 MB)
  # (Triton's cache stays behind too, except the autotuning results FLA writes there, FLA_CACHE_RESULTS=1: a
  # few KB that spare the next call FLA's autotuning, which cut session 13's first profile step short)
  # (a second save in one call replaces the first: a stale part left beside fewer new ones would corrupt the join)
  rm -f "$OUT"/kcache.tar.xz "$OUT"/kcache.tar.xz.part-*
  ( cd "$KCACHE" && { find . -mindepth 1 -maxdepth 1 ! -name .restored ! -name triton -print0
                      [ -d triton ] && find triton -name '*.autotune.json' -print0; } \
      | tar cf - --exclude='*/cuda-binaries' --null -T - ) | xz -T16 -6 > "$KCACHE.tar.xz"
  if [ "$(stat -c %s "$KCACHE.tar.xz")" -gt "$(numfmt --from=iec "$KCACHE_SPLIT")" ]; then
    split -b "$KCACHE_SPLIT" "$KCACHE.tar.xz" "$OUT/kcache.tar.xz.part-"
  else
    cp "$KCACHE.tar.xz" "$OUT/kcache.tar.xz"
  fi
  ls -la "$OUT"/kcache.tar.xz*
  echo "total $(( $(date +%s) - START ))s"
}
if [ ! -f "$KCACHE/.restored" ]; then
  if ls .gpu/kcache.tar.xz.part-* > /dev/null 2>&1; then
    cat .gpu/kcache.tar.xz.part-* | tar xJf - -C "$KCACHE" && touch "$KCACHE/.restored"
  elif [ -f .gpu/kcache.tar.xz ]; then
    tar xJf .gpu/kcache.tar.xz -C "$KCACHE" && touch "$KCACHE/.restored"
  elif [ -f benchmarks/kcache/kcache.tar.xz ]; then
    # the committed copy (a new checkout has no .gpu/: session 26 started cold and spent run 1 on compiles); a
    # stale entry is only a cache miss, as TileLang keys each kernel by its source
    tar xJf benchmarks/kcache/kcache.tar.xz -C "$KCACHE" && touch "$KCACHE/.restored"
  fi
fi
# FLA's Triton autotuning results on the H200 (benchmarks/fla_autotune_h200, from session 13's runs: 2/8, 4/16, 8/32,
# 16/32 heads, bf16, K = V = 128): without them each new head configuration spends ~60-80 s of device time in FLA's
# autotuner (run 1 of session 13 lost its profile step to it).  FLA looks them up itself (FLA_CACHE_RESULTS=1,
# its default), keyed by triton's version, the target, the kernel source and the tuning key, so a stale entry is
# simply not found.  Refresh with the `save` step, which returns the new ones in kcache.tar.xz (triton/).
if [ -d benchmarks/fla_autotune_h200 ]; then
  mkdir -p "$KCACHE/triton" && cp -rn benchmarks/fla_autotune_h200/. "$KCACHE/triton/"
fi
# whichever bundles this call carried (.gpu: tilelang + peers; .gpu_cute: the CuTe DSL)
for _d in .gpu .gpu_cute; do [ -f "$_d/setup.sh" ] && source "$_d/setup.sh"; done
export PYTHONPATH=$PWD:${PYTHONPATH:-}
pack_results() {
  # at most 8 files come back from $OUT (session 9 lost its logs to that): everything but the compile cache
  # goes back as one results.tar.xz (unpack it here with tar xJf); the originals are removed only once packed
  ( cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name 'kcache.tar.xz*' ! -name results.tar.xz -print0 \
      | tar cJf results.tar.xz --null -T - ) || return
  find "$OUT" -mindepth 1 -maxdepth 1 ! -name 'kcache.tar.xz*' ! -name results.tar.xz -exec rm -rf {} +
  ls -la "$OUT"
}
