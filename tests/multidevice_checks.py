"""The multi-device checks of tests/test_distributed.py, run in a process of its own: JAX must
be given its 4 host devices before it starts, and the test process's JAX has started.

``python tests/multidevice_checks.py OUT.json [CHECK ...]``: runs the checks (default: all of
:data:`CHECKS`), computes each one's largest deviation from the single-device result and writes
them (with what each case held, and the seconds each check took) as JSON; the tests assert.
Float64 (exact up to summation order) unless a check says float32.
"""

import json
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from ase.build import fcc111  # noqa: E402
from ase.cluster import Icosahedron  # noqa: E402

from jequi.graph import Graph  # noqa: E402
from jequi.models import JequiCalculator, MACEConfig, NequIP, NequIPConfig, NequixConfig, ase_nve, data  # noqa: E402
from jequi.models import calculator as single  # noqa: E402
from jequi.models import distributed as dist  # noqa: E402
from jequi.models import mesh as mesh_lib  # noqa: E402
from jequi.models.decomposition import SCHEMES, Decomposition  # noqa: E402
from jequi.models.train import train  # noqa: E402

CONFIG = NequIPConfig(hidden="4x0e+2x1o", sh_lmax=1, num_layers=2, num_basis=4, radial_hidden=8)
# data parallelism does not depend on depth: one layer keeps the training step's compilation short
TRAIN_CONFIG = NequIPConfig(hidden="4x0e+2x1o", sh_lmax=1, num_layers=1, num_basis=4, radial_hidden=8)
# one bucket for every structure below: one compilation per scheme and device count
ATOMS_PAD, EDGES_PAD = 64, 1536


def periodic():
    """Rattled Cu3Au, 2 x 2 x 4 cubic cells (64 atoms): slabs thinner than the cutoff, periodic
    self-images, ghosts from every other device."""
    from jequi.__main__ import default_structure

    return default_structure().repeat((1, 1, 2))


def open_cluster():
    """A rattled 55-atom Ni-Ag icosahedron, no cell, not periodic (Cartesian cuts)."""
    atoms = Icosahedron("Ni", 3)
    atoms.numbers[::3] = 47
    atoms.rattle(0.05, seed=3)
    atoms.cell[:] = 0.0
    return atoms


def planes():
    """A 3-layer Cu(111) slab, periodic in x and y, open in z, cut into 4 regions along z: the
    count-balanced cuts fall on the atomic planes, so every atom lies on a region boundary and
    region 0 holds no atom."""
    atoms = fcc111("Cu", (3, 3, 3), vacuum=4.0)
    atoms.numbers[::4] = 79
    return atoms


STRUCTURES = {"periodic": (periodic, None), "open": (open_cluster, None), "planes": (planes, (1, 1, 4))}


def model_params():
    atoms = periodic()
    s, r, sh = data.neighbour_edges(atoms, CONFIG.cutoff)
    g = Graph.build(s, r, len(atoms), shifts=sh)
    p = NequIP(CONFIG).init(jax.random.key(0), jnp.asarray(CONFIG.species_index(atoms.numbers)), jnp.asarray(atoms.positions), g,
                            jnp.asarray(atoms.cell.array))  # fmt: skip
    return jax.tree.map(lambda a: a + 0.1, p)  # nonzero species shifts


# MACE through the same machinery (its conv input exchanged like NequIP's; species-indexed skip
# and contraction on each device's own atoms)
MACE_CONFIG = MACEConfig(species=(29, 79), cutoff=4.5, hidden="4x0e+4x1o", radial_mlp=(8,), avg_num_neighbors=20.0,
                         atomic_energies=(-3.0, -4.0), backend="xla", contraction_backend="xla")  # fmt: skip
# a small Nequix: layer norm and per-species skips (index_weights) both on
NEQUIX_CONFIG = NequixConfig(species=(29, 79), cutoff=4.5, hidden="4x0e+2x1o+2x2e", sh_lmax=2, num_layers=2, radial_mlp_size=8,
                             index_weights=True, avg_num_neighbors=20.0, shift=0.1, scale=1.3, backend="xla")  # fmt: skip


