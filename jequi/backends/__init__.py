"""Backend registry: each backend supplies forward/backward kernels for a descriptor.

A backend is a set of four functions taking the descriptor first:
``forward(desc, x, y, w)``, ``backward(desc, x, y, w, gz, needs)``,
``conv_forward(desc, x, y, w, graph[, kahan])`` and
``conv_backward(desc, x, y, w, gz, graph, needs[, kahan])`` (``graph`` a :class:`jequi.Graph`;
``kahan`` only where ``supports_kahan``). ``needs`` (three bools, default all True) says which
of ``(gx, gy, gw)`` a backward computes; it returns None for the others.
Inputs are flat: ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, weight_numel)`` or shared
``(weight_numel,)``, all of one floating dtype. Derivatives of every order are built from
these by :mod:`jequi.autodiff`; a backend may add a fused double backward (``second``,
``conv_second``) that computes the seven-op identity's sums (a :class:`jequi.sums.Sums`) in
fewer kernel passes.

``"xla"`` is pure JAX (:mod:`.xla`). The kernel packages ``pallas_kernels`` and ``ffi`` share
one contract, and one adapter (:mod:`.kernels`) makes ``"pallas"`` and ``"cuda"`` of them with
their default knobs; ``"cuda-atomic"`` is the cuda backend whose conv backward adds ``gx`` with
atomics (``ffi.Config.atomic_conv_backward``: faster, not bitwise reproducible).

Benchmarks and tests build other backends from these (:func:`configured`: a kernel
package's knobs other than its defaults; :func:`mixed`: one backend's forward kernels with
another's backward ones, for A/B runs) and :func:`register` them to call them by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import MutableMapping
from types import ModuleType
from typing import Callable

import jax
import numpy as np

from ..dtypes import STORED
from . import kernels, xla


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
    # Fused sums of a jequi.sums.Sums (the double backward, a forward-mode tangent), or None:
    # composed from forward/backward calls (jequi.autodiff.composed_second).
    # ``second(desc, sums, arrays)``, ``conv_second(desc, sums, arrays, graph[, kahan])``.
    second: Callable | None = None
    conv_second: Callable | None = None
    # The kernel package (pallas_kernels or ffi) and its knobs the functions run, or None
    # (xla, a mixed backend): what configured() builds another config of.
    package: ModuleType | None = None
    config: object = None
    # The dtypes its kernels store operands in (each computes in jequi.dtypes.compute_dtype of it).
    dtypes: tuple = STORED

    def check_dtype(self, dtype):
        """Raises ValueError, before any kernel runs, for operands stored in a dtype it does not take."""
        if np.dtype(dtype) not in self.dtypes:
            takes = " and ".join(str(d) for d in self.dtypes)
            raise ValueError(f"backend {self.name!r} takes {takes} operands, not {np.dtype(dtype)}")


def _kernel_backend(name: str, package, config, supports_kahan: bool = False) -> Backend:
    return Backend(
        name, **kernels.functions(package, config), supports_kahan=supports_kahan, package=package, config=config, dtypes=package.DTYPES
    )


class _Registry(MutableMapping):
    """The backends by name. The kernel packages' backends join it on its first use, not when
    jequi is imported: the kernel packages import jequi's core, so ``import ffi``,
    ``import pallas_kernels`` and ``import jequi`` work in any order and none imports the
    others' kernels it does not use."""

    def __init__(self, **backends: Backend):
        self._backends = dict(backends)
        self._loaded = False

    def _all(self) -> dict[str, Backend]:
        if not self._loaded:
            self._loaded = True
            from ffi import ops as ffi_ops
            from pallas_kernels import ops as pallas_ops

            kernel_backends = {
                # On CPU the Pallas kernels run in interpret mode: available (for tests), never the default.
                "pallas": _kernel_backend("pallas", pallas_ops, pallas_ops.DEFAULT, supports_kahan=True),
                # GPU only (never the interpreter): CUDA kernels through the XLA FFI, channelwise products.
                "cuda": _kernel_backend("cuda", ffi_ops, ffi_ops.DEFAULT),
                # opt-in, since its conv's gx is not bitwise reproducible
                "cuda-atomic": _kernel_backend("cuda-atomic", ffi_ops, ffi_ops.Config(atomic_conv_backward=True)),
            }
            self._backends = {**self._backends, **{k: v for k, v in kernel_backends.items() if k not in self._backends}}
        return self._backends

    def __getitem__(self, name: str) -> Backend:
        return self._all()[name]

    def __setitem__(self, name: str, backend: Backend):
        self._all()[name] = backend

    def __delitem__(self, name: str):
        del self._all()[name]

    def __iter__(self):
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


BACKENDS: MutableMapping[str, Backend] = _Registry(
    xla=Backend("xla", xla.forward, xla.backward, xla.conv_forward, xla.conv_backward, second=xla.second, conv_second=xla.conv_second)
)


def configured(name: str, config) -> Backend:
    """Backend `name` (``"pallas"`` or ``"cuda"``) with its kernels built from `config` (a
    :class:`pallas_kernels.Config` or an :class:`ffi.Config`), named ``name[config]``: what a
    tuning sweep times (:func:`register` it to call it by name). ``"cuda-atomic"`` is itself
    configured: ``configured("cuda", ffi.Config(atomic_conv_backward=True, ...))``."""
    base = BACKENDS[name]
    if base.package is None:
        raise ValueError(f"the {name} backend has no kernel config")
    if base.config != base.package.DEFAULT:
        raise ValueError(f"backend {name!r} runs {base.config!r} already: configure the default backend of its kernels")
    return _kernel_backend(f"{name}[{config!r}]", base.package, config, base.supports_kahan)


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
        second=second.second, conv_second=second.conv_second, dtypes=tuple(d for d in first.dtypes if d in second.dtypes),
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


def resolve(name: str | None, desc, shared_weights: bool = False, conv: bool = False, dtype=None) -> Backend:
    """The backend called `name` for descriptor `desc`, or the default one for it (for weights
    shared by every row, `shared_weights`, for the fused convolution, `conv`, and for operands
    stored in `dtype`)."""
    if name is None:
        name = default_backend(desc, shared_weights, conv, dtype)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if not backend.available():
        raise ValueError(f"backend {name!r} is not available on this machine ({jax.default_backend()})")
    backend.check(desc)
    if dtype is not None:
        backend.check_dtype(dtype)
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


def default_backend(desc=None, shared_weights: bool = False, conv: bool = False, dtype=None) -> str:
    """The fastest correct backend for `desc` on the default JAX platform (with weights
    shared by every row if `shared_weights`; for the fused convolution if `conv`; for operands
    stored in `dtype`, None: float32 or float64); without a descriptor, the platform's default
    for the products the Pallas kernels run. Every backend stores half precision (widened to
    float32 as it loads), so `dtype` changes the choice only for a dtype a backend refuses.

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
    from ffi import schedule  # the cuda backend's footprint (the registry loads ffi on first use)

    runs = _cuda_runs(desc) and (dtype is None or np.dtype(dtype) in BACKENDS["cuda"].dtypes)
    if conv and runs and schedule.backward_footprint(desc) <= CUDA_FOOTPRINT and min(p.mul_in1 for p in desc.active_paths) >= CUDA_CONV_MIN_CHANNELS:
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
