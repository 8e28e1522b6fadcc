"""``python -m jequi``: a foundation potential on a real material.

Loads a model (``--model``: a shipped name or a checkpoint's path; default the Nequix
foundation model ``nequix-oam-1``, trained on OMat24, sAlex and MPtrj DFT data, see
``jequi/models/weights/nequix-oam-1.md``) and prints its provenance. It builds the periodic
radius graph of a structure (default: rocksalt MgO, 2x2x2 conventional cells, 64 atoms,
thermally rattled; ``--structure FILE`` for any ase-readable file) and prints its energy,
forces and stress, the backend used and timings. Then it runs a short molecular dynamics
(``--md STEPS``, default 20; 0: none): velocity Verlet at constant energy from 300 K through
ase with :class:`jequi.models.JequiCalculator`, printing steps per second and the energy
drift.

``--model nequip-emt`` runs the small NequIP-style model trained on EMT labels, on a Cu3Au
alloy, with ase's EMT as the reference. ``--train`` first trains such a model for a short
while (progress bar) and reports its validation errors. ``--devices N`` splits the structure
over N devices (:mod:`jequi.models.distributed`; on a CPU, N host devices) and prints the
same energy and forces as one device. ``--check`` reports what this machine runs
(:mod:`jequi.check`) and exits.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import numpy as np
from ase import units

import jequi
from jequi.models import JequiCalculator, NequIPConfig, NequixConfig, ase_nve, data, pretrained
from jequi.models.calculator import load_model
from jequi.models.decomposition import SCHEMES


def default_structure():
    """Cu3Au (L1_2, a = 3.75 Å), 2x2x2 cubic cells, rattled by 0.08 Å: the EMT model's structure."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.75, cubic=True)
    atoms.numbers[0] = 79  # Au at the cube corners, Cu on the faces: L1_2
    atoms = atoms.repeat((2, 2, 2))
    atoms.rattle(0.08, seed=42)
    return atoms


def foundation_structure():
    """Rocksalt MgO (a = 4.21 Å, the measured lattice constant), 2x2x2 conventional cells
    (64 atoms), rattled by 0.05 Å."""
    from ase.build import bulk

    atoms = bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((2, 2, 2))
    atoms.rattle(0.05, seed=42)
    return atoms


def describe(name, params, config, info) -> list[str]:
    """What the job prints about the model: its architecture, size and provenance."""
    count = sum(x.size for x in jax.tree.leaves(params))
    if isinstance(config, NequixConfig):
        lines = [f"model: {name}: Nequix, {config.num_layers} layers, hidden {config.hidden}, cutoff {config.cutoff} A, "
                 f"{len(config.species)} elements, {count} parameters"]  # fmt: skip
        f = pretrained.FOUNDATION.get(str(name))
        if f:
            lines += [f"  trained on {f['data']}", f"  labels: {f['theory']}", f"  reference: {f['reference']}",
                      f"  weights: {pretrained.NEQUIX_REPO} at {f['commit'][:10]} (MIT licence); card: "
                      f"{pretrained.WEIGHTS / f'{name}.md'}"]  # fmt: skip
        return lines
    line = (f"model: {name}: NequIP-style, {config.num_layers} layers, hidden {config.hidden}, cutoff {config.cutoff} A, "
            f"{count} parameters")  # fmt: skip
    if "val_energy_mae_eV_per_atom" in info:
        line += (f"; held-out errors {1e3 * info['val_energy_mae_eV_per_atom']:.1f} meV/atom, "
                 f"{1e3 * info['val_force_mae_eV_per_A']:.0f} meV/A")  # fmt: skip
    if "large_force_mae_eV_per_A" in info:
        line += (f" (larger cells: {1e3 * info['large_energy_mae_eV_per_atom']:.1f} meV/atom, "
                 f"{1e3 * info['large_force_mae_eV_per_A']:.0f} meV/A)")  # fmt: skip
    lines = [line]
    if name == pretrained.NAME:
        lines.append(f"  trained on EMT labels (a toy potential for tests and demos); card: {pretrained.WEIGHTS / f'{pretrained.NAME}.md'}")
    return lines


