"""tp.conv against gather + e3nn-jax tensor product + segment_sum."""

import jax
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp

import jequi


def reference(tp, x, y, w, s, r, n):
    valid = (s >= 0) & (s < x.shape[0]) & (r >= 0) & (r < n)
    s, r, y = s[valid], r[valid], y[valid]
    w = w if w.ndim == 1 else w[valid]
    if len(s) == 0:
        return np.zeros((n, tp.irreps_out.dim))
    return np.asarray(jax.ops.segment_sum(e3nn_tp(tp, x[s], y, w), r, num_segments=n))


def graph(rng, tp, n, e, shared=False):
    x = rng.normal(size=(n, tp.irreps_in1.dim))
    y = rng.normal(size=(e, tp.irreps_in2.dim))
    w = rng.normal(size=(tp.weight_numel,) if shared else (e, tp.weight_numel))
    return x, y, w, rng.integers(0, n, e), rng.integers(0, n, e)


@pytest.fixture(scope="module")
def tp():
    return jequi.problems.get("nequip-water")


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("order", ["unsorted", "sorted"])
def test_conv_matches_reference(tp, order, shared):
    rng = np.random.default_rng(0)
    x, y, w, s, r = graph(rng, tp, 7, 30, shared)
    if order == "sorted":
        perm = np.argsort(r, kind="stable")
        s, r, y = s[perm], r[perm], y[perm]
        w = w if shared else w[perm]
    assert_close(jax.jit(tp.conv, static_argnums=5)(x, y, w, s, r, 7), reference(tp, x, y, w, s, r, 7), 1e-12)


def test_isolated_nodes_hub_and_empty_graph(tp):
    rng = np.random.default_rng(1)
    x, y, w, s, _ = graph(rng, tp, 9, 40)
    r = np.full(40, 4)  # one hub receives every edge; every other node is isolated
    out = tp.conv(x, y, w, s, r, 9)
    assert_close(out, reference(tp, x, y, w, s, r, 9), 1e-12)
    assert np.all(np.asarray(out)[np.arange(9) != 4] == 0)
    empty = tp.conv(x, y[:0], w[:0], s[:0], r[:0], 9)
    assert empty.shape == (9, tp.irreps_out.dim) and not np.any(np.asarray(empty))


def test_out_of_range_indices_are_dropped(tp):
    rng = np.random.default_rng(2)
    x, y, w, s, r = graph(rng, tp, 6, 20)
    s[[0, 5]] = [-1, 6]
    r[[1, 7, 9]] = [6, -2, 1000]
    out = jax.jit(tp.conv, static_argnums=5)(x, y, w, s, r, 6)
    assert_close(out, reference(tp, x, y, w, s, r, 6), 1e-12)
    gx = jax.grad(lambda x: tp.conv(x, y, w, s, r, 6).sum())(x)
    assert np.all(np.isfinite(gx))


def test_bipartite_num_nodes(tp):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(5, tp.irreps_in1.dim))
    y = rng.normal(size=(12, tp.irreps_in2.dim))
    w = rng.normal(size=(12, tp.weight_numel))
    s, r = rng.integers(0, 5, 12), rng.integers(0, 3, 12)
    assert_close(tp.conv(x, y, w, s, r, 3), reference(tp, x, y, w, s, r, 3), 1e-12)
