"""How jequi launches a Pallas kernel: the one place that picks the Pallas lowering, below both
kernel packages (``pallas_kernels`` and the row-part fix-up :mod:`jequi.row_fixup`, which the
``cuda`` backend shares).

GPU: Pallas' Triton lowering. The kernels need in-kernel gathers and scatters with vectors of
static indices (every irrep block is read and written channel-wise at a stride) and, for the
fused convolution, indexed atomics; Mosaic GPU (JAX's default GPU lowering since 0.9.0) has
neither (the project's shared BASELINES.md, outside this repository). The Triton lowering is
deprecated since JAX 0.11.0 (the Pallas changelog) but works in 0.11-0.12; its deprecation
warning is filtered here, deliberately and by its exact message (it is raised when a jitted
caller lowers, so it cannot be caught around our call alone). To move the kernels to Mosaic
GPU, replace :func:`pallas_call` and ``pallas_kernels.lowering.fma`` (Triton's inline assembly).

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


def pallas_call(kernel, out_shape, grid, num_warps: int = 4, name: str | None = None, aliases=None):
    """``pl.pallas_call`` with whole-array refs, on Triton (GPU) or the interpreter (CPU);
    `aliases`: ``{input index: output index}`` updated in place."""
    common = dict(out_shape=out_shape, grid=grid, name=name, input_output_aliases=aliases or {})
    if on_gpu():
        return pl.pallas_call(
            kernel, compiler_params=pl_triton.CompilerParams(num_warps=num_warps, num_stages=1), **common
        )
    return pl.pallas_call(kernel, interpret=True, **common)
