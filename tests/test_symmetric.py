"""jequi.SymmetricContraction: mace-torch's values and weight layout (its own module's outputs,
tests/fixtures/mace_torch_sc.npz), cuEquivariance's MACE polynomial space, equivariance, the
kernels against the reference to third order and in forward mode, vmap, and bad inputs."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from test_equivariance import rotation, wigner_d

import jequi
from jequi import species as species_lib
from jequi import symmetric_basis as sb

FIXTURE = np.load(os.path.join(os.path.dirname(__file__), "fixtures", "mace_torch_sc.npz"))
ON_GPU = jax.default_backend() == "gpu"


def flat_from_channels(irreps, xc):
    """mace-torch's ``(N, mul, d)`` node features as flat mul_ir rows."""
    parts, i = [], 0
    for mul, ir in jequi.Irreps(irreps):
        parts.append(xc[:, :, i : i + ir.dim].reshape(xc.shape[0], -1))
        i += ir.dim
    return np.concatenate(parts, axis=1)


def fixture_case(name):
    irin, irout, corr, species = FIXTURE[f"{name}/args"]
    prefix = f"{name}/w/"
    # mace-torch >= 0.3.13 also stores `*_zeroed` flags (buffers, not weights)
    weights = {k[len(prefix) :]: FIXTURE[k] for k in FIXTURE.files if k.startswith(prefix) and not k.endswith("_zeroed")}
    sc = jequi.SymmetricContraction(str(irin), str(irout), int(corr), int(species))
    return sc, weights, flat_from_channels(str(irin), FIXTURE[f"{name}/x"]), FIXTURE[f"{name}/species"], FIXTURE[f"{name}/out"]


def test_wigner_3j_has_e3nn_torch_signs():
    for l1, l2, l3, first in FIXTURE["wigner_3j_first"]:
        c = sb.torch_wigner_3j(int(l1), int(l2), int(l3)).ravel()
        assert abs(c[np.flatnonzero(np.abs(c) > 1e-12)[0]] - first) < 1e-12, (l1, l2, l3)


@pytest.mark.parametrize("name", ["a", "b", "c", "d"])
def test_matches_mace_torch(name):
    """Values and weight names/shapes of mace-torch's own SymmetricContraction (correlation 2-4)."""
    sc, weights, x, species, out = fixture_case(name)
    assert set(sc.weight_shapes) == set(weights)
    assert all(tuple(weights[k].shape) == s for k, s in sc.weight_shapes.items())
    assert_close(sc(x, species, weights, backend="xla"), out, 1e-12, "xla")
    if name in ("a", "b"):  # the kernels compile per descriptor: two cases on CPU
        assert_close(sc(x, species, weights, backend="pallas"), out, 1e-12, "pallas")


def test_spans_cuequivariance_polynomials():
    """The same equivariant polynomials as cuEquivariance's MACE descriptor (evaluated by its
    numpy reference): for one channel and species, jequi's outputs over random weights and
    cuEquivariance's over its own weights span one space."""
    cue = pytest.importorskip("cuequivariance")
    from cuequivariance.group_theory.experimental.mace import symmetric_contraction

    irin, irout, corr = "0e+1o+2e", "0e+1o", 3
    sc = jequi.SymmetricContraction(irin, irout, corr, 1)
    e, _ = symmetric_contraction(cue.Irreps("O3", irin), cue.Irreps("O3", irout), range(1, corr + 1))
    x = np.random.default_rng(0).normal(size=(12, sc.irreps_in.dim))  # one channel: both layouts agree
    nw = e.inputs[0].dim
    cue_cols = np.stack([e.polynomial(np.eye(nw)[k][None].repeat(12, 0), x)[0].ravel() for k in range(nw)], 1)
    rng = np.random.default_rng(1)
    ours = np.stack(
        [np.asarray(sc(x, np.zeros(12, np.int32), {k: rng.normal(size=s) for k, s in sc.weight_shapes.items()})).ravel() for _ in range(3 * nw)], 1
    )
    rank = np.linalg.matrix_rank
    assert rank(ours, 1e-9) == rank(cue_cols, 1e-9) == rank(np.concatenate([ours, cue_cols], 1), 1e-9)


