"""Where Pallas kernels run: the one place that picks the Pallas lowering.

GPU: Pallas' Triton lowering. The kernels need in-kernel gathers and scatters with vectors
of static indices (every irrep block is read and written channel-wise at a stride) and, for
the fused convolution, indexed atomics; Mosaic GPU (JAX's default GPU lowering since 0.11)
has neither (BASELINES.md). The Triton lowering is marked deprecated in JAX 0.11-0.12 but
works; its deprecation warning is filtered here, deliberately and by its exact message (it
is raised when a jitted caller lowers, so it cannot be caught around our call alone). To move to Mosaic GPU or to the CUDA FFI path, replace :func:`pallas_call` only.

CPU: ``interpret=True`` (the same kernels, slowly, for tests).
"""

from __future__ import annotations

import warnings

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def pallas_call(kernel, out_shape, grid, num_warps: int = 4, name: str | None = None):
    """``pl.pallas_call`` with whole-array refs, on Triton (GPU) or the interpreter (CPU)."""
    if on_gpu():
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1),
            name=name,
        )
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=True, name=name)
