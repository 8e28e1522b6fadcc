"""The Nequix foundation model (``nequix-oam-1``, as released) three ways, on one GPU, in one
process: jequi's Nequix (``jequi.models.nequix``, the default backend); Nequix as shipped (the
``nequix`` package's model, e3nn-jax: gather, product, ``scatter_sum``); and Nequix with its
OpenEquivariance kernels (``load_model(kernel=True)``, OpenEquivariance's JAX conv).

Workloads:

* ``efs``: energy, forces and stress of one periodic structure, what an MD or relaxation step
  runs. The structure is a rattled fcc Cu-Au alloy of about 1k, 4k, 16k or 64k atoms
  (``--atoms``). Every implementation gets the same graph, padded as Nequix's calculator pads
  it: edges to 1.1x rounded up to 64, atoms to the next multiple of 8, one padding graph.
* ``train``: the fine-tuning step, the gradient in the parameters of an energy + force + stress
  MAE loss (Nequix's ``loss_type: mae``; second derivatives of every conv). It runs on the
  same structure at ``--train-atoms``.

Each cell gives median ms, compile s and XLA's memory estimate. Device tool, from the repo
root: ``bash benchmarks/nequix_run.sh``. It writes
``<date>-<device>-nequix-oam-1.{json,md}`` into --out and $OUT after every cell.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from model_step import KERNEL_CLASSES, alloy, measure
from timing import save, versions

from jequi.models import pretrained
from jequi.models.calculator import _evaluate
from jequi.models.data import neighbour_edges
from jequi.models.nequix import read_nqx

IMPLS = ("jequi", "nequix", "nequix-oeq")


def padded_sizes(n_atoms: int, n_edges: int) -> tuple[int, int]:
    """Nequix's calculator's padding (nequix/calculator.py ``_pad_graph_jax``)."""
    return ((n_atoms + 8) // 8) * 8, ((math.ceil(n_edges * 1.1) + 63) // 64) * 64


def graph_arrays(atoms, cutoff: float):
    s, r, shifts = neighbour_edges(atoms, cutoff)
    n_pad, e_pad = padded_sizes(len(atoms), len(s))
    return s, r, shifts, n_pad, e_pad


def jequi_inputs(config, atoms, edges):
    """The calculator's padded inputs at Nequix's padding (padding edges: index -1)."""
    s, r, shifts, n_pad, e_pad = edges
    n, pad = len(atoms), e_pad - len(s)
    species = np.zeros(n_pad, np.int32)
    species[:n] = config.species_index(atoms.numbers)
    positions = np.zeros((n_pad, 3))
    positions[:n] = atoms.positions
    f = jnp.float32
    return (jnp.asarray(species), jnp.asarray(positions, f), jnp.asarray(atoms.cell.array, f),
            jnp.asarray(np.concatenate([s, np.full(pad, -1, np.int32)])), jnp.asarray(np.concatenate([r, np.full(pad, -1, np.int32)])),
            jnp.asarray(np.concatenate([shifts, np.zeros((pad, 3))]), f), jnp.asarray(np.arange(n_pad) < n))  # fmt: skip


def nequix_graph(species_order, atoms, edges):
    """Nequix's jraph graph, padded as its calculator pads."""
    import jraph

    s, r, shifts, n_pad, e_pad = edges
    index = np.array([species_order.index(z) for z in atoms.numbers], np.int32)
    g = jraph.GraphsTuple(
        n_node=np.array([len(atoms)]), n_edge=np.array([len(s)]),
        nodes={"species": index, "positions": atoms.positions.astype(np.float32), "forces": None},
        edges={"shifts": shifts.astype(np.float32)}, senders=s, receivers=r,
        globals={"cell": atoms.cell.array.astype(np.float32)[None], "energy": None, "stress": None},
    )  # fmt: skip
    return jax.tree.map(jnp.asarray, jraph.pad_with_graphs(g, n_node=n_pad, n_edge=e_pad, n_graph=2))


def mae_loss(energy, forces, stress, n_atoms, targets):
    e0, f0, s0 = targets
    return jnp.abs(energy - e0) / n_atoms + jnp.mean(jnp.abs(forces - f0)) + jnp.mean(jnp.abs(stress - s0))


def make_cell(impl, workload, atoms, models):
    """``(fn, args, info)`` of one cell."""
    params, config = models["jequi"]
    edges = graph_arrays(atoms, config.cutoff)
    n = len(atoms)
    info = {"atoms": n, "edges": len(edges[0]), "padded_edges": edges[4]}
    rng = np.random.default_rng(0)
    targets = (jnp.float32(-4.0 * n), jnp.asarray(rng.normal(size=(edges[3], 3)), jnp.float32),
               jnp.asarray(rng.normal(size=(3, 3)) * 1e-3, jnp.float32))  # fmt: skip
    volume = float(abs(np.linalg.det(atoms.cell.array)))
    if impl == "jequi":
        inputs = jequi_inputs(config, atoms, edges)
        evaluate = functools.partial(_evaluate, config)
        if workload == "efs":
            return evaluate, (params, *inputs), info

        def step(params, *inputs):
            def loss(p):
                total, _, forces, virial = evaluate(p, *inputs)
                return mae_loss(total, forces, virial / volume, n, targets)

            return jax.grad(loss)(params)

        return step, (params, *inputs), info
    model = models[impl]
    g = nequix_graph(list(config.species), atoms, edges)
    if workload == "efs":
        return (lambda m, g: m(g)), (model, g), info

    def step(model, g):
        def loss(m):
            energy, forces, stress = m(g)
            return mae_loss(energy[0], forces, stress[0], n, targets)

        return jax.grad(loss)(model)

    return step, (model, g), info


