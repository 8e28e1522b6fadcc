"""Multi-GPU scaling of the NequIP model with one structure split over devices
(``jequi.models.distributed``): strong and weak scaling, both schemes, where the time goes, and
the largest structure that fits on 1 and on N GPUs.

Uses the GPUs it sees (1..N); each cell runs in a fresh process (``--attempt``), killed after
``--cell-timeout`` (``--attempt-timeout`` for the largest search), so a device out of memory
(whose other devices would wait in a collective until the whole run's timeout) costs that cell,
recorded as its error, and the run goes on. Each cell is one energy + forces + virial call
(what an MD step runs) of a rattled fcc Cu-Au alloy (``model_step.alloy``), float32, model
``nequip-oam-l`` (``model_step.MODELS``) with random parameters. Parts (``--parts``):

* ``strong``: ``--strong-atoms`` (default 256,000) on 1, 2, 4, ... devices, each scheme
  (``--schemes``); parallel efficiency ``t_1 / (D t_D)``; every multi-device result is checked
  against one device's (energy and forces). The default must fit one GPU (the efficiency's
  baseline): pick ``--strong-atoms`` below ``--parts largest``'s one-device result for the model
  and GPU (docs/distributed.md has the H100's);
* ``weak``: ``--weak-atoms`` per device on 1, 2, 4, ... devices (exchange scheme); efficiency
  ``t_1 / t_D``;
* ``breakdown`` (with ``strong``, on the most devices): each device's share computed alone on
  one GPU (the same arrays, the ghosts' rows gathered locally instead of received), the
  collectives alone (the same ``ppermute``-s and their transposes), and the rest of the
  sharded step (waiting for the slowest device, synchronisation);
* ``largest``: each size in a fresh process (``--attempt``): on one device doubling from
  ``--largest-start`` until a size fails, then one size between the last two; on the most
  devices ``D x`` that, else 3.5x (the target), so a handful of attempts. ``--largest-one``
  takes the one-device result of an earlier run (one GPU's job, ``benchmarks/parallel_run.sh``)
  and runs only the multi-device attempts.

Every cell stops being started once ``--max-seconds`` have passed; a largest attempt is killed
after ``--attempt-timeout``. Writes ``<date>-<device>-scaling[-largest].{json,md}`` (and a PNG
where matplotlib is installed) into ``--out`` after every cell. ``--smoke``: a tiny model and
sizes on 4 host devices, to check the script on a CPU.

GPU machine (device tool, from the repo root, ``.whl`` carried): ``bash benchmarks/scaling_run.sh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from model_step import MODELS, alloy, init
from timing import median_ms, save

from jequi.models import NequIPConfig
from jequi.models import distributed as dist
from jequi.models import mesh as mesh_lib
from jequi.models.decomposition import Decomposition, split

SMOKE_MODEL = NequIPConfig(hidden="8x0e+4x1o+2x2e", sh_lmax=1, num_layers=2, num_basis=4, radial_hidden=8)


def neighbour_list(atoms, cutoff):
    """vesin's radius graph (JequiCalculator's), or ase's where vesin is not installed."""
    if importlib.util.find_spec("vesin"):
        from jequi.models.data import neighbour_edges

        return neighbour_edges(atoms, cutoff)
    from jequi.atoms import radius_edges

    return radius_edges(atoms, cutoff)


@dataclasses.dataclass
class Structure:
    """A built structure and its radius graph (reused by every cell of that size)."""

    atoms: object
    edges: tuple
    species: np.ndarray
    build_s: float

    @classmethod
    def make(cls, n_atoms: int, config: NequIPConfig) -> Structure:
        t0 = time.perf_counter()
        atoms = alloy(n_atoms)
        edges = neighbour_list(atoms, config.cutoff)
        return cls(atoms, edges, config.species_index(atoms.numbers), time.perf_counter() - t0)

    def split(self, devices: int, scheme: str, config: NequIPConfig, growth: float):
        a = self.atoms
        dec = Decomposition(devices, scheme, growth=growth)
        return split(a.positions, a.cell.array, a.pbc, self.species, *self.edges, dec, config.num_layers)


