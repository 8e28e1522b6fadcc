#!/usr/bin/env bash
# The cuda backend with no system CUDA toolkit: every PATH entry holding an nvcc dropped and
# $CUDA_HOME / $CUDA_PATH pointed at nothing, so ffi.build.nvcc() must find the nvidia-cuda-nvcc
# wheel's compiler (what `pip install "jax[cuda13]"` installs). Then, on a GPU, `python -m jequi
# --check` builds the cuda kernels with it into an empty cache and self-tests them against xla;
# on a CPU, the generated kernels compile with it (tests/test_cuda.py -k generated_kernels_compile).
#   bash benchmarks/piponly_run.sh            (device tool, .peers carried; or here, the wheels installed)
# WHEELS=DIR puts the nvidia wheels of DIR on PYTHONPATH first (a CPU machine without them).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -f benchmarks/model_env.sh ] && source benchmarks/model_env.sh
[ -n "${WHEELS:-}" ] && export PYTHONPATH=$WHEELS:$PYTHONPATH
PY=${PY:-$(command -v python3)}
path=""
IFS=: read -ra dirs <<< "$PATH"
for d in "${dirs[@]}"; do [ -x "$d/nvcc" ] || path="${path:+$path:}$d"; done
export PATH=$path CUDA_HOME=/nonexistent/cuda CUDA_PATH=/nonexistent/cuda JEQUI_CACHE_DIR=$(mktemp -d)
{
  echo "PATH without nvcc: $PATH; CUDA_HOME=$CUDA_HOME; nvcc on PATH: $(command -v nvcc || echo none)"
  "$PY" -c "from ffi import build; c = build.nvcc(); print('ffi.build.nvcc():', c, '| wheel:', build.wheel_nvcc(), '| missing:', build.toolchain_missing())"
  "$PY" -c "import importlib.metadata as m; print('wheels:', *sorted(f'{d.metadata[\"Name\"]}=={d.version}' for d in m.distributions() if d.metadata['Name'].startswith('nvidia-cuda-nvcc') or d.metadata['Name'] in ('nvidia-nvvm', 'nvidia-cuda-crt', 'nvidia-cuda-runtime')))"
  if "$PY" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
    timeout "${PIPONLY_TIMEOUT:-240}" "$PY" -m jequi --check; echo "--check exit $?"
    echo "cubins built into the empty cache: $(ls "$JEQUI_CACHE_DIR"/*.cubin 2>/dev/null | wc -l)"
  else
    timeout "${PIPONLY_TIMEOUT:-600}" "$PY" -m pytest -q -p no:cacheprovider -n 2 tests/test_cuda.py -k generated_kernels_compile 2>&1 | tail -2
  fi
} 2>&1 | tee "$OUT/piponly.log"
