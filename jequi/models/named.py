"""What the models whose parameters are one flat dict, keyed by a reference package's own names
(:mod:`~jequi.models.mace`: mace-torch's ``state_dict``; :mod:`~jequi.models.nequix`: the
Equinox module's paths), share: reading the dict, initialising it, replacing one entry."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def flat_parameters(params) -> dict:
    """The flat name -> array dict, from ``{"params": ...}`` (Flax's) or the dict itself."""
    if isinstance(params, dict) and "params" in params and isinstance(params["params"], dict):
        return params["params"]
    return params


def init_named(shapes: dict, init_one, key) -> dict:
    """``{"params": {name: init_one(name, shape, key)}}``, one key a parameter."""
    keys = jax.random.split(key, len(shapes))
    return {"params": {name: init_one(name, shape, k) for (name, shape), k in zip(shapes.items(), keys)}}


def with_parameter(params, name: str, value) -> dict:
    """`params` with entry `name` replaced by `value` (in the old entry's dtype)."""
    p = dict(flat_parameters(params))
    p[name] = jnp.asarray(value, p[name].dtype)
    return {"params": p}
