"""The floating dtypes jequi's kernels store and the dtype they compute in: one rule for every
backend.

Half precision is storage only: ``bfloat16`` and ``float16`` operands are read, widened to
float32, multiplied and summed in float32 (on chip, and across a kernel's partial sums), and
rounded once when a result is stored in the operands' dtype. float32 and float64 compute in
their own dtype. cuEquivariance-JAX's half-precision kernels keep float32 math the same way
(its ``math_dtype``); accuracy per model policy: docs/precision.md.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
STORED = (*HALF, np.dtype(np.float32), np.dtype(np.float64))


def compute_dtype(dtype) -> np.dtype:
    """The dtype kernels compute in for operands stored in `dtype`: float32 for half
    precision, else `dtype` itself."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in HALF else dtype