def reference(params, atoms, config=CONFIG):
    """Single-device energy, per-atom energies, forces and virial (the calculator's function)."""
    n = len(atoms)
    s, r, sh = data.neighbour_edges(atoms, config.cutoff)
    pad = EDGES_PAD - len(s)
    species = np.zeros(ATOMS_PAD, np.int32)
    species[:n] = config.species_index(atoms.numbers)
    positions = np.zeros((ATOMS_PAD, 3))
    positions[:n] = atoms.positions
    inputs = (species, positions, atoms.cell.array, np.concatenate([s, -np.ones(pad, np.int32)]),
              np.concatenate([r, -np.ones(pad, np.int32)]), np.concatenate([sh, np.zeros((pad, 3))]), np.arange(ATOMS_PAD) < n)  # fmt: skip
    e, per_atom, forces, virial = jax.jit(single._evaluate, static_argnums=0)(config, params, *map(jnp.asarray, inputs))
    return float(e), np.asarray(per_atom)[:n], np.asarray(forces)[:n], np.asarray(virial)


def deviations(result, ref):
    e, per_atom, forces, virial = ref
    return {
        "energy": abs(result.energy - e) / max(abs(e), 1.0),
        "energies": float(np.abs(result.energies - per_atom).max() / np.abs(per_atom).max()),
        "forces": float(np.abs(result.forces - forces).max() / np.abs(forces).max()),
        "virial": float(np.abs(result.virial - virial).max() / np.abs(virial).max()),
        "max_force": float(np.abs(forces).max()),
    }


def check_structures(params):
    """Both schemes on 4 devices against one device."""
    out = {}
    for name, (build, grid) in STRUCTURES.items():
        atoms = build()
        ref = reference(params, atoms)
        for scheme in SCHEMES:
            dec = Decomposition(4, scheme, grid, min_atoms=ATOMS_PAD, min_edges=EDGES_PAD)
            shards = dist.split_atoms(atoms, CONFIG, dec)
            result = dist.evaluate(params, CONFIG, shards, mesh_lib.device_mesh(4), jnp.float64)
            key = f"{name}/{scheme}/4"
            out[key] = deviations(result, ref) | {
                "atoms": len(atoms), "grid": list(shards.grid), "owned": shards.counts["owned"].tolist(),
                "ghosts": shards.counts["ghosts"].tolist(), "shifts": list(shards.layout.shifts),
            }  # fmt: skip
            if name == "planes":  # where each atom lies relative to its region's cuts
                z = atoms.positions[:, 2]
                cuts = np.sort(z)[(np.arange(1, 4) * len(z)) // 4]
                out[key]["atoms_on_cuts"] = int(np.isin(z, cuts).sum())
    return out


def check_split_model(config, seed: int):
    """A model (`config`, random parameters) split over 4 devices, both schemes, against one
    device (periodic Cu3Au)."""
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), config.init_params(jax.random.key(seed)))
    atoms = periodic()
    ref = reference(params, atoms, config)
    out = {}
    for scheme in SCHEMES:
        dec = Decomposition(4, scheme, None, min_atoms=ATOMS_PAD, min_edges=EDGES_PAD)
        shards = dist.split_atoms(atoms, config, dec)
        out[scheme] = deviations(dist.evaluate(params, config, shards, mesh_lib.device_mesh(4), jnp.float64), ref)
    return out


def check_training():
    """Three steps of :func:`train` on 4 devices and on one from the same parameters: the same
    losses and parameters. Batches of 3 structures: one device holds none."""
    from jequi.models.train import fit_species_shift, make_batches

    structures = data.emt_dataset(6, seed=5)
    b = make_batches(structures, TRAIN_CONFIG, 3)[0]
    start = NequIP(TRAIN_CONFIG).init(jax.random.key(0), b.species, b.positions, b.graph, b.cell)
    start = {"params": {**start["params"], "species_shift": jnp.asarray(fit_species_shift(TRAIN_CONFIG, structures))}}
    runs = {}
    for devices in (1, 4):
        params, history = train(TRAIN_CONFIG, structures, steps=3, batch_size=3, progress=False, devices=devices, learning_rate=1e-2,
                                params=start)  # fmt: skip
        runs[devices] = (jax.tree.leaves(params), np.asarray(history.loss))
    (p1, l1), (p4, l4) = runs[1], runs[4]
    largest = lambda pairs: max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in pairs)  # noqa: E731
    return {
        "losses": l1.tolist(),
        "loss": float(np.abs(l4 - l1).max() / np.abs(l1).max()),
        "params": largest(zip(p1, p4)) / max(float(np.abs(a).max()) for a in p1),
        "moved": largest(zip(p1, jax.tree.leaves(start))),
    }


