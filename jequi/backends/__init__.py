"""Backend registry: each backend supplies forward/backward kernels for a descriptor.

A backend is a set of four functions taking the descriptor first:
``forward(desc, x, y, w)``, ``backward(desc, x, y, w, gz, needs)``,
``conv_forward(desc, x, y, w, graph[, kahan])`` and
``conv_backward(desc, x, y, w, gout, graph, needs[, kahan])`` (``graph`` a :class:`jequi.Graph`;
``kahan`` only where ``supports_kahan``). ``"cuda-atomic"`` is the cuda
backend with a conv backward that adds ``gx`` with atomics (faster, not bitwise
reproducible). ``needs`` (three bools, default all True) says which of ``(gx, gy, gw)`` a
backward computes; it returns None for the others.
Inputs are flat: ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, weight_numel)`` or shared
``(weight_numel,)``, all of one floating dtype. Derivatives of every order are built from
these by :mod:`jequi.autodiff`; a backend may add a fused double backward (``second``,
``conv_second``) that computes the seven-op identity's sums in fewer kernel passes.

Benchmarks and tests build other backends from these (:func:`configured`: a kernel
package's knobs other than its defaults; :func:`mixed`: one backend's forward kernels with
another's backward ones, for A/B runs) and :func:`register` them to call them by name.
"""

from __future__ import annotations

import dataclasses
import functools
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
    # Fused sums of a jequi.autodiff.SecondOrder (the double backward, a forward-mode tangent),
    # or None: composed from forward/backward calls (jequi.autodiff.composed_second). ``second(desc, spec, arrays)``, ``conv_second(desc, spec,
    # arrays, graph[, kahan])``.
    second: Callable | None = None
    conv_second: Callable | None = None


