#!/usr/bin/env bash
# One-GPU jobs side by side on a multi-GPU host (device tool, kind nvidia-h100-x4), one job per
# GPU, from the repo root; carry what the jobs need (.whl; the peers' wheels for cuEquivariance):
#   bash benchmarks/parallel_run.sh "bash benchmarks/model_run.sh --model mace-width" "bash benchmarks/eaas_run.sh --ls 2"
# Job i runs with CUDA_VISIBLE_DEVICES=i and OUT=<scratch>/gpu<i> (its output there: job.log);
# a job may chain commands with ';'. Everything the jobs write comes back as one archive,
# $OUT/parallel.tgz (the device tool returns at most 8 files a call; `tar xzf` it), written on
# exit, a timeout's SIGTERM included. The carried wheels are installed once before the jobs
# start (concurrent installs into one folder would race). Each job has its GPU to itself, so its
# timings are one GPU's; the host's CPU cores are shared (16 per GPU on the x4 machine).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
JOBS=/tmp/parallel_run.$$; mkdir -p "$JOBS"  # the jobs' outputs, archived on exit
trap 'tar czf "$OUT/parallel.tgz" -C "$JOBS" .' EXIT
trap 'exit 143' TERM INT  # run the EXIT trap when a timeout stops the script
source benchmarks/model_env.sh
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader | tee "$JOBS/gpus.log"
i=0
for job in "$@"; do
  dir="$JOBS/gpu$i"; mkdir -p "$dir"
  ( export CUDA_VISIBLE_DEVICES=$i OUT="$dir"; bash -c "$job" >"$dir/job.log" 2>&1; echo "exit $?" >>"$dir/job.log" ) &
  i=$((i + 1))
done
wait
for log in "$JOBS"/gpu*/job.log; do echo "== $log"; tail -n 4 "$log"; done