def local_send(sends, values):
    """The ghosts' rows gathered from this device's own rows: the exchange's work without the
    communication (:func:`jequi.models.distributed.exchange` with each ``ppermute`` dropped)."""
    return jnp.concatenate([values] + [values[rows] for rows in sends])


@functools.lru_cache(maxsize=8)
def compute_alone(config: NequIPConfig, layout):
    """One device's share of the sharded step run on one device alone: ``f(params, *arrays of
    that device) -> (energy, forces, virial)``."""

    def f(params, species, positions, cell, senders, receivers, shifts, atom_mask, sends):
        send = functools.partial(local_send, sends)

        def energy(positions, strain):
            return dist.device_energy(config, layout, params, species, positions, cell, senders, receivers, shifts, atom_mask, strain, send)

        (e, _), (grad, virial) = jax.value_and_grad(energy, argnums=(0, 1), has_aux=True)(positions, jnp.zeros((3, 3), positions.dtype))
        return e, -grad, virial

    return jax.jit(f)


def exchange_alone(layout, mesh, widths: list[int]):
    """The sharded step's collectives alone: positions and, for the exchange scheme, one array of
    each width in `widths` sent (forward) and their cotangents returned (backward)."""
    spec = jax.sharding.PartitionSpec(mesh_lib.AXIS)

    def f(sends, positions, *features):
        sends = tuple(s[0] for s in sends)
        arrays = (positions[0],) + tuple(x[0] for x in features)
        out, vjp = jax.vjp(lambda *xs: [dist.exchange(layout, sends, x) for x in xs], *arrays)
        back = vjp([jnp.ones_like(o) for o in out])
        return tuple(b[None] for b in back)

    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec))


def conv_input_widths(config: NequIPConfig) -> list[int]:
    """Row widths of each layer's convolution input (what the exchange scheme sends)."""
    import e3nn_jax as e3nn

    hidden = e3nn.Irreps(config.hidden)
    return [hidden.count("0e")] + [hidden.dim] * (config.num_layers - 1)


