"""The models shipped with jequi: loading them by name (:func:`load_any`), and rebuilding the
NequIP-style model trained on EMT-labelled metal structures. The Nequix foundation models
ship as their authors released them (``weights/nequix-*.nqx``, read by
:mod:`jequi.models.nequix`; cards ``weights/nequix-*.md``).

``python -m jequi.models.pretrained`` rebuilds it (``benchmarks/train_shipped_model.sh`` runs
it on a GPU, where it takes about five minutes): it generates the data with
:func:`jequi.models.data.emt_dataset` (seed 1: training; seed 2: held-out structures of the
training sizes; seed 3, ``large=True``: held-out cells larger than any trained on), trains
with :func:`jequi.models.train.train` for a wall-time budget, evaluates the held-out errors and
writes into ``--out``: ``nequip-emt.msgpack`` (parameters), ``nequip-emt.json``
(hyper-parameters, errors) and ``nequip-emt.md`` (the model card: data, size, errors, training
time, device, the command that rebuilt it).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import flax.serialization
import jax
import jax.numpy as jnp

from .nequip import NequIPConfig

WEIGHTS = pathlib.Path(__file__).parent / "weights"
NAME = "nequip-emt"


def save(params, config: NequIPConfig, info: dict, directory=WEIGHTS, name: str = NAME):
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{name}.msgpack").write_bytes(flax.serialization.msgpack_serialize(jax.tree.map(jax.numpy.asarray, params)))
    (directory / f"{name}.json").write_text(json.dumps({"config": dataclasses.asdict(config), **info}, indent=1))


def load(directory=WEIGHTS, name: str = NAME):
    """``(params, config, info)`` of a saved model."""
    directory = pathlib.Path(directory)
    meta = json.loads((directory / f"{name}.json").read_text())
    fields = meta.pop("config")
    config = NequIPConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    params = flax.serialization.msgpack_restore((directory / f"{name}.msgpack").read_bytes())
    return jax.tree.map(jnp.asarray, params), config, meta


# The Nequix foundation models shipped as released (MIT licence: weights/LICENSE-nequix). Their
# cards (weights/<name>.md) are written from these entries by foundation_card (a test checks).
NEQUIX_REPO = "https://github.com/atomicarchitects/nequix"
FOUNDATION = {
    "nequix-mp-1": {
        "commit": "0ffdf881603d2c97f9105c64c3ec2df74dc1c224",
        "sha256": "1647af8e627e1afa11e2bfadeab0797326513a521afd7dd01606a96f56783eee",
        "data": "MPtrj (the Materials Project's relaxation trajectories, 1.58 M structures of 146 k materials)",
        "theory": "DFT, PBE and PBE+U (the Materials Project's settings)",
        "reference": "T. Koker, K. Kotak, T. Smidt, Nequix, arXiv:2508.16067 (2025)",
    },
    "nequix-oam-1": {
        "commit": "0ffdf881603d2c97f9105c64c3ec2df74dc1c224",
        "sha256": "6a43475eaeb32a7a049f36c1306d78aa1e7a17e8af37aeda7901c8fec0ca845c",
        "data": "OMat24 (pre-training: nequix-omat-1), then fine-tuned on sAlex and MPtrj (8 copies of MPtrj to one of sAlex)",
        "theory": "DFT, PBE and PBE+U (OMat24's VASP settings, compatible with the Materials Project's)",
        "reference": "T. Koker et al., Phonon fine-tuning (PFT), arXiv:2601.07742 (2026); the Nequix architecture: arXiv:2508.16067",
    },
}


def foundation_card(name: str) -> str:
    """The model card (markdown) of a shipped Nequix model."""
    from .nequix import read_nqx

    f = FOUNDATION[name]
    params, config, meta = read_nqx(WEIGHTS / f"{name}.nqx")
    count = sum(int(a.size) for a in params["params"].values())
    return "\n".join([
        f"# {name}: a Nequix foundation potential", "",
        f"Weights: `{name}.nqx`, Nequix's own checkpoint file as released, unchanged (sha256 `{f['sha256']}`), "
        f"{count} float32 parameters. Licence: MIT, `LICENSE-nequix` (Copyright (c) 2025 Teddy Koker).", "",
        f"Source: {NEQUIX_REPO}, `models/{name}.nqx` at commit `{f['commit']}`.", "",
        "Use: `jequi.models.JequiCalculator(\"" + name + "\")`, `python -m jequi --model " + name + "`; "
        "`jequi.models.nequix.read_nqx` reads the file.", "",
        "## Model", "",
        f"Nequix (`jequi.models.nequix`): {config.num_layers} layers, hidden irreps `{config.hidden}`, spherical "
        f"harmonics to l = {config.sh_lmax}, {config.num_basis} Bessel radial functions, a {config.radial_mlp_layers}-layer "
        f"{config.radial_mlp_size}-wide radial MLP, RMS layer norm, cutoff {config.cutoff} Å, "
        f"{len(config.species)} elements (Z = 1-83, 89-94).", "",
        "## Data and level of theory", "",
        f"Training data: {f['data']}. Labels: {f['theory']}.", "",
        "## Reference", "",
        f"{f['reference']}.", "",
        "## Checked", "",
        "Energies, forces, stress and the Hessian equal Nequix's own code (the `nequix` package on the same file) "
        "to 1e-10 relative in float64 and to 1e-5 in float32 (`tests/test_nequix.py`).", "",
    ])  # fmt: skip


def shipped() -> list[str]:
    """The names of the models in :data:`WEIGHTS`."""
    return sorted({p.stem for p in WEIGHTS.glob("*.json")} | {p.stem for p in WEIGHTS.glob("*.nqx")})


def load_any(model) -> tuple:
    """``(params, config)`` of a shipped name, a ``.nqx`` path, or a saved jequi model's path
    (:func:`jequi.models.calculator.load_model` lists them)."""
    from .nequix import read_nqx

    path = pathlib.Path(model)
    if (WEIGHTS / f"{model}.nqx").is_file():
        return read_nqx(WEIGHTS / f"{model}.nqx")[:2]
    if (WEIGHTS / f"{model}.json").is_file():
        return load(WEIGHTS, str(model))[:2]
    if path.suffix == ".nqx" and path.is_file():
        return read_nqx(path)[:2]
    if path.is_dir() and (path / f"{NAME}.json").exists():
        return load(path, NAME)[:2]
    if path.with_suffix(".json").exists():
        return load(path.parent, path.name)[:2]
    raise ValueError(f"unknown model {str(model)!r}: not a shipped model {shipped()}, a .nqx file nor a saved model's path")


def card(config: NequIPConfig, info: dict) -> str:
    """The model card (markdown) of a model saved with `info` (see :func:`main`)."""
    t, e = info["training"], info["errors"]
    rows = [f"| {name} | {v['structures']} ({v['atoms']} atoms, {v['sizes']}) | {1e3 * v['energy_mae_eV_per_atom']:.2f} | "
            f"{1e3 * v['force_mae_eV_per_A']:.1f} |" for name, v in e.items()]  # fmt: skip
    return "\n".join([
        f"# {NAME}: the NequIP-style potential shipped with jequi", "",
        f"Weights: `{NAME}.msgpack` ({info['weight_bytes']} bytes, {info['num_parameters']} float32 parameters); "
        f"hyper-parameters and errors: `{NAME}.json`. Load with `jequi.models.pretrained.load()` or use "
        "`jequi.models.JequiCalculator()`.", "",
        "## Model", "",
        f"NequIP-style (`jequi.models.NequIP`): {config.num_layers} interaction layers, hidden irreps `{config.hidden}`, "
        f"spherical harmonics to l = {config.sh_lmax}, {config.num_basis} Bessel radial functions and a "
        f"{config.radial_hidden}-wide radial MLP, cutoff {config.cutoff} Å; elements {list(config.species)} "
        "(EMT's metals: Al Ni Cu Pd Ag Pt Au).", "",
        "## Data", "",
        f"{info['data']}. Labels: ase {info['ase']} EMT (effective-medium theory) energies and forces. Perturbed fcc "
        "bulk cells, binary alloys, vacancies, (111) surface slabs and icosahedral clusters of those metals "
        "(`jequi.models.data.emt_dataset`).", "",
        "## Errors on held-out structures (mean absolute errors)", "",
        "| set | structures | energy meV/atom | forces meV/Å |", "|---|---|---|---|", *rows, "",
        "## Training", "",
        f"{t['steps']} Adam steps of {t['batch_size']} structures (learning rate {t['learning_rate']} cosine-decayed to "
        f"5 %, energy loss weight {t['energy_weight']}) in {t['seconds']:.0f} s ({t['step_ms']:.2f} ms a step) "
        f"on {t['device']}, jax {t['jax']}, jequi backend `{t['backend']}`, {t['date']}.", "",
        "## Rebuild", "",
        "On one GPU: `bash benchmarks/train_shipped_model.sh` (from the repository root; it writes these three files "
        f"into `$OUT`), which ran `{info['command']}`.", "",
    ])


def main(argv=None):
    import argparse
    import datetime
    import importlib.metadata
    import os
    import shlex
    import sys
    import time

    from . import data
    from .train import evaluate, make_batches, train

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=2000, help="training structures")
    ap.add_argument("--val", type=int, default=200, help="held-out structures of the training sizes")
    ap.add_argument("--large", type=int, default=60, help="held-out structures in larger cells")
    ap.add_argument("--seconds", type=float, default=240.0, help="training wall-time budget")
    ap.add_argument("--steps", type=int, default=100_000, help="at most this many steps")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--learning-rate", type=float, default=5e-3)
    ap.add_argument("--energy-weight", type=float, default=30.0)
    ap.add_argument("--hidden", default="64x0e+32x1o+16x2e")
    ap.add_argument("--backend", default=None, help="jequi backend for training (default: the fastest available)")
    ap.add_argument("--eval-every", type=int, default=2000)
    ap.add_argument("--max-bytes", type=int, default=1_000_000, help="fail if the weights are larger")
    ap.add_argument("--out", default=str(WEIGHTS))
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    log = lambda line: print(line, flush=True)  # noqa: E731
    config = NequIPConfig(hidden=a.hidden, backend=a.backend)
    workers = min(16, os.cpu_count() or 1) if (os.cpu_count() or 1) >= 8 else 1  # spawning costs ~10 s a worker on 2 cores
    train_set = data.emt_dataset(a.train, seed=1, workers=workers)
    val_set, large_set = data.emt_dataset(a.val, seed=2, workers=workers), data.emt_dataset(a.large, seed=3, large=True, workers=workers)
    log(f"data: {len(train_set)} + {len(val_set)} + {len(large_set)} structures in {time.perf_counter() - t_start:.0f} s")
    params, history = train(config, train_set, val_set, steps=a.steps, batch_size=a.batch_size, learning_rate=a.learning_rate,
                            eval_every=a.eval_every, energy_weight=a.energy_weight, seconds=a.seconds, progress=False, log=log)  # fmt: skip
    errors = {}
    for name, structures, bs in (("training sizes", val_set, a.batch_size), ("larger cells", large_set, 4)):
        m = evaluate(params, config, make_batches(structures, config, bs))
        sizes = sorted({len(s.numbers) for s in structures})
        errors[name] = {"structures": len(structures), "atoms": sum(len(s.numbers) for s in structures),
                        "sizes": f"{sizes[0]}-{sizes[-1]} atoms each", "energy_mae_eV_per_atom": m["energy_mae"],
                        "force_mae_eV_per_A": m["force_mae"]}  # fmt: skip
        log(f"held-out, {name}: energy MAE {1e3 * m['energy_mae']:.2f} meV/atom, force MAE {1e3 * m['force_mae']:.1f} meV/A")
    saved = NequIPConfig(**{**config.__dict__, "backend": None})  # inference picks its own backend
    dev = jax.devices()[0]
    info = {
        "data": f"{a.train} training structures (emt_dataset seed 1); held out: {a.val} of the training sizes (seed 2), "
                f"{a.large} in larger cells (seed 3, large=True)",
        "ase": importlib.metadata.version("ase"),
        "training": {"steps": len(history.step), "batch_size": a.batch_size, "learning_rate": a.learning_rate,
                     "energy_weight": a.energy_weight, "seconds": history.seconds, "step_ms": 1e3 * history.seconds_per_step(),
                     "device": f"{dev.platform} {dev.device_kind}", "jax": jax.__version__,
                     "backend": a.backend or "default", "date": datetime.date.today().isoformat(),
                     "val_step": history.val_step, "val_energy_mae": history.val_energy_mae,
                     "val_force_mae": history.val_force_mae},
        "errors": errors,
        "val_energy_mae_eV_per_atom": errors["training sizes"]["energy_mae_eV_per_atom"],
        "val_force_mae_eV_per_A": errors["training sizes"]["force_mae_eV_per_A"],
        "large_energy_mae_eV_per_atom": errors["larger cells"]["energy_mae_eV_per_atom"],
        "large_force_mae_eV_per_A": errors["larger cells"]["force_mae_eV_per_A"],
        "num_parameters": int(sum(x.size for x in jax.tree.leaves(params))),
        "command": "python -m jequi.models.pretrained " + shlex.join(sys.argv[1:] if argv is None else argv),
    }  # fmt: skip
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    size = len(flax.serialization.msgpack_serialize(jax.tree.map(jax.numpy.asarray, params)))
    info["weight_bytes"] = size
    save(params, saved, info, a.out)
    (pathlib.Path(a.out) / f"{NAME}.md").write_text(card(saved, info))
    log(json.dumps({k: v for k, v in info.items() if k not in ("training", "errors")}, indent=1))
    log(f"wrote {a.out}/{NAME}.{{msgpack,json,md}} in {time.perf_counter() - t_start:.0f} s")
    if size > a.max_bytes:
        raise SystemExit(f"the weights take {size} bytes, more than --max-bytes {a.max_bytes}")


if __name__ == "__main__":
    main()
