"""What the framework modules share: the product they wrap and its weight initialiser, and the
SO(2) convolution's call."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..products import TensorProduct
from ..so2_conv import SO2Layout, so2_conv, so2_layout


def check_tp(tp) -> TensorProduct:
    if not isinstance(tp, TensorProduct):
        raise TypeError(f"tp must be a jequi.TensorProduct, got {type(tp).__name__}")
    return tp


def init_weights(tp: TensorProduct, key, dtype=jnp.float32):
    """e3nn-jax's initialisation: standard normal scaled by each path's ``weight_std``."""
    std = jnp.asarray(tp.weight_std, dtype)
    return jax.random.normal(key, (tp.weight_numel,), dtype) * std



def so2_call(layout: SO2Layout, x, vectors, weights):
    """``jequi.so2_conv`` of a layer with this layout (a plain `x` has ``layout.irreps_in``)."""
    return so2_conv(x, vectors, weights, layout.irreps_out, m_max=layout.m_max, irreps_in=layout.irreps_in)
