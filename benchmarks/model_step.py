"""The model step, the benchmark that decides: jequi's NequIP model at two real widths, on what
users run, with each convolution implementation in the same model and the same process.

Models (``MODELS``): NequIP at NequIP-OAM-L width (``128x0e+64x1o+32x2e+32x3o``, lmax 3, 4
layers) and at a MACE-like width (``128x0e+128x1o+128x2e``, lmax 3, 2 layers). Workloads:

* ``md``: one large periodic structure (a rattled fcc Cu-Au alloy), energy and forces, what a
  molecular-dynamics step runs, at about 1k, 4k, 16k and 64k atoms (``--atoms``);
* ``train``: the force-training step (gradient of the energy + force loss, so the conv's
  second derivatives) on a padded batch of EMT-labelled structures (``--batch-atoms``), with
  ``--padding`` of its edges (and 10 % of its nodes) padding, as a data loader with a fixed
  budget pads (out-of-range indices, ``jequi.models.data.batch``).

Implementations (``--impls``): ``jequi`` (the default backend), ``jequi-<backend>``,
``e3nn`` (gather, e3nn-jax's product, ``segment_sum``) and ``cuex`` (cuEquivariance-JAX's
fused indexed ``segmented_polynomial``, uniform multiplicities only; its operands converted to
``ir_mul``, its weights in its own order: a timing, not the same numbers); a jequi impl
followed by ``/k`` runs its radial conv in ``k`` edge chunks (``NequIPConfig.edge_chunks``;
default: the memory rule of ``TensorProduct.radial_conv``). Each cell: median
ms, compile s, XLA's memory estimate (arguments + outputs + temporaries) and, for ``--profile``
impls, the GPU time by kernel class from a profile. ``--largest`` doubles the ``md``
structure until an implementation fails, for the largest system that fits.

Device tool, from the repo root (peers carried for cuex):

    source .peers/setup_peers.sh; python3 benchmarks/model_step.py --model mace-width

Writes ``<date>-<device>-model-<model>.{json,md}`` into --out (and $OUT) after every cell;
``--plot FILE.json ...`` draws the step times of saved results into one PNG (no GPU needed).
``--largest`` runs each size in a fresh process (an allocator that served other cells can
be too fragmented for the largest one).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import glob
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms, save

import jequi
from jequi.descriptor import layout_positions
from jequi.models import MACEConfig, NequIP, NequIPConfig, data
from jequi.models.nequip import energy_and_forces
from jequi.models.loss import errors

MODELS = {
    "nequip-oam-l": NequIPConfig(hidden="128x0e+64x1o+32x2e+32x3o", sh_lmax=3, num_layers=4, radial_hidden=64),
    "mace-width": NequIPConfig(hidden="128x0e+128x1o+128x2e", sh_lmax=3, num_layers=2, radial_hidden=64),
    # MACE-MP-0 medium (89 elements, 128x0e+128x1o, lmax 3, correlation 3, r_max 6 A)
    "mace-mp-medium": MACEConfig(),
}
# Kernel classes of a profile, by the first pattern a GPU kernel's name matches.
KERNEL_CLASSES = [
    ("conv", r"jequi|segmented_polynomial|uniform_1d|tensor_product|cuequivariance"),
    ("matmul (linears, radial MLP)", r"gemm|cublas|cutlass|xmma|nvjet|matmul|dot"),
    ("sort, scatter, gather (indices)", r"sort|scatter|gather|radix|cub::|select|searchsorted"),
    ("other XLA fusions (gates, SH, radial basis, elementwise)", r""),
]


def alloy(n_atoms: int, seed: int = 0):
    """A rattled fcc Cu-Au alloy (25 % Au) of about `n_atoms` atoms, a cubic cell repeated."""
    from ase.build import bulk

    k = max(1, round((n_atoms / 4) ** (1 / 3)))
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((k, k, k))
    rng = np.random.default_rng(seed)
    atoms.numbers[rng.random(len(atoms)) < 0.25] = 79
    atoms.positions += rng.normal(0, 0.05, atoms.positions.shape)
    return atoms


def cuex_conv(tp, x, sh, weights, graph):
    """cuEquivariance's fused conv in the model: ``segmented_polynomial`` with gather and scatter
    indices, operands in ``ir_mul`` (out-of-range receivers go to an extra row, dropped)."""
    import cuequivariance as cue
    import cuequivariance_jax as cuex

    desc = tp.descriptor
    in1, in2, out = (cue.Irreps("O3", str(i)) for i in (tp.irreps_in1, tp.irreps_in2, tp.irreps_out))
    poly = cue.descriptors.channelwise_tensor_product(in1, in2, out).polynomial
    sizes = [op.size for op in poly.inputs] + [poly.outputs[0].size]
    if sizes != [tp.weight_numel, *desc.dims]:
        raise ValueError(f"cuEquivariance's operands {sizes} are not jequi's {[tp.weight_numel, *desc.dims]}")
    x_ir = x.array[:, np.argsort(layout_positions(desc.in1, "ir_mul"))]
    sh_ir = sh.array[:, np.argsort(layout_positions(desc.in2, "ir_mul"))]
    n = graph.num_nodes
    (z,) = cuex.segmented_polynomial(
        poly, [weights, x_ir, sh_ir], [jax.ShapeDtypeStruct((n + 1, desc.dims[2]), x.dtype)],
        indices=[None, graph.senders, None, graph.receivers], method="uniform_1d",
    )  # fmt: skip
    return e3nn.IrrepsArray(tp.irreps_out, z[:n][:, layout_positions(desc.out, "ir_mul")])


@functools.lru_cache(maxsize=8)
def _cuex_symmetric(irreps_in: str, irreps_out: str, correlation: int):
    import cuequivariance as cue
    from cuequivariance.group_theory.experimental.mace import symmetric_contraction

    return symmetric_contraction(cue.Irreps("O3", irreps_in), cue.Irreps("O3", irreps_out), range(1, correlation + 1))


def _to_ir_mul(irreps, x, inverse=False):
    """``mul_ir`` columns of `x` to ``ir_mul`` (or back)."""
    parts, i = [], 0
    for mul, ir in e3nn.Irreps(str(irreps)):
        block = x[:, i : i + mul * ir.dim]
        i += mul * ir.dim
        shape = (-1, ir.dim, mul) if inverse else (-1, mul, ir.dim)
        parts.append(jnp.swapaxes(block.reshape(shape), 1, 2).reshape(x.shape[0], -1))
    return jnp.concatenate(parts, axis=1)


def cuex_contraction(sc, x, species, weights):
    """cuEquivariance's MACE symmetric contraction in the model: ``uniform_1d`` indexed by
    species, weights through its projection (mace-torch order in, its group's signs: a timing,
    not the same numbers), operands in ``ir_mul``, as its MACE example calls it."""
    import cuequivariance_jax as cuex

    e, projection = _cuex_symmetric(str(sc.irreps_in), str(sc.irreps_out), sc.correlation)
    w = jnp.concatenate(list(weights.values()), axis=1)
    w = jnp.einsum("sau,ab->sbu", w, jnp.asarray(projection, w.dtype)).reshape(w.shape[0], -1)
    [y] = cuex.segmented_polynomial(
        e.polynomial, [w, _to_ir_mul(sc.irreps_in, x)], [jax.ShapeDtypeStruct((x.shape[0], e.outputs[0].dim), x.dtype)],
        indices=[species, None, None], method="uniform_1d",
    )  # fmt: skip
    return _to_ir_mul(sc.irreps_out, y, inverse=True)


def cuex_skip(lin, x, species, w):
    """cuEquivariance's species-indexed linear (``method="indexed_linear"``, rows sorted by
    species with ``cuex.Repeats``, as its MACE example), its weights `w` reshaped (a timing)."""
    import cuequivariance as cue
    import cuequivariance_jax as cuex

    s = lin.num_species
    e = cue.descriptors.linear(cue.Irreps("O3", str(lin.irreps_in)), cue.Irreps("O3", str(lin.irreps_out))) * (1.0 / s**0.5)
    order = jnp.argsort(species)
    counts = jnp.zeros((s,), jnp.int32).at[species].add(1)
    [y] = cuex.segmented_polynomial(
        e.polynomial, [w.reshape(s, -1)[:, : e.inputs[0].dim], _to_ir_mul(lin.irreps_in, x)[order]],
        [jax.ShapeDtypeStruct((x.shape[0], e.outputs[0].dim), x.dtype)],
        indices=[cuex.Repeats(counts), None, None], method="indexed_linear",
    )  # fmt: skip
    return _to_ir_mul(lin.irreps_out, jnp.zeros_like(y).at[order].set(y), inverse=True)


def variant(config: NequIPConfig, impl: str) -> NequIPConfig:
    """The model for `impl`; ``<jequi impl>/<k>`` runs its radial conv in `k` edge chunks."""
    if "/" in impl:
        impl, chunks = impl.split("/")
        return dataclasses.replace(variant(config, impl), edge_chunks=int(chunks))
    if impl == "jequi":
        return config
    if impl.startswith("jequi-"):
        return dataclasses.replace(config, backend=impl[len("jequi-") :])
    mace = isinstance(config, MACEConfig)
    if impl == "e3nn":  # MACE: the pure-XLA model (the contraction's XLA reference too)
        return dataclasses.replace(config, conv="e3nn", **({"contraction_backend": "xla"} if mace else {}))
    if impl == "cuex":
        return dataclasses.replace(config, conv=cuex_conv, **({"contraction": cuex_contraction, "skip": cuex_skip} if mace else {}))
    raise ValueError(f"unknown implementation {impl!r}")


def init(config):
    """The model's parameters (the same for every size and implementation), from a small alloy."""
    atoms = alloy(32)
    graph = jequi.graph_from_atoms(atoms, config.cutoff)
    species = jnp.asarray(config.species_index(atoms.numbers))
    args = species, jnp.asarray(atoms.positions, jnp.float32), graph, jnp.asarray(atoms.cell.array, jnp.float32)
    if isinstance(config, MACEConfig):
        return config.init_params(jax.random.key(0))
    return jax.jit(NequIP(dataclasses.replace(config, conv="jequi", backend="xla")).init)(jax.random.key(0), *args)


