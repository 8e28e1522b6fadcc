"""Where a Pallas kernel's first-call time goes: JAX's lowering vs XLA's compile (GPU run).

    python3 benchmarks/compile_time.py [--problems nequip-benzene] [--graph carbon]
        [--dtype float32] [--layout mul_ir] [--backward-chunks auto,1,2] [--tp-batch 0]

For each product and each ``pallas_kernels.Config.backward_chunks`` setting, the conv's forward and its
gradient (and with ``--tp-batch`` the batched product's) are lowered (JAX tracing and Pallas'
Triton lowering, in Python) and then compiled (XLA: Triton's passes, LLVM, ptxas), each timed
apart, with the size of the lowered module. Nothing is run. On a machine without a GPU the
kernels lower for the interpreter instead, which says nothing about the GPU's compile.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import structures

import jequi
import pallas_kernels


def split(fn, args) -> str:
    """``lower s, compile s, module MB`` of ``jax.jit(fn)`` on `args`."""
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return f"lower {t1 - t0:.1f} s, compile {t2 - t1:.1f} s, module {len(lowered.as_text()) / 1e6:.1f} MB"


def gradient(f):
    """The gradients of ``<f(x, y, w, *rest), g>`` in x, y, w (`g` an argument: a captured
    array would be lowered as a constant)."""
    return lambda x, y, w, g, *rest: jax.grad(lambda x, y, w: jnp.vdot(f(x, y, w, *rest), g), (0, 1, 2))(x, y, w)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default="nequip-benzene", help="comma list of jequi.problems names")
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layout", default="mul_ir")
    ap.add_argument("--backward-chunks", default="auto", help="comma list of Config.backward_chunks (auto: the rule)")
    ap.add_argument("--tp-batch", type=int, default=0, help="also the batched product on this many rows")
    a = ap.parse_args()
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    atoms, _, graph = structures.radius_graph(a.graph)
    print(f"{a.graph}: {len(atoms)} atoms, {graph.num_edges} edges; {jax.devices()[0].device_kind}", flush=True)
    for name in a.problems.split(","):
        tp = jequi.problems.get(name, layout=a.layout)
        d1, d2, do = tp.descriptor.dims
        n, e, b = len(atoms), graph.num_edges, a.tp_batch
        shapes = [(n, d1), (e, d2), (e, tp.weight_numel), (n, do), (b, d1), (b, d2), (b, tp.weight_numel), (b, do)]
        x, y, w, g, bx, by, bw, bg = (jax.ShapeDtypeStruct(s, jnp.dtype(a.dtype)) for s in shapes)
        for chunks in a.backward_chunks.split(","):
            config = pallas_kernels.Config(backward_chunks=None if chunks == "auto" else int(chunks))
            backend = jequi.backends.register(jequi.backends.configured("pallas", config))
            conv_fn = lambda x, y, w, graph: tp.conv(x, y, w, graph, backend=backend)  # noqa: E731
            tp_fn = lambda x, y, w: tp(x, y, w, backend=backend)  # noqa: E731
            jax.clear_caches()  # each setting's lowering and compile timed from scratch
            head = f"{name} {a.dtype} {a.layout} backward_chunks={chunks}:"
            print(f"{head} conv fwd {split(conv_fn, (x, y, w, graph))}", flush=True)
            print(f"{head} conv grad {split(gradient(conv_fn), (x, y, w, g, graph))}", flush=True)
            if b:
                print(f"{head} tp fwd {split(tp_fn, (bx, by, bw))}", flush=True)
                print(f"{head} tp grad {split(gradient(tp_fn), (bx, by, bw, bg))}", flush=True)


if __name__ == "__main__":
    main()
