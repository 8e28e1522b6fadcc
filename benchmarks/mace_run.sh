#!/usr/bin/env bash
# The MACE model on one GPU (device tool, from the repo root; carry .peers, from
# ../shared/device/fetch_peers.sh: e3nn-jax and cuEquivariance-JAX with its CUDA ops):
#   bash benchmarks/mace_run.sh [model_step.py args, e.g. --impls jequi,cuex --atoms 4000]
# First tests/test_mace.py on the GPU (MACE_TESTS=0 skips them), then benchmarks/model_step.py
# --model mace-mp-medium under MODEL_TIMEOUT seconds; writes
# <date>-<device>-model-mace-mp-medium.{json,md} and the logs into $OUT (copy the .json/.md
# into benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/mace.log"
python3 -c "import jax, cuequivariance_jax as c; print('jax', jax.__version__, 'cuex', c.__version__)" | tee -a "$OUT/mace.log"
if [ "${MACE_TESTS:-1}" != 0 ]; then
  timeout "${MACE_TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider tests/test_mace.py 2>&1 | tail -8 | tee "$OUT/mace-tests.log"
fi
cd benchmarks && timeout "${MODEL_TIMEOUT:-560}" python3 model_step.py --model mace-mp-medium --out "$OUT" "$@" 2>&1 \
  | grep -v "Benchmark\|warner" | tee -a "$OUT/mace.log"
exit "${PIPESTATUS[0]}"
