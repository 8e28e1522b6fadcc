"""Validation and sanitizing of graph index arrays for ``TensorProduct.conv``.

Out-of-range indices never write outside the output: an edge whose sender is not in
``[0, x.shape[0])`` or whose receiver is not in ``[0, num_nodes)`` contributes nothing
(and receives zero gradient). Range checks cannot raise under ``jit`` (values are not
known at trace time), so they are applied as this masking rule instead.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np


def check_num_nodes(num_nodes) -> int:
    if not isinstance(num_nodes, numbers.Integral) or isinstance(num_nodes, bool) or num_nodes < 0:
        raise ValueError(f"num_nodes must be a non-negative Python int (static), got {num_nodes!r}")
    return int(num_nodes)


def check_indices(senders, receivers, num_edges: int):
    """Check dtypes and shapes of `senders` and `receivers` (1-D integer arrays of length E)."""
    for name, idx in (("senders", senders), ("receivers", receivers)):
        dtype = np.dtype(idx.dtype if hasattr(idx, "dtype") else np.asarray(idx).dtype)
        if not np.issubdtype(dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {dtype}")
        shape = np.shape(idx)
        if len(shape) != 1:
            raise ValueError(f"{name} must be 1-D (one entry per edge), got shape {shape}")
        if shape[0] != num_edges:
            raise ValueError(f"{name} has {shape[0]} entries but y/w have {num_edges} edges")


def sanitize(senders, receivers, num_senders: int, num_nodes: int):
    """Map edges with out-of-range indices to (sender 0, receiver ``num_nodes``) = dropped."""
    senders = jnp.asarray(senders, jnp.int32)
    receivers = jnp.asarray(receivers, jnp.int32)
    valid = (senders >= 0) & (senders < num_senders) & (receivers >= 0) & (receivers < num_nodes)
    return jnp.where(valid, senders, 0), jnp.where(valid, receivers, num_nodes)