def md_step(config, atoms, params):
    """``(fn, args, info)``: energy and forces of one structure."""
    graph = jequi.graph_from_atoms(atoms, config.cutoff)
    species = jnp.asarray(config.species_index(atoms.numbers))
    cell = jnp.asarray(atoms.cell.array, jnp.float32)
    positions = jnp.asarray(atoms.positions, jnp.float32)

    def fn(params, positions, graph):
        return energy_and_forces(lambda p: config.energies(params, species, p, graph, cell).sum(), positions)

    return fn, (params, positions, graph), {"atoms": len(atoms), "edges": graph.num_edges}


def train_step(config, structures, batch_size, params, padding: float):
    """``(fn, args, info)``: the gradient of the energy + force loss on one padded batch."""
    chosen = structures[:batch_size]
    edges = data.structure_edges(chosen, config.cutoff)
    atoms = sum(len(s.numbers) for s in chosen)
    n_edge = int(sum(len(e[0]) for e in edges) / (1 - padding))
    b = data.batch(chosen, config, int(atoms * 1.1), n_edge, edges)

    def fn(params, b):
        return jax.grad(lambda p: errors(p, config, b)[0])(params)

    real_edges = int(np.sum(np.asarray(b.graph.receivers) < b.graph.num_nodes))
    info = {"atoms": int(np.sum(np.asarray(b.node_mask))), "nodes": int(b.species.shape[0]), "edges": b.graph.num_edges,
            "real_edges": real_edges, "structures": batch_size}  # fmt: skip
    return fn, (params, b), info


