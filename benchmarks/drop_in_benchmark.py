"""The e3nn-jax drop-in in a model's message passing: ``e3nn.tensor_product`` against
``jequi.tensor_product``, each followed by what a model does next (``* radial`` per-channel
scalars, ``e3nn.scatter_sum`` over receivers), and jequi's fused ``channelwise`` +
``tp.conv`` (the migration notes' path) on the same inputs, in one process.

Each implementation runs ``gather -> product -> * radial -> scatter_sum`` under ``jax.jit``,
forward (``fwd``) and forward + backward of a loss in the node features, the edge attributes
and the radial weights (``fwd+bwd``). The graph is random with receivers sorted (as a batch of
structures), ``--degree`` edges per node. Problems (``PROBLEMS``): MACE-like node irreps
``128x0e+128x1o`` with spherical harmonics to l=3 and NequIP-like ``32x0e+32x1o+32x2e`` to l=2.
Each cell: median ms (of 7 runs of 10 calls), first call (compile) s, and the largest
difference of the result from e3nn's relative to its largest value.

Device tool, from the repo root:

    python3 benchmarks/drop_in_benchmark.py [--edges 10000,100000] [--problems mace,nequip] [--dtype float32]

Writes ``<date>-<device>-drop-in.{json,md}`` into --out (and $OUT). ``--smoke`` runs one tiny
case on any device (CPU included) and writes into a temporary folder unless --out is given.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import tempfile

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
from timing import save, timed, versions

import jequi

# name -> (node irreps, spherical-harmonic irreps, filter_ir_out)
PROBLEMS = {
    "mace": ("128x0e+128x1o", "0e+1o+2e+3o", "0e+1o+2e+3o"),
    "nequip": ("32x0e+32x1o+32x2e", "0e+1o+2e", "0e+1o+2e"),
    "smoke": ("4x0e+4x1o", "0e+1o+2e", "0e+1o+2e"),
}


def message_passing(product, filter_ir_out, num_nodes):
    """``out[r] = sum_{e: receivers[e] = r} product(x[senders[e]], sh[e]) * radial[e]`` with e3nn's
    operations after the product, as an e3nn-jax model writes it."""

    def f(x, sh, radial, senders, receivers):
        msg = product(x[senders], sh, filter_ir_out=filter_ir_out)
        return e3nn.scatter_sum(msg * radial, dst=receivers, output_size=num_nodes).array

    return f


def fused_conv(tp, graph):
    """jequi's fused path: the radial values are the channelwise product's per-edge weights."""

    def f(x, sh, radial, senders, receivers):
        return tp.conv(x, sh, radial, graph).array

    return f


def run_problem(name, num_edges, degree, dtype, repeat, calls, rng):
    irreps_x, irreps_sh, filter_ir_out = PROBLEMS[name]
    num_nodes = max(1, num_edges // degree)
    senders = jnp.asarray(rng.integers(0, num_nodes, num_edges), jnp.int32)
    receivers = jnp.asarray(np.sort(rng.integers(0, num_nodes, num_edges)), jnp.int32)
    x = e3nn.IrrepsArray(irreps_x, jnp.asarray(rng.normal(size=(num_nodes, e3nn.Irreps(irreps_x).dim)), dtype))
    vectors = jnp.asarray(rng.normal(size=(num_edges, 3)), dtype)
    sh = e3nn.spherical_harmonics(irreps_sh, vectors, normalize=True)
    irreps_msg = e3nn.tensor_product(x.irreps, sh.irreps, filter_ir_out=filter_ir_out)
    radial = jnp.asarray(rng.normal(size=(num_edges, irreps_msg.num_irreps)), dtype)
    tp = jequi.channelwise(x.irreps, sh.irreps, filter_ir_out)
    graph = jequi.Graph.build(senders, receivers, num_nodes)
    impls = {
        "e3nn.tensor_product": message_passing(e3nn.tensor_product, filter_ir_out, num_nodes),
        "jequi.tensor_product": message_passing(jequi.tensor_product, filter_ir_out, num_nodes),
        "jequi channelwise + conv": fused_conv(tp, graph),
    }
    args = (x, sh, radial, senders, receivers)
    reference = None
    cells = []
    for impl, f in impls.items():
        fwd = jax.jit(f)

        def loss(x_, sh_, radial_, f=f):
            out = f(e3nn.IrrepsArray(x.irreps, x_), e3nn.IrrepsArray(sh.irreps, sh_), radial_, senders, receivers)
            return jnp.sum(out**2)

        both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        out = np.asarray(fwd(*args), np.float64)
        reference = out if reference is None else reference
        err = float(np.abs(out - reference).max() / max(np.abs(reference).max(), 1e-30))
        fwd_ms, fwd_first = timed(fwd, args, repeat, calls)
        both_ms, both_first = timed(both, (x.array, sh.array, radial), repeat, calls)
        cell = {"problem": name, "impl": impl, "edges": num_edges, "nodes": num_nodes, "fwd_ms": fwd_ms,
                "fwd_bwd_ms": both_ms, "fwd_compile_s": fwd_first, "fwd_bwd_compile_s": both_first,
                "rel_diff_vs_e3nn": err}  # fmt: skip
        cells.append(cell)
        print(f"{name:7s} {num_edges:7d} edges {impl:26s} fwd {fwd_ms:8.3f} ms  fwd+bwd {both_ms:8.3f} ms  "
              f"(diff vs e3nn {err:.1e})", flush=True)  # fmt: skip
    return cells


def write(result, out) -> str:
    lines = [
        f"# e3nn-jax drop-in: product -> * radial -> scatter_sum, {result['device']} ({result['date']})", "",
        ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + f"; {result['dtype']}, "
        f"{result['degree']} edges per node, receivers sorted; median of {result['repeat']} runs of {result['calls']} calls.",
        "jequi.tensor_product ran on its default backend (its blocks here are uvu: spherical harmonics have multiplicity one); the fused conv on the default conv backend. "
        "e3nn's einsums run at JAX's default matmul precision, jequi's xla backend at HIGHEST.", "",
        "| problem | edges | implementation | fwd ms | fwd+bwd ms | fwd / e3nn | fwd+bwd / e3nn | compile s (fwd, fwd+bwd) | diff vs e3nn |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    base = {}
    for c in result["cells"]:
        key = (c["problem"], c["edges"])
        base.setdefault(key, c)
        b = base[key]
        lines.append(
            f"| {c['problem']} | {c['edges']} | {c['impl']} | {c['fwd_ms']:.3f} | {c['fwd_bwd_ms']:.3f} | "
            f"{c['fwd_ms'] / b['fwd_ms']:.2f}x | {c['fwd_bwd_ms'] / b['fwd_bwd_ms']:.2f}x | "
            f"{c['fwd_compile_s']:.1f}, {c['fwd_bwd_compile_s']:.1f} | {c['rel_diff_vs_e3nn']:.1e} |"
        )
    return save(result, "drop-in", "\n".join(lines) + "\n", out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", default="mace,nequip")
    ap.add_argument("--edges", default="10000,100000")
    ap.add_argument("--degree", type=int, default=20)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--smoke", action="store_true", help="one tiny case (CPU is fine), written to a temporary folder")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.problems, a.edges, a.repeat, a.calls = "smoke", "64", 1, 1
    out = a.out or (tempfile.mkdtemp() if a.smoke else str(pathlib.Path(__file__).resolve().parent / "results"))
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(a.dtype)
    rng = np.random.default_rng(0)
    result = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "versions": versions("jaxlib", "e3nn-jax"),
              "dtype": a.dtype, "degree": a.degree, "repeat": a.repeat, "calls": a.calls, "cells": []}  # fmt: skip
    for problem in a.problems.split(","):
        for num_edges in (int(e) for e in a.edges.split(",")):
            result["cells"] += run_problem(problem, num_edges, a.degree, dtype, a.repeat, a.calls, rng)
            stem = write(result, out)  # after every case: a later failure keeps the earlier cells
    print(f"wrote {pathlib.Path(out) / stem}.{{json,md}}")


if __name__ == "__main__":
    main()
