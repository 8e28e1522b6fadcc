"""Two versions of jequi's autodiff in one process on one GPU: reverse-mode cells and model
steps, each timed for both versions side by side, and the forward-mode cells only the new one
has.

The old version is a copy of the ``jequi`` package renamed ``jequi_before`` (its imports
inside the package are relative; it shares ``pallas_kernels`` and ``ffi``, which the change
did not touch). Make it from a commit, then run on the GPU machine from the repo root::

    mkdir -p .before && git archive COMMIT jequi | tar -x -C .before && mv .before/jequi .before/jequi_before
    source .peers/setup_peers.sh; python3 benchmarks/autodiff_before_after.py --before .before

Cells (``jax.jit``; median of 5 runs of a few calls, the two versions alternating):

* batched product and conv of the MACE-width channelwise product ``128x0e+128x1o+128x2e x
  0e+1o+2e+3o``, float32, on ``cuda`` and ``pallas``: ``bwd``, ``dbl``, ``dblf``
  (``gpu_benchmark.tp_passes``), and for the new version ``jvp`` (along all three inputs)
  and ``hvp`` (``jvp`` of ``bwd``);
* the NequIP model steps of ``model_step.py``: OAM-L width training on a 4,000-atom batch
  (30 % padding) and md at 4,000 atoms, MACE width training, on ``--model-backend``
  (``cuda``, as the model table).

Writes ``<date>-<device>-autodiff-before-after.{json,md}`` into ``--out`` (and $OUT).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import pathlib
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import median_ms, save  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PRODUCT = ("128x0e+128x1o+128x2e", "0e+1o+2e+3o", "128x0e+128x1o+128x2e")


def model_step_module(package: str) -> types.ModuleType:
    """``benchmarks/model_step.py`` with its ``jequi`` imports pointed at `package`."""
    source = (HERE / "model_step.py").read_text()
    if package != "jequi":
        source = source.replace("import jequi\n", f"import {package} as jequi\n").replace("from jequi.", f"from {package}.")
    module = types.ModuleType(f"model_step_{package}")
    module.__file__ = str(HERE / "model_step.py")
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


def passes():
    from gpu_benchmark import tp_passes

    p = tp_passes()
    bwd = p["bwd"]
    extra = {
        "jvp": lambda f: lambda x, y, w, g: jax.jvp(f, (x, y, w), (2 * x, -y, 0.5 * w))[1],
        "hvp": lambda f: lambda x, y, w, g: jax.jvp(lambda x, y, w: bwd(f)(x, y, w, g), (x, y, w), (2 * x, -y, 0.5 * w))[1],
    }
    return {k: p[k] for k in ("bwd", "dbl", "dblf")}, extra


def compile_warm(fn, args):
    compiled = jax.jit(fn).lower(*args).compile()
    jax.block_until_ready(compiled(*args))
    return compiled


def pair(cells, name, fns, args, alternations: int = 3):
    """Time each version's `fns[version]` alternately; the median of each version's medians.
    `args`: one tuple for all, or a dict of each version's (a model's batch holds its own
    package's Graph)."""
    args = args if isinstance(args, dict) else {v: args for v in fns}
    compiled = {}
    for version, fn in fns.items():
        try:
            compiled[version] = compile_warm(fn, args[version])
        except Exception as exc:  # noqa: BLE001 - recorded, the others go on
            cell = {"cell": name, "version": version, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            cells.append(cell)
            print(json.dumps(cell), flush=True)
    times = {v: [] for v in compiled}
    for _ in range(alternations):
        for version, c in compiled.items():
            times[version].append(median_ms(c, args[version], repeat=5, calls=5))
    for version, t in times.items():
        cell = {"cell": name, "version": version, "ms": float(np.median(t))}
        cells.append(cell)
        print(json.dumps(cell), flush=True)


def kernel_cells(cells, packages, backends, rows: int, nodes: int, edges: int):
    reverse, forward = passes()
    rng = np.random.default_rng(0)
    senders, receivers = rng.integers(0, nodes, edges), rng.integers(0, nodes, edges)
    for backend in backends:
        tps = {v: pkg.channelwise(*PRODUCT) for v, pkg in packages.items()}
        d1, d2, do = tps["after"].descriptor.dims
        nw = tps["after"].weight_numel
        graphs = {v: pkg.Graph.build(senders, receivers, nodes) for v, pkg in packages.items()}
        for kind, n_x, n_e, n_out in (("tp", rows, rows, rows), ("conv", nodes, edges, nodes)):
            args = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((n_x, d1), (n_e, d2), (n_e, nw), (n_out, do)))

            def op(v):
                tp = tps[v]
                if kind == "tp":
                    return lambda x, y, w: tp(x, y, w, backend=backend)
                return lambda x, y, w: tp.conv(x, y, w, graphs[v], backend=backend)

            for name, make in reverse.items():
                pair(cells, f"{kind} {backend} {name}", {v: make(op(v)) for v in packages}, args)
            for name, make in forward.items():
                pair(cells, f"{kind} {backend} {name}", {"after": make(op("after"))}, args)


