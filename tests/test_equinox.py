"""Equinox layers (jequi.nn.equinox): values equal the linen layers' for the same weights,
e3nn-jax's weight initialisation, eqx.filter_jit and eqx.filter_grad."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close
from test_layers import TP, inputs  # the same product and graph as the other layers' tests

import jequi.nn.equinox as jeqx
import jequi.nn.linen as jlinen


def test_weights_initialised_as_e3nn_and_the_other_layers():
    layer = jeqx.TensorProduct(TP, key=jax.random.key(3))
    assert layer.weights.shape == (TP.weight_numel,) and layer.weights.dtype == jnp.float32
    # the rule every jequi layer shares: standard normal times each path's weight_std
    expected = jax.random.normal(jax.random.key(3), (TP.weight_numel,), jnp.float32) * TP.weight_std
    assert_close(layer.weights, expected, 1e-7)
    conv = jeqx.Conv(TP, key=jax.random.key(3))
    assert_close(conv.weights, expected, 1e-7)


def test_tensor_product_layer_equals_linen_under_filter_jit_and_filter_grad():
    x, y, _, _ = inputs()
    y = y[:5]
    layer = jeqx.TensorProduct(TP, key=jax.random.key(0), backend="xla")
    linen = jlinen.TensorProduct(TP, backend="xla")
    params = {"params": {"weights": layer.weights}}
    ref = linen.apply(params, x, y)
    assert_close(layer(x, y), ref, 1e-6)
    assert_close(eqx.filter_jit(lambda m, x, y: m(x, y))(layer, x, y), ref, 1e-6)

    def loss(m, x, y):
        return jnp.sum(m(x, y) ** 2)

    grads = eqx.filter_grad(loss)(layer, x, y)
    ref_gw = jax.grad(lambda p: jnp.sum(linen.apply(p, x, y) ** 2))(params)["params"]["weights"]
    assert grads.weights.shape == (TP.weight_numel,) and np.any(np.asarray(grads.weights) != 0)
    assert_close(grads.weights, ref_gw, 1e-6)
    grads_jit = eqx.filter_jit(eqx.filter_grad(loss))(layer, x, y)
    assert_close(grads_jit.weights, ref_gw, 1e-6)


def test_conv_layer_equals_linen_with_internal_and_external_weights():
    x, y, w, g = inputs()
    conv = jeqx.Conv(TP, key=jax.random.key(1), backend="xla")
    linen = jlinen.Conv(TP, backend="xla")
    params = {"params": {"weights": conv.weights}}
    assert_close(eqx.filter_jit(lambda m, x, y, g: m(x, y, g))(conv, x, y, g), linen.apply(params, x, y, g), 1e-6)
    # per-edge weights from the caller (a radial MLP's output) replace the internal ones
    assert_close(conv(x, y, g, weights=w), TP.conv(x, y, w, g, backend="xla"), 1e-12)
    gw = eqx.filter_grad(lambda m: jnp.sum(m(x, y, g) ** 2))(conv).weights
    ref_gw = jax.grad(lambda p: jnp.sum(linen.apply(p, x, y, g) ** 2))(params)["params"]["weights"]
    assert_close(gw, ref_gw, 1e-6)


def test_layers_without_internal_weights_need_weights():
    x, y, w, g = inputs()
    conv = jeqx.Conv(TP, key=None)
    assert conv.weights is None
    assert_close(conv(x, y, g, weights=w), TP.conv(x, y, w, g), 1e-12)
    with pytest.raises(TypeError, match="weights="):
        conv(x, y, g)
    with pytest.raises(TypeError, match="jequi.TensorProduct"):
        jeqx.TensorProduct("4x0e", key=jax.random.key(0))
