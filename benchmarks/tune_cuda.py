"""The CUDA backend's kernels beside the Pallas ones on a real graph, and sweeps of their
schedule knobs (GPU run, device tool).

    python3 benchmarks/tune_cuda.py [--problems mace-large] [--graph carbon] [--dtype float32]
        [--layouts mul_ir,ir_mul] [--backends cuda,cuda-atomic,pallas] [--tp-batch 50000] [--dbl-batch 20000 [--dbl-force]]
        [--forward-registers 64] [--batched-forward-registers 128] [--backward-values 128]
        [--prefetch 64,0] [--batched-float32-backward-prefetch 0,64] [--min-warps 16,0] [--l2-prefetch 4,0] [--block-warps 8] [--channels 1,4]
        [--smem-budget 65536] [--float32-spill-bytes 64,0] [--second fused,composed]
        [--no-conv] [--no-backward] [--conv-dbl] [--precompile | --only-precompile]

Knobs: the fields of :class:`ffi.Config` but ``atomic_conv_backward``, which the backend sets
(``cuda-atomic``; comma lists are swept; a float64 batched forward is built twice, see
``Config.batched_float64_forward_registers``: sweep its ``batched_forward_*`` knobs with that
one at 0). Each setting is a ``Config`` value, run through the cuda backends built with it
(``jequi.backends.configured``). Prints, per product and setting,
the conv's fwd and fwd+bwd ms (tune_conv.py's timings), the batched product's with
``--tp-batch``, its double backward with ``--dbl-batch`` (and force training's with
``--dbl-force``) and the conv's with ``--conv-dbl``
(``--second composed``: the cuda backends' double backward composed from forward and
backward calls instead of their fused kernels), and the registers of each generated kernel.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import os

import jax
import numpy as np
import structures
from tune_conv import time_both, time_dbl

import jequi
import ffi
from ffi import build, build_search, launch, ops, schedule
from jequi.sums import Sums

KNOBS = tuple(f.name for f in dataclasses.fields(ffi.Config) if f.name != "atomic_conv_backward")
CUDA = ("cuda", "cuda-atomic")  # the backends whose kernels the knobs shape


def registers(desc, dtype, config) -> str:
    """Registers per thread and threads per block of the kernels generated for `desc` with `config`."""
    out = []
    for (d, dt, kind, sums, shared, c), kernel in ops.generated.items():
        if d == desc and dt == dtype and c == config:
            usage = build.resources(build.cubin(kernel.source))
            full = sums == launch.computed(kind, launch.FIRST_ORDER)
            out.append(f"{kind}{'' if full else f'[{sums}]'}: {usage['registers']} x {kernel.threads}")
    return ", ".join(out)


def precompile(a):
    """Build the kernels of every swept schedule setting into the disk cache at once, one nvcc
    per core (the timed sweep then finds them there; ``--only-precompile``: on a machine
    without a GPU, for ``sm_90``, to carry in ``JEQUI_CACHE_DIR``): the conv's forward and
    backward, with ``--tp-batch`` / ``--dbl-batch`` the batched product's too and the backward
    of its double backward as :func:`tune_conv.time_dbl` calls it; at the default
    per-row (edge) weights, no conv double backward's kernels."""
    full = launch.FIRST_ORDER
    kinds = []
    if a.conv:
        kinds += [("conv_forward", full)]
        kinds += [(f"conv_{'atomic_' if b == 'cuda-atomic' else ''}backward", full) for b in a.backends.split(",") if b in CUDA and a.backward]
    if a.tp_batch or a.dbl_batch:
        kinds += [("tp_forward", full), *([("tp_backward", full)] if a.backward or a.dbl_batch else [])]
    if a.dbl_batch:  # the gradient of |gx|^2 + |gy|^2: the backward pruned to gx, gy, then x, y, w perturbed
        spec = Sums.of((True, True, True, False), (True, True, False))
        kinds += [("tp_backward", Sums.gradients((True, True, False))), ("tp_backward", spec.of_kind(backward=True))]
    if a.dbl_batch and a.dbl_force:  # every input perturbed, every gradient read: dgz too, fused or in its own kernel
        sums = Sums.of((True, True, True, True), (True, True, True))
        kinds += [("tp_backward", sums), ("tp_forward", sums), ("tp_second", sums)]
    jobs = []
    for name, layout in itertools.product(a.problems.split(","), a.layouts.split(",")):
        desc = jequi.problems.get(name, layout=layout).descriptor.trilinear
        for values in itertools.product(*(getattr(a, k).split(",") for k in KNOBS)):
            config = ffi.Config(**{k: int(v) for k, v in zip(KNOBS, values)})
            jobs += [(desc, kind, launch.computed(kind, sums), config) for kind, sums in kinds
                     if kind != "tp_second" or schedule.outputs_follow_x(desc)]  # fmt: skip
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(lambda j: build_search.make(j[0], np.dtype(a.dtype), j[1], j[2], False, j[3]), jobs))
    print(f"precompiled {len(jobs)} kernels", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--problems", default="mace-large")
    ap.add_argument("--graph", default="carbon")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layouts", default="mul_ir")
    ap.add_argument("--backends", default="cuda,pallas")
    ap.add_argument("--tp-batch", type=int, default=0)
    ap.add_argument("--dbl-batch", type=int, default=0)
    ap.add_argument("--dbl-force", action="store_true", help="with --dbl-batch, also force training's double backward (time_dbl's force)")
    ap.add_argument("--conv", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--conv-dbl", action="store_true", help="also the conv's double backward (tune_conv.time_dbl)")
    ap.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--precompile", action="store_true", help="first build every setting's kernels, nvcc beside nvcc")
    ap.add_argument("--only-precompile", action="store_true", help="build every setting's kernels, then stop (no GPU needed)")
    ap.add_argument("--second", default="fused", help="comma list: fused, composed (the cuda double backward)")
    for k in KNOBS:
        ap.add_argument("--" + k.replace("_", "-"), default=str(int(getattr(ffi.DEFAULT, k))))  # booleans as 0 / 1
    a = ap.parse_args()
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    if a.precompile or a.only_precompile:
        precompile(a)
        if a.only_precompile:
            return
    atoms, _, graph = structures.radius_graph(a.graph)
    print(f"{a.graph}: {len(atoms)} atoms, {graph.num_edges} edges", flush=True)
    for name, layout in itertools.product(a.problems.split(","), a.layouts.split(",")):
        tp = jequi.problems.get(name, layout=layout)
        d1, d2, do = tp.descriptor.dims
        n, e, b = len(atoms), graph.num_edges, a.tp_batch
        shapes = [(n, d1), (e, d2), (e, tp.weight_numel), (n, do), (b, d1), (b, d2), (b, tp.weight_numel), (b, do)]
        keys = jax.random.split(jax.random.key(0), len(shapes))
        x, y, w, g, bx, by, bw, bg = (jax.random.normal(k, s, a.dtype) for k, s in zip(keys, shapes))
        sweeps = [a.second.split(",")] + [getattr(a, k).split(",") for k in KNOBS]
        for base in a.backends.split(","):
            cuda = base in CUDA
            for second, *values in itertools.product(*sweeps) if cuda else [(None,)]:
                label, backend = base, base
                if cuda:
                    config = ffi.Config(**{k: int(v) for k, v in zip(KNOBS, values)}, atomic_conv_backward=base == "cuda-atomic")
                    configured = jequi.backends.configured("cuda", config)
                    if second == "composed":
                        configured = dataclasses.replace(configured, name=configured.name + " composed", second=None, conv_second=None)
                    backend = jequi.backends.register(configured)
                    label += f" {second} " + " ".join(f"{k}={v}" for k, v in zip(KNOBS, values))
                line = f"{name} {layout} {a.dtype} {label}:"
                try:
                    if a.conv:
                        conv = lambda x, y, w: tp.conv(x, y, w, graph, backend=backend)  # noqa: E731
                        line += " conv" + time_both(conv, g, (x, y, w), a.backward)
                        line += time_dbl(conv, g, (x, y, w)) if a.conv_dbl else ""
                    if b:
                        line += " tp" + time_both(lambda x, y, w: tp(x, y, w, backend=backend), bg, (bx, by, bw), a.backward)
                    if a.dbl_batch:
                        k = a.dbl_batch
                        for force in (False, True) if a.dbl_force else (False,):
                            line += time_dbl(lambda x, y, w: tp(x, y, w, backend=backend), bg[:k], (bx[:k], by[:k], bw[:k]), force)
                except Exception as exc:  # noqa: BLE001 - report and go on with the next setting
                    line += f" failed: {type(exc).__name__}: {str(exc)[:300]}"
                if cuda:
                    line += " | " + registers(tp.descriptor.trilinear, jax.numpy.dtype(a.dtype), config)
                print(line, flush=True)


if __name__ == "__main__":
    main()
