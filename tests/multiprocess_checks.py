"""The multi-process checks of tests/test_multiprocess.py: one of several processes of one
``jax.distributed`` run, each with 2 host CPU devices and gloo's CPU collectives, as a cluster
runs one process per GPU (docs/distributed.md). The model code is the single-process code.

``python tests/multiprocess_checks.py PROCESS_ID NUM_PROCESSES PORT OUT.json``: each process
computes on the mesh of every process's devices and, on its own first device, the
single-device reference, and writes the largest deviations as JSON; the test asserts.
Float64.
"""

import json
import sys

import jax

process_id, num_processes, port, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_enable_x64", True)
jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes, process_id=process_id)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jequi.models import JequiCalculator, NequIP, NequIPConfig, data  # noqa: E402
from jequi.models.distributed import ShardedCalculator  # noqa: E402
from jequi.models.train import fit_species_shift, make_batches, train  # noqa: E402

TRAIN_CONFIG = NequIPConfig(hidden="4x0e+2x1o", sh_lmax=1, num_layers=1, num_basis=4, radial_hidden=8)


def relative(a, b, floor=1e-30) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), floor))


def check_calculator():
    """The shipped model split over every process's devices (the exchange scheme, whose
    ``ppermute`` crosses processes) against one device."""
    from jequi.__main__ import default_structure

    atoms = default_structure()
    with jax.default_device(jax.local_devices()[0]):
        one = JequiCalculator("nequip-emt", backend="xla", dtype="float64")
        reference = {p: np.asarray(one.get_property(p, atoms)) for p in ("energy", "forces", "stress")}
    out = {}
    for scheme in ("exchange",):
        calc = ShardedCalculator("nequip-emt", devices=jax.device_count(), scheme=scheme, backend="xla", dtype="float64")
        out[scheme] = {p: relative(calc.get_property(p, atoms), v, 1.0 if p == "energy" else 1e-30) for p, v in reference.items()}
    out["energy"] = float(reference["energy"])
    return out


def check_training():
    """Two data-parallel steps of :func:`train` over every device against one device, from the
    same parameters: the same losses and parameters."""
    structures = data.emt_dataset(8, seed=5)
    b = make_batches(structures, TRAIN_CONFIG, 4)[0]
    start = NequIP(TRAIN_CONFIG).init(jax.random.key(0), b.species, b.positions, b.graph, b.cell)
    start = TRAIN_CONFIG.with_species_energies(start, fit_species_shift(TRAIN_CONFIG, structures))
    runs = {}
    for devices in (1, jax.device_count()):
        with jax.default_device(jax.local_devices()[0]):
            params, history = train(TRAIN_CONFIG, structures, steps=2, batch_size=4, progress=False, devices=devices,
                                    learning_rate=1e-2, params=start)  # fmt: skip
        runs[devices] = ([np.asarray(a) for a in jax.tree.leaves(params)], np.asarray(history.loss))
    (p1, l1), (pn, ln) = runs[1], runs[jax.device_count()]
    return {"loss": relative(ln, l1), "params": max(relative(a, b) for a, b in zip(pn, p1)), "losses": l1.tolist()}


result = {"process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
          "local_devices": jax.local_device_count(), "calculator": check_calculator(), "training": check_training()}  # fmt: skip
with open(out_path, "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