def model_cells(cells, modules, backend: str | None, chosen: list[str]):
    for model, workload in (c.split(":") for c in chosen):
        fns, args = {}, {}
        for version, ms in modules.items():
            config = dataclasses.replace(ms.MODELS[model], backend=backend)
            params = ms.init(config)
            if workload == "train":
                structures = ms.data.emt_dataset(4000 // 20 + 8, seed=1)
                fn, a, info = ms.train_step(config, structures, 4000 // 22, params, 0.3)
            else:
                fn, a, info = ms.md_step(config, ms.alloy(4000), params)
            fns[version], args[version] = fn, a  # the same values for both: the same code made them
        pair(cells, f"{model} {workload} ({info['atoms']} atoms, {info['edges']} edges)", fns, args)


def markdown(result) -> str:
    lines = [
        f"# autodiff before / after: {result['device']}, {result['date']}",
        "",
        f"jax {result['jax']}; before = {result['before']}, after = the working tree. Each cell: the two versions "
        "compiled in one process, timed alternately (median of 3 alternations of 5 x 5 calls), ms.",
        "",
        "| cell | before | after | after / before |",
        "|---|---|---|---|",
    ]
    by = {}
    for c in result["cells"]:
        by.setdefault(c["cell"], {})[c["version"]] = c
    for name, v in by.items():
        b, a = v.get("before", {}), v.get("after", {})
        fmt = lambda c: f"{c['ms']:.3f}" if "ms" in c else (c.get("error", "")[:60] or "-")  # noqa: E731
        ratio = f"{a['ms'] / b['ms']:.3f}" if "ms" in a and "ms" in b else "-"
        lines.append(f"| {name} | {fmt(b)} | {fmt(a)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="folder holding the old package as jequi_before")
    ap.add_argument("--label", default="", help="what the old version is (a commit)")
    ap.add_argument("--backends", default="cuda,pallas")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--nodes", type=int, default=4_000)
    ap.add_argument("--edges", type=int, default=100_000)
    ap.add_argument("--no-models", action="store_true")
    ap.add_argument("--model-cells", default="nequip-oam-l:train,nequip-oam-l:md,mace-width:train")
    ap.add_argument("--model-backend", default="cuda", help="the models' conv backend ('default': jequi's choice)")
    ap.add_argument("--no-kernels", action="store_true")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    sys.path.insert(0, str(pathlib.Path(a.before).resolve()))
    import jequi
    import jequi_before

    if importlib.util.find_spec("jequi_before").origin == jequi.__file__:
        raise SystemExit("jequi_before is the same package as jequi")
    result = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "before": a.label or a.before, "cells": []}  # fmt: skip
    if not a.no_kernels:
        kernel_cells(result["cells"], {"before": jequi_before, "after": jequi}, a.backends.split(","), a.rows, a.nodes, a.edges)
        save(result, "autodiff-before-after", markdown(result), a.out)
    if not a.no_models:
        backend = None if a.model_backend == "default" else a.model_backend
        modules = {"before": model_step_module("jequi_before"), "after": model_step_module("jequi")}
        model_cells(result["cells"], modules, backend, a.model_cells.split(","))
    print(save(result, "autodiff-before-after", markdown(result), a.out))


if __name__ == "__main__":
    main()
