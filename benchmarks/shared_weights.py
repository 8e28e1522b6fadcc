"""Shared-weight products: jequi's Pallas kernels against its xla backend (GPU run, device tool).

    python3 benchmarks/shared_weights.py [--dtype float32] [--batch 50000] [--problems a,b]
        [--conv-problems a,b] [--graph carbon] [--out benchmarks/results]

With one weight vector for every row (``w`` of shape ``(weight_numel,)``, as the layers of
``jequi.nn`` with internal weights use), a fully connected (``uvw``) path is a matrix
product over the batch: XLA's einsums run it as one, the Pallas kernels read the path's
weight block for every row. This times both backends (forward, and the gradients of
``<tp(x, y, w), g>`` w.r.t. x, y, w) on the batched product and on the conv over a real graph,
which ``jequi.default_backend(desc, shared_weights=True)`` is chosen from. Writes
``<date>-<device>-shared-weights-<dtype>.{json,md}`` into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import jax
import jax.numpy as jnp
import structures
from gpu_benchmark import device_slug, versions
from timing import timed

import jequi

BACKENDS = ("xla", "pallas")


def time_backends(op, args, g) -> dict:
    """{backend: {fwd, bwd ms and compile s}} of ``op(backend)(x, y, w)``."""
    out = {}
    for b in BACKENDS:
        f = op(b)
        grads = jax.grad(lambda x, y, w, g, f=f: jnp.vdot(f(x, y, w), g), (0, 1, 2))
        fwd_ms, fwd_s = timed(jax.jit(f), args)
        bwd_ms, bwd_s = timed(jax.jit(grads), (*args, g))
        out[b] = {"fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "compile_s": [fwd_s, bwd_s]}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--problems", default="diffdock-l1,tetris-poly-1,tetris-poly-2,tetris-1-lin2,tetris-2-lin2,e3tools-conv,tetris-1-sc")
    ap.add_argument("--conv-problems", default="diffdock-l1,tetris-poly-1,tetris-poly-2,e3tools-conv")
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    a = ap.parse_args()
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    atoms, _, graph = structures.radius_graph(a.graph)
    device = jax.devices()[0].device_kind
    result = {"date": datetime.date.today().isoformat(), "device": device, "versions": versions(), "dtype": a.dtype,
              "batch": a.batch, "graph": f"{a.graph}: {len(atoms)} atoms, {graph.num_edges} edges", "rows": []}
    stem = f"{result['date']}-{device_slug(device)}-shared-weights-{a.dtype}"
    runs = [("tp", n) for n in filter(None, a.problems.split(","))] + [("conv", n) for n in filter(None, a.conv_problems.split(","))]
    for kind, name in runs:
        tp = jequi.problems.get(name)
        d1, d2, do = tp.descriptor.dims
        rows, edges = (len(atoms), graph.num_edges) if kind == "conv" else (a.batch, a.batch)
        keys = jax.random.split(jax.random.key(0), 4)
        x, y, g = (jax.random.normal(k, (n, d), a.dtype) for k, n, d in zip(keys, (rows, edges, rows), (d1, d2, do)))
        w = jax.random.normal(keys[3], (tp.weight_numel,), a.dtype)
        if kind == "conv":
            op = lambda b, tp=tp: lambda x, y, w: tp.conv(x, y, w, graph, backend=b)  # noqa: E731
        else:
            op = lambda b, tp=tp: lambda x, y, w: tp(x, y, w, backend=b)  # noqa: E731
        row = {"kind": kind, "problem": name, "weight_numel": tp.weight_numel,
               "default": jequi.default_backend(tp.descriptor.trilinear, shared_weights=True),
               **time_backends(op, (x, y, w), g)}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write(result, pathlib.Path(a.out), stem)


def write(result, out: pathlib.Path, stem: str):
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Shared weights: jequi pallas vs xla, {result['dtype']}: {result['device']} ({result['date']})", "",
        ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v), "",
        f"Batched product: {result['batch']} rows; conv: {result['graph']}. One weight vector for every row. "
        "Median ms (timing.py); bwd = the gradients w.r.t. x, y, w. `default` is "
        "`jequi.default_backend(desc, shared_weights=True)`.", "",
        "| kind | problem | weights | xla fwd / bwd | pallas fwd / bwd | default |", "|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        cells = [f"{r[b]['fwd_ms']:.3f} / {r[b]['bwd_ms']:.3f}" for b in BACKENDS]
        lines.append(f"| {r['kind']} | {r['problem']} | {r['weight_numel']} | {' | '.join(cells)} | {r['default']} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
