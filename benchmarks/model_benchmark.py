"""The NequIP-style model on the GPU: one training step and one inference step timed with
jequi's conv (every available backend) vs the same model on e3nn-jax (gather, product, segment_sum), then
a few minutes of training with the jequi backend whose step measured fastest, and its
held-out errors. Device tool, from the repo root:

    source .peers/setup_peers.sh && python3 benchmarks/model_benchmark.py --train-seconds 180

Writes ``<date>-<device>-model.{json,md}`` into --out (and $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import re
import shutil
import time

import jax
from timing import timed

import jequi
from jequi.models import NequIPConfig, data
from jequi.models.loss import errors, predict
from jequi.models.train import evaluate, make_batches, train


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-structures", type=int, default=2000)
    ap.add_argument("--val-structures", type=int, default=200)
    ap.add_argument("--train-seconds", type=float, default=180.0, help="0: the timings only")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--hidden", default="64x0e+32x1o+16x2e")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    dev = jax.devices()[0]
    base = NequIPConfig(hidden=a.hidden)
    train_set = data.emt_dataset(a.train_structures, seed=1)
    val_set = data.emt_dataset(a.val_structures, seed=2)
    batches = make_batches(train_set[: a.batch_size * 8], base, a.batch_size)
    b = batches[0]
    result = {"date": datetime.date.today().isoformat(), "device": dev.device_kind, "jax": jax.__version__,
              "hidden": a.hidden, "batch_size": a.batch_size, "batch_nodes": int(b.species.shape[0]),
              "batch_edges": int(b.graph.num_edges), "timings": {}}
    print(f"{dev.device_kind}: batch of {a.batch_size} structures = {b.species.shape[0]} nodes, {b.graph.num_edges} edges", flush=True)

    # Timing: the same parameters, three convolution implementations.
    params, _ = train(base, train_set[: a.batch_size], steps=1, batch_size=a.batch_size, progress=False)
    val_batches = make_batches(val_set, base, a.batch_size)  # the variants differ in the conv only
    before = evaluate(params, base, val_batches)
    kernels = [b for b in ("cuda", "pallas") if jax.default_backend() == "gpu" and b in jequi.available_backends()]
    variants = {f"jequi-{b}": dataclasses.replace(base, backend=b) for b in kernels + ["xla"]}
    variants["e3nn"] = dataclasses.replace(base, conv="e3nn")
    for name, config in variants.items():
        infer = jax.jit(lambda p, b, c=config: predict(p, c, b))
        grad_step = jax.jit(jax.grad(lambda p, b, c=config: errors(p, c, b)[0]))
        inf_ms, inf_c = timed(infer, (params, b))
        step_ms, step_c = timed(grad_step, (params, b))
        result["timings"][name] = {"inference_ms": inf_ms, "train_step_ms": step_ms, "compile_s": [inf_c, step_c]}
        print(f"  {name}: inference (energy+forces) {inf_ms:.2f} ms, training step (loss grad) {step_ms:.2f} ms "
              f"(compile {inf_c:.1f} / {step_c:.1f} s)", flush=True)

    stem = f"{result['date']}-{re.sub('[^a-z0-9]+', '-', dev.device_kind.lower()).strip('-')}-model"
    write(result, stem, pathlib.Path(a.out))  # the timings survive a run cut short in training
    if a.train_seconds <= 0:
        return

    # Training with jequi's backend of the fastest measured training step; the step count
    # from a short calibration run on a few batches (a whole step: gradient, optimizer
    # update, host loop; the first step, which compiles, is not counted).
    best = min((n for n in variants if n.startswith("jequi-")), key=lambda n: result["timings"][n]["train_step_ms"])
    config = variants[best]
    kw = dict(batch_size=a.batch_size, progress=False, energy_weight=30.0)
    _, calibration = train(config, train_set[: a.batch_size * 4], None, steps=50, **kw)
    steps = max(100, int(a.train_seconds / calibration.seconds_per_step()))
    print(f"training {best}: {steps} steps of ~{1e3 * calibration.seconds_per_step():.1f} ms", flush=True)
    t0 = time.perf_counter()
    params, history = train(config, train_set, None, steps=steps, **kw)
    m = evaluate(params, config, val_batches)
    result["training"] = {"conv": best, "steps": steps, "seconds": time.perf_counter() - t0,
                          "step_ms": 1e3 * history.seconds_per_step(), "train_structures": a.train_structures,
                          "val_structures": a.val_structures, "val_energy_mae_meV_per_atom": 1e3 * m["energy_mae"],
                          "val_force_mae_meV_per_A": 1e3 * m["force_mae"],
                          "untrained_val_energy_mae_meV_per_atom": 1e3 * before["energy_mae"],
                          "untrained_val_force_mae_meV_per_A": 1e3 * before["force_mae"]}
    print(json.dumps(result["training"]), flush=True)
    write(result, stem, pathlib.Path(a.out))


def write(result, stem, out):
    """``<stem>.json`` and ``.md`` into `out` (and $OUT); the markdown printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    rows = [f"| {n} | {t['inference_ms']:.2f} | {t['train_step_ms']:.2f} |" for n, t in result["timings"].items()]
    lines = [f"# NequIP-style model on {result['device']} ({result['date']})", "",
             f"hidden {result['hidden']}, batch {result['batch_size']} structures ({result['batch_nodes']} nodes, "
             f"{result['batch_edges']} edges)", "", "| conv | inference ms | training step ms |", "|---|---|---|", *rows]
    t = result.get("training")
    if t:
        lines += ["", f"Training ({t['conv']}): {t['steps']} steps ({t['step_ms']:.1f} ms each) in {t['seconds']:.0f} s; "
                  f"held-out energy MAE {t['val_energy_mae_meV_per_atom']:.1f} meV/atom, force MAE "
                  f"{t['val_force_mae_meV_per_A']:.0f} meV/A (untrained: {t['untrained_val_energy_mae_meV_per_atom']:.1f} "
                  f"meV/atom, {t['untrained_val_force_mae_meV_per_A']:.0f} meV/A)"]
    md = "\n".join(lines) + "\n"
    (out / f"{stem}.md").write_text(md)
    if os.environ.get("OUT"):
        for f in (out / f"{stem}.json", out / f"{stem}.md"):
            shutil.copy(f, os.environ["OUT"])
    print(md, flush=True)


if __name__ == "__main__":
    main()
