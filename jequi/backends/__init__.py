"""Backend registry: each backend supplies forward/backward kernels for a descriptor.

A backend is a set of four functions taking the descriptor first:
``forward(desc, x, y, w)``, ``backward(desc, x, y, w, gz, needs)``,
``conv_forward(desc, x, y, w, graph[, kahan])`` and
``conv_backward(desc, x, y, w, gout, graph, needs[, kahan])`` (``graph`` a :class:`jequi.Graph`;
``kahan`` only where ``supports_kahan``). ``needs`` (three bools, default all True) says
which of ``(gx, gy, gw)`` a backward computes; it returns None for the others.
Inputs are flat: ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, weight_numel)`` or shared
``(weight_numel,)``, all of one floating dtype. Derivatives of every order are built from
these by :mod:`jequi.autodiff`; a backend may add a fused double backward (``second``,
``conv_second``) that computes the seven-op identity's sums in fewer kernel passes.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from . import cuda, pallas, xla
from .cuda import footprint as cuda_footprint


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    forward: Callable
    backward: Callable
    conv_forward: Callable
    conv_backward: Callable
    check: Callable = lambda desc: None  # raises ValueError for a descriptor it cannot run
    available: Callable[[], bool] = lambda: True
    supports_kahan: bool = False
    # Fused double backward (jequi.autodiff.trilinear_op's `second`), or None: composed from
    # forward/backward calls. ``second(desc, spec, arrays)``, ``conv_second(desc, spec,
    # arrays, graph[, kahan])``.
    second: Callable | None = None
    conv_second: Callable | None = None


BACKENDS: dict[str, Backend] = {
    "xla": Backend("xla", xla.forward, xla.backward, xla.conv_forward, xla.conv_backward),
    # On CPU the Pallas kernels run in interpret mode: available (for tests), never the default.
    "pallas": Backend(
        "pallas", pallas.forward, pallas.backward, pallas.conv_forward, pallas.conv_backward, pallas.check,
        supports_kahan=True, second=pallas.second, conv_second=pallas.conv_second,
    ),
    # GPU only (never the interpreter): CUDA kernels through the XLA FFI, channelwise products.
    "cuda": Backend(
        "cuda", cuda.forward, cuda.backward, cuda.conv_forward, cuda.conv_backward, cuda.check,
        available=cuda.available, second=cuda.second, conv_second=cuda.conv_second,
    ),
}


def available_backends() -> list[str]:
    """Names of the backends that run on this machine."""
    return [name for name, b in BACKENDS.items() if b.available()]


def resolve(name: str | None, desc, shared_weights: bool = False, conv: bool = False) -> Backend:
    """The backend called `name` for descriptor `desc`, or the default one for it (for weights
    shared by every row, `shared_weights`, and for the fused convolution, `conv`)."""
    if name is None:
        name = default_backend(desc, shared_weights, conv)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if not backend.available():
        raise ValueError(f"backend {name!r} is not available on this machine ({jax.default_backend()})")
    backend.check(desc)
    return backend


# The CUDA conv kernels are the default for a channelwise conv whose channel groups are all at
# least CUDA_CONV_MIN_CHANNELS wide and whose backward lane holds at most CUDA_CONV_FOOTPRINT
# values per edge (ffi.schedule.backward_footprint). Measured (H200): MACE-large (128 channels,
# 86 values) on the carbon lattice and the water box beats the Pallas kernels in fwd and
# fwd+bwd in both dtypes (benchmarks/results/2026-11-23-h200-conv-cuda-*.md); NequIP-benzene
# (64 channels, 134 values) wins its forward but its backward ran 2-3x slower (registers
# spill); jequi.models' product (64/32/16 channels, a 512-node batch) ran inference 2x and the
# training step 2.8x slower (2026-11-23-nvidia-h200-model-cuda.md).
CUDA_CONV_MIN_CHANNELS = 128
CUDA_CONV_FOOTPRINT = 100


def default_backend(desc=None, shared_weights: bool = False, conv: bool = False) -> str:
    """The fastest correct backend for `desc` on the default JAX platform (with weights
    shared by every row if `shared_weights`; for the fused convolution if `conv`); without a
    descriptor, the platform's default for the products the Pallas kernels run.

    Measured (benchmarks/results/2026-11-21-h200-tp.md): on GPU the Pallas kernels beat
    ``xla`` on every problem measured with per-row weights (channelwise and ``uvw``), so they
    are the default for every descriptor whose modes they run; on CPU always ``xla`` (Pallas
    runs interpreted). With shared weights, a product whose ``uvw``/``uuw`` paths contract
    over several ``x`` channels goes to ``xla``: the kernels read each path's whole
    ``(u, w)`` weight block for every row, where XLA contracts the weights as matrix products
    (:func:`contracts_shared_weights`; benchmarks/results/2026-11-22-h200-shared-weights-float32.md).
    The convolution of a wide channelwise product goes to the CUDA kernels where they were
    measured to pay (:data:`CUDA_CONV_MIN_CHANNELS`, :data:`CUDA_CONV_FOOTPRINT`); its batched
    product stays on Pallas, whose forward and double backward measured faster (MACE-large,
    50,000 rows, float32: fwd 0.666 vs 0.793 ms in ``ir_mul``, dbl 0.922 vs 1.231 ms;
    2026-11-23-h200-tp-cuda-tp-f32.md).
    """
    if jax.default_backend() != "gpu":
        return "xla"
    if desc is None:
        return "pallas"
    if conv and _cuda_conv_pays(desc):
        return "cuda"
    try:
        BACKENDS["pallas"].check(desc)
    except ValueError:
        return "xla"
    return "xla" if shared_weights and contracts_shared_weights(desc) else "pallas"


def _cuda_conv_pays(desc) -> bool:
    cuda = BACKENDS["cuda"]
    if not cuda.available() or min((p.mul_in1 for p in desc.active_paths), default=0) < CUDA_CONV_MIN_CHANNELS:
        return False
    try:
        cuda.check(desc)
    except ValueError:
        return False
    return cuda_footprint(desc) <= CUDA_CONV_FOOTPRINT


def contracts_shared_weights(desc) -> bool:
    """Whether a ``uvw``/``uuw`` path of `desc` sums over more than one ``x`` channel (a
    weight matrix per path rather than a vector over the output channels)."""
    return any(p.mode in ("uvw", "uuw") and p.mul_in1 > 1 for p in desc.active_paths)
