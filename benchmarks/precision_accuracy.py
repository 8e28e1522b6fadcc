"""The precision policies (jequi.models.precision) beyond one evaluation, on one GPU: NVE energy
drift, phonon frequencies, a training curve, and the NequIP and MACE model steps per policy.

* ``nve``: :class:`jequi.models.md.DeviceMD` of ``--nve-model`` (the Nequix foundation model) on
  a rattled Cu-Au alloy of ``--nve-atoms`` atoms, ``--nve-steps`` velocity-Verlet steps of 1 fs
  from 300 K, per policy. Drift: the least-squares slope of the total energy per atom (meV/atom/ps)
  and the largest ``|E(t) - E(0)|`` per atom; the mean temperature.
* ``phonons``: the Gamma-point frequencies of a 32-atom fcc Cu supercell (the 2x2x2 cubic cell,
  so the Gamma, X and L points of the primitive cell) from ``JequiCalculator.get_hessian`` per
  policy, and from float64 on the pure-JAX reference (``backend="xla"``, x64): the largest and
  the mean frequency difference (THz) against float64 and against float32.
* ``train``: the EMT NequIP model (the shipped model's hyper-parameters) trained from scratch for
  ``--train-steps`` steps per policy on the same batches and seed: the loss curve and the
  held-out energy and force MAEs against the EMT labels every ``--eval-every`` steps.
* ``steps``: the MD step (energy and forces) of ``benchmarks/model_step.py``'s NequIP-OAM-L and
  MACE-MP-0-medium configurations at ``--step-atoms`` atoms per policy: median ms, and the energy
  and force differences from float32 (their parameters are model_step's initialisation, not
  trained: a check of the numerics, not of a potential's accuracy).

Device tool, from the repo root: ``bash benchmarks/precision_accuracy_run.sh`` runs the parts
as concurrent processes (one per policy) and merges them (``--merge``); one process:
``BENCH=precision_accuracy.py bash benchmarks/precision_run.sh``.
Writes ``<date>-<device>-precision-accuracy.{json,md}`` into --out (and $OUT). On a CPU (a check
of this program): ``--small``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from model_step import MODELS, alloy, init, md_step
from timing import median_ms, save, versions

from jequi.models import JequiCalculator, data
from jequi.models.md import DeviceMD, thermalize
from jequi.models.precision import with_precision
from jequi.models.train import evaluate, make_batches, train

POLICIES = ("float32", "tf32", "bf16-mixed")


def nve(model: str, atoms_target: int, steps: int, policies, skin: float, block: int) -> list[dict]:
    from ase import units

    rows = []
    for p in policies:
        atoms = alloy(atoms_target, seed=5)
        thermalize(atoms, 300.0, seed=3)
        md = DeviceMD(atoms, model, precision=p, timestep_fs=1.0, skin=skin, rebuild_every=10)
        # blocks of `block` steps: one compiled program (the chunk count is static); the first
        # block compiles, and a block that regrew the cell list ran twice, so neither is timed
        pot, kin, timed = [], [], []
        for _ in range(max(1, -(-steps // block))):
            regrown, t0 = md.regrown, time.perf_counter()
            out = md.run(block)
            seconds = time.perf_counter() - t0
            if pot and md.regrown == regrown:
                timed.append(seconds / out["steps"])
            pot.append(out["potential"])
            kin.append(out["kinetic"])
        pot, kin = np.concatenate(pot), np.concatenate(kin)
        n = len(atoms)
        total = (pot + kin) / n
        t_ps = np.arange(len(total)) * 1e-3
        slope = np.polyfit(t_ps, total, 1)[0]
        temperature = 2 * kin / (3 * n * units.kB)
        row = {"model": model, "atoms": n, "steps": len(total), "policy": p, "timestep_fs": 1.0,
               "drift_mev_per_atom_per_ps": 1e3 * float(slope), "max_deviation_mev_per_atom": 1e3 * float(np.abs(total - total[0]).max()),
               "std_mev_per_atom": 1e3 * float(total.std()), "mean_temperature_K": float(temperature.mean()),
               "ms_per_step": 1e3 * float(np.median(timed)) if timed else None, "regrown": md.regrown,
               "total_per_atom_every_100": total[::100].tolist()}  # fmt: skip
        rows.append(row)
        print({k: v for k, v in row.items() if k != "total_per_atom_every_100"}, flush=True)
    return rows


def frequencies_thz(hessian: np.ndarray, masses: np.ndarray) -> np.ndarray:
    """Sorted Gamma-point frequencies (THz; negative for an imaginary mode) of the ``(n, n, 3,
    3)`` Hessian (eV/Å^2) with `masses` (amu), the three translations (smallest |f|) dropped."""
    from ase import units

    n = len(masses)
    h = hessian.transpose(0, 2, 1, 3).reshape(3 * n, 3 * n)
    h = 0.5 * (h + h.T)
    m = np.repeat(masses, 3)
    lam = np.linalg.eigvalsh(h / np.sqrt(np.outer(m, m)))  # eV / (Å^2 amu)
    f = np.sign(lam) * np.sqrt(np.abs(lam) * units._e / units._amu) * 1e10 / (2 * np.pi) / 1e12
    return np.sort(f[np.argsort(np.abs(f))[3:]])


def phonons(model: str, policies, repeat: int) -> list[dict]:
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.63, cubic=True).repeat((repeat,) * 3)
    masses = atoms.get_masses()
    got = {}
    for p in policies:
        calc = JequiCalculator(model, precision=p)
        calc.get_hessian(atoms)  # compiles
        t0 = time.perf_counter()
        got[p] = frequencies_thz(calc.get_hessian(atoms), masses), time.perf_counter() - t0
    jax.config.update("jax_enable_x64", True)
    try:
        ref = frequencies_thz(JequiCalculator(model, backend="xla", dtype="float64").get_hessian(atoms), masses)
    finally:
        jax.config.update("jax_enable_x64", False)
    rows = []
    for p, (f, seconds) in got.items():
        row = {"model": model, "atoms": len(atoms), "policy": p, "hessian_s": seconds,
               "max_abs_thz_vs_float64": float(np.abs(f - ref).max()), "mean_abs_thz_vs_float64": float(np.abs(f - ref).mean()),
               "max_abs_thz_vs_float32": float(np.abs(f - got["float32"][0]).max()) if "float32" in got else None,
               "max_rel_vs_float64": float(np.abs(f - ref).max() / np.abs(ref).max()),
               "min_thz": float(f.min()), "max_thz": float(f.max()), "float64_min_thz": float(ref.min()), "float64_max_thz": float(ref.max())}  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    return rows


def training(policies, steps: int, n_train: int, n_val: int, eval_every: int) -> list[dict]:
    from jequi.models.calculator import load_model

    _, shipped = load_model("nequip-emt")
    workers = min(16, os.cpu_count() or 1) if (os.cpu_count() or 1) >= 8 else 1
    train_set, val_set = data.emt_dataset(n_train, seed=1, workers=workers), data.emt_dataset(n_val, seed=2, workers=workers)
    config = dataclasses.replace(shipped, backend=None)
    rows = []
    for p in policies:
        params, history = train(config, train_set, val_set, steps=steps, batch_size=16, learning_rate=5e-3, seed=0,
                                progress=False, eval_every=eval_every, energy_weight=30.0, precision=p)  # fmt: skip
        final = evaluate(params, config, make_batches(val_set, config, 16))  # the trained weights under float32
        row = {"policy": p, "steps": steps, "train": n_train, "val": n_val, "step_ms": 1e3 * history.seconds_per_step(),
               "loss_every_50": [float(np.mean(history.loss[i : i + 50])) for i in range(0, len(history.loss), 50)],
               "val_step": history.val_step, "val_energy_mae_mev_per_atom": [1e3 * v for v in history.val_energy_mae],
               "val_force_mae_mev_per_a": [1e3 * v for v in history.val_force_mae],
               "final_float32_energy_mae_mev_per_atom": 1e3 * final["energy_mae"], "final_float32_force_mae_mev_per_a": 1e3 * final["force_mae"]}  # fmt: skip
        rows.append(row)
        print({k: row[k] for k in ("policy", "step_ms", "final_float32_energy_mae_mev_per_atom", "final_float32_force_mae_mev_per_a")}, flush=True)
    return rows


def model_steps(models, atoms_target: int, policies) -> list[dict]:
    rows = []
    for name in models:
        base = MODELS[name]
        params = init(base)
        atoms = alloy(atoms_target)
        outs = {}
        for p in policies:
            fn, args, info = md_step(with_precision(base, p), atoms, params)
            fn = jax.jit(fn)
            energy, forces = jax.block_until_ready(fn(*args))
            outs[p] = float(energy), np.asarray(forces, np.float64)
            rows.append({"model": name, **info, "policy": p, "ms": median_ms(fn, args, repeat=5, calls=3)})
        for row in rows[-len(policies) :]:
            e, f = outs[row["policy"]]
            e0, f0 = outs[policies[0]]
            row["energy_mev_per_atom_vs_" + policies[0]] = 1e3 * abs(e - e0) / row["atoms"]
            row["force_mae_mev_per_a_vs_" + policies[0]] = 1e3 * float(np.abs(f - f0).mean())
            row["force_scale_mev_per_a"] = 1e3 * float(np.abs(f0).mean())
            print(row, flush=True)
    return rows


def markdown(r) -> str:
    m = r["meta"]
    out = [f"# Precision policies: NVE drift, phonons, training, model steps ({m['device']}, {m['date']})", "",
           f"jax {m['versions'].get('jax')}, jequi {m['versions'].get('jequi')}. Script: benchmarks/precision_accuracy.py.", ""]  # fmt: skip
    if m.get("concurrent", 1) > 1:
        out += [f"The parts ran as {m['concurrent']} concurrent processes on the one GPU: their ms columns are not speed numbers.", ""]
    if r["nve"]:
        c = r["nve"][0]
        out += [f"## NVE, {c['model']}, {c['atoms']} atoms (Cu-Au), {c['steps']} steps of 1 fs from 300 K", "",
                "| policy | drift meV/atom/ps | max abs(E - E0) meV/atom | std meV/atom | mean T (K) | ms/step | drift vs float32 |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        f32 = next((c["drift_mev_per_atom_per_ps"] for c in r["nve"] if c["policy"] == "float32"), None)
        for c in r["nve"]:
            ratio = f"{abs(c['drift_mev_per_atom_per_ps']) / abs(f32):.2f}x" if f32 else ""
            out.append(f"| {c['policy']} | {c['drift_mev_per_atom_per_ps']:+.4f} | {c['max_deviation_mev_per_atom']:.4f} | {c['std_mev_per_atom']:.4f} | "
                       f"{c['mean_temperature_K']:.0f} | {'-' if c['ms_per_step'] is None else format(c['ms_per_step'], '.2f')} | {ratio} |")  # fmt: skip
    if r["phonons"]:
        c = r["phonons"][0]
        out += ["", f"## Phonons, {c['model']}, fcc Cu {c['atoms']}-atom cell (Gamma of the supercell)", "",
                f"float64 (xla) frequencies {c['float64_min_thz']:.3f} to {c['float64_max_thz']:.3f} THz.", "",
                "| policy | max abs(df) THz vs float64 | mean abs(df) THz vs float64 | max abs(df) THz vs float32 | max relative vs float64 |",
                "|---|---|---|---|---|"]  # fmt: skip
        for c in r["phonons"]:
            vs32 = "" if c["max_abs_thz_vs_float32"] is None else f"{c['max_abs_thz_vs_float32']:.5f}"
            out.append(f"| {c['policy']} | {c['max_abs_thz_vs_float64']:.5f} | {c['mean_abs_thz_vs_float64']:.5f} | {vs32} | {c['max_rel_vs_float64']:.2e} |")
    if r["train"]:
        c = r["train"][0]
        out += ["", f"## Training the EMT NequIP model from scratch ({c['steps']} steps, batch 16, {c['train']} structures, {c['val']} held out)", "",
                "| policy | step ms | held-out energy MAE meV/atom (last eval) | force MAE meV/Å (last eval) | same weights under float32: energy / force |",
                "|---|---|---|---|---|"]  # fmt: skip
        for c in r["train"]:
            out.append(f"| {c['policy']} | {c['step_ms']:.2f} | {c['val_energy_mae_mev_per_atom'][-1]:.2f} | {c['val_force_mae_mev_per_a'][-1]:.1f} | "
                       f"{c['final_float32_energy_mae_mev_per_atom']:.2f} / {c['final_float32_force_mae_mev_per_a']:.1f} |")  # fmt: skip
        out += ["", "Held-out MAEs along the run (energy meV/atom / force meV/Å):", "",
                "| step | " + " | ".join(c["policy"] for c in r["train"]) + " |", "|---|" + "---|" * len(r["train"])]  # fmt: skip
        for i, step in enumerate(r["train"][0]["val_step"]):
            out.append(f"| {step} | " + " | ".join(f"{c['val_energy_mae_mev_per_atom'][i]:.2f} / {c['val_force_mae_mev_per_a'][i]:.1f}" for c in r["train"]) + " |")
    if r["steps"]:
        out += ["", "## Model MD step (energy + forces) per policy", "",
                "| model | atoms / edges | policy | ms | vs float32 | abs(dE) meV/atom vs float32 | force MAE meV/Å vs float32 (mean abs(F)) |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in r["steps"]:
            base = next(x["ms"] for x in r["steps"] if x["model"] == c["model"] and x["policy"] == "float32")
            out.append(f"| {c['model']} | {c['atoms']} / {c['edges']} | {c['policy']} | {c['ms']:.2f} | {base / c['ms']:.2f}x | "
                       f"{c['energy_mev_per_atom_vs_float32']:.3f} | {c['force_mae_mev_per_a_vs_float32']:.3f} ({c['force_scale_mev_per_a']:.0f}) |")  # fmt: skip
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="nve,phonons,train,steps")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--nve-model", default="nequix-oam-1")
    ap.add_argument("--nve-atoms", type=int, default=864)
    ap.add_argument("--nve-steps", type=int, default=10_000)
    ap.add_argument("--nve-block", type=int, default=1000, help="steps per timed block (one compiled program)")
    ap.add_argument("--skin", type=float, default=0.5)
    ap.add_argument("--phonon-model", default="nequix-oam-1")
    ap.add_argument("--phonon-repeat", type=int, default=2, help="the cubic fcc cell repeated this many times a direction")
    ap.add_argument("--train-steps", type=int, default=3000)
    ap.add_argument("--train-structures", type=int, default=1000)
    ap.add_argument("--val-structures", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--step-models", default="nequip-oam-l,mace-mp-medium")
    ap.add_argument("--step-atoms", type=int, default=4000)
    ap.add_argument("--small", action="store_true", help="CPU sizes: a check of this program")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="merge these results files (parts run as separate, "
                    "concurrent processes: benchmarks/precision_accuracy_run.sh) into one, and run nothing")  # fmt: skip
    a = ap.parse_args()
    if a.merge:
        import json

        parts = [json.loads(pathlib.Path(f).read_text()) for f in a.merge]
        result = dict(parts[0], meta=dict(parts[0]["meta"], concurrent=len(parts)))
        for key in ("nve", "phonons", "train", "steps"):
            result[key] = [row for r in parts for row in r[key]]
        save(result, "precision-accuracy", markdown(result), a.out)
        print(markdown(result))
        return
    if a.small:
        a.nve_model, a.nve_atoms, a.nve_steps, a.nve_block, a.skin = "nequip-emt", 256, 30, 10, 0.3
        a.phonon_model, a.phonon_repeat = "nequip-emt", 1
        a.train_steps, a.train_structures, a.val_structures, a.eval_every = 4, 8, 4, 2
        a.step_models, a.step_atoms = "nequip-oam-l", 32
    parts, policies = a.parts.split(","), tuple(a.policies.split(","))
    device = jax.devices()[0].device_kind
    meta = {"date": datetime.date.today().isoformat(), "device": device, "versions": versions("e3nn-jax", "ase")}
    result = {"meta": meta, "date": meta["date"], "device": device, "nve": [], "phonons": [], "train": [], "steps": []}

    def write():
        save(result, "precision-accuracy", markdown(result), a.out)

    for part, run in (("phonons", lambda: phonons(a.phonon_model, policies, a.phonon_repeat)),
                      ("steps", lambda: model_steps(a.step_models.split(","), a.step_atoms, policies)),
                      ("nve", lambda: nve(a.nve_model, a.nve_atoms, a.nve_steps, policies, a.skin, a.nve_block)),
                      ("train", lambda: training(policies, a.train_steps, a.train_structures, a.val_structures, a.eval_every))):  # fmt: skip
        if part in parts:
            result[part] = run()
            write()
    print(markdown(result))


if __name__ == "__main__":
    main()