def measure_cell(config, params, structure: Structure, devices: int, scheme: str, growth: float, breakdown: bool = False,
                 reference=None, repeat: int = 3) -> dict:  # fmt: skip
    """One sharded energy + forces call: split, compile, time; optionally the breakdown."""
    cell = {"atoms": len(structure.atoms), "devices": devices, "scheme": scheme}
    t0 = time.perf_counter()
    shards = structure.split(devices, scheme, config, growth)
    cell["split_s"] = time.perf_counter() - t0
    lay = shards.layout
    cell.update(grid=list(shards.grid), shifts=list(lay.shifts), padded={"owned": lay.owned, "ghosts": lay.ghosts, "edges": lay.edges},
                real={k: v.tolist() for k, v in shards.counts.items()})  # fmt: skip
    mesh = mesh_lib.device_mesh(devices)
    arrays = dist.device_arrays(shards, mesh)
    t0 = time.perf_counter()
    compiled = dist.compiled(config, mesh).lower(lay, params, *arrays).compile()
    cell["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    if mem is not None:
        cell["memory_gib"] = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 2**30
    energy, _, forces, _ = jax.block_until_ready(compiled(params, *arrays))
    forces = shards.gather(forces)
    cell["energy"] = float(energy)
    cell["finite"] = bool(np.isfinite(forces).all() and np.isfinite(cell["energy"]))
    if reference is not None:  # against one device: float32, sums in another order
        cell["energy_rel_diff"] = abs(cell["energy"] - reference[0]) / max(abs(reference[0]), 1e-30)
        cell["force_max_diff"] = float(np.abs(forces - reference[1]).max())
        cell["force_scale"] = float(np.abs(reference[1]).max())
    cell["ms"] = median_ms(compiled, (params, *arrays), repeat=repeat, calls=2)
    if breakdown and devices > 1:
        cell["breakdown"] = breakdown_cell(config, params, shards, mesh, arrays, cell["ms"])
    del compiled, arrays
    return cell, forces


def breakdown_cell(config, params, shards, mesh, arrays, step_ms) -> dict:
    """Each device's share alone (on the first device), the collectives alone, and the rest."""
    lay = shards.layout
    first = mesh.devices.flat[0]
    alone = compute_alone(config, lay)
    put = lambda a: jax.device_put(np.asarray(a, np.float32) if np.asarray(a).dtype.kind == "f" else a, first)  # noqa: E731
    per_device = []
    for d in range(lay.devices):
        args = (params, put(shards.species[d]), put(shards.positions[d]), put(shards.cell), put(shards.senders[d]),
                put(shards.receivers[d]), put(shards.shifts[d]), put(shards.atom_mask[d]), tuple(put(s[d]) for s in shards.sends))  # fmt: skip
        jax.block_until_ready(alone(*args))
        per_device.append(median_ms(alone, args, repeat=3, calls=2))
    widths = conv_input_widths(config) if lay.scheme == "exchange" else []
    rng = np.random.default_rng(0)
    split_ = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh_lib.AXIS))
    features = [jax.device_put(rng.normal(size=(lay.devices, lay.owned, w)).astype(np.float32), split_) for w in widths]
    comm = exchange_alone(lay, mesh, widths)
    comm_args = (arrays[7], arrays[1], *features)
    jax.block_until_ready(comm(*comm_args))
    exchange_ms = median_ms(comm, comm_args, repeat=5, calls=3)
    sent = sum(lay.sends) * (3 + sum(widths)) * 4 * 2  # bytes a device sends per step, forward and back (padded)
    slowest = max(per_device)
    return {
        "compute_ms_per_device": per_device,
        "compute_ms_max": slowest,
        "compute_ms_mean": float(np.mean(per_device)),
        "exchange_ms": exchange_ms,
        "exchange_mb_per_device": sent / 1e6,
        "rest_ms": step_ms - slowest - exchange_ms,
    }


def device_name() -> str:
    devices = jax.devices()
    return f"{devices[0].device_kind} x{len(devices)}"


def alloy_atoms(n_atoms: int) -> int:
    """How many atoms ``alloy(n_atoms)`` builds (a cubic cell of 4 repeated k times a side)."""
    k = max(1, round((n_atoms / 4) ** (1 / 3)))
    return 4 * k**3


def device_counts(limit: int | None) -> list[int]:
    n = len(jax.devices()) if limit is None else min(limit, len(jax.devices()))
    counts = [1]
    while counts[-1] * 2 <= n:
        counts.append(counts[-1] * 2)
    if counts[-1] != n:
        counts.append(n)
    return counts


def run_scaling(a, result, out) -> None:
    counts = device_counts(a.max_devices)
    deadline = time.perf_counter() + a.max_seconds
    parts = set(a.parts.split(","))
    schemes = a.schemes.split(",")
    last_s = 0.0

    def run(kind, atoms, devices, scheme, breakdown=False, reference=None, save_forces=None):
        nonlocal last_s
        remaining = deadline - time.perf_counter()
        if remaining < 1.2 * last_s:
            cell = {"part": kind, "atoms": alloy_atoms(atoms), "devices": devices, "scheme": scheme,
                    "error": f"skipped: {remaining:.0f} s of --max-seconds left, the last cell took {last_s:.0f} s"}  # fmt: skip
            print(json.dumps(cell), flush=True)
        else:
            t0 = time.perf_counter()
            cell = attempt(a, atoms, devices, kind, scheme, breakdown, reference, save_forces)
            last_s = time.perf_counter() - t0
            cell["cell_s"] = last_s
        result["cells"].append(cell)
        write(result, out)
        return cell

    if "strong" in parts:
        scratch = tempfile.mkdtemp()
        reference = os.path.join(scratch, "one-device.npz")  # the 1-device cell's energy and forces
        one = run("strong", a.strong_atoms, 1, schemes[0], save_forces=reference)
        result["structures"][str(one["atoms"])] = {k: one[k] for k in ("edges", "build_s") if k in one}
        for devices in counts[1:]:
            for scheme in schemes:
                run("strong", a.strong_atoms, devices, scheme, breakdown="breakdown" in parts and devices == counts[-1],
                    reference=reference if "error" not in one else None)  # fmt: skip
    if "weak" in parts:
        for devices in counts:
            same = [c for c in result["cells"] if c["part"] == "strong" and c["atoms"] == alloy_atoms(a.weak_atoms * devices)
                    and c["devices"] == devices and c["scheme"] == "exchange" and "ms" in c]  # fmt: skip
            if same:  # the strong part measured this size on this many devices
                result["cells"].append({**same[0], "part": "weak", "breakdown": None})
                write(result, out)
                continue
            run("weak", a.weak_atoms * devices, devices, "exchange")


