# Source on the GPU machine (device tool), from the repo root, for the runs of jequi's model
# (model steps, training, MD): ase and e3nn-jax (and vesin) from a carried .whl
# (benchmarks/fetch_test_wheels.sh, via benchmarks/device_env.sh), else the wheels of a carried
# .peers without building OpenEquivariance (the model does not run it; its build takes minutes).
if [ -d .whl ]; then
  source benchmarks/device_env.sh
elif [ -d .peers ]; then
  [ -d /tmp/peers ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .peers/*.whl
  export PYTHONPATH=/tmp/peers:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
