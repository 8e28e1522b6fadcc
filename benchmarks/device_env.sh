# Source on the GPU machine (device tool, .peers or .whl carried), from the repo root: the peers'
# packages (installed by .peers/setup_peers.sh, once per machine: a warm machine keeps /tmp
# between calls, and building OpenEquivariance's extension takes a minute or two) and jequi
# on PYTHONPATH. The paths below are the ones setup_peers.sh installs to.
if [ -d /tmp/peers_oeq ] && [ -d /tmp/peers ]; then
  export PYTHONPATH=/tmp/peers_oeq:/tmp/oeq/openequivariance-0.7.0:/tmp/peers:${PYTHONPATH:-}
  export OEQ_NOTORCH=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
elif [ -f .peers/setup_peers.sh ]; then
  source .peers/setup_peers.sh
elif ls .peers/*.whl >/dev/null 2>&1; then  # only some of the peers' wheels carried (no OpenEquivariance build)
  [ -d /tmp/peers ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .peers/*.whl
  export PYTHONPATH=/tmp/peers:${PYTHONPATH:-}
fi
# What the tests need that the image lacks, where .whl is carried (benchmarks/fetch_test_wheels.sh).
if [ -d .whl ]; then
  [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
