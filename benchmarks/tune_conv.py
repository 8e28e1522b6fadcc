"""Sweep the Pallas kernels' schedule knobs on a real graph (GPU run, device tool).

    python3 benchmarks/tune_conv.py [--problems mace-large] [--graph carbon] [--tp-batch 50000]
        [--channelwise IN1:IN2:OUT] [--no-conv] [--accumulator-registers 32,64,128]
        [--forward-warps auto,1,2,4] [--backward-warps auto,1,2,4] [--fill-warps 4096]
        [--rows-per-program auto,1,8] [--backward-groups auto,0,1]
        [--forward-accumulators auto,64,128] [--backward-chunks auto,1,2,4] [--channel-windows auto,1,2]
        [--chained-forward auto,0,1] [--fused-forward auto,0,1] [--block-forward-rows 16,32]
        [--block-forward-warps 4,8] [--block-backward-rows auto,16] [--block-backward-warps 2,4]
        [--fused-second auto,0,1] [--no-backward] [--dbl-batch 20000] [--dbl-force]
        [--layouts mul_ir,ir_mul]

Knobs: the fields of :class:`pallas_kernels.Config` (comma lists are swept; ``auto``: None,
the rule of :mod:`pallas_kernels.heuristics`). Each setting is a ``Config`` value, run through
a ``pallas`` backend built with it (``jequi.backends.configured``). Prints conv fwd and
fwd+bwd ms per setting (unless --no-conv), with --tp-batch the batched product's too, and with
--dbl-batch the batched product's double backward (gpu_benchmark.py's dbl) on that many of
those rows (with --dbl-force, force training's, gpu_benchmark.py's dblf, which runs dgz).
--channelwise adds a product of one's own irreps (jequi.channelwise), e.g. a model's
convolution. --layouts builds every product in each of these layouts (x, y, z and the conv's
node arrays).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import jax
import jax.numpy as jnp
import structures
from timing import timed

import jequi
import pallas_kernels

# (runs, calls per run) of each timing: settings differ by a few percent, more than the
# run-to-run spread of timing.py's default 5 x 5 calls.
REPEAT = (9, 20)

KNOBS = tuple(f.name for f in dataclasses.fields(pallas_kernels.Config))


def parse(value: str):
    """A knob's value from the command line: ``auto`` (None: the rule), an int, or a 0/1 flag
    for the boolean knobs (parsed as ints, which the rules read alike)."""
    return None if value == "auto" else int(value)


def config_of(setting) -> pallas_kernels.Config:
    """The :class:`pallas_kernels.Config` of one setting (a value string per knob)."""
    values = {k: parse(v) for k, v in zip(KNOBS, setting)}
    bools = {f.name for f in dataclasses.fields(pallas_kernels.Config) if "bool" in str(f.type)}
    return pallas_kernels.Config(**{k: v if v is None or k not in bools else bool(v) for k, v in values.items()})


def time_both(f, g, args, backward: bool) -> str:
    """`` fwd ms (compile s)[, fwd+bwd ms (compile s)]`` of ``f`` and of ``f`` with its
    gradients (the loss ``<f(x, y, w), g>``)."""
    fwd_ms, fwd_c = timed(jax.jit(f), args, *REPEAT)
    text = f" fwd {fwd_ms:.3f} ms (compile {fwd_c:.1f} s)"
    if backward:  # g is an argument: a captured array would be embedded as a constant
        both = jax.jit(jax.value_and_grad(lambda x, y, w, g: jnp.vdot(f(x, y, w), g), (0, 1, 2)))
        both_ms, both_c = timed(both, (*args, g), *REPEAT)
        text += f", fwd+bwd {both_ms:.3f} ms (compile {both_c:.1f} s)"
    return text


def time_dbl(f, g, args, force: bool = False) -> str:
    """`` dbl ms (compile s)``: gpu_benchmark.py's double backward, the gradient of
    ``|gx|^2 + |gy|^2`` of the backward of ``<f(x, y, w), g>`` w.r.t. ``(x, y, w)``. `force`:
    `` dblf ...``, the double backward force training runs, where every input of the backward
    is perturbed (``g`` is a later layer's cotangent) and every gradient is read: the gradient
    of ``|gx|^2 + |gy|^2 + |gw|^2`` w.r.t. ``(x, y, w, g)``, so its ``dgz`` kernel runs too."""

    def loss(x, y, w, g):
        gx, gy, gw = jax.grad(lambda x, y, w: jnp.vdot(f(x, y, w), g), (0, 1, 2))(x, y, w)
        return jnp.sum(gx**2) + jnp.sum(gy**2) + (jnp.sum(gw**2) if force else 0)

    ms, compile_s = timed(jax.jit(jax.grad(loss, (0, 1, 2, 3) if force else (0, 1, 2))), (*args, g), *REPEAT)
    return f" dbl{'f' if force else ''} {ms:.3f} ms (compile {compile_s:.1f} s)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", default="mace-large", help="comma list of jequi.problems names")
    ap.add_argument("--channelwise", action="append", default=[], help="IN1:IN2:OUT irreps of another product")
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp-batch", type=int, default=0, help="also time the batched product on this many rows")
    ap.add_argument("--dbl-batch", type=int, default=0, help="also time the batched product's double backward")
    ap.add_argument("--conv", action=argparse.BooleanOptionalAction, default=True, help="time the conv")
    ap.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True, help="time fwd+bwd too")
    ap.add_argument("--dbl-force", action="store_true", help="time force training's double backward (dblf) instead")
    ap.add_argument("--layouts", default="mul_ir", help="comma list of the products' layouts (mul_ir, ir_mul)")
    for name in KNOBS:
        default = getattr(pallas_kernels.DEFAULT, name)
        ap.add_argument("--" + name.replace("_", "-"), default="auto" if default is None else str(int(default)))
    a = ap.parse_args()
    if a.dbl_batch > a.tp_batch:
        ap.error("--dbl-batch takes its rows from the --tp-batch ones: give --tp-batch at least as large")
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    atoms, _, graph = structures.radius_graph(a.graph)
    print(f"{a.graph}: {len(atoms)} atoms, {graph.num_edges} edges, edges_sorted={graph.edges_sorted}", flush=True)
    products = {}
    for layout in a.layouts.split(","):
        tag = "" if layout == "mul_ir" else f" {layout}"
        products.update({name + tag: jequi.problems.get(name, layout=layout) for name in filter(None, a.problems.split(","))})
        products.update({spec + tag: jequi.channelwise(*spec.split(":"), layout=layout) for spec in a.channelwise})
    for name, tp in products.items():
        d1, d2, do = tp.descriptor.dims
        n, e, b = len(atoms), graph.num_edges, a.tp_batch
        shapes = [(n, d1), (e, d2), (e, tp.weight_numel), (n, do), (b, d1), (b, d2), (b, tp.weight_numel), (b, do)]
        x, y, w, g, bx, by, bw, bg = (
            jax.random.normal(k, s, a.dtype) for k, s in zip(jax.random.split(jax.random.key(0), len(shapes)), shapes)
        )
        settings = list(itertools.product(*(getattr(a, k).split(",") for k in KNOBS)))
        for setting in settings:
            backend = jequi.backends.register(jequi.backends.configured("pallas", config_of(setting)))
            line = " ".join(f"{k}={v}" for k, v in zip(KNOBS, setting)) + ":"
            if a.conv:
                line += " conv" + time_both(lambda x, y, w: tp.conv(x, y, w, graph, backend=backend), g, (x, y, w), a.backward)
            if b:
                line += " tp" + time_both(lambda x, y, w: tp(x, y, w, backend=backend), bg, (bx, by, bw), a.backward)
            if a.dbl_batch:
                k = a.dbl_batch
                line += time_dbl(lambda x, y, w: tp(x, y, w, backend=backend), bg[:k], (bx[:k], by[:k], bw[:k]), a.dbl_force)
            print(f"{name} {a.dtype} {line}", flush=True)


if __name__ == "__main__":
    main()
