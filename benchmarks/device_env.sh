# Source on the GPU machine (device tool, .peers or .whl carried), from the repo root: the peers'
# packages (installed by .peers/setup_peers.sh, once per machine: a warm machine keeps /tmp
# between calls, and building OpenEquivariance's extension takes a minute or two) and jequi
# on PYTHONPATH. The paths below are the ones setup_peers.sh installs to.
if [ -d /tmp/peers_oeq ] && [ -d /tmp/peers ]; then
  export PYTHONPATH=/tmp/peers_oeq:/tmp/oeq/openequivariance-0.7.0:/tmp/peers:${PYTHONPATH:-}
  export OEQ_NOTORCH=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
elif [ -d .peers ]; then
  source .peers/setup_peers.sh
fi
# What the tests need that the image lacks, where .whl is carried (benchmarks/fetch_test_wheels.sh).
if [ -d .whl ]; then
  [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-} XLA_PYTHON_CLIENT_PREALLOCATE=false
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