def markdown(result) -> str:
    rows = ["| workload | atoms | edges (padded) | impl | ms | compile s | XLA memory GiB | vs nequix | vs nequix-oeq |", "|---|---|---|---|---|---|---|---|---|"]
    cells = result["cells"]
    ms = {(c["workload"], c["size"], c["impl"]): c.get("ms") for c in cells}
    for c in cells:
        if "error" in c:
            rows.append(f"| {c['workload']} | {c['size']} | | {c['impl']} | {c['error'][:80]} | | | | |")
            continue
        ratio = lambda peer: (f"{ms[(c['workload'], c['size'], peer)] / c['ms']:.2f}x" if ms.get((c["workload"], c["size"], peer)) else "")  # noqa: E731
        rows.append(f"| {c['workload']} | {c['atoms']} | {c['edges']} ({c['padded_edges']}) | {c['impl']} | {c['ms']:.2f} | "
                    f"{c['compile_s']:.0f} | {c['memory_gib'] or 0:.2f} | {ratio('nequix')} | {ratio('nequix-oeq')} |")  # fmt: skip
    profiled = [c for c in cells if "profile_ms" in c]
    if profiled:
        rows += ["", "GPU time per call by kernel class (ms, profile), and the longest kernels:", "",
                 "| workload | atoms | impl | " + " | ".join(c for c, _ in KERNEL_CLASSES) + " | longest kernels (ms) |",
                 "|---|---|---|" + "---|" * (len(KERNEL_CLASSES) + 1)]  # fmt: skip
        for c in profiled:
            top = "; ".join(f"{k} {v:.2f}" for k, v in list(c["profile_ms"]["top kernels"].items())[:4])
            rows.append(f"| {c['workload']} | {c['atoms']} | {c['impl']} | " + " | ".join(f"{c['profile_ms'][k]:.2f}" for k, _ in KERNEL_CLASSES) + f" | {top} |")
    return "\n".join([f"# nequix-oam-1 on {result['device']} ({result['date']})", "", f"versions: {result['versions']}", "",
                      "Energy + forces + stress (`efs`) and the fine-tuning step (`train`, energy + force + stress MAE "
                      "gradient); the same graph for every implementation, padded as Nequix's calculator pads. "
                      "`benchmarks/nequix_step.py`.", "", *rows, ""])  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="nequix-oam-1", help="a shipped Nequix model or a .nqx path")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--atoms", default="1000,4000,16000,64000", help="efs structure sizes")
    ap.add_argument("--train-atoms", default="1000,4000", help="fine-tuning step sizes")
    ap.add_argument("--skip", default="", help="impl@workload@size cells not to run, comma list (e.g. nequix@efs@64000)")
    ap.add_argument("--profile", default="", help="impl@workload@size cells to profile by kernel class, comma list")
    ap.add_argument("--append", help="a results .json of this script whose cells the new ones join (a rerun cell replaces its old one)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    skip, profile = set(filter(None, a.skip.split(","))), set(filter(None, a.profile.split(",")))
    path = pretrained.WEIGHTS / f"{a.model}.nqx" if (pretrained.WEIGHTS / f"{a.model}.nqx").exists() else pathlib.Path(a.model)
    impls = a.impls.split(",")
    models = {"jequi": read_nqx(path)[:2]}
    for impl in impls:
        if impl.startswith("nequix"):
            precision = jax.config.jax_default_matmul_precision
            from nequix.model import load_model

            jax.config.update("jax_default_matmul_precision", precision)  # nequix sets "highest" globally; jequi's model sets it itself
            models[impl] = load_model(str(path), kernel=impl == "nequix-oeq")[0]
    dev = jax.devices()[0]
    result = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "model": a.model,
              "versions": versions("nequix", "e3nn-jax", "openequivariance"), "cells": []}  # fmt: skip
    old = json.loads(pathlib.Path(a.append).read_text())["cells"] if a.append else []
    if result["versions"]["openequivariance"] is None and "nequix-oeq" in impls:  # run from its source tree: no metadata
        import openequivariance

        result["versions"]["openequivariance"] = getattr(openequivariance, "__version__", None) or "unknown (run from its source tree: no package metadata)"
    # Nequix's package sets "highest" matmul precision when imported (no TF32); every impl here runs under it.
    jax.config.update("jax_default_matmul_precision", "highest")
    runs = [(w, int(n), impl) for w, sizes in (("efs", a.atoms), ("train", a.train_atoms)) for n in sizes.split(",") if n
            for impl in impls if f"{impl}@{w}@{n}" not in skip]  # fmt: skip
    result["cells"] = [c for c in old if (c["workload"], c["size"], c["impl"]) not in runs]
    for workload, size, impl in runs:
        atoms = alloy(size)
        cell = {"workload": workload, "size": size, "impl": impl}
        try:
            fn, args, info = make_cell(impl, workload, atoms, models)
            cell.update(info)
            cell.update(measure(fn, args, f"{impl}@{workload}@{size}" in profile))
        except Exception as exc:  # noqa: BLE001  (a failure or out of memory: recorded)
            cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(json.dumps(cell), flush=True)
        result["cells"].append(cell)
        result["cells"].sort(key=lambda c: (c["workload"], c["size"], c["impl"]))
        save(result, f"nequix-{pathlib.Path(a.model).stem}", markdown(result), a.out)
        jax.clear_caches()

if __name__ == "__main__":
    main()
