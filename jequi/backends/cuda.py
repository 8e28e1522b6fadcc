"""The ``"cuda"`` backend: CUDA kernels generated per descriptor and run through the XLA FFI
(see ``ffi/``). It runs channelwise (``uvu``) products in float32 and float64, batched and as
the fused, deterministic convolution; derivatives of every order compose its forward and
backward kernels (:mod:`jequi.autodiff`). Available on a CUDA GPU with ``nvcc`` and a C++
compiler (the kernels are compiled at first use and cached on disk)."""

from __future__ import annotations

import ffi

from ..descriptor import TensorProductDescriptor

ALL = (True, True, True)


def available() -> bool:
    return ffi.available()


def check(desc: TensorProductDescriptor):
    reason = ffi.unsupported_reason(desc)
    if reason:
        raise ValueError(f"{reason}; use backend='pallas' or 'xla'")


def footprint(desc) -> int:
    """Values a backward lane holds per edge (what decides whether the kernels pay)."""
    return ffi.schedule.backward_footprint(desc)


def forward(desc, x, y, w):
    return ffi.forward(desc, x, y, w)


def backward(desc, x, y, w, gz, needs=ALL):
    return ffi.backward(desc, x, y, w, gz, needs)


def conv_forward(desc, x, y, w, graph):
    return ffi.conv_forward(desc, x, y, w, graph)


def conv_backward(desc, x, y, w, gout, graph, needs=ALL):
    return ffi.conv_backward(desc, x, y, w, gout, graph, needs)
