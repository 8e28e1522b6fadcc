"""The Pallas kernels as JAX functions on flat arrays, with the kernel packages' one contract
(``ffi`` exposes the same functions): the four first-order ops and the sums of a
:class:`~jequi.sums.Sums` over ``arrays = (x, y, w, gz, ggx, ggy, ggw)`` (``gz`` at
``arrays[GZ]``, shared weights where ``arrays[W]`` is 1-D), batched and as the fused
convolution over a :class:`jequi.Graph`; :mod:`jequi.backends.kernels` makes a backend of
them. Each takes the kernels' :class:`~.config.Config` (``config``, default
:data:`~.config.DEFAULT`). A batched product runs on the kernels of :func:`kernels_for`
(:mod:`.row_blocks` for products of one-channel inputs, else :mod:`.per_row`), the conv on
:mod:`.conv`'s."""

from __future__ import annotations

from jequi.dtypes import STORED
from jequi.sums import ALL, FORWARD, GZ, Sums

from . import conv, heuristics, per_row, row_blocks
from .config import DEFAULT, Config
from .row_code import SUPPORTED_MODES, unsupported_modes


# The operands' dtypes the kernels take: half precision stored, computed in float32 (jequi.dtypes).
DTYPES = STORED


def available() -> bool:
    """Always: the kernels run compiled by Triton on a GPU and interpreted elsewhere (slowly:
    for tests; :func:`jequi.default_backend` never picks them there)."""
    return True


def unsupported_reason(desc) -> str | None:
    """Why the kernels cannot run `desc` (its trilinear view), or None."""
    bad = unsupported_modes(desc)
    if bad:
        return f"the pallas backend does not run mode(s) {sorted(bad)} yet (it runs {', '.join(SUPPORTED_MODES)})"
    return None


def kernels_for(desc):
    """The module whose ``forward_sum`` and ``backward_sum`` run the batched product of `desc`."""
    return row_blocks if row_blocks.applies(desc) else per_row


def forward_sum(desc, arrays, sums: Sums = FORWARD, config: Config = DEFAULT):
    """``z (N, out.dim) = sum of f(arrays[a], arrays[b], arrays[c])`` over the triples
    ``(a, b, c)`` of ``sums.out`` (the default: the product of ``(x, y, w)``): ``x``-like
    arrays ``(N, in1.dim)``, ``y``-like ``(N, in2.dim)``, ``w``-like ``(N, nw)`` or shared
    ``(nw,)`` (None where no term reads it)."""
    return kernels_for(desc).forward_sum(desc, arrays, sums=sums.of_kind(backward=False), config=config)


def backward_sum(desc, arrays, sums: Sums, config: Config = DEFAULT):
    """``(gx, gy, gw)``: each the sum of the backward against ``gz = arrays[GZ]`` over its
    pairs in ``sums.pairs``; None for a gradient without pairs. Shared weights get ``gw``
    summed over rows."""
    return kernels_for(desc).backward_sum(desc, arrays[GZ], arrays, sums=sums.of_kind(backward=True), config=config)


def fuses_second(desc, dtype, sums: Sums, shared: bool = False, config: Config = DEFAULT) -> bool:
    """Whether :func:`second_sum` runs the double backward `sums` of `desc` in `dtype`
    (:func:`.heuristics.fuses_second`, which `shared` weights do not change; the row-block
    kernels have no fused form)."""
    return kernels_for(desc) is per_row and heuristics.fuses_second(desc, dtype, sums, config)


def second_sum(desc, arrays, sums: Sums, config: Config = DEFAULT):
    """``(gx, gy, gw, out)``: :func:`backward_sum` and :func:`forward_sum` of `sums` in one
    kernel (where :func:`fuses_second`)."""
    return per_row.second_sum(desc, arrays[GZ], arrays, sums=sums, config=config)


def forward(desc, x, y, w, config: Config = DEFAULT):
    """``z (N, out.dim)`` from ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, nw)`` or ``(nw,)``."""
    return forward_sum(desc, (x, y, w), FORWARD, config)


def backward(desc, x, y, w, gz, needs=ALL, config: Config = DEFAULT):
    """``(gx, gy, gw)``, None for those not flagged in `needs`; shared weights get ``gw``
    summed over rows."""
    return backward_sum(desc, (x, y, w, gz), Sums.gradients(needs), config)


def conv_forward_sum(desc, arrays, graph, sums: Sums = FORWARD, config: Config = DEFAULT, *, kahan: bool = False):
    """:func:`forward_sum` of the fused convolution over `graph` (:func:`.conv.conv_forward_sum`:
    ``x``-like rows gathered by sender, each receiver's edges summed on chip); `kahan`:
    compensated sums."""
    return conv.conv_forward_sum(
        desc, arrays, graph.receiver_senders, graph.receiver_order, graph.receiver_offsets,
        sums=sums.of_kind(backward=False), edges_sorted=graph.edges_sorted, kahan=kahan, config=config,
    )  # fmt: skip


def conv_backward_sum(desc, arrays, graph, sums: Sums, config: Config = DEFAULT, *, kahan: bool = False):
    """:func:`backward_sum` of the fused convolution over `graph` (:func:`.conv.conv_backward_sum`:
    ``gx`` per sender, ``gy`` and ``gw`` per edge); `kahan`: compensated sums."""
    return conv.conv_backward_sum(
        desc, arrays[GZ], arrays, graph.sender_receivers, graph.sender_order, graph.sender_offsets,
        sums=sums.of_kind(backward=True), kahan=kahan, config=config,
    )  # fmt: skip


def conv_forward(desc, x, y, w, graph, config: Config = DEFAULT, *, kahan: bool = False):
    """``out (num_nodes, out.dim)``: the sum over each receiver's edges of the product of its
    sender's ``x`` row and the edge's ``y`` and ``w`` rows."""
    return conv_forward_sum(desc, (x, y, w), graph, FORWARD, config, kahan=kahan)


def conv_backward(desc, x, y, w, gz, graph, needs=ALL, config: Config = DEFAULT, *, kahan: bool = False):
    """``(gx, gy, gw)`` of :func:`conv_forward` for the output cotangent ``gz``, None for those
    not flagged in `needs`."""
    return conv_backward_sum(desc, (x, y, w, gz), graph, Sums.gradients(needs), config, kahan=kahan)
