"""Backend registry: each backend supplies forward/backward kernels for a descriptor.

A backend is a set of four functions taking the descriptor first:
``forward(desc, x, y, w)``, ``backward(desc, x, y, w, gz)``,
``conv_forward(desc, x, y, w, senders, receivers, num_nodes)`` and
``conv_backward(desc, x, y, w, gout, senders, receivers, num_nodes)``.
Inputs are flat: ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, weight_numel)`` or shared
``(weight_numel,)``, all of one floating dtype. Derivatives of every order are built from
these by :mod:`jequi.autodiff`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from . import xla


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    forward: Callable
    backward: Callable
    conv_forward: Callable
    conv_backward: Callable
    available: Callable[[], bool] = lambda: True


BACKENDS: dict[str, Backend] = {
    "xla": Backend("xla", xla.forward, xla.backward, xla.conv_forward, xla.conv_backward),
}


def available_backends() -> list[str]:
    """Names of the backends that run on this machine."""
    return [name for name, b in BACKENDS.items() if b.available()]


def resolve(name: str | None) -> Backend:
    """The backend called `name`, or the default one for the default JAX platform."""
    if name is None:
        name = default_backend()
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known backends: {', '.join(BACKENDS)}")
    backend = BACKENDS[name]
    if not backend.available():
        raise ValueError(f"backend {name!r} is not available on this machine ({jax.default_backend()})")
    return backend


def default_backend() -> str:
    """The fastest correct backend for the default JAX platform."""
    return "xla"