@pytest.mark.parametrize("parity", [1, -1])
def test_equivariance(parity):
    sc = jequi.SymmetricContraction("3x0e+3x1o+3x2e+3x3o", "3x0e+3x1o+3x2e", 3, 2)
    w = sc.init_weights(jax.random.key(0), jnp.float64)
    rng = np.random.default_rng(3)
    x, s = rng.normal(size=(4, sc.irreps_in.dim)), rng.integers(0, 2, 4)
    R = rotation(5, parity)
    din, dout = wigner_d(sc.irreps_in, R), wigner_d(sc.irreps_out, R)
    assert_close(sc(x @ din.T, s, w, backend="xla"), np.asarray(sc(x, s, w, backend="xla")) @ dout.T, 1e-11)


def test_layouts_agree():
    a = jequi.SymmetricContraction("2x0e+2x1o", "2x0e+2x1o", 3, 2)
    b = jequi.SymmetricContraction("2x0e+2x1o", "2x0e+2x1o", 3, 2, layout="ir_mul")
    w = a.init_weights(jax.random.key(1), jnp.float64)
    x, s = np.random.default_rng(0).normal(size=(3, 8)), np.array([0, 1, 1])

    def to_ir_mul(v):
        return np.concatenate([v[:, :2], v[:, 2:].reshape(-1, 2, 3).transpose(0, 2, 1).reshape(-1, 6)], 1)

    assert_close(b(to_ir_mul(x), s, w, backend="xla"), to_ir_mul(np.asarray(a(x, s, w, backend="xla"))), 1e-13)
    assert_close(b(to_ir_mul(x), s, w, backend="pallas"), to_ir_mul(np.asarray(a(x, s, w, backend="xla"))), 1e-13)


def _problem(n=7):
    sc = jequi.SymmetricContraction("4x0e+4x1o+4x2e", "4x0e+4x1o", 3, 3)
    rng = np.random.default_rng(2)
    w = {k: jnp.asarray(rng.normal(size=s)) for k, s in sc.weight_shapes.items()}
    return sc, jnp.asarray(rng.normal(size=(n, sc.irreps_in.dim))), jnp.asarray(rng.integers(0, 3, n)), w, rng


def _tree_close(a, b, rtol, what):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert_close(u, v, rtol, what)


def test_kernels_derivatives_match_reference():
    """grad, jvp, force training's second derivative (grad in the weights of a loss on gx) and a
    third order, the kernels against autodiff of the reference."""
    sc, x, s, w, rng = _problem()
    run = {b: (lambda x, w, b=b: sc(x, s, w, backend=b)) for b in ("xla", "pallas")}
    assert_close(run["pallas"](x, w), run["xla"](x, w), 1e-12, "forward")
    g = jnp.asarray(rng.normal(size=(x.shape[0], sc.irreps_out.dim)))
    grads = {b: jax.grad(lambda x, w: jnp.vdot(f(x, w), g), argnums=(0, 1))(x, w) for b, f in run.items()}
    _tree_close(grads["pallas"], grads["xla"], 1e-12, "grad")
    tx = jnp.asarray(rng.normal(size=x.shape))
    tw = jax.tree.map(lambda v: jnp.asarray(rng.normal(size=v.shape)), w)
    jvps = {b: jax.jvp(f, (x, w), (tx, tw))[1] for b, f in run.items()}
    assert_close(jvps["pallas"], jvps["xla"], 1e-12, "jvp")

    def force_loss(f):
        def loss(w, x):
            gx = jax.grad(lambda x: jnp.sum(jnp.tanh(f(x, w))))(x)
            return jnp.sum(gx**2)

        return loss

    second = {b: jax.grad(force_loss(f), argnums=(0, 1))(w, x) for b, f in run.items()}
    _tree_close(second["pallas"], second["xla"], 1e-11, "second order")
    third = {b: jax.jvp(lambda x: jax.grad(force_loss(f), argnums=1)(w, x), (x,), (tx,))[1] for b, f in run.items()}
    assert_close(third["pallas"], third["xla"], 1e-10, "third order")


