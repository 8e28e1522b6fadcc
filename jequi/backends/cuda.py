"""The ``"cuda"`` backend: CUDA kernels generated per descriptor and run through the XLA FFI
(see ``ffi/``). It runs channelwise (``uvu``) products in float32 and float64, batched and as
the fused, deterministic convolution. Its double backward is fused like the Pallas backend's
(:func:`second`); higher orders compose its kernels (:mod:`jequi.autodiff`). Available on a CUDA GPU with ``nvcc`` and a C++
compiler (the kernels are compiled at first use and cached on disk). Each kernel function
takes the kernels' knobs as ``config`` (:class:`ffi.Config`; :func:`jequi.backends.configured`
binds another than the default)."""

from __future__ import annotations

import ffi

from ..autodiff import GZ, W
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


def forward(desc, x, y, w, *, config=ffi.DEFAULT):
    return ffi.forward(desc, x, y, w, config)


def backward(desc, x, y, w, gz, needs=ALL, *, config=ffi.DEFAULT):
    return ffi.backward(desc, x, y, w, gz, needs, config)


def second(desc, spec, arrays, *, config=ffi.DEFAULT):
    """The fused double backward (:class:`jequi.autodiff.SecondOrder`): one backward-like
    kernel for ``dx, dy, dw`` over the spec's pairs that also sums ``dgz`` over its triples
    (:func:`ffi.second_sum`, where :func:`ffi.fuses_second`), else that kernel and a
    forward-like one for ``dgz``; instead of up to three forward and three backward calls,
    each reading its own copies of ``x, y, w, gz``."""
    if ffi.fuses_second(desc, arrays[GZ].dtype, spec.dgz, spec.pairs, arrays[W].ndim == 1, config):
        return ffi.second_sum(desc, arrays, spec.dgz, spec.pairs, config)
    return spec.evaluate(
        lambda triples: ffi.forward_sum(desc, arrays, triples, config), lambda pairs: ffi.backward_sum(desc, arrays, pairs, config)
    )


def conv_second(desc, spec, arrays, graph, atomic: bool = False, *, config=ffi.DEFAULT):
    """:func:`second` of the conv: ``dgz`` walks receivers, ``dx, dy, dw`` senders (receivers
    too where `atomic`, see :func:`conv_backward`)."""
    return spec.evaluate(
        lambda triples: ffi.conv_forward_sum(desc, arrays, graph, triples, config),
        lambda pairs: ffi.conv_backward_sum(desc, arrays, graph, pairs, atomic, config),
    )


def conv_forward(desc, x, y, w, graph, *, config=ffi.DEFAULT):
    return ffi.conv_forward(desc, x, y, w, graph, config)


def conv_backward(desc, x, y, w, gout, graph, needs=ALL, atomic: bool = False, *, config=ffi.DEFAULT):
    """The conv's backward: deterministic (each sender's ``gx`` summed on chip over its edges,
    every edge's cotangent row gathered), or with `atomic` from the forward's receiver walk
    (each receiver's cotangent row read once, ``gx`` added to the senders' rows with atomics:
    faster where the output is much wider than ``x``, but ``gx`` is not bitwise reproducible)."""
    return ffi.conv_backward(desc, x, y, w, gout, graph, needs, atomic, config)
