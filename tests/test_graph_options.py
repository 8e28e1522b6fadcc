"""Graph forms a third-party model passes: radial_conv from raw indices (as conv takes them),
Graph.build's promise that edges come in receiver order (saves the sort under jit, checked
where the indices are concrete), and a jraph padding node whose edges are dropped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close

import jequi

TP = jequi.channelwise("4x0e+4x1o", "0e+1o", "0e+1o")


def _inputs(n=7, e=30, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, TP.irreps_in1.dim))
    y = rng.normal(size=(e, TP.irreps_in2.dim))
    w = rng.normal(size=(e, TP.weight_numel))
    s = rng.integers(0, n, e).astype(np.int32)
    r = np.sort(rng.integers(0, n, e)).astype(np.int32)
    return x, y, w, s, r


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_padding_node_edges_are_dropped(backend):
    """jraph pads with edges from and to a padding node (here the last): dropped, the padding
    row zero, the rest as if those edges were not there."""
    x, y, w, s, r = _inputs()
    n, pad = x.shape[0], 6
    s = np.concatenate([np.where(s == n - 1, n - 2, s), np.full(pad, n - 1, np.int32)])
    r = np.concatenate([np.where(r == n - 1, n - 2, r), np.full(pad, n - 1, np.int32)])
    assert jequi.Graph.build(s, r, n, padding_node=n - 1).edges_sorted  # kept edges in order, the dropped last
    s[:3] = n - 1  # edges out of the padding node into real nodes: dropped too
    y, w = np.concatenate([y, np.ones((pad, y.shape[1]))]), np.concatenate([w, np.ones((pad, w.shape[1]))])
    keep = (s != n - 1) & (r != n - 1)
    g = jequi.Graph.build(s, r, n, padding_node=n - 1)
    out = jax.jit(lambda x, y, w, g: TP.conv(x, y, w, g, backend=backend))(x, y, w, g)
    ref = TP.conv(x, y[keep], w[keep], jequi.Graph.build(s[keep], r[keep], n), backend="xla")
    assert_close(out, ref, 1e-12, "padding node")
    assert np.abs(np.asarray(out)[n - 1]).max() == 0.0


def test_sorted_promise_under_jit_saves_the_sort_and_is_checked_on_the_host():
    x, y, w, s, r = _inputs()
    n = x.shape[0]

    @jax.jit
    def promised(x, y, w, s, r):
        g = jequi.Graph.build(s, r, n, edges_sorted=True)
        assert g.edges_sorted  # static, known at trace time
        return TP.conv(x, y, w, g, backend="xla"), g.receiver_order

    out, order = promised(x, y, w, s, r)
    np.testing.assert_array_equal(order, np.arange(len(s)))
    assert_close(out, TP.conv(x, y, w, s, r, backend="xla"), 1e-12, "promise")
    assert not jax.jit(lambda s, r: jnp.asarray(jequi.Graph.build(s, r, n).edges_sorted))(s, r)  # traced, no promise: unsorted
    with pytest.raises(ValueError, match="not in receiver order"):
        jequi.Graph.build(s, r[::-1], n, edges_sorted=True)
    assert not jequi.Graph.build(s, r, n, edges_sorted=False).edges_sorted


def test_radial_conv_takes_raw_indices_like_conv():
    x, y, _, s, r = _inputs()
    rng = np.random.default_rng(3)
    hidden, kernel = rng.normal(size=(len(s), 5)), rng.normal(size=(5, TP.weight_numel))
    ref = TP.radial_conv(x, y, hidden, kernel, jequi.Graph.build(s, r, x.shape[0]), backend="xla")
    assert_close(TP.radial_conv(x, y, hidden, kernel, s, r, backend="xla"), ref, 1e-12, "raw")
    assert_close(TP.radial_conv(x, y, hidden, kernel, s, r, x.shape[0], edge_chunks=3, backend="xla"), ref, 1e-12, "raw, chunks")
    with pytest.raises(TypeError, match="both senders and receivers"):
        TP.radial_conv(x, y, hidden, kernel, s)


@pytest.mark.parametrize("bad", [-1, 7, 1.5, "0"])
def test_bad_padding_node_is_a_clear_error(bad):
    _, _, _, s, r = _inputs()
    with pytest.raises(ValueError, match="padding_node must be a node index"):
        jequi.Graph.build(s, r, 7, padding_node=bad)
