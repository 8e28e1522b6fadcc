"""jequi.models over several processes of one ``jax.distributed`` run, as a cluster runs one
process per GPU: 2 processes of 2 host CPU devices each, with gloo's CPU collectives
(tests/multiprocess_checks.py). The sharded calculator (the exchange scheme) and data-parallel
training over the 4 devices equal one device, in every process, with no change to the model
code."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("multiprocess")
    port = _free_port()
    # one thread each: the suite's other workers share the CPU
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "multiprocess_checks.py"), str(i), "2", str(port), str(out / f"{i}.json")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]  # fmt: skip
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=900)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the multi-process run did not finish in 900 s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((out / f"{i}.json").read_text()) for i in range(2)]


def test_two_processes_of_two_devices(results):
    for i, r in enumerate(results):
        assert (r["process"], r["processes"], r["devices"], r["local_devices"]) == (i, 2, 4, 2)


def test_sharded_calculator_equals_one_device_in_every_process(results):
    for r in results:
        for scheme in ("exchange",):
            for prop, dev in r["calculator"][scheme].items():
                assert dev < 1e-12, (r["process"], scheme, prop, dev)
    assert results[0]["calculator"]["energy"] == results[1]["calculator"]["energy"]


def test_data_parallel_training_equals_one_device(results):
    for r in results:
        assert r["training"]["loss"] < 1e-12 and r["training"]["params"] < 1e-12, r["training"]
        assert r["training"]["losses"][1] < r["training"]["losses"][0]  # it trained