def test_force_training_gradient_float32():
    """Force training's second derivative on kernels (the backward in wr, a four-point stencil of
    backward calls in x) in float32: near float64, as close as the XLA form's float32."""
    sc, x, s, w, _ = _problem(24)

    def grad(b, dtype):
        def loss(w, x):
            gx = jax.grad(lambda x: jnp.sum(jnp.tanh(sc(x, s, w, backend=b))))(x)
            return jnp.sum(gx**2)

        cast = lambda t: jax.tree.map(lambda a: a.astype(dtype), t)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(cast(w), cast(x))

    exact = grad("xla", jnp.float64)
    for b in ("pallas", "xla"):
        for u, v in zip(jax.tree.leaves(grad(b, jnp.float32)), jax.tree.leaves(exact)):
            assert np.abs(np.asarray(u, np.float64) - v).max() < 1e-5 * np.abs(v).max(), b


def test_kernels_vmap_and_batch_dims():
    sc, x, s, w, _ = _problem()
    xb, sb_ = jnp.stack([x, 2 * x]), jnp.stack([s, (s + 1) % 3])
    wb = jax.tree.map(lambda v: jnp.stack([v, -v]), w)
    for b in ("xla", "pallas"):
        out = jax.vmap(lambda x, s, w: sc(x, s, w, backend=b))(xb, sb_, wb)
        ref = jnp.stack([sc(xb[i], sb_[i], jax.tree.map(lambda v: v[i], wb), backend="xla") for i in range(2)])
        assert_close(out, ref, 1e-12, f"vmap {b}")
        assert_close(sc(xb, sb_, w, backend=b), jnp.stack([sc(xb[i], sb_[i], w, backend="xla") for i in range(2)]), 1e-12, f"batch dims {b}")


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_out_of_range_species_under_jit_give_zero(backend):
    sc, x, s, w, _ = _problem()
    s = s.at[2].set(7).at[4].set(-1)
    out, gx = jax.jit(lambda x, s: (sc(x, s, w, backend=backend), jax.grad(lambda x: jnp.sum(sc(x, s, w, backend=backend) ** 2))(x)))(x, s)
    assert np.all(np.asarray(out)[[2, 4]] == 0) and np.all(np.asarray(gx)[[2, 4]] == 0)
    keep = np.array([0, 1, 3, 5, 6])
    assert_close(np.asarray(out)[keep], sc(x[keep], s[keep], w, backend="xla"), 1e-12)


def test_species_blocks_schedule():
    s = jnp.asarray([2, 0, 2, 5, 1, 2, 2, 0, 9])  # 9: out of range for 6 species
    rows, bs = species_lib.species_blocks(s, 6, 2)
    rows, bs = np.asarray(rows), np.asarray(bs)
    assert sorted(rows[rows >= 0]) == list(range(9))
    for b, sp in enumerate(bs):
        members = rows[2 * b : 2 * b + 2]
        members = members[members >= 0]
        assert all(min(int(np.asarray(s)[m]), 6) == sp for m in members)


def test_bad_inputs():
    sc, x, s, w, _ = _problem()
    with pytest.raises(ValueError, match="species must lie"):
        sc(x, s.at[0].set(3), w)
    with pytest.raises(TypeError, match="integer"):
        sc(x, s.astype(jnp.float64), w)
    with pytest.raises(ValueError, match="last axis"):
        sc(x[:, :-1], s, w)
    with pytest.raises(ValueError, match="leading dims"):
        sc(x, s[:-1], w)
    with pytest.raises(ValueError, match="missing"):
        sc(x, s, {k: v for k, v in list(w.items())[1:]})
    with pytest.raises(ValueError, match="expected"):
        sc(x, s, {**w, "contractions.0.weights_max": w["contractions.0.weights_max"][:, :-1]})
    with pytest.raises(ValueError, match="one multiplicity"):
        jequi.SymmetricContraction("4x0e+2x1o", "4x0e", 2, 3)
    with pytest.raises(ValueError, match="correlation"):
        jequi.SymmetricContraction("4x0e+4x1o", "4x0e", 5, 3)
    with pytest.raises(ValueError, match="reaches"):
        jequi.SymmetricContraction("4x0e", "4x1o", 3, 3)
    with pytest.raises(ValueError, match="backend"):
        sc(x, s, w, backend="cuda")
