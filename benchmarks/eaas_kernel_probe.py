"""Prototype check (branch i50-eaas-kernel): pallas_kernels.eaas.forward against the XLA EAAS
product, one GPU: `source benchmarks/model_env.sh; python3 benchmarks/eaas_kernel_probe.py`."""
import sys, time
sys.path.insert(0, "benchmarks")
import e3nn_jax as e3nn, jax, jax.numpy as jnp, numpy as np
from timing import median_ms
from jequi import eaas, eaas_reference
from jequi.drop_in import _filter_irreps
from pallas_kernels import eaas as kern
def natural(L, mul=1):
    return e3nn.Irreps([(mul, (l, (-1) ** l)) for l in range(L + 1)])
for L, C, rows in [(2, 128, 100000), (4, 64, 10000), (2, 128, 10000), (6, 64, 10000)]:
    irreps_x = natural(L, C)
    plan = eaas._plan(irreps_x, (False,)*len(irreps_x), eaas.sh_irreps(list(range(L+1))), _filter_irreps(natural(L)), "component", "component")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, irreps_x.dim)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(rows, 3)), jnp.float32)
    xla = jax.jit(lambda x, r: eaas_reference.product(plan, x, *eaas_reference.frame(r, plan.lmax, True), (rows,), jnp.float32))
    ref = xla(x, r)
    line = f"L={L} C={C} rows={rows} out={plan.irreps_out.dim}: xla {median_ms(xla, (x, r)):.3f} ms"
    for rpp, warps in [(1, 4), (4, 4)]:
        t = time.time()
        f = jax.jit(lambda x, r: kern.forward(plan, x, r, rows_per_program=rpp, num_warps=warps))
        z = jax.block_until_ready(f(x, r))
        err = float(jnp.max(jnp.abs(z - ref)) / jnp.max(jnp.abs(ref)))
        line += f" | kernel rpp={rpp} w={warps} {median_ms(f, (x, r)):.3f} ms (compile {time.time()-t:.0f} s, err {err:.1e})"
    loss_xla = jax.jit(jax.grad(lambda x, r: jnp.sum(xla(x, r) ** 2), (0, 1)))
    bwd = jax.jit(lambda x, r: kern.backward(plan, x, r, 2.0 * kern.forward(plan, x, r)))
    gx_ref, gr_ref = loss_xla(x, r)
    gx, gr = jax.block_until_ready(bwd(x, r))
    err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in ((gx, gx_ref), (gr, gr_ref)))
    line += f" | fwd+bwd: xla {median_ms(loss_xla, (x, r)):.3f} ms, kernels {median_ms(bwd, (x, r)):.3f} ms (err {err:.1e})"
    gb = rows * 4 * (irreps_x.dim + plan.irreps_out.dim + 3) / 1e9
    line += f" | bound {gb / 3.35:.3f} ms"
    print(line, flush=True)
