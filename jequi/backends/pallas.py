"""The ``"pallas"`` backend: generated Pallas kernels (see ``pallas_kernels/``).

The tensor product and the fused, deterministic convolution (with optional Kahan summation
of the on-chip sums) run in the generated Pallas kernels. Each function takes the kernels'
knobs as ``config`` (:class:`pallas_kernels.Config`; :func:`jequi.backends.configured` binds
another than the default).
"""

from __future__ import annotations

import pallas_kernels

from ..autodiff import GZ, W
from ..descriptor import TensorProductDescriptor


def check(desc: TensorProductDescriptor):
    bad = pallas_kernels.unsupported_modes(desc)
    if bad:
        raise ValueError(
            f"the pallas backend does not run mode(s) {sorted(bad)} yet "
            f"(it runs {', '.join(pallas_kernels.SUPPORTED_MODES)}); use backend='xla'"
        )


def forward(desc, x, y, w, *, config=pallas_kernels.DEFAULT):
    return pallas_kernels.forward(desc, x, y, w, config)


def backward(desc, x, y, w, gz, needs=pallas_kernels.ALL, *, config=pallas_kernels.DEFAULT):
    return pallas_kernels.backward(desc, x, y, w, gz, needs, config)


def second(desc, spec, arrays, *, config=pallas_kernels.DEFAULT):
    """The fused double backward (:class:`jequi.autodiff.SecondOrder`): one backward-like
    kernel for ``dx, dy, dw`` over the spec's pairs that also sums ``dgz`` over its triples
    (:func:`pallas_kernels.second_sum`, where :func:`pallas_kernels.fuses_second`), else that
    kernel and a forward-like one for ``dgz``. One kernel per gradient instead was slower: each
    reads the rows again (benchmarks/results/2026-11-21-h200-ab.md;
    docs/tuning.md#backends-pallas-second)."""
    shared = arrays[W].ndim == 1
    if pallas_kernels.fuses_second(desc, arrays[GZ].dtype, spec.dgz, spec.pairs, config):
        return pallas_kernels.second_sum(
            desc, arrays[GZ], arrays, triples=spec.dgz, terms=spec.pairs, shared_weights=shared, config=config
        )
    return spec.evaluate(
        lambda triples: pallas_kernels.forward_sum(desc, arrays, terms=triples, config=config),
        lambda pairs: pallas_kernels.backward_sum(desc, arrays[GZ], arrays, terms=pairs, shared_weights=shared, config=config),
    )


def conv_forward(desc, x, y, w, graph, kahan: bool = False, *, config=pallas_kernels.DEFAULT):
    return pallas_kernels.conv_forward(
        desc, x, y, w, graph.receiver_senders, graph.receiver_order, graph.receiver_offsets,
        edges_sorted=graph.edges_sorted, kahan=kahan, config=config,
    )  # fmt: skip


def conv_backward(desc, x, y, w, gout, graph, needs=pallas_kernels.ALL, kahan: bool = False, *, config=pallas_kernels.DEFAULT):
    return pallas_kernels.conv_backward(
        desc, x, y, w, gout, graph.sender_receivers, graph.sender_order, graph.sender_offsets, needs=needs, kahan=kahan,
        config=config,
    )  # fmt: skip


def conv_second(desc, spec, arrays, graph, kahan: bool = False, *, config=pallas_kernels.DEFAULT):
    """:func:`second` of the conv: ``dgz`` walks receivers, ``dx, dy, dw`` senders."""
    return spec.evaluate(
        lambda triples: pallas_kernels.conv_forward_sum(
            desc, arrays, graph.receiver_senders, graph.receiver_order, graph.receiver_offsets, terms=triples,
            edges_sorted=graph.edges_sorted, kahan=kahan, config=config,
        ),
        lambda pairs: pallas_kernels.conv_backward_sum(
            desc, arrays[GZ], arrays, graph.sender_receivers, graph.sender_order, graph.sender_offsets, terms=pairs,
            shared_weights=arrays[W].ndim == 1, kahan=kahan, config=config,
        ),
    )  # fmt: skip
