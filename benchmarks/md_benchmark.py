"""Molecular dynamics steps per second: the ASE-calculator path against the on-device loop.

Periodic fcc Cu supercells (1k, 10k, 100k atoms by default) at 300 K, NVE velocity Verlet with a
1 fs step and the shipped model (float32), two ways:

* ``ase``: ase's ``VelocityVerlet`` with :class:`jequi.models.JequiCalculator` (vesin's
  neighbour list on the host every step, sizes padded to buckets, one device call a step);
* ``device``: :class:`jequi.models.DeviceMD`, velocity Verlet in ``lax.scan`` with the cell
  list rebuilt on the device every ``--rebuild-every`` steps (skin 0.5 Å); one call a run.

The first steps (compilation) are run and timed apart. Writes
``<date>-<device>-md.{json,md}`` into --out (and $OUT) after every cell, so a run cut short
keeps what it measured. ``--smoke``: a tiny random model on 108 atoms, a few steps (CPU check).

    python benchmarks/md_benchmark.py [--sizes 1000,10000,100000] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import sys
import time
import traceback

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import jequi  # noqa: E402
from jequi.models import DeviceMD, JequiCalculator, NequIP, NequIPConfig, ase_nve, pretrained  # noqa: E402
from jequi.models.md import thermalize  # noqa: E402
from timing import save  # noqa: E402


def cu_supercell(atoms_wanted: int, seed: int = 0):
    """fcc Cu (a = 3.61 Å), the cubic cell repeated n^3 times with 4 n^3 nearest `atoms_wanted`."""
    from ase.build import bulk

    n = max(1, round((atoms_wanted / 4) ** (1 / 3)))
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))
    atoms.rattle(0.02, seed=seed)
    return atoms


def smoke_model():
    """A tiny random model (cutoff 3 Å) for a CPU check of the whole script."""
    config = NequIPConfig(hidden="4x0e+2x1o+2x2e", num_basis=4, radial_hidden=8, cutoff=3.0)
    atoms = cu_supercell(108)
    g = jequi.graph_from_atoms(atoms, config.cutoff)
    params = NequIP(config).init(jax.random.key(0), config.species_index(atoms.numbers), atoms.positions.astype(np.float32), g,
                                 atoms.cell.array.astype(np.float32))  # fmt: skip
    return params, config


def measure_ase(atoms, model, steps: int) -> dict:
    calc = JequiCalculator(model)
    t0 = time.perf_counter()
    run = ase_nve(atoms, calc, steps, timestep_fs=1.0, temperature_K=None)
    total = time.perf_counter() - t0
    return {"steps": steps, "steps_per_s": run["steps_per_s"], "first_step_s": total - (steps - 1) / run["steps_per_s"],
            "drift_meV_per_atom": run["drift_meV_per_atom"], "compilations": calc.compilations}  # fmt: skip


def measure_device(atoms, model, steps: int, rebuild_every: int) -> dict:
    t0 = time.perf_counter()
    md = DeviceMD(atoms, model, timestep_fs=1.0, skin=0.5, rebuild_every=rebuild_every)
    warm = md.run(steps)  # compiles (the timed run has the same number of steps: the same program)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = md.run(steps)
    seconds = time.perf_counter() - t0
    total = np.concatenate([warm["potential"] + warm["kinetic"], out["potential"] + out["kinetic"]])
    c = md.cells
    return {"steps": out["steps"], "steps_per_s": out["steps"] / seconds, "first_run_s": first_s,
            "drift_meV_per_atom": 1e3 * (total[-1] - total[0]) / len(atoms), "rebuild_every": rebuild_every,
            "cell_list": {"dims": list(c.dims), "cell_capacity": c.cell_capacity, "neighbour_capacity": c.neighbour_capacity},
            "regrown": md.regrown}  # fmt: skip


def markdown(result: dict) -> str:
    lines = [
        f"# MD steps per second on {result['device']} ({result['date']})", "",
        f"jax {result['jax']}, jequi backend `{result['backend']}`, ase {result['ase']}, vesin {result['vesin']}; model "
        f"{result['model']}; fcc Cu at 300 K, NVE velocity Verlet, 1 fs, float32. `ase`: ase's VelocityVerlet with "
        "JequiCalculator (vesin neighbour list on the host every step); `device`: DeviceMD (lax.scan, cell list "
        "rebuilt on the device every k steps, skin 0.5 Å). `python benchmarks/md_benchmark.py`.", "",
        "| atoms | ase steps/s | device steps/s | device / ase | ase drift meV/atom | device drift meV/atom | notes |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for cell in result["cells"]:
        a, d = cell.get("ase", {}), cell.get("device", {})
        ratio = d["steps_per_s"] / a["steps_per_s"] if "steps_per_s" in a and "steps_per_s" in d else float("nan")
        fmt = lambda x, p: f"{x:.{p}f}" if isinstance(x, float) else "-"  # noqa: E731
        notes = "; ".join(f"{k}: {v['error']}" for k, v in (("ase", a), ("device", d)) if "error" in v)
        if "steps" in d:
            notes = (notes + "; " if notes else "") + f"device: {d['steps']} steps, rebuild every {d['rebuild_every']}"
        lines.append(f"| {cell['atoms']} | {fmt(a.get('steps_per_s'), 2)} | {fmt(d.get('steps_per_s'), 2)} | {ratio:.1f}x | "
                     f"{fmt(a.get('drift_meV_per_atom'), 3)} | {fmt(d.get('drift_meV_per_atom'), 3)} | {notes} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--ase-steps", type=int, default=20, help="ASE-path steps at 1k atoms (fewer for larger, at least 4)")
    ap.add_argument("--device-steps", type=int, default=200, help="on-device steps timed (after as many to compile)")
    ap.add_argument("--rebuild-every", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="a tiny random model on 108 atoms (a CPU check)")
    ap.add_argument("--kind", default="md", help="the results' name after <date>-<device>- (a second run's own name)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    if a.smoke:
        model, sizes, a.ase_steps, a.device_steps, label = smoke_model(), [108], 3, 10, "tiny random (smoke)"
        a.rebuild_every = 5
    else:
        params, config, info = pretrained.load()
        model, sizes = (params, config), [int(s) for s in a.sizes.split(",")]
        label = f"nequip-emt ({config.hidden}, cutoff {config.cutoff} Å)"
    dev = jax.devices()[0]
    result = {
        "date": datetime.date.today().isoformat(), "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
        "backend": jequi.default_backend(), "ase": importlib.metadata.version("ase"), "vesin": importlib.metadata.version("vesin"),
        "model": label, "cells": [],
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}), flush=True)
    kind = f"{a.kind}-smoke" if a.smoke else a.kind
    for size in sizes:
        atoms = cu_supercell(size)
        thermalize(atoms, 300.0, seed=0)
        cell = {"atoms": len(atoms)}
        result["cells"].append(cell)
        ase_steps = max(4, round(a.ase_steps * min(1.0, 1000 / len(atoms)) ** 0.5))
        for name, fn in (("ase", lambda: measure_ase(atoms, model, ase_steps)),
                         ("device", lambda: measure_device(atoms, model, a.device_steps, a.rebuild_every))):  # fmt: skip
            try:
                cell[name] = fn()
            except Exception as e:  # noqa: BLE001 (out of memory at the largest sizes: recorded, the others go on)
                traceback.print_exc()
                cell[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            print(json.dumps({"atoms": len(atoms), name: cell[name]}), flush=True)
            save(result, kind, markdown(result), a.out)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
