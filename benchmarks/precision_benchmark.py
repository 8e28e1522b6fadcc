"""Half precision on one GPU: the models' convolutions stored in bfloat16 / float16 against
float32, and the Nequix foundation model's MD step (energy, forces, stress) under each precision
policy (jequi.models.precision), with its errors against float32 and float64.

* ``conv``: the fused conv of each model product (``--problems``) on the graph of a rattled
  Cu-Au alloy (``--conv-atoms`` atoms, the product's model's cutoff), forward and forward +
  backward (the gradients of x, y and w), per dtype (``--dtypes``) and backend
  (``--conv-backends``: the default backend, cuda for the wide products in every dtype, and
  pallas). The HBM
  bound is the bytes each pass must move (inputs read once, outputs written once) at the copy
  bandwidth measured here.
* ``model``: ``nequix-oam-1``'s efs step at ``--atoms`` under each policy: median ms, and the
  energy (per atom), force and stress errors against float32 and against float64 (x64) on
  ``--oracle-backend`` (xla: the pure-JAX reference).

Device tool, from the repo root: ``bash benchmarks/precision_run.sh``. Writes
``<date>-<device>-precision.{json,md}`` into --out (and $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from model_step import alloy
from nequix_step import graph_arrays, jequi_inputs
from timing import median_ms, save, versions

import jequi
from jequi.models.calculator import _evaluate, calculator_model
from jequi.models.data import neighbour_edges

PROBLEMS = {"nequix-main": 6.0, "nequip-oam-main": 6.0, "mace-large": 5.0}  # product: its model's cutoff (Å)
DTYPES = ("float32", "bfloat16", "float16")


def copy_bandwidth(mb: int = 2048) -> float:
    """GB/s of a device copy (read + write) of `mb` MB."""
    a = jnp.ones((mb * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    jax.block_until_ready(f(a))
    return 2 * a.nbytes / (median_ms(f, (a,)) * 1e-3) / 1e9


def conv_cells(problem: str, atoms_target: int, bandwidth: float, dtypes=DTYPES, backends=("default", "pallas")) -> list[dict]:
    tp = jequi.problems.get(problem)
    atoms = alloy(atoms_target)
    s, r, _ = neighbour_edges(atoms, PROBLEMS[problem])
    n, e = len(atoms), len(s)
    graph = jequi.Graph.build(jnp.asarray(s), jnp.asarray(r), n)
    d1, d2, do = tp.descriptor.dims
    nw = tp.weight_numel
    rng = np.random.default_rng(0)
    base = [rng.normal(size=shape) for shape in ((n, d1), (e, d2), (e, nw), (n, do))]
    rows = []
    for dtype in dtypes:
        x, y, w, g = (jnp.asarray(a, dtype) for a in base)
        item = jnp.dtype(dtype).itemsize
        # bytes: fwd reads x (per node), y and w (per edge), writes out; fwd+bwd also reads g and
        # writes gx, gy, gw
        fwd_bytes = item * (n * d1 + e * (d2 + nw) + n * do)
        bwd_bytes = fwd_bytes + item * (n * do + n * d1 + e * (d2 + nw))
        default = jequi.default_backend(tp.descriptor.trilinear, conv=True, dtype=dtype)
        for backend in dict.fromkeys(default if b == "default" else b for b in backends):
            fwd = jax.jit(lambda x, y, w, b=backend: tp.conv(x, y, w, graph, backend=b))

            def both(x, y, w, g, b=backend):
                out, vjp = jax.vjp(lambda *a: tp.conv(*a, graph, backend=b), x, y, w)
                return out, vjp(g)

            both = jax.jit(both)
            cell = {"problem": problem, "atoms": n, "edges": e, "dtype": dtype, "backend": backend}
            try:
                jax.block_until_ready(fwd(x, y, w))
                jax.block_until_ready(both(x, y, w, g))
                cell["fwd_ms"] = median_ms(fwd, (x, y, w))
                cell["fwd_bwd_ms"] = median_ms(both, (x, y, w, g))
                cell["fwd_bound_ms"] = fwd_bytes / bandwidth / 1e6
                cell["fwd_bwd_bound_ms"] = bwd_bytes / bandwidth / 1e6
            except Exception as err:  # noqa: BLE001 (an OOM or a lowering failure: recorded)
                cell["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(cell, flush=True)
            rows.append(cell)
    return rows


def model_cells(model: str, atoms_target: int, policies, oracle_backend: str | None, rows: list, write) -> None:
    """The efs step per policy (float32 parameters, the default backends), then float64 (the
    default backends, and `oracle_backend`'s: the oracle the errors are taken against, where given),
    each cell appended to `rows` and `write()` called as it is measured (a run cut short keeps its
    times); the errors are added once every cell has run."""
    atoms = alloy(atoms_target)
    cells = [*((p, "float32", None) for p in policies), ("float32", "float64", None)]
    if oracle_backend:
        cells += [("float32", "float32", oracle_backend), ("float32", "float64", oracle_backend)]
    results, first = {}, len(rows)
    for name, dtype, backend in cells:
        if dtype == "float64":  # the oracle last: the float32 cells run as users run them, without x64
            jax.config.update("jax_enable_x64", True)
        params, config, _ = calculator_model(model, backend, dtype, name)
        edges = graph_arrays(atoms, config.cutoff)
        inputs = jequi_inputs(config, atoms, edges)
        if dtype == "float64":
            inputs = tuple(a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in inputs)
        fn = jax.jit(functools.partial(_evaluate, config))
        args = (params, *inputs)
        total, per_atom, forces, virial = jax.block_until_ready(fn(*args))
        n = len(atoms)
        results[name, dtype, backend] = (float(total), np.asarray(forces[:n], np.float64), np.asarray(virial, np.float64))
        cell = {"model": model, "atoms": n, "edges": len(edges[0]), "policy": name, "dtype": dtype, "backend": backend or "default",
                "ms": median_ms(fn, args, repeat=5, calls=3)}  # fmt: skip
        rows.append(cell)
        write()
        print(cell, flush=True)
    volume = float(abs(np.linalg.det(atoms.cell.array)))
    refs = {"float32": ("float32", "float32", None), "float64": ("float32", "float64", oracle_backend)}
    for cell in rows[first:]:
        e, f, v = results[cell["policy"], cell["dtype"], None if cell["backend"] == "default" else cell["backend"]]
        for tag, ref in refs.items():
            e0, f0, v0 = results[ref]
            cell[f"energy_mev_per_atom_vs_{tag}"] = 1e3 * abs(e - e0) / len(atoms)
            cell[f"force_mae_mev_per_a_vs_{tag}"] = 1e3 * float(np.abs(f - f0).mean())
            cell[f"stress_max_mev_per_a3_vs_{tag}"] = 1e3 * float(np.abs(v - v0).max()) / volume


def markdown(result) -> str:
    m = result["meta"]
    out = [f"# Half precision: convs and the Nequix MD step ({m['device']}, {m['date']})", "",
           f"jax {m['versions'].get('jax')}, jequi {m['versions'].get('jequi')}; copy bandwidth {m['bandwidth_GBps']:.0f} GB/s. "
           "Script: benchmarks/precision_benchmark.py.", ""]  # fmt: skip
    if result["conv"]:
        out += ["## Convs (median ms; bound: bytes moved at the copy bandwidth)", "",
                "| problem | atoms / edges | dtype | backend | fwd | fwd+bwd | fwd bound | fwd+bwd bound | fwd+bwd vs float32 best |",
                "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        best32 = {}
        for c in result["conv"]:
            if c["dtype"] == "float32" and "fwd_bwd_ms" in c:
                best32[c["problem"]] = min(best32.get(c["problem"], 1e30), c["fwd_bwd_ms"])
        for c in result["conv"]:
            if "error" in c:
                out.append(f"| {c['problem']} | {c['atoms']} / {c['edges']} | {c['dtype']} | {c['backend']} | {c['error']} | | | | |")
                continue
            ratio = best32.get(c["problem"], float("nan")) / c["fwd_bwd_ms"]
            out.append(f"| {c['problem']} | {c['atoms']} / {c['edges']} | {c['dtype']} | {c['backend']} | {c['fwd_ms']:.3f} | "
                       f"{c['fwd_bwd_ms']:.3f} | {c['fwd_bound_ms']:.3f} | {c['fwd_bwd_bound_ms']:.3f} | {ratio:.2f}x |")  # fmt: skip
    if result["model"]:
        out += ["", "## Nequix MD step (energy, forces, stress) per policy", "",
                "| atoms / edges | policy | dtype | backend | ms | vs float32 | |ΔE| meV/atom vs f32 / f64 | force MAE meV/Å vs f32 / f64 | "
                "stress max meV/Å³ vs f32 / f64 |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        base = next((c["ms"] for c in result["model"] if c["policy"] == "float32" and c["dtype"] == "float32" and c["backend"] == "default"), float("nan"))
        for c in result["model"]:
            if "energy_mev_per_atom_vs_float32" not in c:  # a run cut short: its time, no errors yet
                out.append(f"| {c['atoms']} / {c['edges']} | {c['policy']} | {c['dtype']} | {c['backend']} | {c['ms']:.2f} | {base / c['ms']:.2f}x | | | |")
                continue
            out.append(f"| {c['atoms']} / {c['edges']} | {c['policy']} | {c['dtype']} | {c['backend']} | {c['ms']:.2f} | {base / c['ms']:.2f}x | "
                       f"{c['energy_mev_per_atom_vs_float32']:.3f} / {c['energy_mev_per_atom_vs_float64']:.3f} | "
                       f"{c['force_mae_mev_per_a_vs_float32']:.3f} / {c['force_mae_mev_per_a_vs_float64']:.3f} | "
                       f"{c['stress_max_mev_per_a3_vs_float32']:.4f} / {c['stress_max_mev_per_a3_vs_float64']:.4f} |")  # fmt: skip
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default=",".join(PROBLEMS))
    ap.add_argument("--conv-atoms", type=int, default=4000)
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="the convs' dtypes")
    ap.add_argument("--conv-backends", default="default,pallas", help="the convs' backends ('default': jequi.default_backend's)")
    ap.add_argument("--model", default="nequix-oam-1")
    ap.add_argument("--atoms", default="4000", help="comma list of structure sizes for the model step")
    ap.add_argument("--policies", default="float32,tf32,bf16-mixed")
    ap.add_argument("--oracle-backend", default="xla", help="backend of the float64 oracle ('' : the default backends)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: conv, model")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    device = jax.devices()[0].device_kind
    meta = {"date": datetime.date.today().isoformat(), "device": device, "versions": versions("e3nn-jax"), "bandwidth_GBps": copy_bandwidth()}
    result = {"meta": meta, "date": meta["date"], "device": device, "conv": [], "model": []}

    def write():
        save(result, "precision", markdown(result), a.out)

    if "conv" not in skip:
        for p in a.problems.split(","):
            result["conv"] += conv_cells(p, a.conv_atoms, meta["bandwidth_GBps"], a.dtypes.split(","), a.conv_backends.split(","))
            write()
    if "model" not in skip:
        for atoms in map(int, a.atoms.split(",")):
            model_cells(a.model, atoms, a.policies.split(","), a.oracle_backend or None, result["model"], write)
            write()
            jax.config.update("jax_enable_x64", False)
    print(markdown(result))


if __name__ == "__main__":
    main()
