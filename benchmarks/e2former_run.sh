#!/usr/bin/env bash
# The E2Former-style model on one GPU (device tool, from the repo root; carry .whl, made by
# benchmarks/fetch_test_wheels.sh, which holds e3nn-jax, ase and vesin):
#   bash benchmarks/e2former_run.sh [e2former_benchmark.py args, e.g. --preset released --backends pallas]
# First tests/test_e2former.py on the GPU (E2FORMER_TESTS=0 skips it: the model's symmetries,
# forces, per-source values vs per-edge, Pallas vs xla), then benchmarks/e2former_benchmark.py
# (energy + forces steps/s at 1k, 10k, 50k, 100k atoms of fcc Cu, fused Pallas attention vs the
# materialised xla one) under E2FORMER_TIMEOUT seconds; writes <date>-<device>-e2former.{json,md},
# the pytest report and e2former.log into $OUT (copy the .json/.md into benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/e2former.log"
python3 -c 'import vesin' 2>/dev/null || echo "vesin is missing: ase's slower neighbour list is used" | tee -a "$OUT/e2former.log"
if [ "${E2FORMER_TESTS:-1}" != 0 ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_e2former.py 2>&1 | tail -15 | tee "$OUT/e2former-tests.log"
fi
timeout "${E2FORMER_TIMEOUT:-540}" python3 benchmarks/e2former_benchmark.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/e2former.log"
exit "${PIPESTATUS[0]}"
