#!/usr/bin/env bash
# Nequix on one GPU (device tool, from the repo root). Carry .peers: ../shared/device/fetch_peers.sh's
# wheels (e3nn-jax, cuEquivariance, OpenEquivariance's sources) plus the nequix oracle's and the
# calculator's, fetched with
#   pip download --no-deps -d .peers nequix==0.4.5 jraph==0.0.6.dev0 equinox==0.13.8 jaxtyping==0.3.11 \
#       wadler_lindig==0.1.8 ase==3.29.0 vesin==0.6.2
#   bash benchmarks/nequix_run.sh [nequix_step.py args, e.g. --atoms 4000,16000 --train-atoms 4000]
# Builds OpenEquivariance's JAX extension (.peers/setup_peers.sh, 1-2 min), runs tests/test_nequix.py
# on the GPU (NEQUIX_TESTS=0 skips it), then benchmarks/nequix_step.py under NEQUIX_TIMEOUT seconds;
# writes <date>-<device>-nequix-<model>.{json,md} and the logs into $OUT (copy the .json/.md into
# benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source .peers/setup_peers.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/nequix.log"
if [ "${NEQUIX_TESTS:-1}" != 0 ]; then
  timeout "${NEQUIX_TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_nequix.py 2>&1 | tail -8 | tee "$OUT/nequix-tests.log"
fi
cd benchmarks && timeout "${NEQUIX_TIMEOUT:-560}" python3 nequix_step.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/nequix.log"
exit "${PIPESTATUS[0]}"
