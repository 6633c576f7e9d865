#!/usr/bin/env bash
# flashqla on the GPU machine: install, info, GPU tests, correctness check, benchmarks, summary.
#
# usage (from the repository root, on the device machine):
#     bash benchmarks/gpu_check.sh [PRESET ...]        # presets: quick qwen35-fwd qwen35-bwd flashqla-fwd flashqla-bwd
#                                                      # default: quick
# environment:
#     OUT            where results go (set on the device machine; default ./gpu_out)
#     BUDGET_S       seconds this script may take in all (default 560: a device command is killed at 600);
#                    every step gets a timeout from what is left, so the packing at the end always happens
#     BENCH_ARGS     extra arguments for every `flashqla bench` (e.g. "--backends triton --baselines fla")
#     TESTS          gpu (default: `pytest -m gpu`, then the rest of the suite if time allows) | all | none
#     CHECK          1 (default) runs `python -m flashqla check --device cuda $CHECK_ARGS`; 0 skips it
#     PYTHON         default python3
#     SAVE_CACHES=1  also return the compiled-kernel caches as $OUT/kcache.tar.gz (gpu_save_caches of .gpu/setup.sh)
#     SKIP_INSTALL=1 use the source tree as it is (no pip install)
#
# examples:
#     bash benchmarks/gpu_check.sh                                   # install, info, tests, check, bench quick
#     TESTS=none CHECK=0 bash benchmarks/gpu_check.sh qwen35-fwd     # benchmarks only
#     BENCH_ARGS="--backends triton --filter 16/32" TESTS=none bash benchmarks/gpu_check.sh qwen35-fwd qwen35-bwd
# Baselines: FLA and FlashQLA may be missing from the device image; carry their wheels in .whl/ (fla-core, einops,
# flash-qla; pure Python) and this script installs them into /tmp/site.
#
# What comes back (the device returns at most 8 files from $OUT):
#     $OUT/gpu_check.log    everything printed
#     $OUT/summary.md       info, test results, check table, every bench table (markdown)
#     $OUT/results.tar.gz   bench JSON/CSV/markdown/PNG and each step's own log
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
WORK="$(mktemp -d /tmp/gpu_check.XXXXXX)"
mkdir -p "$WORK/bench" "$WORK/logs"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-560}"
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
PRESETS=("$@")
[ ${#PRESETS[@]} -eq 0 ] && PRESETS=(quick)
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/gpu_check.log") 2>&1

left() { echo $((DEADLINE - $(date +%s))); }
# step_timeout WANT: a timeout of at most WANT seconds that still leaves 25 s for packing
step_timeout() { local t=$(( $(left) - 25 )); [ "$t" -gt "$1" ] && t=$1; [ "$t" -lt 1 ] && t=1; echo "$t"; }
banner() { echo; echo "=== $* ($(( $(date +%s) - START ))s elapsed, $(left)s left) ==="; }
SUMMARY="$WORK/summary.md"
say() { echo "$*" >> "$SUMMARY"; }

banner "environment"
[ -f .gpu/setup.sh ] && source .gpu/setup.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" && echo "installed carried wheels: $(ls .whl | tr '\n' ' ')"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"
"$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())'

banner "install"
INSTALL="editable install ok"
if [ "${SKIP_INSTALL:-0}" = 1 ]; then
  INSTALL="install skipped (SKIP_INSTALL=1); running from the source tree"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
elif ! timeout "$(step_timeout 240)" "$PY" -m pip install --no-build-isolation --no-deps -q -e . > "$WORK/logs/install.log" 2>&1; then
  tail -5 "$WORK/logs/install.log"
  INSTALL="editable install FAILED (logs/install.log); running from the source tree (no native cpu module)"
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "$INSTALL"
say "# flashqla gpu_check ($(date '+%Y-%m-%d %H:%M:%S'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
say ""
say "- $INSTALL"

banner "info"
timeout "$(step_timeout 120)" "$PY" -m flashqla info 2>&1 | tee "$WORK/logs/info.txt"
say ""; say '## info'; say '```'; cat "$WORK/logs/info.txt" >> "$SUMMARY"; say '```'

TESTS="${TESTS:-gpu}"
say ""; say "## tests"
if [ "$TESTS" != "none" ] && "$PY" -m pytest --version >/dev/null 2>&1; then
  banner "pytest -m gpu"
  timeout -s INT -k 15 "$(step_timeout 300)" "$PY" -m pytest -m gpu -x -q -p no:cacheprovider 2>&1 | tee "$WORK/logs/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
  say "- pytest -m gpu: rc $rc: $(tail -1 "$WORK/logs/pytest_gpu.log")"
  t=$(step_timeout 240)
  if [ "$TESTS" = "all" ] || [ "$t" -gt 200 ]; then
    banner "pytest (the rest of the suite)"
    timeout -s INT -k 15 "$t" "$PY" -m pytest -m "not gpu" -x -q -p no:cacheprovider 2>&1 | tee "$WORK/logs/pytest_rest.log"
    rc=${PIPESTATUS[0]}
    say "- pytest -m 'not gpu': rc $rc$([ "$rc" = 124 ] && echo ' (timed out)'): $(tail -1 "$WORK/logs/pytest_rest.log")"
  else
    say "- pytest -m 'not gpu': skipped (time budget)"
  fi
else
  say "- pytest: not run (TESTS=$TESTS, or pytest is not importable here)"
  echo "pytest: not run (TESTS=$TESTS or pytest missing)"
fi

if [ "${CHECK:-1}" = 1 ]; then
  banner "flashqla check --device cuda"
  timeout -s INT -k 15 "$(step_timeout 240)" "$PY" -m flashqla check --device cuda ${CHECK_ARGS:-} 2>&1 | tee "$WORK/logs/check.txt"
  rc=${PIPESTATUS[0]}
  say ""; say "## check (rc $rc$([ "$rc" = 124 ] && echo ', timed out'))"; say '```'; cat "$WORK/logs/check.txt" >> "$SUMMARY"; say '```'
fi

for p in "${PRESETS[@]}"; do
  t=$(step_timeout 600)
  if [ "$t" -lt 30 ]; then
    echo "bench $p: skipped, no time left"; say ""; say "## bench $p: skipped (time budget)"; continue
  fi
  banner "bench --preset $p (timeout ${t}s)"
  # SIGINT first: bench then prints and writes what it measured; KILL 15 s later if it hangs.
    # shellcheck disable=SC2086
  timeout -s INT -k 15 "$t" "$PY" -m flashqla bench --preset "$p" --out "$WORK/bench" ${BENCH_ARGS:-} \
    2> >(tee "$WORK/logs/bench_$p.err" >&2) | tee "$WORK/logs/bench_$p.txt"
  rc=${PIPESTATUS[0]}
  say ""; say "## bench $p (rc $rc)"
  for f in "$WORK"/bench/bench_"$p"_*.md; do [ -f "$f" ] && cat "$f" >> "$SUMMARY"; done
done

banner "pack"
if [ "${SAVE_CACHES:-0}" = 1 ] && declare -F gpu_save_caches >/dev/null; then gpu_save_caches; fi
tar czf "$OUT/results.tar.gz" -C "$WORK" bench logs 2>/dev/null
cp "$SUMMARY" "$OUT/summary.md"
ls -la "$OUT"

echo
echo "==================== SUMMARY ===================="
echo "$INSTALL"
grep -E "^- pytest" "$SUMMARY" || true
[ -f "$WORK/logs/check.txt" ] && { grep -E "  (FAIL|ERROR)  " "$WORK/logs/check.txt" | head -20; grep -E "passed, .* failed" "$WORK/logs/check.txt" | sed "s/^/check: /"; }
"$PY" "$ROOT/benchmarks/summarize.py" "$WORK/bench" 2>&1 || true
echo "total $(( $(date +%s) - START ))s; full tables in \$OUT/summary.md, raw results in \$OUT/results.tar.gz"
sleep 1  # let tee flush the log
