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

from . import pallas, xla


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
}


def available_backends() -> list[str]:
    """Names of the backends that run on this machine."""
    return [name for name, b in BACKENDS.items() if b.available()]


def resolve(name: str | None, desc) -> Backend:
    """The backend called `name` for descriptor `desc`, or the default one."""
    if name is None:
        name = default_backend(desc)
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if not backend.available():
        raise ValueError(f"backend {name!r} is not available on this machine ({jax.default_backend()})")
    backend.check(desc)
    return backend


def default_backend(desc=None) -> str:
    """The fastest correct backend for `desc` on the default JAX platform.

    Measured (benchmarks/results/2026-11-21-h200-tp.md): on GPU the Pallas kernels beat
    ``xla`` on every problem measured (channelwise and ``uvw``), so they are the default for
    every descriptor whose modes they run; on CPU always ``xla`` (Pallas runs interpreted).
    """
    if jax.default_backend() == "gpu" and desc is not None:
        try:
            BACKENDS["pallas"].check(desc)
            return "pallas"
        except ValueError:
            pass
    return "xla"
