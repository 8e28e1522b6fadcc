#!/usr/bin/env bash
# The MD benchmark on one GPU (device tool, from the repo root; carry .whl, made by
# benchmarks/fetch_test_wheels.sh, which holds ase, e3nn-jax and vesin):
#   bash benchmarks/md_run.sh [md_benchmark.py args, e.g. --sizes 1000,10000]
# Runs benchmarks/md_benchmark.py (ASE-calculator path vs the on-device loop at 1k, 10k, 100k
# atoms) under MD_TIMEOUT seconds; writes <date>-<device>-md.{json,md} and md.log into $OUT
# (copy the .json/.md into benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/md.log"
python3 -c 'import vesin' 2>/dev/null || { echo "vesin is missing: carry its wheel in .whl (benchmarks/fetch_test_wheels.sh)" | tee -a "$OUT/md.log"; exit 2; }
timeout "${MD_TIMEOUT:-560}" python3 benchmarks/md_benchmark.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/md.log"
exit "${PIPESTATUS[0]}"