BACKENDS: dict[str, Backend] = {
    "xla": Backend(
        "xla", xla.forward, xla.backward, xla.conv_forward, xla.conv_backward, second=xla.second, conv_second=xla.conv_second
    ),
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


# The cuda backend with the conv's backward kernels walking receivers and adding gx with atomics
# (jequi.backends.cuda.conv_backward): opt-in, since its gx is not bitwise reproducible.
BACKENDS["cuda-atomic"] = dataclasses.replace(
    BACKENDS["cuda"], name="cuda-atomic",
    conv_backward=functools.partial(cuda.conv_backward, atomic=True),
    conv_second=functools.partial(cuda.conv_second, atomic=True),
)  # fmt: skip


_KERNEL_FUNCTIONS = ("forward", "backward", "conv_forward", "conv_backward", "second", "conv_second")


def configured(name: str, config) -> Backend:
    """Backend `name` (``"pallas"``, ``"cuda"`` or ``"cuda-atomic"``) with its kernels built
    from `config` (a :class:`pallas_kernels.Config` or an :class:`ffi.Config`), named
    ``name[config]``: what a tuning sweep times (:func:`register` it to call it by name)."""
    base = BACKENDS[name]
    if name == "xla":
        raise ValueError("the xla backend has no kernel config")
    bound = {f: functools.partial(getattr(base, f), config=config) for f in _KERNEL_FUNCTIONS}
    return dataclasses.replace(base, name=f"{name}[{config!r}]", **bound)


def mixed(forward: str, backward: str) -> Backend:
    """A backend named ``forward+backward`` whose forward kernels are backend `forward`'s and
    whose backward ones (and fused double backward) are backend `backward`'s: for A/B runs,
    never a default (:func:`register` it to call it by name)."""
    first, second = BACKENDS[forward], BACKENDS[backward]

    def check(desc):
        first.check(desc)
        second.check(desc)

    return Backend(
        f"{forward}+{backward}", first.forward, second.backward, first.conv_forward, second.conv_backward, check,
        available=lambda: first.available() and second.available(), supports_kahan=first.supports_kahan and second.supports_kahan,
        second=second.second, conv_second=second.conv_second,
    )  # fmt: skip


def register(backend: Backend) -> str:
    """Add `backend` to :data:`BACKENDS` under its name, so that ``backend=name`` calls it
    (a name already registered keeps its first backend: names say what they run); returns
    the name."""
    BACKENDS.setdefault(backend.name, backend)
    return backend.name


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


# The CUDA kernels run the conv of a channelwise product where a backward lane holds at most
# CUDA_FOOTPRINT values per edge (ffi.schedule.backward_footprint) and every path is at least a
# warp of channels wide (CUDA_CONV_MIN_CHANNELS: the kernels put channels on lanes). Decided by
# the model step, where NequIP at NequIP-OAM-L width ran faster on them than on Pallas
# (benchmarks/results/2026-11-27-model-step-notes.md); narrower products ran slower
# (2026-11-23-nvidia-h200-model-cuda.md), and NequIP-benzene's footprint keeps it on Pallas
# (2026-11-26-h200-conv-final-notes.md).
CUDA_CONV_MIN_CHANNELS = 32
CUDA_FOOTPRINT = 100


def default_backend(desc=None, shared_weights: bool = False, conv: bool = False) -> str:
    """The fastest correct backend for `desc` on the default JAX platform (with weights
    shared by every row if `shared_weights`; for the fused convolution if `conv`), in either
    dtype; without a descriptor, the platform's default for the products the Pallas kernels
    run.

    On GPU the Pallas kernels beat ``xla`` on every problem measured with per-row weights
    (channelwise and ``uvw``; benchmarks/results/2026-11-21-h200-tp.md), so they run every
    descriptor whose modes they run, but for the CUDA kernels' products below; on
    CPU always ``xla`` (Pallas runs interpreted). With shared weights, a product whose
    ``uvw``/``uuw`` paths contract over several ``x`` channels goes to ``xla``: the kernels
    read each path's whole ``(u, w)`` weight block for every row, where XLA contracts the
    weights as matrix products
    (:func:`contracts_shared_weights`; benchmarks/results/2026-11-22-h200-shared-weights-float32.md).
    The convolution of a wide channelwise product goes to the CUDA kernels where they were
    measured to pay (:data:`CUDA_CONV_MIN_CHANNELS`, :data:`CUDA_FOOTPRINT`). A batched
    channelwise product with per-row weights runs on the CUDA kernels (``"cuda"``): with two
    rows per block, and in ``mul_ir`` its rows moved through shared memory, their forward,
    backward and double backward beat Pallas' on every channelwise product measured, in both
    layouts and dtypes (benchmarks/results/2026-11-24-h200-batched-rows.md,
    2026-11-24-h200-tp-rows-f32.md, -tp-rows-f64.md, -tp-cuda-second-*.md). The products whose
    backward lanes hold more (134 values: NequIP-benzene, SevenNet's main layer) beat Pallas
    too, NequIP-benzene since its backward kernels run split to fit the instruction caches
    (``ffi.Config.batched_code_bytes``; 2026-11-26-h100-batched-code-budget.md,
    2026-11-25-h200-tp-benzene-backends.md; docs/tuning.md#backends-default_backend).
    """
    if jax.default_backend() != "gpu":
        return "xla"
    if desc is None:
        return "pallas"
    runs = _cuda_runs(desc)
    if conv and runs and cuda_footprint(desc) <= CUDA_FOOTPRINT and min(p.mul_in1 for p in desc.active_paths) >= CUDA_CONV_MIN_CHANNELS:
        return "cuda"
    try:
        BACKENDS["pallas"].check(desc)
    except ValueError:
        return "xla"
    if shared_weights:
        return "xla" if contracts_shared_weights(desc) else "pallas"
    return "cuda" if runs and not conv else "pallas"


def _cuda_runs(desc) -> bool:
    """Whether the CUDA kernels are available and run `desc`."""
    cuda = BACKENDS["cuda"]
    if not cuda.available() or not desc.active_paths:
        return False
    try:
        cuda.check(desc)
    except ValueError:
        return False
    return True


def contracts_shared_weights(desc) -> bool:
    """Whether a ``uvw``/``uuw`` path of `desc` sums over more than one ``x`` channel (a
    weight matrix per path rather than a vector over the output channels)."""
    return any(p.mode in ("uvw", "uuw") and p.mul_in1 > 1 for p in desc.active_paths)
