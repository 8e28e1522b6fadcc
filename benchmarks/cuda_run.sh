#!/usr/bin/env bash
# The CUDA backend on the GPU machine (device tool, .peers carried): a smoke call, its tests,
# then tune_cuda.py. Usage there, from the repo root:  bash benchmarks/cuda_run.sh [tune_cuda args]
# RUN_TESTS=0 / RUN_TUNE=0 skip a part; TESTS picks test files, TEST_K a -k expression;
# TEST_TIMEOUT / TUNE_TIMEOUT (s). A/B against an older ffi/: benchmarks/ab_cuda.sh.
# The whole of tests/test_cuda.py takes longer than one device command on a fresh machine (nvcc
# builds every kernel): run TEST_K="not split_into_groups", then TEST_K="split_into_groups".
# The log names each test as it ends, so a run cut short by its timeout still says what failed.
# TEST_K matches module names too: any expression with "cuda" selects all of tests/test_cuda.py;
# pick tests by their function names (TESTS=tests/test_cuda.py::test_name).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -d /tmp/site/e3nn_jax ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 - <<'PY'
import time, jax, numpy as np, jequi
print("jax", jax.__version__, jax.devices(), "backends", jequi.available_backends())
tp = jequi.problems.get("mace-large")
x, y, w = (np.random.default_rng(0).normal(size=(1000, d)).astype(np.float32) for d in (1152, 16, 2176))
t = time.time(); z = tp(x, y, w, backend="cuda"); z.block_until_ready(); print("first call s", round(time.time() - t, 1))
print("max |cuda - xla| / max |xla|", float(np.abs(z - tp(x, y, w, backend="xla")).max() / np.abs(z).max()))
PY
if [ "${RUN_TESTS:-1}" = 1 ]; then
  timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -v -rfE -p no:cacheprovider -n "${TEST_WORKERS:-8}" -W ignore \
    ${TESTS:-tests/test_cuda.py} ${TEST_K:+-k "$TEST_K"} --durations=5 2>&1 | grep -v "PytestBenchmarkWarning\|warner(" \
    | tee "$OUT/cuda_tests.log" | grep -vE " (PASSED|SKIPPED) " | tail -40
fi
if [ "${RUN_TUNE:-1}" = 1 ]; then
  cd benchmarks && timeout "${TUNE_TIMEOUT:-400}" python3 tune_cuda.py "$@" 2>&1 | tee "$OUT/tune_cuda.log"
fi
