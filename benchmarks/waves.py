"""Wave quantization of the conv forward (GPU run, device tool): the forward's time against
the number of receivers, on a structure's radius graph cut to its first `k` receivers (every
receiver of the carbon lattice has the same degree, so each block has the same work).

    python3 benchmarks/waves.py [--graph carbon] [--problem mace-large] [--layout ir_mul]
        [--backend cuda] [--dtype float32] [--fractions 0.7,0.75,...,1]

Prints, per `k`, the blocks' waves (`k` over ``--slots``, the resident blocks the kernel's
registers and threads allow: this counts one block per receiver, as MACE-large's forward has;
a product whose programs spread over several blocks per node has that many times more) and
the ms per call and per receiver. Were the last partial
wave as long as a full one, the time per receiver would step with whole waves; were the
kernel bound by throughput alone, it would stay flat.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import structures
from timing import timed

import jequi


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--problem", default="mace-large")
    ap.add_argument("--layout", default="ir_mul")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=264, help="resident blocks (SMs x blocks per SM)")
    ap.add_argument("--fractions", default="0.70,0.75,0.764,0.80,0.85,0.90,0.917,0.95,1.0")
    a = ap.parse_args()
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    atoms, _, graph = structures.radius_graph(a.graph)
    tp = jequi.problems.get(a.problem, layout=a.layout)
    s, r, n = np.asarray(graph.senders), np.asarray(graph.receivers), len(atoms)
    d1, d2, _ = tp.descriptor.dims
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.normal(size=(n, d1)).astype(a.dtype))
    y_all = rng.normal(size=(len(s), d2)).astype(a.dtype)
    w_all = rng.normal(size=(len(s), tp.weight_numel)).astype(a.dtype)
    print(f"{a.graph}: {n} atoms, {len(s)} edges; {a.problem} {a.layout} {a.dtype} {a.backend}, {a.slots} slots")
    for f in map(float, a.fractions.split(",")):
        k = int(round(f * n))
        keep = r < k
        g = jequi.Graph.build(s[keep], r[keep], k, num_senders=n)
        y, w = jax.numpy.asarray(y_all[keep]), jax.numpy.asarray(w_all[keep])
        fn = jax.jit(lambda x, y, w, g=g: tp.conv(x, y, w, g, backend=a.backend))
        ms, _ = timed(fn, (x, y, w), repeat=7, calls=20)
        print(f"receivers {k:6d}  waves {k / a.slots:5.2f}  {ms:.4f} ms  {1e3 * ms / k:.3f} us per receiver", flush=True)


if __name__ == "__main__":
    main()
