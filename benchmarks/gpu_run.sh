#!/usr/bin/env bash
# The GPU run (device tool, .peers carried): Pallas tests on the GPU, then the side-by-side
# benchmark. Usage there, from the repo root:  bash benchmarks/gpu_run.sh [benchmark args]
# RUN_TESTS=0 or RUN_BENCH=0 skips a part; TESTS picks test files; TEST_TIMEOUT / BENCH_TIMEOUT bound
# each (seconds); TEST_WORKERS test processes share the GPU (pytest-xdist, on the GPU machine's
# image; Triton compiles are CPU-bound). Conv benchmark: bash benchmarks/gpu_run.sh --conv [--graphs ...]
set -uo pipefail
source benchmarks/device_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import jax, e3nn_jax; print('jax', jax.__version__, jax.devices(), 'e3nn-jax', e3nn_jax.__version__)"
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q -rA -p no:cacheprovider \
    -n "${TEST_WORKERS:-8}" ${TESTS:-tests/test_pallas.py tests/test_conv.py} --durations=8 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -vE "^PASSED"
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  timeout "${BENCH_TIMEOUT:-540}" python3 benchmarks/gpu_benchmark.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
fi
