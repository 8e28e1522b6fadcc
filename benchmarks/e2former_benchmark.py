"""The E2Former-style model's steps per second (energy and forces) on periodic fcc crystals.

For each size (1k, 10k, 50k, 100k atoms by default) and each attention backend: fcc Cu (a = 3.61 Å,
rattled 0.02 Å), vesin's neighbour list on the host turned into the model's padded
:class:`jequi.models.Neighbors` (K = max degree rounded up to a bucket, ghost sources for the
periodic images, local origin at the centroid), random parameters (:func:`init_params`, float32),
and one jitted call of energy and forces (``-dE/dpositions``) per step, timed after the first
(compiling) call. Peak device memory is read from ``memory_stats()`` where the device has it
(reset per cell only by starting a new process, so it is a running peak: compare within a column
of increasing sizes). A size that fails (out of memory) is recorded and the larger sizes of
that backend are skipped: the last that ran is the largest that fits.

Presets (``--preset``): ``default``: ``E2FormerConfig()`` (32x0e+16x1o+8x2e, 4 heads, d = 8, 2
layers, cutoff 4.5 Å); ``released``: E2Former-V2's released widths with natural parity
(256x0e+256x1o+256x2e, 128 heads, d = 8, 4 layers, cutoff 4.5 Å; values per head
2x0e+2x1o+2x2e (18 numbers) and their EAAS product 2x0e+4x1o+2x2e (24): D_v = 42; the released
code's is 58).
Backends: ``pallas`` (the fused attention kernels) and ``xla`` (the materialised gather
attention: the baseline, ``N x K x H x D_v`` in memory).

Writes ``<date>-<device>-e2former.{json,md}`` into --out (and $OUT) after every cell.
``--smoke``: a tiny model on 108 and 256 atoms on whatever device there is (a CPU check).

    python benchmarks/e2former_benchmark.py [--sizes 1000,10000,50000,100000] [--preset default]
        [--backends pallas,xla] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import pathlib
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from jequi.models import E2Former, E2FormerConfig, neighbor_list  # noqa: E402
from jequi.models.e2former import init_params, tile_origins  # noqa: E402
from md_benchmark import cu_supercell  # noqa: E402
from timing import save, timed  # noqa: E402

PRESETS = {
    "default": E2FormerConfig(),
    "released": E2FormerConfig(hidden="256x0e+256x1o+256x2e", heads=128, head_dim=8, num_layers=4, qk_hidden=128,
                               radial_hidden=64),  # fmt: skip
    "smoke": E2FormerConfig(hidden="8x0e+4x1o+4x2e", heads=2, head_dim=4, num_basis=4, radial_hidden=8, qk_hidden=8, cutoff=3.0),
}


def edges(atoms, cutoff):
    try:
        from jequi.models.data import neighbour_edges

        return neighbour_edges(atoms, cutoff)
    except ImportError:  # no vesin: ase's (slower) list
        from jequi.atoms import radius_edges

        return radius_edges(atoms, cutoff)


def peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure(config: E2FormerConfig, atoms, repeat: int, calls: int, tile: float | None = None) -> dict:
    t0 = time.perf_counter()
    senders, receivers, shifts = edges(atoms, config.cutoff)
    origin = atoms.positions.mean(axis=0) if tile is None else tile_origins(atoms.positions, tile)
    nb = neighbor_list(senders, receivers, len(atoms), shifts, origin=origin, growth=config.growth)
    host_s = time.perf_counter() - t0
    species = jnp.asarray(config.species_index(atoms.numbers))
    positions = jnp.asarray(atoms.positions, jnp.float32)
    cell = jnp.asarray(atoms.cell.array, jnp.float32)
    params = init_params(config, jax.random.key(0), species, positions, nb, cell)
    model = E2Former(config)

    @jax.jit
    def step(params, positions, nb):
        energy, grad = jax.value_and_grad(lambda p: model.apply(params, species, p, nb, cell).sum())(positions)
        return energy, -grad

    ms, first_s = timed(step, (params, positions, nb), repeat=repeat, calls=calls)
    energy, forces = step(params, positions, nb)
    return {
        "steps_per_s": 1e3 / ms, "ms_per_step": ms, "first_call_s": first_s, "neighbour_list_s": host_s,
        "K": nb.neighbors.shape[1], "num_sources": nb.num_sources, "edges": int(len(senders)),
        "peak_bytes": peak_bytes(), "finite": bool(np.isfinite(float(energy)) and np.all(np.isfinite(np.asarray(forces)))),
    }  # fmt: skip


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [
        f"# E2Former-style model, energy + forces steps/s on {result['device']} ({result['date']})", "",
        f"jax {result['jax']}; preset `{result['preset']}`: hidden {c['hidden']}, {c['heads']} heads, d = {c['head_dim']}, "
        f"{c['num_layers']} layers, cutoff {c['cutoff']} Å, float32; local origins: "
        f"{'the centroid' if result.get('tile') is None else 'tiles of %g Å' % result['tile']}; periodic fcc Cu (a = 3.61 Å). One jitted call of "
        "energy and forces per step (the neighbour list is built on the host once and not timed). "
        "`python benchmarks/e2former_benchmark.py`.", "",
        "| atoms | edges | K | sources | backend | steps/s | ms/step | first call s | peak GiB | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for cell in result["cells"]:
        for backend, r in cell["backends"].items():
            peak = f"{r['peak_bytes'] / 2**30:.2f}" if r.get("peak_bytes") else "-"
            if "error" in r:
                lines.append(f"| {cell['atoms']} | - | - | - | {backend} | - | - | - | - | {r['error']} |")
                continue
            lines.append(f"| {cell['atoms']} | {r['edges']} | {r['K']} | {r['num_sources']} | {backend} | {r['steps_per_s']:.2f} | "
                         f"{r['ms_per_step']:.1f} | {r['first_call_s']:.1f} | {peak} | {'' if r['finite'] else 'NOT FINITE'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000,10000,50000,100000")
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--backends", default="pallas,xla", help="neighbor_attention backends, comma separated")
    ap.add_argument("--tile", type=float, default=None, help="local origins per cubic tile of this side (Å); default: the centroid")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on 108 and 256 atoms (a CPU check)")
    ap.add_argument("--kind", default="e2former", help="the results' name after <date>-<device>-")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.sizes.split(",")]
    backends = a.backends.split(",")
    if a.smoke:
        a.preset, sizes, a.repeat, a.calls = "smoke", [108, 256], 2, 2
        if jax.devices()[0].platform == "cpu":
            backends = ["xla"]  # Pallas runs interpreted on a CPU: a test, not a benchmark
    config = PRESETS[a.preset]
    dev = jax.devices()[0]
    result = {
        "date": datetime.date.today().isoformat(), "device": dev.device_kind, "platform": dev.platform, "jax": jax.__version__,
        "e3nn_jax": importlib.metadata.version("e3nn-jax"), "preset": a.preset, "tile": a.tile, "config": dataclasses.asdict(config),
        "cells": [],
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "cells"}), flush=True)
    kind = f"{a.kind}-smoke" if a.smoke else (a.kind if a.preset == "default" else f"{a.kind}-{a.preset}")
    failed = set()
    for size in sizes:
        atoms = cu_supercell(size)
        cell = {"atoms": len(atoms), "backends": {}}
        result["cells"].append(cell)
        for backend in backends:
            if backend in failed:
                cell["backends"][backend] = {"error": "skipped (a smaller size failed)"}
                continue
            try:
                cell["backends"][backend] = measure(dataclasses.replace(config, backend=backend), atoms, a.repeat, a.calls, a.tile)
            except Exception as e:  # noqa: BLE001 (out of memory at the largest sizes: recorded, the others go on)
                traceback.print_exc()
                failed.add(backend)
                cell["backends"][backend] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
            print(json.dumps({"atoms": len(atoms), backend: cell["backends"][backend]}), flush=True)
            save(result, kind, markdown(result), a.out)
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
