#!/usr/bin/env bash
# compute-sanitizer over jequi's GPU kernels (device tool, from the repo root; carry .whl or .peers
# as for the other runs). Each tool runs the GPU tests that drive the kernel families on hostile
# inputs: tests/test_hostile_inputs.py (indices -1, -2^31, N, 2^31-1, a hub, empty graphs, zero
# nodes and rows: TP and conv on pallas, cuda and cuda-atomic), plus the families' own tests
# selected by SANITIZE_TESTS. The first line of the log says whether the runtime supports the
# sanitizer (gVisor machines refuse it: KINDS.md).
#   SANITIZE_TOOLS="memcheck racecheck initcheck" SANITIZE_TESTS="tests/test_conv.py -k hub" bash benchmarks/sanitize_run.sh
# Writes <tool>.log per tool and summary.txt (each tool's ERROR SUMMARY line) into $OUT; copy the
# summary into benchmarks/results/<date>-<device>-sanitizer.md with the device and versions.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
export JEQUI_CACHE_DIR=${JEQUI_CACHE_DIR:-/tmp/jequi-sanitize-cache}
TESTS=${SANITIZE_TESTS:-"tests/test_hostile_inputs.py tests/test_symmetric.py::test_out_of_range_species_under_jit_give_zero"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
python3 -c "import jax; print('jax', jax.__version__)" | tee -a "$OUT/summary.txt"
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck}; do
  extra=""
  [ "$tool" = initcheck ] && extra="--track-unused-memory no"
  # XLA's allocator pools memory: without preallocation each buffer is its own allocation, so
  # memcheck sees out-of-bounds accesses past a buffer's end
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    timeout "${SANITIZE_TIMEOUT:-500}" compute-sanitizer --tool "$tool" $extra --target-processes all --print-limit 20 \
    python3 -m pytest -q -p no:cacheprovider -p no:xdist $TESTS > "$OUT/$tool.log" 2>&1
  echo "$tool: exit $?; $(grep -m1 'ERROR SUMMARY' "$OUT/$tool.log" || echo 'no ERROR SUMMARY line'); $(tail -1 "$OUT/$tool.log")" | tee -a "$OUT/summary.txt"
done
