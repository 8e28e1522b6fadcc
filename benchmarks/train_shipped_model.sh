#!/usr/bin/env bash
# Rebuilds the shipped model (jequi/models/weights/nequip-emt.*) on one GPU (device tool, from
# the repo root, .whl or .peers carried for ase and e3nn-jax; a vesin wheel in .whl makes the
# radius graphs ~50x faster, ase's are used without it):
#   bash benchmarks/train_shipped_model.sh [python -m jequi.models.pretrained args]
# Generates 2000 + 200 + 60 EMT structures, trains for SECONDS (default 200) of wall time, then
# evaluates held-out errors (training sizes and larger cells). Writes into $OUT:
#   nequip-emt.msgpack, nequip-emt.json, nequip-emt.md (the model card), train.log
# Copy the first three into jequi/models/weights/ (and the log beside the results if wanted).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh  # ase, e3nn-jax; vesin where .whl is carried
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/train.log"
python3 -c 'import jax, ase, e3nn_jax; print("jax", jax.__version__, jax.devices(), "ase", ase.__version__)' 2>&1 | tee -a "$OUT/train.log"
python3 -c 'import vesin; print("vesin", vesin.__version__)' 2>&1 | tail -1 | tee -a "$OUT/train.log"
timeout "${TRAIN_TIMEOUT:-430}" python3 -m jequi.models.pretrained --out "$OUT" --seconds "${SECONDS_BUDGET:-200}" \
  --backend "${BACKEND:-pallas}" "$@" 2>&1 | tee -a "$OUT/train.log"
rc=${PIPESTATUS[0]}
ls -la "$OUT" | tee -a "$OUT/train.log"
exit $rc
