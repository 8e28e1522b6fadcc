"""The ``"pallas"`` backend: generated Pallas kernels (see ``pallas_kernels/``).

The tensor product runs in the Pallas kernels; until the fused convolution kernel lands,
``conv`` composes them with a gather of sender rows and XLA's ``segment_sum``.
"""

from __future__ import annotations

import jax

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


def backward(desc, x, y, w, gz):
    return pallas_kernels.backward(desc, x, y, w, gz)


def conv_forward(desc, x, y, w, senders, receivers, num_nodes: int):
    z = pallas_kernels.forward(desc, x[senders], y, w)
    return jax.ops.segment_sum(z, receivers, num_segments=num_nodes)


def conv_backward(desc, x, y, w, gout, senders, receivers, num_nodes: int):
    gz = gout.at[receivers].get(mode="fill", fill_value=0)
    gxe, gy, gw = pallas_kernels.backward(desc, x[senders], y, w, gz)
    return jax.ops.segment_sum(gxe, senders, num_segments=x.shape[0]), gy, gw
