"""jequi.IndexedLinear: e3nn-jax's fully connected product with the one-hot species (values and
weight order), its derivatives and vmap against autodiff of that product, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp

import jequi


def _problem(n=9):
    lin = jequi.IndexedLinear("3x0e+2x1o+2x0e+1x2e", "2x0e+3x1o+1x1e+2x2e", 4)
    rng = np.random.default_rng(0)
    return lin, rng.normal(size=(n, lin.irreps_in.dim)), rng.integers(0, 4, n), rng.normal(size=lin.weight_numel), rng


def test_matches_e3nn_one_hot_product():
    lin, x, s, w, _ = _problem()
    assert_close(lin(x, s, w), e3nn_tp(lin.product, x, np.eye(4)[s], np.broadcast_to(w, (len(s), w.size))), 1e-12)


def test_derivatives_and_vmap_match_one_hot_product():
    lin, x, s, w, rng = _problem()
    onehot = jnp.asarray(np.eye(4)[s])
    ref = lambda x, w: lin.product(x, onehot, w, backend="xla")  # noqa: E731
    ours = lambda x, w: lin(x, s, w)  # noqa: E731
    g = rng.normal(size=(len(s), lin.irreps_out.dim))
    for a, b in zip(jax.grad(lambda *a: jnp.vdot(ours(*a), g), (0, 1))(x, w), jax.grad(lambda *a: jnp.vdot(ref(*a), g), (0, 1))(x, w)):
        assert_close(a, b, 1e-12, "grad")
    tx, tw = rng.normal(size=x.shape), rng.normal(size=w.shape)
    assert_close(jax.jvp(ours, (x, w), (tx, tw))[1], jax.jvp(ref, (x, w), (tx, tw))[1], 1e-12, "jvp")
    xb, sb = np.stack([x, -x]), np.stack([s, (s + 1) % 4])
    out = jax.vmap(lambda x, s: lin(x, s, w))(xb, sb)
    assert_close(out, np.stack([lin(xb[i], sb[i], w) for i in range(2)]), 1e-13, "vmap")


def test_out_of_range_species_under_jit_give_zero():
    lin, x, s, w, _ = _problem()
    s = s.copy()
    s[3] = 9
    out = np.asarray(jax.jit(lambda x, s: lin(x, s, w))(x, s))
    assert np.all(out[3] == 0)
    keep = np.arange(len(s)) != 3
    assert_close(out[keep], lin(x[keep], s[keep], w), 1e-13)


def test_bad_inputs():
    lin, x, s, w, _ = _problem()
    with pytest.raises(ValueError, match="species must lie"):
        lin(x, s + 4, w)
    with pytest.raises(TypeError, match="integer"):
        lin(x, s.astype(float), w)
    with pytest.raises(ValueError, match="last axis"):
        lin(x[:, 1:], s, w)
    with pytest.raises(ValueError, match="expected"):
        lin(x, s, w[1:])
    with pytest.raises(ValueError, match="num_species"):
        jequi.IndexedLinear("2x0e", "2x0e", 0)
