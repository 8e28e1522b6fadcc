#!/usr/bin/env bash
# The precision policies' accuracy on one GPU (device tool, from the repo root, .peers carried):
# benchmarks/precision_accuracy.py's parts as concurrent processes, one per part and policy (the
# small models leave the GPU mostly idle, so 10,000 NVE steps of three policies fit one call),
# then --merge into <date>-<device>-precision-accuracy.{json,md} in $OUT. The ms columns of such
# a run are not speed numbers (the `steps` part, run alone, is). Arguments go to every part.
#   ACCURACY_JOBS="nve:float32 nve:tf32 nve:bf16-mixed train:float32 train:bf16-mixed" BENCH_TIMEOUT=560
# With TESTS set, those tests run alongside (precision-tests.log).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/parts"
source benchmarks/model_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/accuracy.log"
if [ -n "${TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-500}" python3 -m pytest -q -rfE -p no:cacheprovider -n "${TEST_WORKERS:-4}" $TESTS --durations=5 > "$OUT/precision-tests.log" 2>&1 &
fi
cd benchmarks
for job in ${ACCURACY_JOBS:-nve:float32 nve:tf32 nve:bf16-mixed train:float32 train:tf32 train:bf16-mixed}; do
  part=${job%%:*} policy=${job#*:} dir="$OUT/parts/$part-$policy"
  mkdir -p "$dir"
  # OUT unset: each part writes only into its own folder (timing.save copies into $OUT otherwise)
  env -u OUT timeout "${BENCH_TIMEOUT:-560}" python3 precision_accuracy.py --parts "$part" --policies "$policy" --out "$dir" "$@" > "$dir/log" 2>&1 &
done
wait
for dir in "$OUT"/parts/*/; do echo "== $dir"; tail -3 "$dir/log"; done | tee -a "$OUT/accuracy.log"
python3 precision_accuracy.py --merge "$OUT"/parts/*/*-precision-accuracy.json --out "$OUT" | tee -a "$OUT/accuracy.log"
[ -f "$OUT/precision-tests.log" ] && tail -15 "$OUT/precision-tests.log" | tee -a "$OUT/accuracy.log"
