"""Launch shapes of the EAAS kernels (pallas_kernels.eaas): rows per program and warps per
program, forward and backward kernels timed alone (their XLA frames included), on one GPU.

Device tool, from the repo root, after ``source benchmarks/model_env.sh``:

    python3 benchmarks/eaas_launch_probe.py --cells 2:128:100000,3:128:10000 --out $OUT

Prints and writes ``<date>-<device>-eaas-launch.{json,md}``: per cell (L, channels, rows) and
launch shape, ms of each kernel and the forward's bandwidth (bytes of x, r and out / time).
Cells past --time-limit seconds are skipped (a backward kernel at L = 4 compiles for minutes).
The files are also written into $OUT under the same name: give one invocation all its cells.
"""

from __future__ import annotations

import argparse
import datetime
import time

import e3nn_jax as e3nn
import jax
import numpy as np
from timing import save, timed, versions

from jequi import eaas
from jequi.drop_in import _filter_irreps
from pallas_kernels import eaas as kernels

SHAPES = ((4, 4), (8, 4), (16, 4), (2, 4), (1, 4), (8, 2), (8, 1))


def natural(lmax: int, mul: int) -> e3nn.Irreps:
    return e3nn.Irreps([(mul, (l, (-1) ** l)) for l in range(lmax + 1)])


def probe(lmax, channels, rows, shapes, deadline, backward: bool):
    irreps = natural(lmax, channels)
    filt = natural(lmax, 1)
    plan = eaas._plan(irreps, (False,) * len(irreps), eaas.sh_irreps(list(range(lmax + 1))), _filter_irreps(filt), "component", "component")
    kx, kr, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (rows, plan.irreps_in.dim))
    r = jax.random.normal(kr, (rows, 3))
    g = jax.random.normal(kg, (rows, plan.irreps_out.dim))
    io_bytes = 4 * rows * (plan.irreps_in.dim + 3 + plan.irreps_out.dim)
    out, first = [], None
    for rpp, warps in shapes:
        row = {"L": lmax, "channels": channels, "rows": rows, "rows_per_program": rpp, "num_warps": warps}
        if time.time() > deadline:
            out.append({**row, "skipped": "time limit"})
            continue
        launch = dict(rows_per_program=rpp, num_warps=warps)
        fwd = jax.jit(lambda x, r, launch=launch: kernels.forward(plan, x, r, **launch))
        row["fwd_ms"], row["fwd_first_s"] = timed(fwd, (x, r))
        row["fwd_gbs"] = io_bytes / row["fwd_ms"] / 1e6
        results = [fwd(x, r)]
        if backward:
            bwd = jax.jit(lambda x, r, g, launch=launch: kernels.backward(plan, x, r, g, **launch))
            row["bwd_ms"], row["bwd_first_s"] = timed(bwd, (x, r, g))
            results += list(bwd(x, r, g))
        if first is None:
            first = results
        row["max_diff_vs_first_shape"] = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(results, first))
        print(row, flush=True)
        out.append(row)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="2:128:100000,3:128:10000", help="L:channels:rows,...")
    ap.add_argument("--forward-only", default="4", help="degrees whose backward is not timed")
    ap.add_argument("--shapes", default=",".join(f"{a}x{b}" for a, b in SHAPES), help="rows_per_program x num_warps,...")
    ap.add_argument("--time-limit", type=float, default=400)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    deadline = time.time() + a.time_limit
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    fwd_only = {int(l) for l in a.forward_only.split(",") if l}
    rows = []
    for spec in a.cells.split(","):
        lmax, channels, n = (int(v) for v in spec.split(":"))
        rows += probe(lmax, channels, n, shapes, deadline, backward=lmax not in fwd_only)
    device = jax.devices()[0].device_kind
    result = {"date": datetime.date.today().isoformat(), "device": device, "versions": versions(), "rows": rows}
    lines = [
        f"# EAAS kernels' launch shapes, {device} ({result['date']})", "",
        ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + "; float32; median of 5 runs of 5 calls; "
        "x = C x (0e+1o+...+L), harmonics 0..L, outputs 0e+1o+...+L; each kernel with its XLA frames.", "",
        "| L | C | rows | rows/program | warps | fwd ms | fwd GB/s | bwd ms | first fwd / bwd call s | max diff vs the cell's first shape |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        head = f"| {r['L']} | {r['channels']} | {r['rows']} | {r['rows_per_program']} | {r['num_warps']} |"
        if "skipped" in r:
            lines.append(head + f" skipped ({r['skipped']}) | | | | |")
            continue
        bwd = f"{r['bwd_ms']:.3f}" if "bwd_ms" in r else "-"
        first = f"{r['fwd_first_s']:.1f} / " + (f"{r['bwd_first_s']:.1f}" if "bwd_first_s" in r else "-")
        lines.append(head + f" {r['fwd_ms']:.3f} | {r['fwd_gbs']:.0f} | {bwd} | {first} | {r['max_diff_vs_first_shape']:.1e} |")
    stem = save(result, "eaas-launch", "\n".join(lines) + "\n", a.out)
    print("\n".join(lines))
    print(f"wrote {stem}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
