"""MACE's element-dependent linear (the skip connection) alone, one process, one GPU:

* ``jequi``: ``jequi.IndexedLinear`` (rows sorted by species, one ``jax.lax.ragged_dot`` per irrep block);
* ``one-hot``: the fully connected product with the one-hot species in XLA (mace-jax's form:
  ``num_species`` times the work);
* ``cuex-indexed_linear``: cuEquivariance's ``method="indexed_linear"`` (cuBLAS grouped GEMM) on
  rows sorted by species with ``cuex.Repeats``, as its MACE example calls it (sorting included).

MACE-MP-0 medium's skip connections, 89 species, atoms drawn from 8: forward and forward +
backward (grad in x and w of ``<y, g>``) median ms.

    python benchmarks/indexed_linear_benchmark.py [--sizes 4096,16384,65536] [--out DIR]
"""

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
from symmetric_benchmark import to_ir_mul  # noqa: E402
from timing import save, timed, versions  # noqa: E402

PROBLEMS = {
    "mace-mp-medium-skip-first": ("128x0e+128x1o+128x2e+128x3o", "128x0e+128x1o+128x2e+128x3o"),
    "mace-mp-medium-skip-last": ("128x0e+128x1o", "128x0e"),
}


def cuex_method(irin, irout, num_species):
    try:
        import cuequivariance as cue
        import cuequivariance_jax as cuex
    except ImportError:
        return None
    e = cue.descriptors.linear(cue.Irreps("O3", irin), cue.Irreps("O3", irout)) * (1.0 / num_species**0.5)

    def f(x, species, w):
        order = jnp.argsort(species)
        counts = jnp.zeros((num_species,), jnp.int32).at[species].add(1)
        [y] = cuex.segmented_polynomial(
            e.polynomial, [w, x[order]], [jax.ShapeDtypeStruct((x.shape[0], e.outputs[0].dim), x.dtype)],
            indices=[cuex.Repeats(counts), None, None], method="indexed_linear",
        )  # fmt: skip
        return jnp.zeros_like(y).at[order].set(y)

    return f, e.inputs[0].dim


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,16384,65536")
    ap.add_argument("--species", type=int, default=89)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    device = jax.devices()[0].device_kind
    result = dict(date=datetime.date.today().isoformat(), device=device, versions=versions("e3nn-jax", "cuequivariance-jax"), cells=[])
    lines = [f"# Indexed linear, {device}, {result['date']}", "", f"versions: {result['versions']}", "",
             "| problem | N | method | fwd ms | fwd+bwd ms | first fwd+bwd s |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, (irin, irout) in PROBLEMS.items():
        lin = jequi.IndexedLinear(irin, irout, args.species)
        w = lin.init_weights(jax.random.key(0))
        cue = cuex_method(irin, irout, args.species)
        for n in [int(s) for s in args.sizes.split(",")]:
            rng = np.random.default_rng(n)
            species = jnp.asarray(rng.choice(rng.choice(args.species, min(8, args.species), replace=False), n), jnp.int32)
            x = jnp.asarray(rng.normal(size=(n, lin.irreps_in.dim)), jnp.float32)
            g = jnp.asarray(rng.normal(size=(n, lin.irreps_out.dim)), jnp.float32)
            onehot = lambda x, s, w: lin.product(x, jax.nn.one_hot(s, args.species, dtype=x.dtype), w, backend="xla")  # noqa: E731
            methods = {"jequi": (lin, x, g, w), "one-hot": (onehot, x, g, w)}
            if cue is not None:
                methods["cuex-indexed_linear"] = (cue[0], to_ir_mul(irin, x), to_ir_mul(irout, g), jax.random.normal(jax.random.key(1), (args.species, cue[1])))
            for method, (f, xm, gm, wm) in methods.items():
                try:
                    ms_f, _ = timed(jax.jit(f), (xm, species, wm))
                    ms_b, first = timed(jax.jit(jax.grad(lambda x, w, s, g: jnp.vdot(f(x, s, w), g), argnums=(0, 1))), (xm, wm, species, gm))
                except Exception as exc:  # a peer failing one cell is reported, not fatal
                    print(f"{name} {n} {method}: {type(exc).__name__}: {exc}"[:400], flush=True)
                    continue
                result["cells"].append(dict(problem=name, n=n, method=method, fwd_ms=ms_f, fwd_bwd_ms=ms_b, first_fwd_bwd_s=first))
                lines.append(f"| {name} | {n} | {method} | {ms_f:.3f} | {ms_b:.3f} | {first:.1f} |")
                print(lines[-1], flush=True)
                save(result, "indexed-linear", "\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
