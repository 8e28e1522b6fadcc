#!/usr/bin/env bash
# A/B of the Pallas kernels on the GPU (device tool): tune_conv.py with the working tree's
# kernels ("new") and with an older copy of pallas_kernels/ ("old"), alternating per dtype.
# Make the copy here first (ignored, never committed):
#   mkdir -p ab_old && git archive REV pallas_kernels | tar x -C ab_old && echo ab_old/ >> .git/info/exclude
# then, with carry [".peers", "ab_old"]:  bash benchmarks/ab_tune.sh [tune_conv.py args]
# DTYPES (default "float32 float64"); AB_TIMEOUT bounds each tune_conv.py run (seconds).
set -uo pipefail
# The wheels once per machine (a warm machine keeps /tmp between calls).
[ -d /tmp/site/e3nn_jax ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .peers/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
cd benchmarks
for dt in ${DTYPES:-float32 float64}; do
  for v in new old; do
    pp=$PYTHONPATH; [ "$v" = old ] && pp=$PWD/../ab_old:$PYTHONPATH
    echo "== $v $dt: $(PYTHONPATH=$pp python3 -c "import pallas_kernels; print(pallas_kernels.__file__)")"
    PYTHONPATH=$pp timeout "${AB_TIMEOUT:-200}" python3 tune_conv.py --dtype "$dt" "$@" 2>&1 | grep -vE "^(carbon|copper|water):"
  done
done
