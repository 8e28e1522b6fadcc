"""The ``"pallas"`` backend: generated Pallas kernels (see ``pallas_kernels/``).

The tensor product and the fused, deterministic convolution (with optional Kahan summation
of the on-chip sums) run in the generated Pallas kernels.
"""

from __future__ import annotations

import pallas_kernels

from ..descriptor import TensorProductDescriptor, convert_layout


def check(desc: TensorProductDescriptor):
    bad = pallas_kernels.unsupported_modes(desc)
    if bad:
        raise ValueError(
            f"the pallas backend does not run mode(s) {sorted(bad)} yet "
            f"(it runs {', '.join(pallas_kernels.SUPPORTED_MODES)}); use backend='xla'"
        )


def forward(desc, x, y, w):
    return pallas_kernels.forward(desc, x, y, w)


def backward(desc, x, y, w, gz):
    return pallas_kernels.backward(desc, x, y, w, gz)


# The conv kernels read node rows (x, the output cotangent) once per edge: in ``ir_mul``
# every (segment, component) vector of channels is contiguous (coalesced loads), while in
# ``mul_ir`` it is strided by the irrep dimension. Converting per-node arrays costs a pass
# over nodes, not edges.
CONV_LAYOUT = "ir_mul"


def conv_forward(desc, x, y, w, graph, kahan: bool = False):
    k = desc.with_layout(CONV_LAYOUT)
    out = pallas_kernels.conv_forward(
        k, convert_layout(x, desc.in1, k.layout), convert_layout(y, desc.in2, k.layout), w,
        graph.receiver_senders, graph.receiver_order, graph.receiver_offsets,
        num_nodes=graph.num_nodes, edges_sorted=graph.edges_sorted, kahan=kahan,
    )  # fmt: skip
    return convert_layout(out, k.out, desc.layout)


def conv_backward(desc, x, y, w, gout, graph, kahan: bool = False):
    k = desc.with_layout(CONV_LAYOUT)
    gx, gy, gw = pallas_kernels.conv_backward(
        k, convert_layout(x, desc.in1, k.layout), convert_layout(y, desc.in2, k.layout), w,
        convert_layout(gout, desc.out, k.layout), graph.sender_receivers, graph.sender_order, graph.sender_offsets,
        kahan=kahan,
    )  # fmt: skip
    return convert_layout(gx, k.in1, desc.layout), convert_layout(gy, k.in2, desc.layout), gw
