#!/usr/bin/env bash
# compute-sanitizer over jequi's GPU kernels (device tool, from the repo root; carry .peers as
# for the other runs). benchmarks/sanitize_kernels.py runs every kernel family on hostile inputs
# (indices -1, -2^31, N, 2^31-1, a 50,000-edge hub, an empty graph, zero nodes and rows) and
# checks its values against xla: once natively (the reference run, which also fills JAX's
# persistent compilation cache so the sanitized runs do not compile under the tool), then under
# each tool, the kernels' calls alone (--kernels-only). Needs a runtime that supports the sanitizer (Firecracker, not gVisor: KINDS.md).
#   SANITIZE_TOOLS="memcheck racecheck initcheck" SANITIZE_FAMILIES=tp,conv bash benchmarks/sanitize_run.sh
# SANITIZE_ONLY=conv/pallas/forward,graph: only the cases whose label starts so (families: also graph,
# the conv's index bookkeeping without a kernel). RUN_CONTROL=0: not the initcheck control
# (benchmarks/initcheck_xla_probe.py: JAX's index ops without jequi, x64 off and on, and in radial_conv's loop).
# Writes native.log, <tool>.log and summary.txt (each run's case count and each tool's ERROR
# SUMMARY, appended) into $OUT; the results file is benchmarks/results/<date>-<device>-sanitizer.md.
# SANITIZE_RUNS=2: each case executed twice under the tool (summary.txt counts the reports per run).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/model_env.sh
export JEQUI_CACHE_DIR=${JEQUI_CACHE_DIR:-/tmp/jequi-sanitize-cache}
export JAX_COMPILATION_CACHE_DIR=/tmp/jax-sanitize-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
# No autotuning (it would run XLA's candidate kernels under the tool), no CUDA graphs; without
# preallocation each buffer is its own allocation, so memcheck sees accesses past its end.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=" \
  XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
# PRINT_LIMIT=0 prints every report the tool keeps (counted in summary.txt); BACKTRACE=host keeps
# host backtraces, yes host and device ones
PRINT_LIMIT=${PRINT_LIMIT:-20}
BACKTRACE="--show-backtrace ${BACKTRACE:-no}"
# the device function of each report in log $1 (a jequi kernel, or an XLA fusion), counted
sites() { grep -oE '^=========     at [A-Za-z0-9_.$]+' "$1" | sed 's/^=========     at /  reported in /' | sort | uniq -c; }
ARGS="--families ${SANITIZE_FAMILIES:-tp,conv,eaas,attention,symmetric} --only=${SANITIZE_ONLY:-}"
if [ "${RUN_NATIVE:-1}" = 1 ]; then  # RUN_NATIVE=0: a later call on the same machine, the cache filled
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; compute-sanitizer --version | tail -1
    python3 -c "import jax; print('jax', jax.__version__)"; } | tee -a "$OUT/summary.txt"
  t0=$(date +%s)
  timeout "${NATIVE_TIMEOUT:-240}" python3 benchmarks/sanitize_kernels.py $ARGS > "$OUT/native.log" 2>&1
  echo "native: exit $?; $(tail -1 "$OUT/native.log"); $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
