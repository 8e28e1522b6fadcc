"""The small NequIP model shipped with jequi, trained on EMT-labelled metal structures.

``python -m jequi.models.pretrained`` rebuilds it (a few minutes on a CPU): it generates the
data with :func:`jequi.models.data.emt_dataset` (seed 1: training, seed 2: validation),
trains with :func:`jequi.models.train.train` and writes ``weights/nequip-emt.msgpack``
(parameters) and ``weights/nequip-emt.json`` (hyper-parameters and validation errors).
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


def main():
    import argparse

    from . import data
    from .train import train

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=int, default=400, help="training structures")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--out", default=str(WEIGHTS))
    a = ap.parse_args()
    config = NequIPConfig()
    train_set, val_set = data.emt_dataset(a.train, seed=1), data.emt_dataset(48, seed=2)
    params, history = train(config, train_set, val_set, steps=a.steps, batch_size=4, learning_rate=5e-3, eval_every=500, energy_weight=30.0)
    info = {
        "data": f"{a.train} EMT structures (emt_dataset seed 1), validation 48 (seed 2)",
        "steps": a.steps,
        "val_energy_mae_eV_per_atom": history.val_energy_mae[-1],
        "val_force_mae_eV_per_A": history.val_force_mae[-1],
        "num_parameters": int(sum(x.size for x in jax.tree.leaves(params))),
    }
    save(params, config, info, a.out)
    print(json.dumps(info, indent=1))



if __name__ == "__main__":
    main()
