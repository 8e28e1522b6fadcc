#!/usr/bin/env bash
# The model-step benchmark on the GPU machine (device tool, .peers carried), from the repo root:
#   bash benchmarks/model_run.sh --model nequip-oam-l [model_step.py args]
# Installs the peers' wheels only (e3nn-jax, cuEquivariance, ase; not OpenEquivariance, which the
# model does not run), then runs benchmarks/model_step.py under MODEL_TIMEOUT seconds.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
cd benchmarks && timeout "${MODEL_TIMEOUT:-560}" python3 model_step.py --out "$OUT" "$@" 2>&1 | grep -v "Benchmark\|warner" | tee "$OUT/model_step.log"