fi
for tool in ${SANITIZE_TOOLS-memcheck racecheck initcheck}; do
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check no"
  t0=$(date +%s)
  # FRESH_TOOL_CACHE=1: the programs compile under the tool (an empty JAX cache) instead of
  # loading the native run's executables: tells reports that come with a cached executable from
  # the others (jequi's own cubin cache, JEQUI_CACHE_DIR, stays shared: its kernels load the same way)
  cache=$JAX_COMPILATION_CACHE_DIR
  if [ "${FRESH_TOOL_CACHE:-0}" = 1 ]; then cache=$(mktemp -d) || exit 1; fi
  JAX_COMPILATION_CACHE_DIR=$cache timeout "${SANITIZE_TIMEOUT:-150}" compute-sanitizer --tool "$tool" $extra --target-processes all \
    --print-limit "$PRINT_LIMIT" $BACKTRACE python3 benchmarks/sanitize_kernels.py $ARGS --kernels-only --runs "${SANITIZE_RUNS:-1}" > "$OUT/$tool.log" 2>&1
  echo "$tool: exit $?; $(grep -m1 'ERROR SUMMARY' "$OUT/$tool.log" || echo 'no ERROR SUMMARY line'); $(grep -E '^[0-9]+ cases' "$OUT/$tool.log" || tail -1 "$OUT/$tool.log"); $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"
  # where the reports are: their device functions (sites), the kind and size of each access,
  # the addresses, and the case each was printed in (reports come before their case's "ran" line)
  sites "$OUT/$tool.log" | tee -a "$OUT/summary.txt"
  grep -oE '^========= [A-Z][A-Za-z_ ]+(of size [0-9]+ bytes)?' "$OUT/$tool.log" | grep -v 'ERROR SUMMARY\|COMPUTE' | sort | uniq -c | sed 's/^/  kind /' | tee -a "$OUT/summary.txt"
  grep -oE 'Address 0x[0-9a-f]+|address 0x[0-9a-f]+' "$OUT/$tool.log" | sort | uniq -c | sort -rn | head -20 | sed 's/^/  at /' | tee -a "$OUT/summary.txt"
  # (device reports only: a host API report has no "at" line, and may print after its case's line)
  awk '/^=========     at /{n++} /^[a-z_]+\/[^ ]*( \(run [0-9]+\))?: (ran|FAIL)/{sub(/: (ran|FAIL).*$/, ""); print "  case " $0 ": " n+0; n=0}' "$OUT/$tool.log" | tee -a "$OUT/summary.txt"
  # a full print (PRINT_LIMIT=0) can run to gigabytes: keep its head and tail, the summary has the counts
  if [ "$(stat -c %s "$OUT/$tool.log")" -gt 8000000 ]; then
    { head -c 4000000 "$OUT/$tool.log"; echo "... cut ..."; tail -c 2000000 "$OUT/$tool.log"; } > "$OUT/$tool.cut.log" && mv "$OUT/$tool.cut.log" "$OUT/$tool.log"
  fi
done
if [ "${RUN_CONTROL:-1}" = 1 ] && [[ " ${SANITIZE_TOOLS-memcheck racecheck initcheck} " == *" initcheck "* ]]; then
  # the control: JAX's own index ops without jequi (benchmarks/initcheck_xla_probe.py), x64 off and on
  # (x64-scan: the same ops in radial_conv's chunk loop, differentiated, so the transposed loop;
  # -keep-order=forward / tangent: the loop itself and its jvp, kept, the orders in which radial_conv reports)
  # CONTROL_MODES: the probe's arguments joined by "-" (x64-scan-chunks=12-keep: 12 chunks, XLA's loop unrolling off)
  for mode in ${CONTROL_MODES:-x32 x64 x64-scan x64-scan-keep-order=forward x64-scan-keep-order=tangent}; do
    log="$OUT/initcheck-control-${mode//=/}.log"  # the device tool returns plain names only
    # CONTROL_CACHED=1: the probe runs natively first and the sanitized run loads its executables
    # from that cache, as the harness's sanitized runs load the native run's; else it compiles under the tool
    JAX_COMPILATION_CACHE_DIR=$(mktemp -d) || exit 1
    export JAX_COMPILATION_CACHE_DIR
    [ "${CONTROL_CACHED:-0}" = 1 ] && python3 benchmarks/initcheck_xla_probe.py ${mode//-/ } > /dev/null 2>&1
    compute-sanitizer --tool initcheck --print-limit "$PRINT_LIMIT" $BACKTRACE python3 benchmarks/initcheck_xla_probe.py ${mode//-/ } > "$log" 2>&1
    echo "initcheck control ($mode, no jequi): $(grep -m1 'ERROR SUMMARY' "$log"); $(grep -m1 '^x' "$log")" | tee -a "$OUT/summary.txt"
    grep -oE 'of size [0-9]+ bytes' "$log" | sort | uniq -c | sed 's/^/  size /' | tee -a "$OUT/summary.txt"
    sites "$log" | tee -a "$OUT/summary.txt"
  done
fi
