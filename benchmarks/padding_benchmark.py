"""The fused conv on padded graphs and on graphs with a hub, against the same graph unpadded.

A padded training batch carries edges that the conv must skip: out-of-range indices (what
``jequi.models.data.batch`` writes, -1) or jraph's padding node, which receives and sends every
padding edge (one valid node with thousands of edges). Both must cost no more than their share
of the edges: the kernels split rows longer than a few times the mean over programs
(:func:`jequi.graph.row_parts`). Device tool, from the repo root:

    python3 benchmarks/padding_benchmark.py [--problem nequip-oam-main] [--nodes 4096]

For each backend: fwd and fwd+bwd ms on the unpadded random graph (``--degree`` edges per
node), then with 10/30/50 % of the edges padded (-1 indices, and jraph's padding node), and
with one extra node receiving and sending ``--hub`` edges; each as a ratio to the unpadded
time per real edge. Writes ``<date>-<device>-padding.{json,md}`` into --out (and $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms, save

import jequi


def graphs(rng, n: int, degree: int, hub: int):
    """``name -> (senders, receivers, num_nodes, real edges)``: the unpadded graph, padded ones
    and one with a hub (receivers sorted, as in a batch built from sorted structures)."""
    e = n * degree
    s, r = rng.integers(0, n, e), np.sort(rng.integers(0, n, e))
    out = {"unpadded": (s, r, n, e)}
    for frac in (0.1, 0.3, 0.5):
        pad = int(round(e * frac / (1 - frac)))
        minus = np.full(pad, -1)
        out[f"{int(frac * 100)}% padded (-1)"] = (np.concatenate([s, minus]), np.concatenate([r, minus]), n, e)
        node = np.full(pad, n)  # jraph: a padding node that sends and receives every padding edge
        out[f"{int(frac * 100)}% padded (jraph node)"] = (np.concatenate([s, node]), np.concatenate([r, node]), n + 1, e)
    hs = np.concatenate([s, np.full(hub, n), rng.integers(0, n, hub)])
    hr = np.concatenate([r, rng.integers(0, n, hub), np.full(hub, n)])
    out[f"hub of {hub} in + {hub} out"] = (hs, hr, n + 1, e + 2 * hub)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", default="nequip-oam-main")
    ap.add_argument("--nodes", type=int, default=4096)
    ap.add_argument("--degree", type=int, default=42)
    ap.add_argument("--hub", type=int, default=5000)
    ap.add_argument("--backends", default="cuda,pallas")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    dev = jax.devices()[0]
    tp = jequi.problems.get(a.problem)
    rng = np.random.default_rng(0)
    dtype = np.dtype(a.dtype)
    cases = graphs(rng, a.nodes, a.degree, a.hub)
    backends = [b for b in a.backends.split(",") if b in jequi.available_backends()]
    result = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "jax": jax.__version__,
              "problem": a.problem, "nodes": a.nodes, "degree": a.degree, "dtype": a.dtype, "cells": []}  # fmt: skip
    for b in backends:
        base = None
        for name, (s, r, n, real) in cases.items():
            e = len(s)
            x = jnp.asarray(rng.normal(size=(n, tp.irreps_in1.dim)), dtype)
            y = jnp.asarray(rng.normal(size=(e, tp.irreps_in2.dim)), dtype)
            w = jnp.asarray(rng.normal(size=(e, tp.weight_numel)), dtype)
            graph = jequi.Graph.build(s, r, n)
            fwd = jax.jit(lambda x, y, w, g: tp.conv(x, y, w, g, backend=b))
            both = jax.jit(jax.grad(lambda x, y, w, g: jnp.sum(tp.conv(x, y, w, g, backend=b) ** 2), argnums=(0, 1, 2)))
            ms = []
            for f in (fwd, both):
                jax.block_until_ready(f(x, y, w, graph))
                ms.append(median_ms(f, (x, y, w, graph), repeat=7, calls=10))
            per_edge = [m / real for m in ms]
            base = base or per_edge
            ratio = [p / q for p, q in zip(per_edge, base)]
            cell = {"backend": b, "graph": name, "nodes": n, "edges": e, "real_edges": real, "fwd_ms": ms[0],
                    "fwd_bwd_ms": ms[1], "fwd_ratio": ratio[0], "fwd_bwd_ratio": ratio[1]}  # fmt: skip
            result["cells"].append(cell)
            print(f"{b:8s} {name:28s} {e:7d} edges: fwd {ms[0]:.3f} ms ({ratio[0]:.2f}x per real edge), "
                  f"fwd+bwd {ms[1]:.3f} ms ({ratio[1]:.2f}x)", flush=True)  # fmt: skip
    write(result, pathlib.Path(a.out))


def write(result, out):
    lines = [f"# The conv on padded and hub graphs, {result['device']} ({result['date']}, jax {result['jax']})", "",
             f"`{result['problem']}`, {result['dtype']}, random graph of {result['nodes']} nodes x {result['degree']} "
             "edges; ratio: time per real edge over the unpadded graph's (target: padding <= 1.1x, hub <= 1.2x)", "",
             "| backend | graph | edges | fwd ms | fwd+bwd ms | fwd ratio | fwd+bwd ratio |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {c['backend']} | {c['graph']} | {c['edges']} | {c['fwd_ms']:.3f} | {c['fwd_bwd_ms']:.3f} | "
              f"{c['fwd_ratio']:.2f}x | {c['fwd_bwd_ratio']:.2f}x |" for c in result["cells"]]  # fmt: skip
    save(result, "padding", "\n".join(lines) + "\n", out)


if __name__ == "__main__":
    main()
