"""Where the symmetric contraction's time goes (one GPU): each stage of ``sc(x, species, w,
backend="pallas")`` jitted alone with real inputs (the species schedule, the reduced weights,
the forward kernel, the backward kernel with its per-species sum), per rows-per-block, at N
nodes of MACE-MP-0 medium's first product layer.

    python benchmarks/symmetric_probe.py [--sizes 4096,65536] [--blocks 8,16,32]
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jequi  # noqa: E402
from jequi import species as species_lib  # noqa: E402
from pallas_kernels import symmetric as kernels  # noqa: E402
from timing import timed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,65536")
    ap.add_argument("--blocks", default="8,16,32")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    sc = jequi.SymmetricContraction("128x0e+128x1o+128x2e+128x3o", "128x0e+128x1o", 3, 89)
    d = sc.descriptor
    w = sc.init_weights(jax.random.key(0))
    lines = ["| N | block | schedule ms | reduced weights ms | forward kernel ms | backward kernel + species sum ms | backward compile s |", "|---|---|---|---|---|---|---|"]
    for n in [int(s) for s in args.sizes.split(",")]:
        rng = np.random.default_rng(n)
        species = jnp.asarray(rng.choice(rng.choice(89, 8, replace=False), n), jnp.int32)
        x = jnp.asarray(rng.normal(size=(n, d.irreps_in.dim)), jnp.float32)
        g = jnp.asarray(rng.normal(size=(n, d.irreps_out.dim)), jnp.float32)
        wr = jax.jit(d.reduced_weights)(w)
        wr = jnp.concatenate([wr, jnp.zeros((1, *wr.shape[1:]), wr.dtype)])
        t_w, _ = timed(jax.jit(d.reduced_weights), (w,))
        for block in [int(b) for b in args.blocks.split(",")]:
            sched = jax.jit(lambda s, block=block: species_lib.species_blocks(s, 89, block))
            t_s, _ = timed(sched, (species,))
            rows, bs = sched(species)
            fwd = jax.jit(lambda x, wr, rows, bs, block=block: kernels.forward(d, x, wr, rows, bs, block=block))
            t_f, _ = timed(fwd, (x, wr, rows, bs))

            def bwd(x, wr, g, rows, bs, block=block):
                gx, part = kernels.backward(d, x, wr, g, rows, bs, block=block)
                return gx, species_lib.species_sum(part, bs, wr.shape[0])

            t_b, first_b = timed(jax.jit(bwd), (x, wr, g, rows, bs))
            lines.append(f"| {n} | {block} | {t_s:.3f} | {t_w:.3f} | {t_f:.3f} | {t_b:.3f} | {first_b:.1f} |")
            print(lines[-1], flush=True)
    with open(os.path.join(args.out, "symmetric-probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
