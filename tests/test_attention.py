"""jequi.neighbor_attention: the fused Pallas kernels (interpret mode on CPU) against the
materialised reference (values) and autodiff of it (derivatives), edge cases, bad inputs.

One small problem serves every test, so each kernel compiles once: ``K = 5`` slots in tiles of
2 (not a multiple), ``d = 3`` and ``D_v = 58`` (not powers of two), 4 heads in blocks of 2.
Its rows hold: a row without a valid neighbour (padding by -1, by ``N_src`` and by the mask), a
self loop, duplicate neighbours tied at the maximum (so the eps term's slot matters), huge
logits, a zero envelope.
"""

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jequi
from jequi.attention.heads import head_irreps, merge_heads, split_heads
from pallas_kernels.attention import AttentionConfig

from conftest import assert_close

N, K, H, D, DV = 6, 5, 4, 3, 58
CONFIG = AttentionConfig(block_heads=2, block_neighbors=2, block_edges=2)
EPS = 1e-3
TOL = 1e-11


def _problem():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(N, H, D))
    k = rng.normal(size=(N, H, D))
    v = rng.normal(size=(N, H, DV))
    nbr = rng.integers(0, N, size=(N, K)).astype(np.int32)
    mask = np.ones((N, K), bool)
    nbr[0] = [-1, N, 2, -1, N]  # no valid neighbour: out of range and masked
    mask[0, 2] = False
    nbr[1, 1] = 1  # a self loop
    nbr[2] = [3, 4, 5, 3, 0]  # duplicates of 3, in different tiles
    nbr[4, 4] = -1
    b = rng.normal(size=(N, K, H))
    g = rng.normal(size=(N, K))
    e = rng.uniform(0.2, 1.0, size=(N, K, H))
    u = rng.normal(size=(N, K))
    b[2, [0, 3]] = 40.0  # the duplicates tie at the maximum (same bias, gate, key)
    g[2, 3] = g[2, 0]
    b[3] -= 3e4  # huge logits, shifted together
    q[5] *= 300.0  # huge logit differences
    e[4, 2] = 0.0  # a zero envelope
    return (q, k, v, b, g, e, u), nbr, mask


X, NBR, MASK = _problem()
C = np.random.default_rng(1).normal(size=(N, H, DV))


def attention(backend, *xs, eps=EPS, mask=MASK):
    q, k, v, b, g, e, u = xs
    return jequi.neighbor_attention(
        q, k, v, NBR, mask=mask, logit_bias=b, logit_gate=g, envelope=e, post_scale=u, eps=eps, backend=backend,
        config=CONFIG,
    )  # fmt: skip


def loss(backend):
    return lambda *xs: jnp.sum(attention(backend, *xs) * C)


ARGS = tuple(range(7))


@pytest.mark.parametrize("eps", [0.0, EPS])
def test_forward_matches_reference(eps):
    envelope = X[5].copy()
    envelope[5] = 0.0  # with eps = 0: Z = 0 on row 5, which must give 0
    xs = (*X[:5], envelope, X[6])
    out = attention("pallas", *xs, eps=eps)
    ref = attention("xla", *xs, eps=eps)
    assert np.all(np.isfinite(out))
    assert_close(out, ref, TOL, "out")
    assert np.all(np.asarray(out[0]) == 0.0)
    if eps == 0.0:
        assert np.all(np.asarray(out[5]) == 0.0)


