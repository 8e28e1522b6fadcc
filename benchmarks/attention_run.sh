#!/usr/bin/env bash
# The neighbour-attention kernels on one GPU (device tool, from the repo root; carry .whl, made by
# benchmarks/fetch_test_wheels.sh, which holds e3nn-jax, a dependency of `import jequi`):
#   bash benchmarks/attention_run.sh [attention_benchmark.py args, e.g. --sizes 8192 --slots 32]
# (every argument is passed on: --profile adds each backward stage timed alone, e.g.
#   ATTENTION_TESTS=0 bash benchmarks/attention_run.sh --profile --sizes 8192,32768 --slots 20 --heads 128x8x58;
#   --configs 'block_edges=4;block_edges=8,num_warps=8' also times the backward's source pass with those launch shapes)
# First tests/test_attention.py on the GPU (the Triton kernels against the reference, float64),
# then benchmarks/attention_benchmark.py (fused vs gather vs three-step, N = 1k-100k, K = 20-64,
# (H, d, D_v) = (128, 8, 58) and (16, 32, 64)) under ATTENTION_TIMEOUT seconds; writes
# <date>-<device>-attention.{json,md}, the pytest report and attention.log into $OUT (copy the
# .json/.md into benchmarks/results/). ATTENTION_TESTS=0 skips the tests.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/attention.log"
if [ "${ATTENTION_TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_attention.py 2>&1 | tail -15 | tee "$OUT/attention-tests.log"
fi
timeout "${ATTENTION_TIMEOUT:-540}" python3 benchmarks/attention_benchmark.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/attention.log"
exit "${PIPESTATUS[0]}"
