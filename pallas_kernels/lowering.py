"""What the Pallas kernels need of their lowering beyond :mod:`jequi.pallas_launch` (which picks
it: Triton on the GPU, the interpreter on the CPU): fused multiply-adds and masked loads and
stores.

Multiply-adds: the Triton kernels are compiled by XLA, whose NVPTX backend does not contract
``a * b + c`` into a fused multiply-add (no ``FFMA`` in the SASS of the conv kernels, only
``FMUL`` and ``FADD``). :func:`fma` emits ``fma.rn`` as inline PTX: contracted multiply-adds
made the conv faster (docs/tuning.md#lowering-fused-multiply-adds); the switch that turned
them off everywhere was removed (:func:`multiply_adds` keeps them apart per kernel, as
``Config.fused_forward`` says).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pl_triton

from jequi.pallas_launch import on_gpu, pallas_call  # noqa: F401 (the kernels' launcher, re-exported)


_fused = [True]  # the innermost multiply_adds() setting
_FMA_PTX = {jnp.dtype(jnp.float32): ("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f"),
            jnp.dtype(jnp.float64): ("fma.rn.f64 $0, $1, $2, $3;", "=d,d,d,d")}  # fmt: skip


@contextlib.contextmanager
def multiply_adds(fused: bool):
    """While a kernel is traced inside this context with ``fused=False``, :func:`fma` emits a
    separate multiply and add (for a kernel measured faster so)."""
    _fused.append(fused)
    try:
        yield
    finally:
        _fused.pop()


def fma(a, b, c):
    """``a * b + c`` inside a kernel, rounded once (a fused multiply-add) where the lowering
    has one: on the GPU, for float32 and float64 vectors (Triton's inline assembly takes no
    scalars). Elsewhere ``a * b + c``, which the interpreter's XLA may contract itself. `c` is
    an array, whose dtype the result has; `a` and `b` may be Python numbers or arrays that
    broadcast against it."""
    shape = np.broadcast_shapes(*(np.shape(v) for v in (a, b, c)))
    dtype = jnp.result_type(c)
    if not (_fused[-1] and on_gpu() and shape and dtype in _FMA_PTX):
        return a * b + c
    asm, constraints = _FMA_PTX[dtype]
    args = [jnp.broadcast_to(jnp.asarray(v, dtype), shape) for v in (a, b, c)]
    (out,) = pl_triton.elementwise_inline_asm(
        asm, args=args, constraints=constraints, pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)]
    )
    return out


def masked_load(ref, idx, mask):
    """``ref[idx]`` where `mask`, 0 elsewhere (`idx` is kept in bounds by the callers)."""
    return pl_triton.load(ref.at[idx], mask=mask, other=0)


def masked_store(ref, idx, value, mask):
    """``ref[idx] = value`` where `mask`, for a flat `ref`. Masked-off lanes get the index one
    past the end: they never touch memory on the GPU, and the interpreter, which writes every
    lane of a store, drops them instead of letting them collide with a stored lane."""
    idx, mask = jnp.broadcast_arrays(idx, mask)
    idx = jnp.where(mask, idx, ref.shape[0])
    pl_triton.store(ref.at[idx], jnp.broadcast_to(value, idx.shape).astype(ref.dtype), mask=mask)
