"""Neighbour-list libraries on this CPU: ase, matscipy and vesin on periodic fcc Cu supercells.

The calculator (:class:`jequi.models.JequiCalculator`) rebuilds the radius graph on the host
at every MD step, so its neighbour list must be fast at the sizes people run (issue 48). Each
library computes the full list ``i, j, S`` (both directions, integer cell shifts) at the shipped
model's cutoff; the pair counts are checked equal. Writes
``<date>-cpu-neighbour-lists.{md,json}`` into --out.

    python benchmarks/neighbour_lists.py [--sizes 1000,10000,100000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import pathlib
import platform
import statistics
import time



def cu_supercell(atoms_wanted: int):
    """Periodic fcc Cu (a = 3.61 Å), the cubic cell repeated n x n x n with 4 n^3 nearest to
    `atoms_wanted`, rattled 0.05 Å."""
    from ase.build import bulk

    n = max(1, round((atoms_wanted / 4) ** (1 / 3)))
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((n, n, n))
    atoms.rattle(0.05, seed=0)
    return atoms


def ase_nl(atoms, cutoff):
    from ase.neighborlist import neighbor_list

    return neighbor_list("ijS", atoms, cutoff)


def matscipy_nl(atoms, cutoff):
    from matscipy.neighbours import neighbour_list

    return neighbour_list("ijS", atoms, cutoff)


def vesin_nl(atoms, cutoff):
    from vesin import NeighborList

    return NeighborList(cutoff=cutoff, full_list=True).compute(
        points=atoms.positions, box=atoms.cell.array, periodic=bool(atoms.pbc.all()), quantities="ijS"
    )


LIBRARIES = {"ase": ase_nl, "matscipy": matscipy_nl, "vesin": vesin_nl}


def cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--cutoff", type=float, default=None, help="Å (default: the shipped model's)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    if a.cutoff is None:
        from jequi.models import pretrained

        a.cutoff = pretrained.load()[1].cutoff
    import os

    versions = {name: importlib.metadata.version(name) for name in ("ase", "matscipy", "vesin", "numpy")}
    result = {
        "date": datetime.date.today().isoformat(), "device": cpu_name(), "cores_visible": os.cpu_count(),
        "python": platform.python_version(), "versions": versions, "cutoff": a.cutoff, "cells": [],
    }  # fmt: skip
    for size in (int(s) for s in a.sizes.split(",")):
        atoms = cu_supercell(size)
        counts = {}
        for name, fn in LIBRARIES.items():
            times = []
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                i, j, S = fn(atoms, a.cutoff)
                times.append(time.perf_counter() - t0)
            counts[name] = len(i)
            cell = {"atoms": len(atoms), "library": name, "pairs": len(i), "median_s": statistics.median(times), "min_s": min(times)}
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
        if len(set(counts.values())) != 1:
            raise RuntimeError(f"the libraries disagree on the number of pairs at {len(atoms)} atoms: {counts}")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{result['date']}-cpu-neighbour-lists"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    sizes = sorted({c["atoms"] for c in result["cells"]})
    lines = [
        f"# Neighbour lists on the CPU ({result['date']})", "",
        f"CPU: {result['device']} ({result['cores_visible']} cores visible, shared with other jobs); Python {result['python']}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".", "",
        f"Periodic fcc Cu supercells (a = 3.61 Å, rattled 0.05 Å), full list `i, j, S` at the shipped model's cutoff "
        f"{a.cutoff} Å; median of {a.repeat} calls, seconds (pairs equal across libraries).", "",
        "| atoms | pairs | " + " | ".join(LIBRARIES) + " |", "|---|---|" + "---|" * len(LIBRARIES),
    ]  # fmt: skip
    for n in sizes:
        row = {c["library"]: c for c in result["cells"] if c["atoms"] == n}
        lines.append(f"| {n} | {row['ase']['pairs']} | " + " | ".join(f"{row[k]['median_s']:.4f}" for k in LIBRARIES) + " |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