def emt_reference(atoms):
    from ase.calculators.emt import EMT

    try:
        ref = atoms.copy()
        ref.calc = EMT()
        return ref.get_potential_energy(), ref.get_forces()
    except NotImplementedError:
        return None


def timed(fn, *args, repeat=3):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return out, first, float(np.median(times))


def main(argv=None, *, train_config: NequIPConfig | None = None):
    """The command line's job; `train_config`: the model ``--train`` trains (default: NequIPConfig()),
    a hook for tests, which check the job's steps rather than the model's quality."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="report the platform, versions and backends, self-test them, and exit")
    ap.add_argument("--model", default="nequix-oam-1", metavar="NAME_OR_PATH",
                    help=f"a shipped model ({', '.join(pretrained.shipped())}) or a checkpoint's path (.nqx); default nequix-oam-1")
    ap.add_argument("--structure", help="an ase-readable file (default: rattled MgO; Cu3Au for the EMT model)")
    ap.add_argument("--train", action="store_true", help="train a fresh model briefly first, and use it")
    ap.add_argument("--steps", type=int, default=150, help="--train: optimisation steps")
    ap.add_argument("--backend", default=None, help="jequi backend (default: the fastest available)")
    ap.add_argument("--md", type=int, default=20, metavar="STEPS", help="molecular-dynamics steps after the single point (0: none)")
    ap.add_argument("--md-timestep", type=float, default=1.0, metavar="FS", help="MD time step, fs")
    ap.add_argument("--temperature", type=float, default=300.0, help="MD starting temperature, K")
    ap.add_argument("--devices", type=int, default=1, metavar="N", help="split the structure (and --train's batches) over N devices (default 1)")
    ap.add_argument("--scheme", choices=SCHEMES, default="exchange", help="--devices: how (jequi.models.decomposition)")
    a = ap.parse_args(argv)
    if a.check:
        from jequi import check

        raise SystemExit(check.run())
    if a.devices < 1:
        ap.error(f"--devices must be >= 1, got {a.devices}")
    if a.devices > 1:
        try:  # a CPU gets N host devices; a GPU platform is unaffected
            jax.config.update("jax_num_cpu_devices", a.devices)
        except RuntimeError:  # JAX already started (main called from a program): the devices it has are checked below
            pass

    name = a.model
    if a.train:
        from jequi.models.train import train

        name, config = "fresh NequIP", train_config or NequIPConfig()  # a small model: a brief training on a CPU
        train_set, val_set = data.emt_dataset(96, seed=11), data.emt_dataset(16, seed=12)
        print(f"training a fresh model on {len(train_set)} EMT structures ({a.steps} steps)")
        params, history = train(config, train_set, val_set, steps=a.steps, eval_every=max(1, a.steps // 3), energy_weight=30.0,
                                devices=a.devices)  # data-parallel over the same devices
        print(f"trained in {history.seconds:.1f} s: validation energy MAE {1e3 * history.val_energy_mae[-1]:.1f} meV/atom, "
              f"force MAE {1e3 * history.val_force_mae[-1]:.0f} meV/A (loss {history.loss[0]:.3f} -> {history.loss[-1]:.3f})\n")
        info = {"val_energy_mae_eV_per_atom": history.val_energy_mae[-1], "val_force_mae_eV_per_A": history.val_force_mae[-1]}
    elif name == pretrained.NAME:
        params, config, info = pretrained.load()
    else:
        (params, config), info = load_model(name), {}
    emt = isinstance(config, NequIPConfig)  # the EMT-trained models: Cu3Au by default, EMT as the reference
    if a.structure:
        import ase.io

        atoms, source = ase.io.read(a.structure), a.structure
    elif emt:
        atoms, source = default_structure(), "embedded Cu3Au L1_2, 2x2x2 cells, rattled 0.08 A"
    else:
        atoms, source = foundation_structure(), "rocksalt MgO, 2x2x2 conventional cells (a = 4.21 A), rattled 0.05 A"

    backend = a.backend or jequi.default_backend()
    config = dataclasses.replace(config, backend=backend)
    # the single point and the MD share the calculator's compilation
    if a.devices > 1:
        from jequi.models.distributed import ShardedCalculator, device_arrays, split_atoms

        calc = ShardedCalculator((params, config), devices=a.devices, scheme=a.scheme)
        t0 = time.perf_counter()
        shards = split_atoms(atoms, calc.config, calc.decomposition)
        split_s = time.perf_counter() - t0
        inputs = (shards.layout, calc.params, *device_arrays(shards, calc.mesh, calc.dtype))

        def energy_forces(*inputs):
            total, _, forces, virial = calc.compiled(*inputs)
            return total, forces, virial
    else:
        calc = JequiCalculator((params, config))
        inputs = calc.padded_inputs(atoms)

        def energy_forces(*inputs):
            total, _, forces, virial = calc.compiled(calc.params, *inputs)
            return total, forces[: len(atoms)], virial

    (energy, forces, virial), first_s, call_s = timed(energy_forces, *inputs)
    forces = shards.gather(forces) if a.devices > 1 else np.asarray(forces)
    print(f"structure: {source}: {atoms.get_chemical_formula()}, {len(atoms)} atoms, pbc={atoms.pbc.tolist()}")
    print("\n".join(describe(name, params, config, info)))
    if a.devices > 1:
        lay, c = shards.layout, shards.counts
        print(f"graph: {c['edges'].sum()} edges split over {a.devices} {jax.default_backend()} devices by the {a.scheme!r} scheme, "
              f"regions {shards.grid}: per device atoms {c['owned'].tolist()}, ghosts {c['ghosts'].tolist()}, edges "
              f"{c['edges'].tolist()} (padded to {lay.owned}, {lay.ghosts}, {lay.edges}; host split {1e3 * split_s:.0f} ms); jequi backend {backend!r}")
    else:
        num_edges = int((np.asarray(inputs[4]) >= 0).sum())
        print(f"graph: {num_edges} edges (padded to {inputs[4].shape[0]}); JAX platform {jax.default_backend()}, jequi backend {backend!r}")
    print(f"\nenergy: {float(energy):.4f} eV ({float(energy) / len(atoms):.4f} eV/atom)")
    print("forces (eV/A), first atoms:")
    for i in range(min(5, len(atoms))):
        print(f"  {i:3d} {atoms.get_chemical_symbols()[i]:>2s} " + " ".join(f"{v:+.4f}" for v in forces[i]))
    print(f"max |F| {np.linalg.norm(forces, axis=1).max():.4f} eV/A; sum of forces {np.abs(forces.sum(0)).max():.1e}")
    if np.all(atoms.pbc):
        stress = np.asarray(virial, np.float64) / atoms.get_volume() / units.GPa
        print("stress (GPa, xx yy zz yz xz xy): " + " ".join(f"{v:+.3f}" for v in stress.flat[[0, 4, 8, 5, 2, 1]]))
    ref = emt_reference(atoms) if emt else None
    if ref is not None:
        print(f"EMT reference: energy {ref[0]:.4f} eV; force MAE of the model vs EMT {1e3 * np.abs(forces - ref[1]).mean():.0f} meV/A "
              f"(EMT forces mean |F_i| {1e3 * np.abs(ref[1]).mean():.0f} meV/A)")
    print(f"\ntiming: first call (compile) {first_s:.2f} s; energy + forces + stress {1e3 * call_s:.2f} ms per call")
    if a.md > 0:
        md = ase_nve(atoms, calc, a.md, timestep_fs=a.md_timestep, temperature_K=a.temperature)
        print(f"\nMD: {a.md} steps of velocity Verlet (NVE, {a.md_timestep} fs, from {a.temperature:.0f} K) through ase and "
              f"{type(calc).__name__} (vesin neighbour list, sizes padded to buckets: {calc.compilations} compilation(s))")
        print(f"MD: {md['steps_per_s']:.1f} steps/s; energy drift {md['drift_meV_per_atom']:+.3f} meV/atom "
              f"(largest deviation {md['max_deviation_meV_per_atom']:.3f} meV/atom; final T {md['atoms'].get_temperature():.0f} K)")


if __name__ == "__main__":
    main()
