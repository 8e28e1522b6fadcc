"""MACE's symmetric contraction alone: jequi's kernels, jequi's XLA reference and cuEquivariance's
``uniform_1d`` kernel (indexed by species, as its MACE example calls it), one process, one GPU.

Problems: MACE-MP-0 medium's two product layers, ``128x(0e+1o+2e+3o)`` to ``128x0e+128x1o``
(first layer) and to ``128x0e`` (last), correlation 3, 89 species with the atoms drawn from 8 of
them. Per cell (N nodes): forward and forward + backward (grad of ``<out, g>`` in ``x`` and the
weights) median ms, the first call's time (compile), and the HBM bound (read ``x``, write the
output; backward also read ``g``, write ``gx``; weights are a few hundred KB and ignored) at
the device's copy rate (``--bandwidth``, 4.3 TB/s measured on the H200s, BASELINES.md).

Inputs are the same values for every method: jequi in ``mul_ir`` (its default layout), cuEquivariance
in ``ir_mul`` (its native one); cuEquivariance's weights are jequi's mace-torch weights through
its projection (``cuequivariance.group_theory.experimental.mace.symmetric_contraction``), and
the outputs are compared.

    python benchmarks/symmetric_benchmark.py [--sizes 4096,16384,65536] [--out DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jequi  # noqa: E402
from timing import save, timed, versions  # noqa: E402

PROBLEMS = {
    "mace-mp-medium-first": ("128x0e+128x1o+128x2e+128x3o", "128x0e+128x1o", 3),
    "mace-mp-medium-last": ("128x0e+128x1o+128x2e+128x3o", "128x0e", 3),
}
SMOKE = {"smoke": ("4x0e+4x1o+4x2e", "4x0e+4x1o", 3)}


def to_ir_mul(irreps, x):
    parts, i = [], 0
    for mul, ir in jequi.Irreps(irreps):
        block = x[:, i : i + mul * ir.dim]
        i += mul * ir.dim
        parts.append(jnp.swapaxes(block.reshape(-1, mul, ir.dim), 1, 2).reshape(x.shape[0], -1))
    return jnp.concatenate(parts, axis=1)


def cuex_method(irreps_in, irreps_out, correlation, num_species):
    """``f(x_ir_mul, species, weights) -> out_ir_mul`` by cuEquivariance's uniform_1d kernel, or
    None where cuequivariance-jax is not installed."""
    try:
        import cuequivariance as cue
        import cuequivariance_jax as cuex
        from cuequivariance.group_theory.experimental.mace import symmetric_contraction
    except ImportError:
        return None
    e, projection = symmetric_contraction(cue.Irreps("O3", irreps_in), cue.Irreps("O3", irreps_out), range(1, correlation + 1))
    method = "uniform_1d" if jax.default_backend() == "gpu" else "naive"

    def f(x, species, weights):
        w = jnp.concatenate(list(weights.values()), axis=1)  # mace-torch order: cue's projection rows
        w = jnp.einsum("sau,ab->sbu", w, jnp.asarray(projection, w.dtype)).reshape(num_species, -1)
        [y] = cuex.segmented_polynomial(
            e.polynomial, [w, x], [jax.ShapeDtypeStruct((x.shape[0], e.outputs[0].dim), x.dtype)],
            indices=[species, None, None], method=method,
        )  # fmt: skip
        return y

    return f


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384,65536")
    ap.add_argument("--species", type=int, default=89)
    ap.add_argument("--present", type=int, default=8)
    ap.add_argument("--bandwidth", type=float, default=4.3e12)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--methods", default="jequi-xla,jequi-pallas,cuex-uniform_1d", help="comma-separated subset")
    ap.add_argument("--kind", default="symmetric", help="results file name: <date>-<device>-<kind>")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    problems = SMOKE if args.smoke else PROBLEMS
    sizes = [64] if args.smoke else [int(s) for s in args.sizes.split(",")]
    device = jax.devices()[0].device_kind
    result = dict(date=datetime.date.today().isoformat(), device=device, versions=versions("e3nn-jax", "cuequivariance-jax"), cells=[])
    lines = [f"# Symmetric contraction, {device}, {result['date']}", "", f"versions: {result['versions']}", "",
             "| problem | N | method | fwd ms | fwd + gx ms | fwd+bwd ms | first fwd+bwd s | fwd / bwd HBM bound ms | max diff vs jequi-xla |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, (irin, irout, corr) in problems.items():
        sc = jequi.SymmetricContraction(irin, irout, corr, args.species)
        weights = sc.init_weights(jax.random.key(0))
        cue_f = cuex_method(irin, irout, corr, args.species)
        for n in sizes:
            rng = np.random.default_rng(n)
            present = rng.choice(args.species, args.present, replace=False)
            species = jnp.asarray(rng.choice(present, n), jnp.int32)
            x = jnp.asarray(rng.normal(size=(n, sc.irreps_in.dim)), jnp.float32)
            g = jnp.asarray(rng.normal(size=(n, sc.irreps_out.dim)), jnp.float32)
            item = 4
            bound_f = n * (sc.irreps_in.dim + sc.irreps_out.dim) * item / args.bandwidth * 1e3
            bound_b = n * (2 * sc.irreps_in.dim + sc.irreps_out.dim) * item / args.bandwidth * 1e3
            methods = {  # the XLA reference first: the others are compared with it
                "jequi-xla": (lambda x, s, w: sc(x, s, w, backend="xla"), x, g),
                "jequi-pallas": (lambda x, s, w: sc(x, s, w, backend="pallas"), x, g),
            }
            if cue_f is not None:
                methods["cuex-uniform_1d"] = (cue_f, to_ir_mul(irin, x), to_ir_mul(irout, g))
            ref = None
            methods = {k: v for k, v in methods.items() if k in args.methods.split(",")}
            for method, (f, xm, gm) in methods.items():
                fwd = jax.jit(f)
                both = jax.jit(jax.grad(lambda x, w, s, g: jnp.vdot(f(x, s, w), g), argnums=(0, 1)))
                forces = jax.jit(jax.grad(lambda x, w, s, g: jnp.vdot(f(x, s, w), g)))  # an MD step's: gx alone
                try:
                    ms_f, first_f = timed(fwd, (xm, species, weights))
                    ms_b, first_b = timed(both, (xm, weights, species, gm))
                    ms_x, _ = timed(forces, (xm, weights, species, gm))
                except Exception as exc:  # a peer failing one cell is reported, not fatal
                    print(f"{name} {n} {method}: {type(exc).__name__}: {exc}"[:400], flush=True)
                    continue
                out = fwd(xm, species, weights)
                if method == "jequi-xla":
                    ref = out
                diff = None
                if ref is not None:
                    diff = float(jnp.max(jnp.abs(out - (ref if method.startswith("jequi") else to_ir_mul(irout, ref)))))
                cell = dict(problem=name, n=n, method=method, fwd_ms=ms_f, fwd_bwd_ms=ms_b, fwd_gx_ms=ms_x, first_fwd_s=first_f, first_fwd_bwd_s=first_b,
                            bound_fwd_ms=bound_f, bound_bwd_ms=bound_b, max_diff=diff)  # fmt: skip
                result["cells"].append(cell)
                lines.append(f"| {name} | {n} | {method} | {ms_f:.3f} | {ms_x:.3f} | {ms_b:.3f} | {first_b:.1f} | {bound_f:.3f} / {bound_b:.3f} | {diff if diff is None else f'{diff:.1e}'} |")
                print(lines[-1], flush=True)
                save(result, args.kind, "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