def attempt(a, atoms: int, devices: int, part: str = "largest", scheme: str = "exchange", breakdown: bool = False,
            reference: str | None = None, save_forces: str | None = None) -> dict:  # fmt: skip
    """One cell in a fresh process, killed after its timeout (``--attempt-timeout`` for a
    largest-search size, else ``--cell-timeout``): a device out of memory (or a collective whose
    other devices wait on it forever) costs that cell, recorded as its error, not the run; and
    the allocator of a process that ran other sizes can be too fragmented for the largest.
    ``reference``: an ``.npz`` of one device's energy and forces to check against;
    ``save_forces``: where to write this cell's."""
    out = tempfile.mkdtemp()
    cmd = [sys.executable, __file__, "--attempt", str(atoms), "--max-devices", str(devices), "--model", a.model, "--out", out,
           "--growth", str(a.growth), "--schemes", scheme, "--repeat", "1" if part == "largest" else "3"]  # fmt: skip
    cmd += (["--smoke"] if a.smoke else []) + (["--backend", a.backend] if a.backend else []) + (["--breakdown"] if breakdown else [])
    cmd += (["--reference", reference] if reference else []) + (["--save-forces", save_forces] if save_forces else [])
    timeout = a.attempt_timeout if part == "largest" else a.cell_timeout
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
        cell = lines[-1] if lines else {"error": (proc.stderr.strip().splitlines() or ["no result"])[-1][:200]}
    except subprocess.TimeoutExpired:
        cell = {"error": f"timed out after {timeout} s"}
    cell.update(part=part, devices=devices, scheme=scheme, size=atoms)
    cell.setdefault("atoms", alloy_atoms(atoms))
    print(json.dumps({k: v for k, v in cell.items() if k != "real"}), flush=True)
    return cell


