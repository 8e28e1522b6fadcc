"""The EAAS kernels (pallas_kernels.eaas) against the XLA product and its derivatives, in
interpret mode on CPU: odd and even paths, pseudovectors, harmonics with multiplicities, the
poles +-y and r = 0."""

import e3nn_jax as e3nn
import jax.numpy as jnp
import numpy as np
import pytest

from jequi import eaas, eaas_reference
from jequi.drop_in import _filter_irreps
from pallas_kernels import eaas as kernel


@pytest.mark.parametrize(
    "irreps_x, sh, filt",
    # every output (odd and even paths, pseudovectors); chunks of 4 channels (stored as tiles)
    # beside chunks of 1 and 2 (stored per component); harmonics with multiplicities; filtered
    # outputs run in test_sh_tensor_product_pallas_backend_derivatives
    [("4x0e+2x1e+1x2o", [0, 1, 2], None), ("4x0e+2x1o", "0e+2x1o+2e", None)],
)
def test_forward_and_tangent_match_xla(irreps_x, sh, filt):
    """The forward kernel against the XLA product, the tangent kernel against its jvp."""
    import jax

    irreps_x = e3nn.Irreps(irreps_x)
    plan = eaas._plan(irreps_x, (False,) * len(irreps_x), eaas.sh_irreps(sh), _filter_irreps(filt), "component", "component")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, irreps_x.dim)))
    r = jnp.asarray(rng.normal(size=(6, 3)))
    r = r.at[0].set(0.0).at[1].set(jnp.array([0.0, -2.0, 0.0])).at[2].set(jnp.array([0.0, 1.5, 0.0]))
    x = eaas._reorder(x, irreps_x, plan.order)
    tx, tr = jnp.asarray(rng.normal(size=x.shape)), jnp.asarray(rng.normal(size=r.shape))

    def product(x, r):
        return eaas_reference.product(plan, x, *eaas_reference.frame(r, plan.lmax, True), (6,), x.dtype)

    z_ref, t_ref = jax.jvp(product, (x, r), (tx, tr))
    np.testing.assert_allclose(kernel.forward(plan, x, r, rows_per_program=4), z_ref, atol=1e-12)
    np.testing.assert_allclose(kernel.tangent(plan, x, r, tx, tr), t_ref, atol=1e-11)


@pytest.mark.parametrize(
    "irreps_x, sh, filt, normalize",
    [("4x0e+4x1o+4x2e", [0, 1, 2], "0e+1o+2e", True), ("2x0e+2x1o", "0e+2x1o+2e", None, False)],
)
def test_backward_matches_xla_vjp(irreps_x, sh, filt, normalize):
    """Gradients in x and r of <g, product> against JAX's reverse mode of the XLA product."""
    import jax

    irreps_x = e3nn.Irreps(irreps_x)
    plan = eaas._plan(irreps_x, (False,) * len(irreps_x), eaas.sh_irreps(sh), _filter_irreps(filt), "component", "component")
    rng = np.random.default_rng(1)
    x = eaas._reorder(jnp.asarray(rng.normal(size=(6, irreps_x.dim))), irreps_x, plan.order)
    r = jnp.asarray(rng.normal(size=(6, 3)))
    r = r.at[0].set(0.0).at[1].set(jnp.array([0.0, -2.0, 0.0])).at[2].set(jnp.array([0.0, 1.5, 0.0]))
    g = jnp.asarray(rng.normal(size=(6, plan.irreps_out.dim)))
    _, vjp = jax.vjp(lambda x, r: eaas_reference.product(plan, x, *eaas_reference.frame(r, plan.lmax, normalize), (6,), x.dtype), x, r)
    gx_ref, gr_ref = vjp(g)
    gx, gr = kernel.backward(plan, x, r, g, normalize=normalize)
    np.testing.assert_allclose(gx, gx_ref, atol=1e-12)
    np.testing.assert_allclose(gr, gr_ref, atol=1e-12)


