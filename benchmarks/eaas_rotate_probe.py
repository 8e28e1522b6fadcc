"""Where the EAAS product's time goes, per form of the frame rotation ``jequi.so2.rotate``.

Times ``jequi.sh_tensor_product``'s computation (frames and product, as ``jequi.eaas`` runs it)
with ``so2.rotate`` replaced by each form below: forward, the gradient of ``sum(out^2)`` in ``x``,
in ``r`` and in both, a forward-mode ``jvp``, and (for ``base``) the frames alone. Each form's
gradient is compared with the first form's (float32, relative to its largest entry). The forms:

* ``base``: n broadcast multiply-adds of per-component slices (the rotate of jequi before
  2026-11-28); each slice transposes into a pad and an add, n of them per block;
* ``landed``: ``jequi.so2.rotate`` as installed;
* ``bsum``: one broadcast product summed over the block; ``einsum``: a batched matrix product;
* ``vjp``: ``base`` forward with a hand-written backward (no forward mode);
* ``hybrid3`` / ``hybrid7``: ``bsum`` up to that block size, ``einsum`` above.

Device tool, from the repo root (carry .whl): ``source benchmarks/model_env.sh; python3
benchmarks/eaas_rotate_probe.py --variants base,landed,bsum,einsum`` writes eaas_rotate.log into
$OUT (results: benchmarks/results/2026-11-28-nvidia-h100-80gb-hbm3-eaas-rotate.md).
"""

from __future__ import annotations

import argparse
import os

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
from timing import median_ms

from jequi import eaas, eaas_reference, so2
from jequi.drop_in import _filter_irreps

landed = so2.rotate


def base(x, d, *, transpose):
    n = d.shape[-1]
    rows = (lambda i: d[..., None, i, :]) if transpose else (lambda i: d[..., None, :, i])
    out = x[..., 0:1] * rows(0)
    for i in range(1, n):
        out = out + x[..., i : i + 1] * rows(i)
    return out


def bsum(x, d, *, transpose):
    m = d if transpose else jnp.swapaxes(d, -1, -2)
    return jnp.sum(x[..., :, :, None] * m[..., None, :, :], axis=-2)


def einsum(x, d, *, transpose):
    m = d if transpose else jnp.swapaxes(d, -1, -2)
    return jnp.einsum("...ci,...ij->...cj", x, m, precision=jax.lax.Precision.HIGHEST)


def _with_vjp(transpose):
    @jax.custom_vjp
    def rot(x, d):
        return base(x, d, transpose=transpose)

    def fwd(x, d):
        return rot(x, d), (x, d)

    def bwd(res, g):
        x, d = res
        dx = base(g, d, transpose=not transpose)
        dd = jnp.einsum("...ci,...cj->...ij", x, g) if transpose else jnp.einsum("...ci,...cj->...ij", g, x)
        return dx, dd

    rot.defvjp(fwd, bwd)
    return rot


_vjp = {True: _with_vjp(True), False: _with_vjp(False)}


def vjp(x, d, *, transpose):
    return _vjp[transpose](x, d)


def hybrid(k):
    return lambda x, d, *, transpose: (bsum if d.shape[-1] <= k else einsum)(x, d, transpose=transpose)


FORMS = {"base": base, "landed": landed, "bsum": bsum, "einsum": einsum, "vjp": vjp, "hybrid3": hybrid(3), "hybrid7": hybrid(7)}


def natural(lmax, mul=1):
    return e3nn.Irreps([(mul, (l, (-1) ** l)) for l in range(lmax + 1)])


def cell(L, C, rows, forms, log):
    irreps_x = natural(L, C)
    plan = eaas._plan(irreps_x, (False,) * len(irreps_x), eaas.sh_irreps(list(range(L + 1))), _filter_irreps(natural(L)), "component", "component")
    rng = np.random.default_rng(0)
    x = eaas._reorder(jnp.asarray(rng.normal(size=(rows, irreps_x.dim)), jnp.float32), irreps_x, plan.order)
    r = jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32)
    ref = None
    for name in forms:
        so2.rotate = FORMS[name]  # every form handles one-component blocks (l = 0) too

        def f(x, r):
            ds, norm = eaas_reference.frame(r, plan.lmax, True)
            return eaas_reference.product(plan, x, ds, norm, (rows,), jnp.float32)

        loss = lambda x, r: jnp.sum(f(x, r) ** 2)  # noqa: E731
        fns = {"fwd": f, "grad_x": jax.grad(loss, 0), "grad_r": jax.grad(loss, 1), "grad_xr": jax.grad(loss, (0, 1)),
               "jvp": lambda x, r: jax.jvp(f, (x, r), (x, r))[1]}
        line = [f"L={L} C={C} rows={rows} {name}:"]
        try:
            for k, fn in fns.items():
                fn = jax.jit(fn)
                out = jax.block_until_ready(fn(x, r))
                if k == "grad_xr":
                    if ref is None:
                        ref = out
                    else:
                        line.append("err=%.1e" % max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(out, ref)))
                line.append(f"{k}={median_ms(fn, (x, r)):.3f}ms")
            if name == forms[0]:
                frames = jax.jit(lambda r: sum(jnp.sum(d) for d in eaas_reference.frame(r, plan.lmax, True)[0]))
                frames_grad = jax.jit(jax.grad(lambda r: sum(jnp.sum(d) for d in eaas_reference.frame(r, plan.lmax, True)[0])))
                for k, fn in (("frame_fwd", frames), ("frame_grad", frames_grad)):
                    jax.block_until_ready(fn(r))
                    line.append(f"{k}={median_ms(fn, (r,)):.3f}ms")
        except Exception as e:  # an out-of-memory form is reported, the others still run
            line.append(f"FAILED {type(e).__name__}: {str(e)[:200]}")
        finally:
            so2.rotate = landed
        print(" ".join(line), flush=True)
        log.write(" ".join(line) + "\n")
        log.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="base,landed,bsum,einsum")
    ap.add_argument("--cells", default="2x128x100000,3x128x10000,4x64x10000,4x128x10000,6x64x10000", help="LxCxrows, comma separated")
    args = ap.parse_args()
    forms = args.variants.split(",")
    out = os.environ.get("OUT", "/tmp")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "eaas_rotate.log"), "a") as log:
        log.write(f"{jax.devices()}\n")
        for spec in args.cells.split(","):
            L, C, rows = (int(v) for v in spec.split("x"))
            cell(L, C, rows if jax.default_backend() != "cpu" else min(rows, 200), forms, log)


if __name__ == "__main__":
    main()
