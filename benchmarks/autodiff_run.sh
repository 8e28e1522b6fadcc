#!/usr/bin/env bash
# The autodiff before/after benchmark on the GPU machine (device tool; carry .peers and .before,
# made as benchmarks/autodiff_before_after.py says), from the repo root:
#   bash benchmarks/autodiff_run.sh --label COMMIT [autodiff_before_after.py args]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd benchmarks && timeout "${BENCH_TIMEOUT:-560}" python3 autodiff_before_after.py --before ../.before --out "$OUT" "$@" 2>&1 \
  | grep -v "Benchmark\|warner" | tee "$OUT/autodiff_before_after.log"
