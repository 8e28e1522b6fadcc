"""The floating dtypes jequi's kernels store and the dtype they compute in: one rule for every
backend.

Half precision is storage only: ``bfloat16`` and ``float16`` operands are read, widened to
float32, multiplied and summed in float32 (on chip, and across a kernel's partial sums), and
rounded once when a result is stored in the operands' dtype. float32 and float64 compute in
their own dtype. cuEquivariance-JAX's half-precision kernels keep float32 math the same way
(its ``math_dtype``); accuracy per model policy: docs/precision.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

HALF = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
STORED = (*HALF, np.dtype(np.float32), np.dtype(np.float64))


def compute_dtype(dtype) -> np.dtype:
    """The dtype kernels compute in for operands stored in `dtype`: float32 for half
    precision, else `dtype` itself."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in HALF else dtype


MATH = (np.dtype(np.float32), np.dtype(np.float64))


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one call stores, computes and returns (from :func:`plan`): the kernels read operands
    stored in ``stored`` and compute in ``math`` (``compute_dtype(stored)``); the result is cast
    once to ``out``."""

    stored: np.dtype
    math: np.dtype
    out: np.dtype

    def inputs(self, *arrays):
        """`arrays` in the stored dtype (exact where it is wider; the rounding asked for where
        it is narrower, e.g. float64 data under ``math_dtype=float32``)."""
        return tuple(a.astype(self.stored) for a in arrays)

    def output(self, z):
        return z.astype(self.out)


def _floating(dtype, name: str) -> np.dtype:
    try:
        dtype = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"{name} must be a floating dtype, got {dtype!r}") from exc
    if dtype not in STORED:
        raise TypeError(f"{name} must be one of {', '.join(d.name for d in STORED)}, got {dtype.name}")
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise ValueError(f"{name}=float64 needs jax_enable_x64 (jax would make float32 arrays)")
    return dtype


def plan(dtype, out_dtype=None, math_dtype=None) -> Plan:
    """The :class:`Plan` of a call on operands of `dtype` with the ``out_dtype=`` and
    ``math_dtype=`` arguments of jequi's ops (None: the result in `dtype`, math in
    ``compute_dtype(dtype)``).

    Math is float32 or float64 only: a half-precision product or sum would lose the accuracy
    that half-precision storage keeps (a lower ``math_dtype`` raises). When the call asks for
    nothing but this module's rule, the kernels read `dtype` itself (half precision's bytes
    saved); otherwise the operands are converted once to ``math_dtype`` and the kernels run in
    it: for half-precision operands that widening is exact, so the result is the same math
    with one rounding, into ``out_dtype``, at the cost of the widened copy
    (docs/precision.md#out_dtype-and-math_dtype)."""
    dtype = np.dtype(dtype)
    out = dtype if out_dtype is None else _floating(out_dtype, "out_dtype")
    if math_dtype is None:
        math = compute_dtype(dtype)
    else:
        math = _floating(math_dtype, "math_dtype")
        if math not in MATH:
            raise ValueError(f"math_dtype must be float32 or float64, got {math.name}: half-precision math is not offered "
                             "(store in half precision and compute in float32: the default)")  # fmt: skip
    if out == dtype and math == compute_dtype(dtype):
        return Plan(dtype, math, out)
    return Plan(math, math, out)