def check_calculator_md(atoms):
    """The shipped model in float32: ShardedCalculator on 2 devices vs JequiCalculator, a single
    point with stress and 4 steps of ase's velocity Verlet (the trajectories' energies), and
    the sharded calculator's compilations over the run (buckets: one). Also returns the single
    device's energy and forces."""
    one, two = JequiCalculator("nequip-emt", backend="xla"), dist.ShardedCalculator("nequip-emt", devices=2, backend="xla")
    out = {}
    reference = one.get_potential_energy(atoms), one.get_forces(atoms)
    for what in ("energy", "forces", "stress"):
        a, b = (np.asarray(c.get_property(what, atoms), np.float64) for c in (one, two))
        out[what] = float(np.abs(b - a).max() / max(np.abs(a).max(), 1.0 if what == "energy" else 1e-30))
    md1, md2 = (ase_nve(atoms, c, 4, temperature_K=600.0, seed=1) for c in (one, two))
    out["md_energy"] = float(np.abs(md2["total_energy"] - md1["total_energy"]).max() / len(atoms))  # eV/atom
    out["md_positions"] = float(np.abs(md2["atoms"].positions - md1["atoms"].positions).max())
    out["compilations"] = two.compilations
    out["shifts"] = list(two.shards.layout.shifts)
    return out, reference


def check_main(reference):
    """``python -m jequi --model nequip-emt --devices 2`` on its default structure: the energy and the forces it
    prints (4 decimals) against the single-device calculator's (`reference`)."""
    import contextlib
    import io

    from jequi.__main__ import main

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        main(["--model", "nequip-emt", "--devices", "2", "--md", "0"])
    text = buffer.getvalue()
    energy = float(text.split("\nenergy: ")[1].split()[0])
    lines = text.split("forces (eV/A), first atoms:\n")[1].splitlines()[:5]
    forces = np.array([[float(v) for v in line.split()[2:5]] for line in lines])
    return {"energy": abs(energy - reference[0]), "forces": float(np.abs(forces - reference[1][:5]).max()), "split_line": "split over 2" in text}


def check_calculator_and_main():
    from jequi.__main__ import default_structure

    calculator, reference = check_calculator_md(default_structure())
    return {"calculator": calculator, "main": check_main(reference)}  # main reuses the calculator check's compilation


def check_chunked_conv():
    """``radial_conv`` in edge chunks (what large structures run) inside ``shard_map`` as the
    models call it (``check_vma=mesh_lib.CHECK_VMA``), each device its own graph, against the
    unchunked conv on one device; xla and the Pallas kernels (a ``pallas_call`` inside)."""
    import jequi
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tp = jequi.channelwise("4x0e+4x1o", "0e+1o", "0e+1o")
    n, e, rng = 6, 10, np.random.default_rng(0)
    x, y, h = (rng.normal(size=(4, m, d)) for m, d in ((n, tp.irreps_in1.dim), (e, tp.irreps_in2.dim), (e, 3)))
    kernel = rng.normal(size=(3, tp.weight_numel))
    s, r = rng.integers(0, n, (4, e)), np.sort(rng.integers(0, n, (4, e)), axis=1)
    mesh = mesh_lib.device_mesh(4)
    axis = mesh.axis_names[0]

    put = lambda a, spec: jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))  # noqa: E731
    args = [put(a, P(axis)) for a in (x, y, h, s, r)] + [put(kernel, P())]
    ref = np.stack([tp.radial_conv(x[d], y[d], h[d], kernel, Graph.build(s[d], r[d], n), edge_chunks=1, backend="xla") for d in range(4)])
    out = {}
    for backend in ("xla", "pallas"):

        def conv(x, y, h, s, r, k, backend=backend):
            return tp.radial_conv(x[0], y[0], h[0], k, Graph.build(s[0], r[0], n), edge_chunks=3, backend=backend)[None]

        sharded = jax.shard_map(conv, mesh=mesh, in_specs=(P(axis),) * 5 + (P(),), out_specs=P(axis), check_vma=mesh_lib.CHECK_VMA)
        out[backend] = float(np.abs(np.asarray(jax.jit(sharded)(*args)) - ref).max() / np.abs(ref).max())
    return out


CHECKS = {"structures": lambda: check_structures(model_params()), "calculator": check_calculator_and_main, "training": check_training,
          "chunked_conv": check_chunked_conv, "mace": lambda: check_split_model(MACE_CONFIG, 3), "nequix": lambda: check_split_model(NEQUIX_CONFIG, 4)}  # fmt: skip


def main(path, names):
    results = {"devices": len(jax.devices()), "seconds": {}}
    for name in names or CHECKS:
        t0 = time.perf_counter()
        results[name] = CHECKS[name]()
        results["seconds"][name] = time.perf_counter() - t0
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
