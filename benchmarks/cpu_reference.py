"""Speed of jequi's pure-JAX ``xla`` backend against e3nn-jax on the CPU (same process).

    python benchmarks/cpu_reference.py [--batch 2000] [--problems mace-large,nequip-lips]

Forward, backward (grad of <tp, g> w.r.t. x, y, w) and double backward (grad of
|gx|^2 + |gy|^2), median of repeated jitted calls; writes a JSON and a markdown table to
benchmarks/results/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import time

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
from e3nn_jax.legacy import FunctionalTensorProduct

import jequi

RESULTS = pathlib.Path(__file__).parent / "results"


def median_ms(fn, *args, repeat=7):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def e3nn_batched(tp):
    f = FunctionalTensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, list(tp.instructions))
    one = lambda w, x, y: f.left_right(w, e3nn.IrrepsArray(tp.irreps_in1, x), e3nn.IrrepsArray(tp.irreps_in2, y)).array  # noqa: E731
    return lambda x, y, w: jax.vmap(one)(w, x, y)


def passes(f, g):
    fwd = jax.jit(f)
    bwd = jax.jit(jax.grad(lambda x, y, w: jnp.vdot(f(x, y, w), g), argnums=(0, 1, 2)))

    def dbl_loss(x, y, w):
        gx, gy, _ = jax.grad(lambda x, y, w: jnp.vdot(f(x, y, w), g), argnums=(0, 1, 2))(x, y, w)
        return jnp.sum(gx**2) + jnp.sum(gy**2)

    dbl = jax.jit(jax.grad(dbl_loss, argnums=(0, 1, 2)))
    return {"fwd": fwd, "bwd": bwd, "dbl": dbl}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2000)
    parser.add_argument("--problems", default="mace-large,mace-medium,nequip-lips,nequip-oam-main,diffdock-l2,tetris-poly-1")
    args = parser.parse_args()
    rows = []
    for name in args.problems.split(","):
        tp = jequi.problems.get(name)
        rng = np.random.default_rng(0)
        d1, d2, do = tp.descriptor.dims
        x, y, w, g = (jnp.asarray(rng.normal(size=(args.batch, d)), jnp.float32) for d in (d1, d2, tp.weight_numel, do))
        row = {"problem": name, "batch": args.batch}
        for label, f in (("jequi", lambda x, y, w: tp(x, y, w, backend="xla")), ("e3nn", e3nn_batched(tp))):
            for kind, fn in passes(f, g).items():
                row[f"{label}_{kind}_ms"] = median_ms(fn, x, y, w)
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    stamp = datetime.date.today().isoformat()
    meta = {
        "date": stamp,
        "device": f"CPU: {platform.processor() or platform.machine()}, {jax.device_count()} device(s)",
        "jax": jax.__version__,
        "e3nn_jax": e3nn.__version__,
        "jequi": jequi.__version__,
        "dtype": "float32",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stamp}-cpu-reference.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        f"# jequi `xla` backend vs e3nn-jax on CPU ({stamp})",
        "",
        ", ".join(f"{k} {v}" for k, v in meta.items()),
        "",
        "| problem | batch | jequi fwd / bwd / dbl ms | e3nn-jax fwd / bwd / dbl ms | speedup fwd / bwd / dbl |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        j = [r[f"jequi_{k}_ms"] for k in ("fwd", "bwd", "dbl")]
        e = [r[f"e3nn_{k}_ms"] for k in ("fwd", "bwd", "dbl")]
        lines.append(
            f"| {r['problem']} | {r['batch']} | {' / '.join(f'{v:.1f}' for v in j)} | "
            f"{' / '.join(f'{v:.1f}' for v in e)} | {' / '.join(f'{b / a:.2f}x' for a, b in zip(j, e))} |"
        )
    (RESULTS / f"{stamp}-cpu-reference.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