def test_sh_tensor_product_pallas_backend_derivatives():
    """backend="pallas" against backend="xla": values with leading dims, the gradient, forward
    mode, force training's second derivative (a loss on dE/dr differentiated in x and r), vmap."""
    import jax

    import jequi

    irreps_x = e3nn.Irreps("2x0e+2x1o")
    rng = np.random.default_rng(3)
    x = e3nn.IrrepsArray(irreps_x, jnp.asarray(rng.normal(size=(2, 3, irreps_x.dim))))
    r = jnp.asarray(rng.normal(size=(2, 3, 3))).at[0, 0].set(jnp.array([0.0, -1.0, 0.0]))

    def energy(backend):
        def f(xa, r_):
            z = jequi.sh_tensor_product(e3nn.IrrepsArray(irreps_x, xa), r_, [0, 1], filter_ir_out="0e+1o", backend=backend)
            return jnp.sum(jnp.sin(z.array))

        return f

    for fn in (
        lambda b: jequi.sh_tensor_product(x, r, [0, 1], backend=b).array,
        lambda b: jax.grad(energy(b), (0, 1))(x.array, r),
        lambda b: jax.jvp(energy(b), (x.array, r), (jnp.ones_like(x.array), jnp.ones_like(r)))[1],
        lambda b: jax.grad(lambda xa, r_: jnp.sum(jax.grad(energy(b), 1)(xa, r_) ** 2), (0, 1))(x.array, r),
        lambda b: jax.vmap(lambda xa, r_: jax.grad(energy(b), 1)(xa, r_))(x.array, r),
    ):
        for a, ref in zip(jax.tree.leaves(fn("pallas")), jax.tree.leaves(fn("xla"))):
            np.testing.assert_allclose(a, ref, atol=1e-11)


def test_generators_are_the_wigner_matrices_derivatives():
    """J_l[a] (the backward's reduction to the angular velocity) is the derivative of
    so2.wigner_d's D_l at the identity along generator a, and antisymmetric."""
    import jax

    from jequi import so2

    js = kernel.generators(4)
    for a in range(3):
        tangents = jax.jvp(lambda rot: so2.wigner_d(rot, 4), (jnp.eye(3),), (jnp.asarray(kernel.GENERATORS[a]),))[1]
        for l, t in enumerate(tangents):
            np.testing.assert_allclose(t, js[l][a], atol=1e-12)
            np.testing.assert_allclose(js[l][a], -js[l][a].T, atol=1e-12)


def _kernel_bodies(jaxpr):
    """The jaxprs of the pallas_calls in `jaxpr`, at any depth."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params["jaxpr"]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _kernel_bodies(inner)


def test_float32_kernels_compute_in_float32():
    """With x64 on, float32 inputs stay float32 inside all three kernels (a numpy float64
    coefficient would promote the kernels' arithmetic to float64)."""
    import jax

    irreps_x = e3nn.Irreps("2x0e+2x1o")
    plan = eaas._plan(irreps_x, (False, False), eaas.sh_irreps("0e+2x1o+2e"), None, "component", "component")
    x = jnp.ones((3, irreps_x.dim), jnp.float32)
    r = jnp.ones((3, 3), jnp.float32)
    g = jnp.ones((3, plan.irreps_out.dim), jnp.float32)
    for jaxpr in (
        jax.make_jaxpr(lambda x, r: kernel.forward(plan, x, r, normalize=False))(x, r),
        jax.make_jaxpr(lambda x, r: kernel.tangent(plan, x, r, x, r, normalize=False))(x, r),
        jax.make_jaxpr(lambda x, r, g: kernel.backward(plan, x, r, g, normalize=False))(x, r, g),
    ):
        bodies = list(_kernel_bodies(jaxpr.jaxpr))
        assert len(bodies) == 1
        assert "f64" not in str(bodies[0])
        assert "f32" in str(bodies[0])


def test_launch_rule_is_one_thread_a_channel_of_the_widest_chunk():
    """pallas_kernels.heuristics.eaas_warps: 4 warps at 128 channels (and wider: chunks stop at
    128), 2 at 64, 1 at 32 and fewer."""
    from pallas_kernels.heuristics import eaas_warps

    def plan(irreps):
        irreps = e3nn.Irreps(irreps)
        return eaas._plan(irreps, (False,) * len(irreps), eaas.sh_irreps([0, 1]), None, "component", "component")

    assert [eaas_warps(plan(s)) for s in ("256x0e", "128x0e+8x1o", "64x0e+64x1o", "96x1o", "32x0e", "3x0e")] == [4, 4, 2, 2, 1, 1]
