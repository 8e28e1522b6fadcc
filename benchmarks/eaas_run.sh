#!/usr/bin/env bash
# The EAAS benchmark on one GPU (device tool, from the repo root; carry .whl, made by
# benchmarks/fetch_test_wheels.sh, which holds e3nn-jax; or .peers):
#   bash benchmarks/eaas_run.sh [eaas_benchmark.py args, e.g. --ls 2,3 --channels 128]
# Runs benchmarks/eaas_benchmark.py (jequi.sh_tensor_product vs e3nn.tensor_product with
# spherical harmonics, L = 2..6, 64-256 channels, 1e4-1e6 rows) under EAAS_TIMEOUT seconds;
# writes <date>-<device>-eaas.{json,md} and eaas.log into $OUT (copy the .json/.md into
# benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/eaas.log"
timeout "${EAAS_TIMEOUT:-570}" python3 benchmarks/eaas_benchmark.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/eaas.log"
exit "${PIPESTATUS[0]}"
