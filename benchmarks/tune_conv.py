"""Sweep the Pallas conv kernels' schedule knobs on a real graph (GPU run, device tool).

    python3 benchmarks/tune_conv.py [--problems mace-large,nequip-benzene] [--graph carbon]

Knobs (module constants): EDGES_PER_STEP (edges per loop step) and ACCUMULATORS_PER_THREAD
(forward output grouping) of pallas_kernels.conv, BACKWARD_WARPS (warps per backward program,
0 = as the forward) of pallas_kernels.tensor_product. Prints fwd and fwd+bwd ms per setting.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp
import structures
from timing import timed

import jequi
import pallas_kernels.conv as conv
import pallas_kernels.tensor_product as tensor_product


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", default="mace-large")
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--steps", default="1,2,4")
    ap.add_argument("--accumulators", default="32,64,128")
    ap.add_argument("--backward-warps", default="0")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    build, cutoff = structures.STRUCTURES[a.graph]
    atoms = build()
    graph = jequi.graph_from_atoms(atoms, cutoff)
    print(f"{a.graph}: {len(atoms)} atoms, {graph.num_edges} edges, edges_sorted={graph.edges_sorted}", flush=True)
    for name in a.problems.split(","):
        tp = jequi.problems.get(name)
        d1, d2, do = tp.descriptor.dims
        keys = jax.random.split(jax.random.key(0), 4)
        n, e = len(atoms), graph.num_edges
        x, y, w, g = (jax.random.normal(k, s, a.dtype) for k, s in zip(keys, [(n, d1), (e, d2), (e, tp.weight_numel), (n, do)]))
        knobs = itertools.product(*(map(int, v.split(",")) for v in (a.steps, a.accumulators, a.backward_warps)))
        for steps, acc, warps in knobs:
            conv.EDGES_PER_STEP, conv.ACCUMULATORS_PER_THREAD = steps, acc
            tensor_product.BACKWARD_WARPS = warps or None
            jax.clear_caches()
            fwd = jax.jit(lambda x, y, w: tp.conv(x, y, w, graph, backend="pallas"))
            both = jax.jit(jax.value_and_grad(lambda x, y, w: jnp.vdot(tp.conv(x, y, w, graph, backend="pallas"), g), (0, 1, 2)))
            both_ms, compile_s = timed(both, (x, y, w))
            groups = len(conv.output_groups(tp.descriptor.trilinear))
            print(f"{name} {a.dtype} steps={steps} acc/thread={acc} bwd warps={warps or 'fwd'} (fwd groups {groups}): "
                  f"fwd {timed(fwd, (x, y, w))[0]:.3f} ms, fwd+bwd {both_ms:.3f} ms (compile {compile_s:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
