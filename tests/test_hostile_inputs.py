"""Hostile graph inputs, the ones a GPU sanitizer run is to use (benchmarks' sanitize run is
still to come), checked for values on every backend here: indices -1, -2^31, N and 2^31 - 1
contribute nothing; a 2,000-edge hub; an empty graph; zero nodes; zero rows."""

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp

import jequi

TP = jequi.channelwise("4x0e+4x1o", "0e+1o", "0e+1o")
BACKENDS = ["xla", "pallas"] + (["cuda", "cuda-atomic"] if "cuda" in jequi.available_backends() else [])
BAD = np.array([-1, -(2**31), 7, 2**31 - 1], np.int64)


def _oracle(x, y, w, s, r, n):
    """e3nn-jax's product of the kept edges (both ends in range), summed into the receivers."""
    keep = (s >= 0) & (s < x.shape[0]) & (r >= 0) & (r < n)
    return jax.ops.segment_sum(e3nn_tp(TP, x[s[keep]], y[keep], w[keep]), r[keep], num_segments=n)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_indices_and_a_hub(backend):
    rng = np.random.default_rng(0)
    n, e = 7, 2000
    x = rng.normal(size=(n, TP.irreps_in1.dim))
    y, w = rng.normal(size=(e, TP.irreps_in2.dim)), rng.normal(size=(e, TP.weight_numel))
    s = rng.integers(0, n, e)
    r = np.full(e, 3)  # a hub: every edge into node 3 ...
    r[::5] = rng.integers(0, n, len(r[::5]))
    s[:8], r[8:16] = np.resize(BAD, 8), np.resize(BAD, 8)  # ... but those with a bad end
    s32, r32 = (np.clip(a, -(2**31), 2**31 - 1).astype(np.int32) for a in (s, r))
    ref = np.asarray(_oracle(x, y, w, s32, r32, n))
    f = jax.jit(lambda x, y, w, s, r: TP.conv(x, y, w, s, r, n, backend=backend))
    out = f(x, y, w, jnp.asarray(s32), jnp.asarray(r32))
    assert_close(out, ref, 1e-11, "conv")
    g = np.random.default_rng(1).normal(size=ref.shape)
    gx = jax.jit(jax.grad(lambda x: jnp.vdot(TP.conv(x, y, w, s32, r32, n, backend=backend), g)))(x)
    ref_gx = jax.grad(lambda x: jnp.vdot(_oracle(x, y, w, s32, r32, n), g))(x)
    assert_close(gx, ref_gx, 1e-11, "gx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_graph_zero_nodes_and_zero_rows(backend):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, TP.irreps_in1.dim))
    y, w = rng.normal(size=(0, TP.irreps_in2.dim)), rng.normal(size=(0, TP.weight_numel))
    none = np.zeros(0, np.int32)
    out = TP.conv(x, y, w, none, none, 5, backend=backend)
    assert out.shape == (5, TP.irreps_out.dim) and not np.any(np.asarray(out))
    gx = jax.grad(lambda x: jnp.sum(TP.conv(x, y, w, none, none, 5, backend=backend) ** 2))(x)
    assert not np.any(np.asarray(gx))
    y1, w1 = rng.normal(size=(3, TP.irreps_in2.dim)), rng.normal(size=(3, TP.weight_numel))
    out = TP.conv(x, y1, w1, np.array([0, 1, 2], np.int32), np.array([0, 0, 0], np.int32), 0, backend=backend)  # zero nodes
    assert out.shape == (0, TP.irreps_out.dim)
    rows = TP(np.zeros((0, TP.irreps_in1.dim)), np.zeros((0, TP.irreps_in2.dim)), np.zeros((0, TP.weight_numel)), backend=backend)
    assert rows.shape == (0, TP.irreps_out.dim)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_zero_rows_of_the_other_operations(backend):
    """Zero rows give empty outputs (and empty gradients) in the symmetric contraction, the
    EAAS product, the species-indexed linear and attention: a ``reshape(0, -1)`` raised
    ZeroDivisionError in the first two (benchmarks/sanitize_kernels.py found it)."""
    sc = jequi.SymmetricContraction("4x0e+4x1o", "4x0e+4x1o", 2, 3)
    w = sc.init_weights(jax.random.key(0))
    x = jnp.zeros((0, sc.irreps_in.dim))
    assert sc(x, jnp.zeros(0, jnp.int32), w, backend=backend).shape == (0, sc.irreps_out.dim)
    gx = jax.grad(lambda x: jnp.sum(sc(x, jnp.zeros(0, jnp.int32), w, backend=backend)))(x)
    assert gx.shape == x.shape
    z = jequi.sh_tensor_product(e3nn.IrrepsArray("4x0e+4x1o", jnp.zeros((0, 16))), jnp.zeros((0, 3)), [0, 1, 2], backend=backend)
    assert z.shape == (0, z.irreps.dim) and z.irreps.dim > 0
    lin = jequi.IndexedLinear("4x0e+4x1o", "2x0e+2x1o", 3)
    assert lin(jnp.zeros((0, 16)), jnp.zeros(0, jnp.int32), lin.init_weights(jax.random.key(1))).shape == (0, 8)
    q = jnp.zeros((0, 2, 3))
    out = jequi.neighbor_attention(q, jnp.ones((4, 2, 3)), jnp.ones((4, 2, 5)), jnp.zeros((0, 3), jnp.int32), backend=backend)
    assert out.shape == (0, 2, 5)
