"""What the framework modules share: the product they wrap and its weight initialiser."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..products import TensorProduct


def check_tp(tp) -> TensorProduct:
    if not isinstance(tp, TensorProduct):
        raise TypeError(f"tp must be a jequi.TensorProduct, got {type(tp).__name__}")
    return tp


def init_weights(tp: TensorProduct, key, dtype=jnp.float32):
    """e3nn-jax's initialisation: standard normal scaled by each path's ``weight_std``."""
    std = jnp.asarray(tp.weight_std, dtype)
    return jax.random.normal(key, (tp.weight_numel,), dtype) * std

