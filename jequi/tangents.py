"""Helpers shared by the rules of jequi's kernel primitives (:mod:`jequi.eaas_autodiff`,
:mod:`jequi.symmetric_autodiff`, :mod:`jequi.attention.autodiff`): JAX's symbolic zero tangents."""

import jax.numpy as jnp
from jax.interpreters import ad


def nonzero(t) -> bool:
    """Whether a tangent or cotangent is an array rather than JAX's symbolic zero."""
    return type(t) is not ad.Zero


def instantiate(t, like):
    """`t`, or zeros like `like` where `t` is a symbolic zero."""
    return t if nonzero(t) else jnp.zeros_like(like)
