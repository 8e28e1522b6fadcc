#!/usr/bin/env bash
# Half precision on one GPU (device tool, from the repo root, .peers carried): the tests in
# $TESTS (default tests/test_half_precision.py) on the GPU, then benchmarks/precision_benchmark.py
# (its arguments: this script's; BENCH=precision_accuracy.py runs that one instead: NVE drift,
# phonons, training, model steps per policy). RUN_TESTS=0 / RUN_BENCH=0 skip a part; TEST_TIMEOUT /
# BENCH_TIMEOUT bound each (s). Writes precision-tests.log and <date>-<device>-precision.{json,md}
# into $OUT (copy the .json/.md into benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/precision.log"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rfE -p no:cacheprovider -n "${TEST_WORKERS:-8}" \
    ${TESTS:-tests/test_half_precision.py} --durations=5 2>&1 | tee "$OUT/precision-tests.log" | tail -30
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  cd benchmarks && timeout "${BENCH_TIMEOUT:-520}" python3 "${BENCH:-precision_benchmark.py}" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/precision.log"
fi
