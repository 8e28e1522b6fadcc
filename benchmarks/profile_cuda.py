"""The CUDA backend's kernels one by one: each kernel kind (and the conv backwards, sender walk
and atomic receiver walk, per set of wanted gradients) called directly, timed, with its
registers and threads (GPU run).

    python3 benchmarks/profile_cuda.py [--problem mace-large] [--layout ir_mul] [--dtype float32]
        [--graph carbon] [--batch 50000] [--repeat 9 --calls 20]

Under Nsight Compute (benchmarks/profile_cuda.sh) run it with ``--repeat 1 --calls 1``: each
kernel then launches twice (the warm-up call and one timed call).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import structures
from timing import timed

import jequi
from ffi import DEFAULT, build, ops
from jequi.sums import FORWARD, Sums

NEEDS = {"all": (True, True, True), "gx+gw": (True, False, True), "gy": (False, True, False), "gx": (True, False, False)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problem", default="mace-large")
    ap.add_argument("--layout", default="ir_mul")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--batch", type=int, default=50000)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--needs", default="all,gx,gw,gy", help="comma list of conv backward variants: " + ", ".join(NEEDS))
    a = ap.parse_args()
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    tp = jequi.problems.get(a.problem, layout=a.layout)
    desc = tp.descriptor.trilinear
    d1, d2, do = desc.dims
    atoms, _, graph = structures.radius_graph(a.graph)
    n, e, b = len(atoms), graph.num_edges, a.batch
    shapes = [(n, d1), (e, d2), (e, desc.weight_numel), (n, do), (b, d1), (b, d2), (b, desc.weight_numel), (b, do)]
    keys = jax.random.split(jax.random.key(0), len(shapes))
    x, y, w, g, bx, by, bw, bg = (jax.random.normal(k, s, a.dtype) for k, s in zip(keys, shapes))
    cases = {
        "tp_forward": (lambda x, y, w: ops.forward(desc, x, y, w), (bx, by, bw)),
        "tp_backward": (lambda x, y, w, g: ops.backward(desc, x, y, w, g), (bx, by, bw, bg)),
        "conv_forward": (lambda x, y, w: ops.conv_forward(desc, x, y, w, graph), (x, y, w)),
    }
    atomic = dataclasses.replace(DEFAULT, atomic_conv_backward=True)
    for kind, config in (("conv_backward", DEFAULT), ("conv_atomic_backward", atomic)):
        for name in a.needs.split(","):
            needs = NEEDS[name]
            cases[f"{kind}[{name}]"] = (
                lambda x, y, w, g, needs=needs, config=config: ops.conv_backward(desc, x, y, w, g, graph, needs, config), (x, y, w, g)
            )
    print(f"{a.problem} {a.layout} {a.dtype}: {a.graph} {n} atoms {e} edges, batch {b}", flush=True)
    for name, (fn, args) in cases.items():
        ms, first = timed(jax.jit(fn), args, a.repeat, a.calls)
        kind = name.split("[")[0]
        needs = NEEDS[name[len(kind) + 1 : -1]] if "[" in name else (True, True, True)
        sums = Sums.gradients(needs) if kind.endswith("backward") else FORWARD
        config = atomic if kind == "conv_atomic_backward" else DEFAULT
        kernel = ops.kernel(desc, jax.numpy.dtype(a.dtype), kind, sums, config=config)
        usage = build.resources(build.cubin(kernel.source))
        print(f"  {name:32s} {ms:8.3f} ms  first call {first:5.1f} s  {usage['registers']} regs x {kernel.threads} threads, "
              f"smem {kernel.smem} B, chunk {kernel.chunk}", flush=True)


if __name__ == "__main__":
    main()