def test_reference_is_the_definition():
    """The reference against the formula written out with numpy loops."""
    q, k, v, b, g, e, u = X
    out = np.asarray(attention("xla", *X))
    for i in range(N):
        slots = [t for t in range(K) if MASK[i, t] and 0 <= NBR[i, t] < N]
        if not slots:
            assert np.all(out[i] == 0.0)
            continue
        s = np.array([[g[i, t] * q[i, h] @ k[NBR[i, t], h] / np.sqrt(D) + b[i, t, h] for h in range(H)] for t in slots])
        a = np.exp(s - s.max(axis=0)) * e[i, slots]
        expect = np.einsum("th,th,thc->hc", a, u[i, slots][:, None] * np.ones(H), v[NBR[i, slots]]) / (a.sum(0) + EPS)[:, None]
        np.testing.assert_allclose(out[i], expect, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend", ["pallas", "pallas-atomic"])
def test_first_derivatives(backend):
    grad = jax.jit(jax.grad(loss(backend), argnums=ARGS))
    grads = grad(*X)
    expect = jax.jit(jax.grad(loss("xla"), argnums=ARGS))(*X)
    for name, a, r in zip("q k v b g e u".split(), grads, expect):
        assert np.all(np.isfinite(a)) and np.all(np.isfinite(r)), name
        assert_close(a, r, TOL, f"d{name}")
    if backend == "pallas":  # the deterministic backward: bitwise reproducible
        for a, b in zip(grads, grad(*X)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    for a in (grads[0], grads[3], grads[5]):  # the row without neighbours: zero gradients
        assert np.all(np.asarray(a[0]) == 0.0)


@pytest.mark.parametrize("argnums", [(0,), (1, 3), (0, 2, 6), (4, 5)])
def test_first_derivatives_of_some_inputs(argnums):
    """Each pass of the deterministic backward alone: keys or values with or without queries
    (the source pass, then the query pass when dq is needed) and no keys or values (the target
    pass), with per-head and shared edge scalars."""
    got = jax.jit(jax.grad(loss("pallas"), argnums=argnums))(*X)
    expect = jax.jit(jax.grad(loss("xla"), argnums=argnums))(*X)
    for n, a, r in zip(argnums, got, expect):
        assert_close(a, r, TOL, f"d{'q k v b g e u'.split()[n]}")
    for n, a in zip(argnums, got):  # the row without neighbours: zero gradients
        if n in (0, 3, 4, 5, 6):
            assert np.all(np.asarray(a[0]) == 0.0)


def test_forward_mode():
    rng = np.random.default_rng(2)
    tangents = tuple(rng.normal(size=np.shape(x)) for x in X)
    _, got = jax.jvp(lambda *xs: attention("pallas", *xs), X, tangents)
    _, expect = jax.jit(lambda t: jax.jvp(lambda *xs: attention("xla", *xs), X, t))(tangents)
    assert_close(got, expect, TOL, "jvp")


def test_second_derivatives():
    """Force training's shape: a loss holding gradients with respect to inputs, differentiated."""

    def force_loss(backend):
        def f(*xs):
            gq, gk = jax.grad(loss(backend), argnums=(0, 1))(*xs)
            return jnp.sum(gq**2) + jnp.sum(jnp.sin(gk))

        return f

    got = jax.jit(jax.grad(force_loss("pallas"), argnums=ARGS))(*X)
    expect = jax.jit(jax.grad(force_loss("xla"), argnums=ARGS))(*X)
    for name, a, r in zip("q k v b g e u".split(), got, expect):
        assert_close(a, r, 1e-10, f"d{name}")


def test_vmap_folds_the_batch():
    qs = jnp.stack([X[0], -0.5 * X[0]])
    got = jax.vmap(lambda q: attention("pallas", q, *X[1:]))(qs)
    for q, out in zip(qs, got):
        assert_close(out, attention("xla", q, *X[1:]), TOL, "vmap")


def test_irreps_values_split_into_heads_and_equivariance():
    irreps = e3nn.Irreps("4x0e+2x1o")
    heads = 2
    rng = np.random.default_rng(3)
    v = e3nn.IrrepsArray(irreps, jnp.asarray(rng.normal(size=(N, irreps.dim))))
    split = split_heads(v, heads)
    assert split.shape == (N, heads, head_irreps(irreps, heads).dim) == (N, heads, 2 + 3)
    np.testing.assert_array_equal(merge_heads(split, irreps).array, v.array)
    # head h holds channels [h m/H, (h+1) m/H) of each block
    np.testing.assert_array_equal(split[:, 1, :2], v.array[:, 2:4])
    np.testing.assert_array_equal(split[:, 1, 2:], v.array[:, 7:10])

    def rotate(x, rot):  # e3nn's 1o is (x, y, z): D = rot
        vectors = x.array[:, 4:].reshape(N, 2, 3) @ rot.T
        return e3nn.IrrepsArray(irreps, jnp.concatenate([x.array[:, :4], vectors.reshape(N, 6)], axis=1))

    q, k = X[0][:, :heads], X[1][:, :heads]
    rot = np.linalg.qr(rng.normal(size=(3, 3)))[0]
    for backend in ("xla", "pallas"):
        out = jequi.neighbor_attention(q, k, v, NBR, mask=MASK, backend=backend, config=CONFIG)
        assert isinstance(out, e3nn.IrrepsArray) and out.irreps == irreps
        rotated = jequi.neighbor_attention(q, k, rotate(v, rot), NBR, mask=MASK, backend=backend, config=CONFIG)
        assert_close(rotated.array, rotate(out, rot).array, 1e-12, f"equivariance ({backend})")


def test_bad_inputs():
    q, k, v, b, g, e, u = X
    cases = [
        (ValueError, "q must have 3 dims", dict(q=q[0])),
        (ValueError, "k must have shape", dict(k=k[:, :2])),
        (ValueError, "v must have shape", dict(v=v[:, :2])),
        (TypeError, "q must be a floating", dict(q=q.astype(np.int32))),
        (TypeError, "neighbors must be an integer", dict(neighbors=NBR.astype(np.float32))),
        (ValueError, "neighbors must have shape", dict(neighbors=NBR[:2])),
        (TypeError, "mask must be a bool", dict(mask=MASK.astype(np.int32))),
        (ValueError, "mask must have", dict(mask=MASK[:, :2])),
        (ValueError, "logit_bias must have shape", dict(logit_bias=b[:, :, :3])),
        (ValueError, "envelope must have shape", dict(envelope=e[:2])),
        (ValueError, "eps must be >= 0", dict(eps=-1.0)),
        (TypeError, "scale must be a Python number", dict(scale=jnp.float32(1.0))),
        (ValueError, "unknown backend", dict(backend="cuda")),
        (TypeError, "config must be", dict(config={"block_heads": 2})),
        (ValueError, "divisible by the 4 heads", dict(v=e3nn.IrrepsArray("2x0e", np.zeros((N, 2))))),
    ]
    for error, match, change in cases:
        kwargs = dict(q=q, k=k, v=v, neighbors=NBR, **{"backend": "xla"})
        kwargs.update(change)
        with pytest.raises(error, match=match):
            jequi.neighbor_attention(kwargs.pop("q"), kwargs.pop("k"), kwargs.pop("v"), kwargs.pop("neighbors"), **kwargs)
    with pytest.raises(ValueError, match="block_heads=3"):
        jequi.neighbor_attention(q, k, v, NBR, backend="pallas", config=AttentionConfig(block_heads=3))