def run_cell(a, config) -> None:
    """``--attempt``: one cell in this (child) process, its JSON line on stdout; an exception
    (out of memory) is the cell's error."""
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), init(config))
    cell = {}
    try:
        structure = Structure.make(a.attempt, config)
        cell.update(edges=len(structure.edges[0]), build_s=structure.build_s)
        reference = None
        if a.reference:
            saved = np.load(a.reference)
            reference = (float(saved["energy"]), saved["forces"])
        measured, forces = measure_cell(config, params, structure, a.max_devices, a.schemes, a.growth, a.breakdown, reference, a.repeat)
        cell.update(measured)
        if a.save_forces:
            np.savez(a.save_forces, energy=cell["energy"], forces=forces)
    except Exception as exc:  # noqa: BLE001  (out of memory, a failed collective: recorded)
        cell["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print(json.dumps(cell), flush=True)


def run_largest(a, result, out) -> None:
    """Largest on 1 device by doubling (then one size between); on the most devices, D x that,
    else 3.5x. A size not tried for lack of time (--max-seconds) ends the search, recorded."""
    deadline = time.perf_counter() + a.max_seconds
    devices = device_counts(a.max_devices)[-1]
    found = result["largest"]

    def go(atoms, on):
        if time.perf_counter() > deadline:
            found["stopped"] = f"--max-seconds spent before {atoms} atoms on {on} device(s)"
            write(result, out, "scaling-largest")
            return None
        cell = attempt(a, atoms, on)
        result["cells"].append(cell)
        write(result, out, "scaling-largest")
        return cell

    if a.largest_one:  # an earlier run's one-device result (a one-GPU job): only the multi-device attempts
        fits = a.largest_one
        found["1"] = {"fits": fits, "fails": None, "error": None, "note": "--largest-one (an earlier run's)"}
    else:
        fits, fails, error, size = None, None, None, a.largest_start
        while size <= a.largest_stop:
            if (cell := go(size, 1)) is None:
                return
            if "error" in cell:
                fails, error = size, cell["error"]
                break
            fits, size = cell["atoms"], size * 2
        found["1"] = {"fits": fits, "fails": fails, "error": error}
        if fits and fails:
            between = int((fits * fails) ** 0.5)
            if (cell := go(between, 1)) is None:
                return
            if "error" in cell:
                found["1"].update(fails=between, error=cell["error"])
            else:
                found["1"]["fits"] = fits = cell["atoms"]
    if devices > 1 and fits:
        for factor in (devices, 3.5):
            if (cell := go(int(factor * fits), devices)) is None:
                return
            if "error" not in cell:
                found[str(devices)] = {"fits": cell["atoms"], "ratio": cell["atoms"] / fits}
                break
            found[str(devices)] = {"fits": None, "fails": int(factor * fits), "error": cell["error"]}
    write(result, out, "scaling-largest")


def write(result, out, name: str = "scaling") -> None:
    cfg = result["config"]
    lines = [f"# Scaling of one structure split over devices: {result['device']} ({result['date']})", "",
             f"jax {result['jax']}, model {result['model']} (hidden {cfg['hidden']}, lmax {cfg['sh_lmax']}, {cfg['num_layers']} layers, "
             f"cutoff {cfg['cutoff']} A, backend {cfg['backend']}), float32, energy + forces + virial of a rattled fcc Cu-Au alloy; "
             f"sizes padded to buckets of growth {result['args']['growth']}; NCCL_NVLS_ENABLE={result['nccl_nvls_enable']}", ""]  # fmt: skip
    cells = [c for c in result["cells"] if c["part"] in ("strong", "weak")]
    if cells:
        lines += ["| part | atoms | devices | scheme | regions | ms | efficiency | atoms / ghosts / edges per device (max real; padded) "
                  "| memory GiB | compile s | split s | check vs 1 device | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in cells:
            lines.append(row(c, result["cells"]))
    for c in result["cells"]:
        b = c.get("breakdown")
        if b:
            lines += ["", f"Where the time goes, {c['atoms']} atoms on {c['devices']} devices, {c['scheme']} scheme (ms):", "",
                      "| sharded step | slowest device alone | mean device alone | collectives alone (MB sent per device) | rest (waiting, sync) |",
                      "|---|---|---|---|---|",
                      f"| {c['ms']:.1f} | {b['compute_ms_max']:.1f} | {b['compute_ms_mean']:.1f} | {b['exchange_ms']:.2f} "
                      f"({b['exchange_mb_per_device']:.1f}) | {b['rest_ms']:.1f} |"]  # fmt: skip
    if result.get("largest"):
        lines += ["", "Largest structure that runs (each size in a fresh process):", ""]
        for devices, v in result["largest"].items():
            if devices == "stopped":
                lines.append(f"- search stopped: {v}")
                continue
            ratio = f", {v['ratio']:.2f}x one device's" if v.get("ratio") else ""
            fails = f"fails at {v['fails']}: {str(v.get('error', ''))[:120]}" if v.get("fails") else "larger not tried"
            lines.append(f"- {devices} device(s): {v.get('fits')} atoms{ratio} ({fails})")
        tried = [c for c in result["cells"] if c["part"] == "largest"]
        lines += ["", "| devices | atoms | ms | memory GiB | result |", "|---|---|---|---|---|"]
        for c in tried:
            ms = f"{c['ms']:.0f}" if "ms" in c else ""
            mem = f"{c['memory_gib']:.1f}" if c.get("memory_gib") else ""
            lines.append(f"| {c['devices']} | {c.get('atoms', c['size'])} | {ms} | {mem} | {c.get('error', 'fits')[:120]} |")
    save(result, name, "\n".join(lines) + "\n", out)
    if name == "scaling":
        plot(result, pathlib.Path(out))


def efficiency(c, cells):
    """Strong: ``t_1 / (D t_D)`` at the same size; weak: time per atom per device, ``(t_1 / N_1) /
    (t_D D / N_D)`` (the alloy's sizes are cubes, so atoms per device differ a little)."""
    if "ms" not in c:
        return None
    if c["part"] == "strong":
        base = [b for b in cells if b["part"] == "strong" and b["devices"] == 1 and b["atoms"] == c["atoms"] and "ms" in b]
        return base[0]["ms"] / (c["devices"] * c["ms"]) if base else None
    base = [b for b in cells if b["part"] == "weak" and b["devices"] == 1 and "ms" in b]
    return (base[0]["ms"] / base[0]["atoms"]) / (c["ms"] * c["devices"] / c["atoms"]) if base else None


def row(c, cells) -> str:
    eff = efficiency(c, cells)
    eff = f"{100 * eff:.0f} %" if eff is not None else ""
    real, pad = c.get("real", {}), c.get("padded", {})
    per = f"{max(real['owned'])} / {max(real['ghosts'])} / {max(real['edges'])}; {pad['owned']} / {pad['ghosts']} / {pad['edges']}" if real else ""
    check = ""
    if "energy_rel_diff" in c:
        check = f"E {c['energy_rel_diff']:.1e} rel, F {c['force_max_diff']:.1e} eV/A (of {c['force_scale']:.1f})"
    fmt = lambda key, f: (f % c[key]) if c.get(key) is not None else ""  # noqa: E731
    return (f"| {c['part']} | {c['atoms']} | {c['devices']} | {c['scheme']} | {'x'.join(map(str, c.get('grid', [])))} | {fmt('ms', '%.1f')} "
            f"| {eff} | {per} | {fmt('memory_gib', '%.1f')} | {fmt('compile_s', '%.0f')} | {fmt('split_s', '%.1f')} | {check} "
            f"| {c.get('error', '')[:100]} |")  # fmt: skip


def plot(result, out: pathlib.Path):
    """Strong and weak scaling: ms per step and efficiency against devices (skipped without matplotlib)."""
    if not importlib.util.find_spec("matplotlib"):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in result["cells"] if c["part"] in ("strong", "weak") and "ms" in c]
    if not cells:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (part, scheme), style in zip([("strong", "exchange"), ("strong", "halo"), ("weak", "exchange")], ["o-", "s--", "^-"]):
        cs = sorted((c for c in cells if c["part"] == part and (c["scheme"] == scheme or c["devices"] == 1)), key=lambda c: c["devices"])
        if len(cs) < 2:
            continue
        label = f"{part}, {scheme}" + (f" ({cs[0]['atoms']} atoms)" if part == "strong" else f" ({cs[0]['atoms']} atoms per device)")
        axes[0].plot([c["devices"] for c in cs], [c["ms"] for c in cs], style, label=label)
        axes[1].plot([c["devices"] for c in cs], [100 * (efficiency(c, result["cells"]) or np.nan) for c in cs], style, label=label)
    axes[0].set(xlabel="devices", ylabel="ms per energy + forces + virial", yscale="log")
    top = max([110.0] + [100 * (efficiency(c, result["cells"]) or 0) + 10 for c in cells])  # above 100 % where fewer edge chunks
    axes[1].set(xlabel="devices", ylabel="parallel efficiency, %", ylim=(0, top))
    axes[1].axhline(80, color="gray", lw=0.8, ls=":")
    for ax in axes:
        ax.set_xticks(sorted({c["devices"] for c in cells}))
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"{result['model']} on {result['device']} ({result['date']})", fontsize=9)
    fig.tight_layout()
    stem = f"{result['date']}-{re.sub('[^a-z0-9]+', '-', result['device'].lower()).strip('-')}-scaling.png"
    fig.savefig(out / stem, dpi=130)
    plt.close(fig)
    if os.environ.get("OUT") and pathlib.Path(os.environ["OUT"]).resolve() != out.resolve():
        fig_path = pathlib.Path(os.environ["OUT"]) / stem
        fig_path.write_bytes((out / stem).read_bytes())
    return out / stem


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="nequip-oam-l")
    ap.add_argument("--parts", default="strong,weak,breakdown", help="comma list of strong, weak, breakdown, largest")
    ap.add_argument("--schemes", default="exchange,halo")
    ap.add_argument("--backend", help="jequi backend of the convolutions (default: the fastest available)")
    ap.add_argument("--strong-atoms", type=int, default=256_000)
    ap.add_argument("--weak-atoms", type=int, default=64_000, help="atoms per device")
    ap.add_argument("--max-devices", type=int, help="use at most this many of the devices JAX sees")
    ap.add_argument("--growth", type=float, default=1.01,
                    help="size buckets (Decomposition.growth): near-exact, so padding does not blur the scaling (MD's default 1.25 "
                         "pads up to 25 %% on one device and on many)")  # fmt: skip
    ap.add_argument("--largest-start", type=int, default=256_000)
    ap.add_argument("--largest-stop", type=int, default=8_192_000)
    ap.add_argument("--largest-one", type=int, help="atoms: the one-device largest an earlier run found (skips that search)")
    ap.add_argument("--attempt-timeout", type=int, default=200, help="seconds for one largest-search size")
    ap.add_argument("--max-seconds", type=float, default=480.0, help="start no cell after this many seconds")
    ap.add_argument("--cell-timeout", type=int, default=240, help="seconds for one strong or weak cell")
    ap.add_argument("--attempt", type=int, help=argparse.SUPPRESS)  # a child process: one cell of this size
    ap.add_argument("--breakdown", action="store_true", help=argparse.SUPPRESS)  # a child's cell: with the breakdown
    ap.add_argument("--repeat", type=int, default=3, help=argparse.SUPPRESS)  # a child's cell: timed repeats
    ap.add_argument("--reference", help=argparse.SUPPRESS)  # a child's cell: one device's energy and forces (.npz) to check against
    ap.add_argument("--save-forces", help=argparse.SUPPRESS)  # a child's cell: write its energy and forces (.npz) here
    ap.add_argument("--smoke", action="store_true", help="a tiny model and sizes on 4 host devices (a CPU check of the script)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(pathlib.Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    if a.smoke:
        jax.config.update("jax_num_cpu_devices", 4)  # before JAX starts; a GPU platform is unaffected
        if a.attempt is None:
            a.strong_atoms, a.weak_atoms, a.largest_start, a.largest_stop = 2048, 500, 500, 1000
    config = dataclasses.replace(SMOKE_MODEL if a.smoke else MODELS[a.model], backend=a.backend)
    if a.attempt is not None:  # a child: one cell
        run_cell(a, config)
        return
    def new_result():
        return {
            "date": datetime.date.today().isoformat(), "device": device_name(), "jax": jax.__version__, "model": "smoke" if a.smoke else a.model,
            "config": {k: str(v) for k, v in dataclasses.asdict(config).items()}, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "structures": {}, "cells": [], "largest": {}, "args": vars(a),
        }  # fmt: skip

    out = pathlib.Path(a.out)
    parts = set(a.parts.split(","))
    if "largest" in parts:
        run_largest(a, new_result(), out)
    if parts - {"largest"}:
        run_scaling(a, new_result(), out)


if __name__ == "__main__":
    main()
