#!/usr/bin/env bash
# Multi-GPU scaling of one structure split over devices (device tool, kind nvidia-h100-x4 or
# nvidia-h100-x2, from the repo root; carry .whl, made by benchmarks/fetch_test_wheels.sh: ase,
# e3nn-jax, vesin). Uses every GPU it sees:
#   bash benchmarks/scaling_run.sh                    # strong + weak scaling, both schemes, breakdown
#   bash benchmarks/scaling_run.sh --parts largest    # the largest structure on 1 and on all GPUs
# Runs benchmarks/scaling_benchmark.py under SCALING_TIMEOUT seconds (it starts no cell after
# --max-seconds); writes <date>-<device>-scaling[-largest].{json,md} (+ .png with matplotlib)
# and scaling.log into $OUT (copy them into benchmarks/results/).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# NVLink multicast stays off (as the machines set it): a program using it can take the host's GPUs out of service
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/scaling.log"
python3 -c 'import vesin' 2>/dev/null || echo "vesin is missing (carry .whl): ase's neighbour list is slower" | tee -a "$OUT/scaling.log"
cd benchmarks && timeout "${SCALING_TIMEOUT:-570}" python3 scaling_benchmark.py --out "$OUT" "$@" 2>&1 | tee -a "$OUT/scaling.log"
exit "${PIPESTATUS[0]}"
