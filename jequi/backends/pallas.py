"""The ``"pallas"`` backend: generated Pallas kernels (see ``pallas_kernels/``).

The tensor product and the fused, deterministic convolution (with optional Kahan summation
of the on-chip sums) run in the generated Pallas kernels.
"""

from __future__ import annotations

import pallas_kernels

from ..descriptor import TensorProductDescriptor


def check(desc: TensorProductDescriptor):
    bad = pallas_kernels.unsupported_modes(desc)
    if bad:
        raise ValueError(
            f"the pallas backend does not run mode(s) {sorted(bad)} yet "
            f"(it runs {', '.join(pallas_kernels.SUPPORTED_MODES)}); use backend='xla'"
        )


def forward(desc, x, y, w):
    return pallas_kernels.forward(desc, x, y, w)


def backward(desc, x, y, w, gz, needs=pallas_kernels.ALL):
    return pallas_kernels.backward(desc, x, y, w, gz, needs)


def conv_forward(desc, x, y, w, graph, kahan: bool = False):
    return pallas_kernels.conv_forward(
        desc, x, y, w, graph.receiver_senders, graph.receiver_order, graph.receiver_offsets,
        num_nodes=graph.num_nodes, edges_sorted=graph.edges_sorted, kahan=kahan,
    )  # fmt: skip


def conv_backward(desc, x, y, w, gout, graph, needs=pallas_kernels.ALL, kahan: bool = False):
    return pallas_kernels.conv_backward(
        desc, x, y, w, gout, graph.sender_receivers, graph.sender_order, graph.sender_offsets, needs=needs, kahan=kahan
    )
