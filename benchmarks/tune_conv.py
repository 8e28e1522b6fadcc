"""Sweep the Pallas kernels' schedule knobs on a real graph (GPU run, device tool).

    python3 benchmarks/tune_conv.py [--problems mace-large] [--graph carbon] [--tp-batch 50000]
        [--channelwise IN1:IN2:OUT] [--no-conv] [--steps 1,2,4] [--accumulators 32,64,128]
        [--forward-warps auto,1,2,4] [--backward-warps auto,1,2,4] [--lane-sums element,tile]
        [--edge-splits auto,1,2,4,8] [--rows auto,1,8] [--backward-groups auto,0,1]
        [--forward-accumulators auto,64,128] [--cotangent-layout ir_mul,mul_ir]
        [--backward-chunks auto,1,2,4] [--channel-windows auto,1,2] [--fma 1,0]
        [--chained-forward auto,0,1] [--fused-forward auto,0,1] [--forward-block-rows 16,32]
        [--forward-block-warps 4,8] [--backward-block-rows auto,16] [--backward-block-warps 2,4]
        [--fused-second auto,0,1] [--no-backward] [--dbl-batch 20000] [--dbl-force]
        [--layouts mul_ir,ir_mul]

Knobs (module constants): EDGES_PER_STEP (edges per loop step), ACCUMULATOR_REGISTERS (the
conv forward's output grouping, 32-bit registers per thread), FILL_WARPS (the warps a small
graph's rows are split to fill, fill_edges' rule), COTANGENT_LAYOUT (the layout the conv backward reads the
output cotangent in), BACKWARD_CHUNKS (the backward's programs per x segment, auto =
backward_programs' rule), CHAINED_FORWARD (the forward's multiply-adds start from the edge
loop's sums, auto = by dtype) of pallas_kernels.conv; FORWARD_WARPS and BACKWARD_WARPS
(warps per program, auto = num_warps' rule), LANE_SUMS (gy's cross-lane sums per element or as
one tile), ROWS_PER_PROGRAM (the batched product's rows per program), BACKWARD_GROUPS (the
batched backward's programs per x segment, auto = backward_groups' rule),
FORWARD_ACCUMULATORS (the batched forward's output elements per thread, any dtype, before a
split over programs; 0 = a program per segment, auto = forward_groups' rule),
CHANNEL_WINDOWS (the batched backward's programs per group by x channels, auto =
channel_windows' rule), FUSED_FORWARD (the batched forward's multiply-adds fused, auto =
by dtype) and FUSED_SECOND (the batched double backward's dgz in its backward kernel, where
fuses_second allows, auto = by output width) of pallas_kernels.tensor_product; FORWARD_ROWS, FORWARD_WARPS, BACKWARD_ROWS (auto =
by dtype) and BACKWARD_WARPS (rows and warps per program) of pallas_kernels.row_blocks;
FUSED_MULTIPLY_ADD (multiply-adds as one instruction) of pallas_kernels.lowering. Prints conv
fwd and fwd+bwd ms per setting (unless --no-conv), with --tp-batch the batched product's too,
and with --dbl-batch the batched product's double backward (gpu_benchmark.py's dbl) on that
many of those rows (with --dbl-force, force training's, gpu_benchmark.py's dblf, which runs dgz). --channelwise adds a product of one's own irreps (jequi.channelwise), e.g.
a model's convolution.
--layouts builds every product in each of these layouts (x, y, z and the conv's node arrays).
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
import pallas_kernels.lowering as lowering
import pallas_kernels.row_blocks as row_blocks
import pallas_kernels.tensor_product as tensor_product

# (runs, calls per run) of each timing: settings differ by a few percent, more than the
# run-to-run spread of timing.py's default 5 x 5 calls.
REPEAT = (9, 20)

_FLAGS = {"1": True, "0": False}
KNOBS = {  # option -> (module, constant, parse)
    "steps": (conv, "EDGES_PER_STEP", int),
    "accumulators": (conv, "ACCUMULATOR_REGISTERS", int),
    "forward_warps": (tensor_product, "FORWARD_WARPS", lambda v: None if v == "auto" else int(v)),
    "backward_warps": (tensor_product, "BACKWARD_WARPS", lambda v: None if v == "auto" else int(v)),
    "lane_sums": (tensor_product, "LANE_SUMS", str),
    "fill_warps": (conv, "FILL_WARPS", int),
    "rows": (tensor_product, "ROWS_PER_PROGRAM", lambda v: None if v == "auto" else int(v)),
    "backward_groups": (tensor_product, "BACKWARD_GROUPS", lambda v: None if v == "auto" else _FLAGS[v]),
    "forward_accumulators": (tensor_product, "FORWARD_ACCUMULATORS", lambda v: None if v == "auto" else int(v)),
    "cotangent_layout": (conv, "COTANGENT_LAYOUT", str),
    "backward_chunks": (conv, "BACKWARD_CHUNKS", lambda v: None if v == "auto" else int(v)),
    "channel_windows": (tensor_product, "CHANNEL_WINDOWS", lambda v: None if v == "auto" else int(v)),
    "fma": (lowering, "FUSED_MULTIPLY_ADD", lambda v: _FLAGS[v]),
    "chained_forward": (conv, "CHAINED_FORWARD", lambda v: None if v == "auto" else _FLAGS[v]),
    "fused_forward": (tensor_product, "FUSED_FORWARD", lambda v: None if v == "auto" else _FLAGS[v]),
    "fused_second": (tensor_product, "FUSED_SECOND", lambda v: None if v == "auto" else _FLAGS[v]),
    "forward_block_rows": (row_blocks, "FORWARD_ROWS", int),
    "forward_block_warps": (row_blocks, "FORWARD_WARPS", int),
    "backward_block_rows": (row_blocks, "BACKWARD_ROWS", lambda v: None if v == "auto" else int(v)),
    "backward_block_warps": (row_blocks, "BACKWARD_WARPS", int),
}


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
    defaults = {"steps": "1", "accumulators": "64", "forward_warps": "auto", "backward_warps": "auto", "lane_sums": "tile",
                "fill_warps": str(conv.FILL_WARPS), "rows": "auto", "backward_groups": "auto", "forward_accumulators": "auto",
                "cotangent_layout": conv.COTANGENT_LAYOUT, "backward_chunks": "auto", "channel_windows": "auto",
                "fma": "1", "chained_forward": "auto", "fused_forward": "auto", "fused_second": "auto",
                "forward_block_rows": str(row_blocks.FORWARD_ROWS), "forward_block_warps": str(row_blocks.FORWARD_WARPS),
                "backward_block_rows": "auto", "backward_block_warps": str(row_blocks.BACKWARD_WARPS)}
    for name, default in defaults.items():
        ap.add_argument("--" + name.replace("_", "-"), default=default)
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
            for (module, constant, parse), value in zip(KNOBS.values(), setting):
                setattr(module, constant, parse(value))
            jax.clear_caches()
            line = " ".join(f"{k}={v}" for k, v in zip(KNOBS, setting)) + ":"
            if a.conv:
                line += " conv" + time_both(lambda x, y, w: tp.conv(x, y, w, graph, backend="pallas"), g, (x, y, w), a.backward)
            if b:
                line += " tp" + time_both(lambda x, y, w: tp(x, y, w, backend="pallas"), bg, (bx, by, bw), a.backward)
            if a.dbl_batch:
                k = a.dbl_batch
                line += time_dbl(lambda x, y, w: tp(x, y, w, backend="pallas"), bg[:k], (bx[:k], by[:k], bw[:k]), a.dbl_force)
            print(f"{name} {a.dtype} {line}", flush=True)


if __name__ == "__main__":
    main()
