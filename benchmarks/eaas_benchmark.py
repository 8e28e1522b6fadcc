"""EAAS against the dense product: ``jequi.sh_tensor_product(x, r, sh)`` against
``e3nn.tensor_product(x, e3nn.spherical_harmonics(sh, r, True))``, EAAS by the XLA product
(``eaas``) and by the kernels (``eaas_pallas``, ``backend="pallas"``), and jequi's dense
``jequi.tensor_product`` on the same harmonics, in one process.

Problems: ``x = C x (0e + 1o + ... + L)`` (natural parity), harmonics ``0..L``, each row its own
vector; mode ``filtered`` keeps the outputs ``0e + 1o + ... + L`` (E2Former-V2's use: features of
the same degrees out) and mode ``full`` every output (L <= 3 by default: the output grows as
(L+1)^4 per channel). Each cell runs under ``jax.jit``, forward (``fwd``) and forward + backward
of ``sum(out^2)`` in ``x`` and ``r`` (``fwd+bwd``): median ms of `repeat` runs of `calls` calls,
the first call (compile) s, the EAAS speed-up over e3nn and the effective bandwidth
``(bytes of x, r and out) / time``. Cells whose arrays would not fit the memory budget are
listed as skipped. Per (L, C), the largest difference of EAAS (and jequi's dense product) from
e3nn on the smallest row count, relative to e3nn's largest value.

Device tool, from the repo root (``bash benchmarks/eaas_run.sh`` wraps it):

    python3 benchmarks/eaas_benchmark.py [--ls 2,3,4,5,6] [--channels 64,128,256] [--rows 10000,100000,1000000]

Writes ``<date>-<device>-eaas.{json,md}`` into --out (and $OUT) after every cell. ``--smoke``
runs tiny cells on any device (CPU included) into a temporary folder unless --out is given.
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import tempfile
import time

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
from timing import save, timed, versions

import jequi


def natural(lmax: int, mul: int = 1) -> e3nn.Irreps:
    return e3nn.Irreps([(mul, (l, (-1) ** l)) for l in range(lmax + 1)])


def implementations(irreps_x, irreps_sh, filter_ir_out, which):
    """name -> f(x, r) -> out array."""

    def dense(x, r):
        sh = e3nn.spherical_harmonics(irreps_sh, r, True)
        return e3nn.tensor_product(e3nn.IrrepsArray(irreps_x, x), sh, filter_ir_out=filter_ir_out).array

    def eaas(x, r):
        return jequi.sh_tensor_product(e3nn.IrrepsArray(irreps_x, x), r, irreps_sh, filter_ir_out=filter_ir_out).array

    def eaas_pallas(x, r):
        return jequi.sh_tensor_product(e3nn.IrrepsArray(irreps_x, x), r, irreps_sh, filter_ir_out=filter_ir_out, backend="pallas").array

    def jequi_dense(x, r):
        sh = e3nn.spherical_harmonics(irreps_sh, r, True)
        return jequi.tensor_product(e3nn.IrrepsArray(irreps_x, x), sh, filter_ir_out=filter_ir_out).array

    impls = {"e3nn": dense, "eaas": eaas, "eaas_pallas": eaas_pallas, "jequi_dense": jequi_dense}
    return {k: impls[k] for k in which}


def memory_budget(gb: float | None) -> float:
    if gb is not None:
        return gb * 2**30
    try:
        return 0.4 * jax.devices()[0].memory_stats()["bytes_limit"]
    except Exception:  # CPU, or no memory stats: a modest default
        return 4 * 2**30


def run_case(lmax, channels, mode, rows_list, impls_which, dtype, repeat, calls, budget, deadline):
    irreps_x, irreps_sh = natural(lmax, channels), natural(lmax)
    filter_ir_out = natural(lmax) if mode == "filtered" else None
    dim_in = irreps_x.dim
    dim_out = e3nn.tensor_product(irreps_x, irreps_sh, filter_ir_out=filter_ir_out).dim
    impls = implementations(irreps_x, irreps_sh, filter_ir_out, impls_which)
    itemsize = jnp.dtype(dtype).itemsize
    cells, checked = [], False
    for rows in rows_list:
        base = {"L": lmax, "channels": channels, "mode": mode, "rows": rows, "dim_in": dim_in, "dim_out": dim_out}
        io_bytes = itemsize * rows * (dim_in + 3 + dim_out)
        if 6 * io_bytes > budget:
            cells.append({**base, "skipped": f"memory: ~{6 * io_bytes / 2**30:.0f} GiB > budget {budget / 2**30:.0f} GiB"})
            print(f"L={lmax} C={channels} {mode} rows={rows}: skipped (memory)", flush=True)
            continue
        if time.time() > deadline:
            cells.append({**base, "skipped": "time limit"})
            continue
        kx, kr = jax.random.split(jax.random.PRNGKey(rows))
        x = jax.random.normal(kx, (rows, dim_in), dtype)
        r = jax.random.normal(kr, (rows, 3), dtype)
        cell = dict(base, io_bytes=io_bytes)
        outputs = {}
        for name, f in impls.items():
            fwd = jax.jit(f)
            both = jax.jit(jax.grad(lambda x, r, f=f: jnp.sum(f(x, r) ** 2), argnums=(0, 1)))
            try:
                if not checked:
                    outputs[name] = np.asarray(fwd(x, r), np.float64)
                fwd_ms, fwd_first = timed(fwd, (x, r), repeat, calls)
                both_ms, both_first = timed(both, (x, r), repeat, calls)
                cell[name] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": both_ms, "fwd_compile_s": fwd_first, "fwd_bwd_compile_s": both_first}
            except Exception as exc:  # out of memory, a failed compile: recorded, the run goes on
                cell[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            del fwd, both
        if not checked and "e3nn" in outputs:
            ref = outputs["e3nn"]
            scale = max(np.abs(ref).max(), 1e-30)
            cell["rel_diff_vs_e3nn"] = {k: float(np.abs(v - ref).max() / scale) for k, v in outputs.items() if k != "e3nn"}
            checked = True
        cells.append(cell)
        summary = "  ".join(
            f"{k} {v['fwd_ms']:.3f}/{v['fwd_bwd_ms']:.3f} ms" if "fwd_ms" in v else f"{k} {v['error'][:60]}"
            for k, v in cell.items()
            if isinstance(v, dict) and k in impls
        )
        print(f"L={lmax} C={channels} {mode} rows={rows}: {summary}", flush=True)
    return cells


def _ratio(cell, name, key):
    a, b = cell.get("e3nn", {}), cell.get(name, {})
    return f"{a[key] / b[key]:.2f}x" if key in a and key in b else "-"


def write(result, out) -> str:
    impls = result["impls"]
    eaas_impls = [k for k in impls if k.startswith("eaas")]
    lines = [
        f"# EAAS (jequi.sh_tensor_product) vs the dense product with spherical harmonics, {result['device']} ({result['date']})", "",
        ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v) + f"; {result['dtype']}; "
        f"median of {result['repeat']} runs of {result['calls']} calls; fwd+bwd: grad of sum(out^2) in x and r.",
        "x = C x (0e+1o+...+L), harmonics 0..L, one vector per row; filtered: outputs 0e+1o+...+L; full: every output. "
        "Speed-up = e3nn ms / EAAS ms; GB/s = bytes of x, r and out / EAAS fwd time; first call s: the first "
        "fwd+bwd call of the cell (compile included).", "",
        "| L | C | mode | rows | dim in -> out | " + " | ".join(f"{k} fwd ms | {k} fwd+bwd ms" for k in impls)
        + "".join(f" | {k} speed-up fwd | fwd+bwd | {k} fwd GB/s | {k} fwd+bwd first call s" for k in eaas_impls) + " | diff vs e3nn |",
        "|" + "---|" * (5 + 2 * len(impls) + 4 * len(eaas_impls) + 1),
    ]  # fmt: skip
    for c in result["cells"]:
        head = f"| {c['L']} | {c['channels']} | {c['mode']} | {c['rows']} | {c['dim_in']} -> {c['dim_out']} |"
        if "skipped" in c:
            lines.append(head + f" skipped ({c['skipped']}) |")
            continue
        times = []
        for k in impls:
            v = c.get(k, {})
            times += [f"{v['fwd_ms']:.3f}", f"{v['fwd_bwd_ms']:.3f}"] if "fwd_ms" in v else [v.get("error", "-")[:40], "-"]
        for k in eaas_impls:
            v = c.get(k, {})
            gbs = f"{c['io_bytes'] / v['fwd_ms'] / 1e6:.0f}" if "fwd_ms" in v else "-"
            first = f"{v['fwd_bwd_compile_s']:.1f}" if "fwd_bwd_compile_s" in v else "-"
            times += [_ratio(c, k, "fwd_ms"), _ratio(c, k, "fwd_bwd_ms"), gbs, first]
        diff = ", ".join(f"{k} {v:.1e}" for k, v in c.get("rel_diff_vs_e3nn", {}).items())
        lines.append(head + " " + " | ".join(times) + f" | {diff} |")
    return save(result, "eaas", "\n".join(lines) + "\n", out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ls", default="2,3,4,5,6")
    ap.add_argument("--channels", default="64,128,256")
    ap.add_argument("--rows", default="10000,100000,1000000")
    ap.add_argument("--modes", default="filtered,full")
    ap.add_argument("--full-lmax", type=int, default=3, help="the full product only up to this L")
    ap.add_argument("--impls", default="e3nn,eaas,eaas_pallas,jequi_dense")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--memory-gb", type=float, default=None, help="skip cells past this (default 40%% of the device's memory)")
    ap.add_argument("--time-limit", type=float, default=520.0, help="seconds; later cells are listed as skipped")
    ap.add_argument("--smoke", action="store_true", help="tiny cells (CPU is fine), written to a temporary folder")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.smoke:
        a.ls, a.channels, a.rows, a.repeat, a.calls = "2,3", "4", "16,32", 1, 1
    out = a.out or (tempfile.mkdtemp() if a.smoke else str(pathlib.Path(__file__).resolve().parent / "results"))
    if a.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    dtype = jnp.dtype(a.dtype)
    impls = a.impls.split(",")
    deadline = time.time() + a.time_limit
    budget = memory_budget(a.memory_gb)
    result = {"date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind, "versions": versions("jaxlib", "e3nn-jax"),
              "dtype": a.dtype, "repeat": a.repeat, "calls": a.calls, "impls": impls, "memory_budget_bytes": budget,
              "cells": []}  # fmt: skip
    rows = [int(n) for n in a.rows.split(",")]
    stem = None
    for mode in a.modes.split(","):
        for lmax in (int(l) for l in a.ls.split(",")):
            if mode == "full" and lmax > a.full_lmax:
                continue
            for channels in (int(c) for c in a.channels.split(",")):
                result["cells"] += run_case(lmax, channels, mode, rows, impls, dtype, a.repeat, a.calls, budget, deadline)
                stem = write(result, out)  # after every case: a later failure keeps the earlier cells
    print(f"wrote {pathlib.Path(out) / stem}.{{json,md}}")


if __name__ == "__main__":
    main()
