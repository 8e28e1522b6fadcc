#!/usr/bin/env bash
# The symmetric-contraction kernels on one GPU (device tool, from the repo root; carry .peers, from
# ../shared/device/fetch_peers.sh: e3nn-jax and cuEquivariance-JAX with its CUDA ops):
#   bash benchmarks/symmetric_run.sh [symmetric_benchmark.py args, e.g. --sizes 4096,65536]
# First tests/test_symmetric.py on the GPU (Triton kernels against the reference, float64), then
# benchmarks/symmetric_benchmark.py (jequi pallas / xla against cuEquivariance's uniform_1d) under
# SYMMETRIC_TIMEOUT seconds; writes <date>-<device>-symmetric.{json,md} and the logs into $OUT
# (copy the .json/.md into benchmarks/results/). SYMMETRIC_TESTS=0 skips the tests.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/symmetric.log"
if [ "${SYMMETRIC_TESTS:-1}" != 0 ]; then
  timeout "${SYMMETRIC_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider tests/test_symmetric.py 2>&1 | tail -15 | tee "$OUT/symmetric-tests.log"
fi
timeout "${SYMMETRIC_TIMEOUT:-420}" python3 benchmarks/symmetric_benchmark.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/symmetric.log"
exit "${PIPESTATUS[0]}"
