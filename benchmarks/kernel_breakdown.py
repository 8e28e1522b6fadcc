"""Where one call of a benchmark cell spends its GPU time: every kernel it launches, with its
duration under Nsight Compute (GPU run, device tool, Firecracker machines).

    python3 benchmarks/kernel_breakdown.py nequip-lips:float32:jequi-pallas+cuda-ir_mul:dbl \
        nequip-lips:float32:cuex:dbl [--batch 50000] [--dbl-batch 20000] [--out DIR]

A cell is ``problem:dtype:impl:pass`` with `gpu_benchmark.py`'s implementations and passes
(the same functions, arrays and layouts). Each cell runs in its own process under
``ncu --profile-from-start off --metrics gpu__time_duration.sum`` (clocks left alone): the
process compiles and warms the call up, then profiles one call between cudaProfilerStart and
cudaProfilerStop. Kernels run one at a time under ncu, so the sum is the call's time without
overlap or launch gaps; the table prints it beside the process's own median wall time,
which ncu's injection inflates (MACE-medium's double backward read 531 us against 345 without
ncu, H200): compare the kernel times, not the wall time, with other runs.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import pathlib
import subprocess
import sys


def profiler(start: bool):
    """cudaProfilerStart/Stop on the primary context that JAX uses."""
    import ctypes
    import glob

    import jax

    names = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    roots = [os.path.dirname(jax.__file__) + "/..", "/usr/local/cuda/lib64"]
    names += [p for r in roots for p in glob.glob(f"{r}/**/libcudart.so*", recursive=True)]
    for name in names:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return (lib.cudaProfilerStart if start else lib.cudaProfilerStop)()
    raise RuntimeError("libcudart not found")


def child(cell: str, batch: int, dbl_batch: int):
    import jax

    problem, dtype, impl, pname = cell.split(":")
    import gpu_benchmark as gb  # enables float64
    from timing import median_ms

    import jequi

    tp = jequi.problems.get(problem)
    tp_ir = jequi.problems.get(problem, layout="ir_mul")
    spec = jequi.problems.CATALOGUE[problem]
    d1, d2, do = tp.descriptor.dims
    x, y, w, g = gb.random_arrays(jax.random.key(0), dtype, [(batch, d1), (batch, d2), (batch, tp.weight_numel), (batch, do)])
    n = dbl_batch
    rows = (x[:n], y[:n], w[:n], g[:n])
    args = {"fwd": (x, y, w), "bwd": (x, y, w, g), "dbl": rows, "dblf": rows}[pname]
    if impl.endswith(gb.IR_MUL):
        roles = ("in1", "in2", None, "out")
        args = tuple(a if role is None else gb.in_layout(tp.descriptor, a, role) for a, role in zip(args, roles))
    note, f = gb.tp_impls(tp, tp_ir, spec, dtype)[impl]()[0]
    fn = jax.jit(gb.tp_passes()[pname](f))
    jax.block_until_ready(fn(*args))
    ms = median_ms(fn, args, 5, 10)
    jax.block_until_ready(fn(*args))
    profiler(True)
    jax.block_until_ready(fn(*args))
    profiler(False)
    print(f"WALL {ms:.4f} {note}", flush=True)


def kernels(csv_text: str) -> list[tuple[str, float]]:
    """(kernel name, us) per profiled launch, in launch order."""
    lines = [ln for ln in csv_text.splitlines() if ln.startswith('"')]
    out = []
    for r in csv.DictReader(io.StringIO("\n".join(lines))):
        if r.get("Metric Name") == "gpu__time_duration.sum":
            unit = r["Metric Unit"]
            scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}[unit]
            out.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) * scale))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cells", nargs="+", help="problem:dtype:impl:pass")
    ap.add_argument("--batch", type=int, default=50_000)
    ap.add_argument("--dbl-batch", type=int, default=20_000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    a = ap.parse_args()
    if a.child:
        return child(a.cells[0], a.batch, a.dbl_batch)
    here = pathlib.Path(__file__).resolve().parent
    report = []
    for cell in a.cells:
        log = pathlib.Path(a.out) / (cell.replace(":", "_").replace("+", "p") + ".csv")
        cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--metrics", "gpu__time_duration.sum",
               "--csv", "--log-file", str(log), sys.executable, str(here / "kernel_breakdown.py"), cell, "--child",
               "--batch", str(a.batch), "--dbl-batch", str(a.dbl_batch)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=here)
        wall = next((ln.split(maxsplit=2)[1:] for ln in run.stdout.splitlines() if ln.startswith("WALL")), None)
        if run.returncode or wall is None or not log.exists():
            report.append(f"\n## {cell}\n\nfailed (rc {run.returncode}): {(run.stdout + run.stderr)[-1500:]}")
            continue
        ks = kernels(log.read_text())
        rows = [f"| {i} | `{name[:90]}` | {us:.1f} |" for i, (name, us) in enumerate(ks)]
        total = sum(us for _, us in ks)
        report.append(
            f"\n## {cell}\n\nwall median under ncu {float(wall[0]) * 1e3:.1f} us per call ({' '.join(wall[1:])}); "
            f"kernels under ncu {total:.1f} us in {len(ks)} launches\n\n| # | kernel | us |\n|---|---|---|\n" + "\n".join(rows)
        )
        print(report[-1], flush=True)
    (pathlib.Path(a.out) / "kernel_breakdown.md").write_text("# Kernel breakdown\n" + "\n".join(report) + "\n")


if __name__ == "__main__":
    main()
