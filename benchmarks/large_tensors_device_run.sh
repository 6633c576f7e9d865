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
BUDGET_S=${BUDGET_S:-570} source benchmarks/device_lib.sh
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
save_kcache