def kernel_breakdown(fn, args, calls: int = 5, top: int = 8) -> dict:
    """GPU time per call by :data:`KERNEL_CLASSES`, in ms, from a profile of `calls` calls, and
    under ``"top kernels"`` the `top` kernels that took longest (name: ms per call)."""
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
        path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
        profile = ProfileData.from_file(path)
    total, kernels = collections.Counter(), collections.Counter()
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                cls = next(c for c, pattern in KERNEL_CLASSES if re.search(pattern, ev.name, re.I))
                total[cls] += ev.duration_ns
                kernels[ev.name[:80]] += ev.duration_ns
    out = {c: total[c] / calls / 1e6 for c, _ in KERNEL_CLASSES}
    out["top kernels"] = {name: ns / calls / 1e6 for name, ns in kernels.most_common(top)}
    return out


def measure(fn, args, profile: bool) -> dict:
    """Compile, XLA's memory estimate, a checked first call, the median time."""
    jitted = jax.jit(fn)
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    gib = None
    if mem is not None:
        gib = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 2**30
    out = jax.block_until_ready(compiled(*args))
    finite = all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree_util.tree_leaves(out))
    ms = median_ms(compiled, args, repeat=5, calls=3)
    cell = {"ms": ms, "compile_s": compile_s, "memory_gib": gib, "finite": finite}
    if profile:
        cell["profile_ms"] = kernel_breakdown(compiled, args)
    return cell


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=MODELS, default="nequip-oam-l")
    ap.add_argument("--impls", default="jequi,jequi-cuda,jequi-pallas,e3nn,cuex")
    ap.add_argument("--atoms", default="1000,4000,16000,64000", help="md structure sizes")
    ap.add_argument("--batch-atoms", default="1000,4000", help="training batch sizes (atoms, about)")
    ap.add_argument("--padding", type=float, default=0.3, help="fraction of the training batch's edges that pad")
    ap.add_argument("--skip", default="", help="impl@workload@size cells not to run, comma list (e.g. jequi-pallas@md@64000)")
    ap.add_argument("--profile", default="jequi", help="impls profiled at 4,000 atoms")
    ap.add_argument("--largest", action="store_true", help="double the md structure from --largest-from until each impl fails")
    ap.add_argument("--largest-from", type=int, help="first size of the --largest search (default: the first of --atoms)")
    ap.add_argument("--largest-to", type=int, default=4_000_000, help="the --largest search stops past this size")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="draw saved results into --out and exit")
    a = ap.parse_args()
    if a.plot:
        return plot([json.loads(pathlib.Path(f).read_text()) for f in a.plot], pathlib.Path(a.out))
    if a.largest:  # only the search, each size in a child process: this one keeps off the GPU
        return search_largest(a)
    dev = jax.devices()[0]
    config = MODELS[a.model]
    impls = a.impls.split(",")
    skip = set(filter(None, a.skip.split(",")))
    result = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "jax": jax.__version__,
              "model": a.model, "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
              "default_backends": {}, "cells": []}  # fmt: skip
    if isinstance(config, MACEConfig):
        from jequi.models.mace import layers

        tps = [(layer.irreps_in, layer.tp) for layer in layers(config)]
    else:
        sh = str(e3nn.Irreps.spherical_harmonics(config.sh_lmax))
        tps = [(irreps_x, jequi.channelwise(irreps_x, sh, config.hidden)) for irreps_x in ("128x0e", config.hidden)]
    for layer, (irreps_x, tp) in enumerate(tps):
        result["default_backends"][f"layer {min(layer, 1)} ({irreps_x})"] = jequi.default_backend(tp.descriptor, conv=True)
    out = pathlib.Path(a.out)

    def run(workload, size, impl, make):
        if f"{impl}@{workload}@{size}" in skip:
            return None
        cell = {"workload": workload, "size": size, "impl": impl}
        try:
            fn, args, info = make(variant(config, impl))
            cell.update(info)
            cell.update(measure(fn, args, impl in a.profile.split(",") and 3000 <= size <= 5000))
        except Exception as exc:  # noqa: BLE001  (an implementation that fails or runs out of memory: recorded)
            cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print(json.dumps(cell), flush=True)
        result["cells"].append(cell)
        write(result, out)
        jax.clear_caches()
        return cell

    params = init(config)
    batch_atoms = [int(s) for s in a.batch_atoms.split(",") if s]
    structures = data.emt_dataset(max(batch_atoms) // 20 + 8, seed=1) if batch_atoms else []
    for size in batch_atoms:
        batch_size = max(1, size // 22)  # the EMT structures average about 22 atoms
        for impl in impls:
            run("train", size, impl, lambda c, bs=batch_size: train_step(c, structures, bs, params, a.padding))
    sizes = [int(s) for s in a.atoms.split(",") if s]
    failed = set()
    for size in sizes:
        atoms = alloy(size)
        for impl in impls:
            if impl not in failed:
                cell = run("md", size, impl, lambda c, atoms=atoms: md_step(c, atoms, params))
                if cell is not None and "error" in cell:
                    failed.add(impl)


def search_largest(a):
    """``--largest``: for each impl, :func:`largest` from ``--largest-from`` (or the first of
    ``--atoms``); the result file holds the cells of the largest sizes that ran."""
    result = {"date": datetime.date.today().isoformat(), "model": a.model, "largest": {}, "cells": [],
              "config": {k: str(v) for k, v in dataclasses.asdict(MODELS[a.model]).items()}}  # fmt: skip
    for impl in a.impls.split(","):
        found = largest(a.model, impl, a.largest_from or int(a.atoms.split(",")[0]), a.largest_to)
        cell = found.pop("cell", None)
        if cell:
            result.update(device=cell.pop("device"), jax=cell.pop("jax"))
            result["cells"].append(cell)
        result["largest"][impl] = found
        if "device" in result:
            write(result, pathlib.Path(a.out), name=f"largest-{a.model}")


def largest(model: str, impl: str, start: int, stop: int) -> dict:
    """The largest md structure (atoms) that `impl` runs, doubling from `start` until a size
    fails (or passes `stop`), then one size between the last two (about 1.4x), each size in a
    fresh process:
    ``{"fits": atoms or None, "ms": its step, "fails": atoms, "error": ...}``."""

    def attempt(size):
        out = tempfile.mkdtemp()
        cmd = [sys.executable, __file__, "--model", model, "--impls", impl, "--atoms", str(size), "--batch-atoms", "",
               "--profile", "", "--out", out]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        cells = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        cell = cells[-1] if cells else {"error": (proc.stderr.strip().splitlines() or ["no result"])[-1][:200]}
        saved = glob.glob(f"{out}/*.json")
        if saved and "error" not in cell:
            info = json.loads(pathlib.Path(saved[0]).read_text())
            cell.update(device=info["device"], jax=info["jax"])
        print(f"largest: {impl} at {size}: {cell.get('error') or cell.get('ms')}", flush=True)
        return cell

    found, size = {"fits": None}, start
    while "error" not in (cell := attempt(size)):
        found.update(fits=cell["atoms"], ms=cell["ms"], memory_gib=cell.get("memory_gib"), cell=cell)
        size *= 2
        if size > stop:
            return {**found, "fails": None, "error": f"not tried past {stop} atoms"}
    found.update(fails=size, error=cell["error"])
    if found["fits"]:
        between = int(size / 2**0.5)
        if "error" not in (cell := attempt(between)):
            found.update(fits=cell["atoms"], ms=cell["ms"], memory_gib=cell.get("memory_gib"), cell=cell)
        else:
            found.update(fails=between, error=cell["error"])
    return found


def write(result, out, name: str | None = None):
    lines = [f"# {result['model']} on {result['device']} ({result['date']}, jax {result['jax']})", "",
             f"hidden {result['config']['hidden']}, lmax {result['config']['sh_lmax']}, {result['config']['num_layers']} "
             f"layers; default conv backends: {result.get('default_backends', 'jequi.default_backend')}", "",
             "| workload | atoms | edges | impl | ms | compile s | XLA memory GiB | note |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in result["cells"]:
        edges = c.get("edges", "")
        if "real_edges" in c:
            edges = f"{c['edges']} ({c['real_edges']} real)"
        ms = f"{c['ms']:.2f}" if "ms" in c else ""
        comp = f"{c['compile_s']:.0f}" if "compile_s" in c else ""
        mem = f"{c['memory_gib']:.2f}" if c.get("memory_gib") is not None else ""
        note = c.get("error", "") or ("" if c.get("finite", True) else "non-finite output")
        lines.append(f"| {c['workload']} | {c.get('atoms', c['size'])} | {edges} | {c['impl']} | {ms} | {comp} | {mem} | {note} |")
    profiled = [c for c in result["cells"] if "profile_ms" in c]
    if profiled:
        lines += ["", "GPU time per step by kernel class (ms, profile):", "",
                  "| workload | impl | " + " | ".join(c for c, _ in KERNEL_CLASSES) + " |",
                  "|---|---|" + "---|" * len(KERNEL_CLASSES)]  # fmt: skip
        for c in profiled:
            lines.append(f"| {c['workload']} | {c['impl']} | " + " | ".join(f"{c['profile_ms'][k]:.2f}" for k, _ in KERNEL_CLASSES) + " |")
    if result.get("largest"):
        lines += ["", "Largest md structure that runs (atoms; each size in a fresh process):", ""]
        lines += [f"- {impl}: {v['fits']} ({v.get('ms', 0):.0f} ms; fails at {v['fails']}: {v['error'][:120]})"
                  for impl, v in result["largest"].items()]
    save(result, name or f"model-{result['model']}", "\n".join(lines) + "\n", out)


def plot(results: list[dict], out: pathlib.Path) -> pathlib.Path:
    """One panel per model: each cell's ms per implementation (log scale), a cross where an
    implementation ran out of memory or could not run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = sorted({c["impl"] for r in results for c in r["cells"]})
    color = {impl: f"C{i}" for i, impl in enumerate(impls)}
    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        keys = sorted({(c["workload"], c.get("atoms", c["size"])) for c in r["cells"]})
        present = [impl for impl in impls if any(c["impl"] == impl for c in r["cells"])]
        width = 0.8 / len(present)
        failed = []
        for i, impl in enumerate(present):
            cells = {(c["workload"], c.get("atoms", c["size"])): c for c in r["cells"] if c["impl"] == impl}
            xs = [j + (i - (len(present) - 1) / 2) * width for j, k in enumerate(keys) if k in cells]
            ax.bar(xs, [cells[k].get("ms", float("nan")) for k in keys if k in cells], width, label=impl, color=color[impl])
            failed += [(x, impl) for x, k in zip(xs, [k for k in keys if k in cells]) if "error" in cells[k]]
        ax.set_yscale("log")
        bottom = ax.get_ylim()[0]
        for x, impl in failed:
            ax.plot(x, bottom * 1.15, "x", color=color[impl], ms=8)
        ax.set_xticks(range(len(keys)), [f"{w}\n{n} atoms" for w, n in keys], fontsize=7)
        ax.set_ylabel("ms per step (x: out of memory or n/a)")
        ax.set_title(f"{r['model']}, {r['device']} ({r['date']})", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{results[0]['date']}-model-step.png"
    fig.savefig(path, dpi=130)
    plt.close(fig)
    print(path)
    return path


if __name__ == "__main__":
    main()
