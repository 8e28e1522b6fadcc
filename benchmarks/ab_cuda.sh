#!/usr/bin/env bash
# A/B of the CUDA backend on the GPU (device tool): tune_cuda.py with the working tree's ffi/
# ("new") and an older copy ("old"), alternating, for each setting in AB_SPECS (";"-separated
# tune_cuda.py argument lists, added to COMMON). Make the copy here first (ignored, never
# committed), then carry [".peers", "ab_old"]:
#   mkdir -p ab_old && git archive REV ffi | tar x -C ab_old && echo /ab_old/ >> .git/info/exclude
# AB_TIMEOUT bounds each tune_cuda.py run (seconds).
set -uo pipefail
[ -d /tmp/site/e3nn_jax ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COMMON=${COMMON:---problems mace-large --layouts ir_mul --backends cuda}
cd benchmarks
IFS=';' read -ra specs <<< "${AB_SPECS:---graph carbon}"
for spec in "${specs[@]}"; do
  for v in new old; do
    pp=$PYTHONPATH; [ "$v" = old ] && pp=$PWD/../ab_old:$PYTHONPATH
    # shellcheck disable=SC2086
    PYTHONPATH=$pp timeout "${AB_TIMEOUT:-120}" python3 tune_cuda.py $COMMON $spec 2>&1 \
      | grep -E "^[a-z0-9-]+ (mul_ir|ir_mul) |Error" | sed "s/^/$v /" | tee -a "$OUT/ab_cuda.log"
  done
done
