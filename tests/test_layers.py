"""Flax linen, Flax nnx and Haiku layers: values, jit, grad, vmap, parameter (de)serialisation."""

import flax.serialization
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp
from flax import nnx

import jequi
import jequi.nn.haiku as jhk
import jequi.nn.linen as jlinen
import jequi.nn.nnx as jnnx

TP = jequi.channelwise("4x0e+2x1o", "0e+1o", "0e+1o")


def inputs(n=5, e=9):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, TP.irreps_in1.dim))
    y = rng.normal(size=(e, TP.irreps_in2.dim))
    w = rng.normal(size=(e, TP.weight_numel))
    graph = jequi.Graph.build(rng.integers(0, n, e), rng.integers(0, n, e), n)
    return x, y, w, graph


def linen_fns():
    tpl, conv = jlinen.TensorProduct(TP), jlinen.Conv(TP)
    x, y, w, g = inputs()
    p_tp = tpl.init(jax.random.key(0), x, y[:5])
    p_conv = conv.init(jax.random.key(0), x, y, g)
    return (lambda x, y: tpl.apply(p_tp, x, y)), p_tp["params"]["weights"], (lambda x, y, g: conv.apply(p_conv, x, y, g)), p_conv["params"]["weights"]


def nnx_fns():
    tpl, conv = jnnx.TensorProduct(TP, rngs=nnx.Rngs(0)), jnnx.Conv(TP, rngs=nnx.Rngs(1))
    return tpl, tpl.weights[...], conv, conv.weights[...]


def haiku_fns():
    tpl = hk.without_apply_rng(hk.transform(lambda x, y: jhk.TensorProduct(TP)(x, y)))
    conv = hk.without_apply_rng(hk.transform(lambda x, y, g: jhk.Conv(TP)(x, y, g)))
    x, y, w, g = inputs()
    p_tp, p_conv = tpl.init(jax.random.key(0), x, y[:5]), conv.init(jax.random.key(0), x, y, g)
    return (lambda x, y: tpl.apply(p_tp, x, y)), p_tp["tensor_product"]["weights"], (lambda x, y, g: conv.apply(p_conv, x, y, g)), p_conv["conv"]["weights"]


FRAMEWORKS = {"linen": linen_fns, "nnx": nnx_fns, "haiku": haiku_fns}


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_internal_weights_layer_matches_op_under_transforms(framework):
    tp_layer, weights, _, _ = FRAMEWORKS[framework]()
    assert weights.shape == (TP.weight_numel,)
    x, y, _, _ = inputs()
    y = y[:5]
    assert_close(tp_layer(x, y), TP(x, y, weights), 1e-12)
    assert_close(jax.jit(tp_layer)(x, y), TP(x, y, weights), 1e-12)
    gx = jax.grad(lambda x: jnp.sum(tp_layer(x, y) ** 2))(x)
    assert_close(gx, jax.grad(lambda x: jnp.sum(TP(x, y, weights) ** 2))(x), 1e-12)
    batched = jax.vmap(tp_layer)(np.stack([x, 2 * x]), np.stack([y, y]))
    assert_close(batched[1], 2 * TP(x, y, weights), 1e-12)


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_conv_layer_internal_weights(framework):
    """The conv layer with its own (shared) weights against e3nn-jax: gather the senders, e3nn's
    product with those weights on every edge, sum into the receivers."""
    _, _, conv, weights = FRAMEWORKS[framework]()
    assert weights.shape == (TP.weight_numel,) and np.abs(np.asarray(weights)).max() > 0
    x, y, _, g = inputs()
    out = conv(x, y, g)
    z = e3nn_tp(TP, x[np.asarray(g.senders)], y, np.broadcast_to(np.asarray(weights), (y.shape[0], TP.weight_numel)))
    ref = jax.ops.segment_sum(z, np.asarray(g.receivers), num_segments=5)
    assert np.abs(np.asarray(ref)).max() > 0.1
    assert_close(out, ref, 1e-12, "conv layer vs e3nn-jax")
    assert_close(jax.jit(conv)(x, y, g), ref, 1e-12, "jit")


def test_external_weights_and_irreps_arrays():
    x, y, w, g = inputs()
    import e3nn_jax as e3nn

    xa = e3nn.IrrepsArray(TP.irreps_in1, x)
    for out in (
        jlinen.Conv(TP).apply({}, xa, y, g, w),
        jnnx.Conv(TP, internal_weights=False)(xa, y, g, w),
        hk.without_apply_rng(hk.transform(lambda *a: jhk.Conv(TP)(*a)))
        .apply({}, xa, y, g, w),
    ):
        assert isinstance(out, e3nn.IrrepsArray) and out.irreps == TP.irreps_out
        assert_close(out.array, TP.conv(x, y, w, g), 1e-12)
    with pytest.raises(TypeError, match="no internal weights"):
        jnnx.Conv(TP, internal_weights=False)(x, y, g)
    with pytest.raises(TypeError, match="jequi.TensorProduct"):
        jlinen.TensorProduct("0e").init(jax.random.key(0), x, y)


def test_parameter_serialisation_round_trip():
    x, y, _, _ = inputs()
    layer = jlinen.TensorProduct(TP)
    params = layer.init(jax.random.key(3), x, y[:5])
    restored = flax.serialization.from_bytes(layer.init(jax.random.key(4), x, y[:5]), flax.serialization.to_bytes(params))
    assert_close(layer.apply(restored, x, y[:5]), layer.apply(params, x, y[:5]), 0)
    model = jnnx.TensorProduct(TP, rngs=nnx.Rngs(5))
    graphdef, state = nnx.split(model)
    blob = flax.serialization.msgpack_serialize(nnx.to_pure_dict(state))
    _, fresh_state = nnx.split(jnnx.TensorProduct(TP, rngs=nnx.Rngs(6)))
    nnx.replace_by_pure_dict(fresh_state, flax.serialization.msgpack_restore(blob))
    again = nnx.merge(graphdef, fresh_state)
    assert_close(again(x, y[:5]), model(x, y[:5]), 0)

