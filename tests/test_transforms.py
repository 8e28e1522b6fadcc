"""jit, vmap (any in_axes), broadcasting and IrrepsArray in/out."""

import functools

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp, five_path_channelwise, random_inputs

import jequi


@pytest.fixture(scope="module")
def tp():
    return jequi.channelwise("3x0e+2x1o+2x2e", "0e+1o+2e", "0e+1o+2e+3o")


def test_jit_equals_eager(tp):
    x, y, w = random_inputs(tp, 4)
    assert_close(jax.jit(tp)(x, y, w), tp(x, y, w), 1e-14)


@pytest.mark.parametrize(
    "in_axes", [(0, 0, 0), (0, 0, None), (None, 0, 0), (0, None, None), (1, 0, 0)]
)
def test_vmap_in_axes(tp, in_axes):
    b = 5
    x, y, w = random_inputs(tp, b)
    args = [x.T if in_axes[0] == 1 else x, y, w]
    args = [a[0] if ax is None else a for a, ax in zip(args, in_axes)]
    shared_w = in_axes[2] is None
    got = jax.vmap(lambda x, y, w: tp(x, y, w), in_axes=in_axes)(*args)
    xb = np.broadcast_to(args[0].T if in_axes[0] == 1 else args[0], (b, x.shape[1]))
    yb = np.broadcast_to(args[1], (b, y.shape[1]))
    expected = e3nn_tp(tp, xb, yb, args[2] if shared_w else w)
    assert_close(got, expected, 1e-12)


def test_vmap_of_grad_and_nested_vmap(tp):
    x, y, w = random_inputs(tp, 6)
    # jitted: eagerly each op of the gradients compiles alone
    g = jax.jit(jax.vmap(jax.grad(lambda x, y, w: jnp.sum(tp(x, y, w) ** 2), argnums=(0, 1, 2))))(x, y, w)
    ref = jax.jit(jax.grad(lambda x, y, w: jnp.sum(e3nn_tp(tp, x, y, w) ** 2), argnums=(0, 1, 2)))(x, y, w)
    for a, b in zip(g, ref):
        assert_close(a, b, 1e-12)
    nested = jax.vmap(jax.vmap(tp))(x.reshape(2, 3, -1), y.reshape(2, 3, -1), w.reshape(2, 3, -1))
    assert_close(nested.reshape(6, -1), tp(x, y, w), 1e-14)


def test_broadcasting_leading_dims(tp):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 1, tp.irreps_in1.dim))
    y = rng.normal(size=(1, 3, tp.irreps_in2.dim))
    w = rng.normal(size=(tp.weight_numel,))
    z = tp(x, y, w)
    assert z.shape == (2, 3, tp.irreps_out.dim)
    xb = np.broadcast_to(x, (2, 3, x.shape[-1])).reshape(6, -1)
    yb = np.broadcast_to(y, (2, 3, y.shape[-1])).reshape(6, -1)
    assert_close(z.reshape(6, -1), e3nn_tp(tp, xb, yb, w), 1e-12)
    assert tp(x[0, 0], y[0, 0], w).shape == (tp.irreps_out.dim,)
    assert tp(x[:, :, :][:0], y, w).shape == (0, 3, tp.irreps_out.dim)


def test_irreps_array_in_and_out(tp):
    x, y, w = random_inputs(tp, 3)
    z = tp(e3nn.IrrepsArray(tp.irreps_in1, x), e3nn.IrrepsArray(tp.irreps_in2, y), w)
    assert isinstance(z, e3nn.IrrepsArray) and z.irreps == tp.irreps_out
    assert_close(z.array, e3nn_tp(tp, x, y, w), 1e-12)
    mixed = tp(x, e3nn.IrrepsArray(tp.irreps_in2, y), w)
    assert isinstance(mixed, e3nn.IrrepsArray)
    # Same irreps, another chunking: accepted.
    regrouped = e3nn.IrrepsArray("1x0e+2x0e+2x1o+2x2e", x)
    assert_close(tp(regrouped, y, w).array, z.array, 0)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_conv_vmap_over_graphs(backend):
    tp = five_path_channelwise()
    rng = np.random.default_rng(3)
    g, n, e = 3, 4, 9
    x = rng.normal(size=(g, n, tp.irreps_in1.dim))
    y = rng.normal(size=(g, e, tp.irreps_in2.dim))
    w = rng.normal(size=(g, e, tp.weight_numel))
    s, r = rng.integers(0, n, (g, e)), rng.integers(0, n, (g, e))
    conv = functools.partial(tp.conv, backend=backend)
    got = jax.jit(jax.vmap(lambda x, y, w, s, r: conv(x, y, w, s, r, n)))(x, y, w, s, r)
    for k in range(g):
        assert_close(got[k], tp.conv(x[k], y[k], w[k], s[k], r[k], n, backend="xla"), 1e-13)
    # Graphs built under vmap, then reused.
    graphs = jax.vmap(lambda s, r: jequi.Graph.build(s, r, n))(s, r)
    assert_close(jax.jit(jax.vmap(conv))(x, y, w, graphs), got, 1e-13)
    # Shared weights and one graph structure for all batch members.
    ws = rng.normal(size=(tp.weight_numel,))
    got = jax.jit(jax.vmap(lambda x, y: conv(x, y, ws, s[0], r[0], n)))(x, y)
    for k in range(g):
        assert_close(got[k], tp.conv(x[k], y[k], ws, s[0], r[0], n, backend="xla"), 1e-13)
