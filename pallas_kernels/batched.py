"""The batched product's entry points: each descriptor on the kernels that run it
(:mod:`.row_blocks` for products of one-channel inputs, else :mod:`.per_row`). Each takes the
kernels' :class:`~.config.Config` (``config``, default :data:`~.config.DEFAULT`)."""

from __future__ import annotations

from . import heuristics, per_row, row_blocks
from .config import DEFAULT, Config
from .row_code import ALL, FORWARD_TERMS, backward_terms


def kernels_for(desc):
    """The module whose ``forward_sum`` and ``backward_sum`` run `desc`."""
    return row_blocks if row_blocks.applies(desc) else per_row


def forward_sum(desc, arrays, *, terms=FORWARD_TERMS, config: Config = DEFAULT):
    """``z (N, out.dim) = sum of f(arrays[a], arrays[b], arrays[c]) over (a, b, c) in terms``:
    ``x``-like arrays ``(N, in1.dim)``, ``y``-like ``(N, in2.dim)``, ``w``-like ``(N, nw)`` or
    shared ``(nw,)`` (None where no term reads it)."""
    return kernels_for(desc).forward_sum(desc, arrays, terms=terms, config=config)


def backward_sum(desc, g, arrays, *, terms, shared_weights: bool, config: Config = DEFAULT):
    """``(gx, gy, gw)``: each the sum of the backward over its pairs in ``terms = (gx pairs,
    gy pairs, gw pairs)`` (pairs of positions in `arrays`) against the output cotangent ``g
    (N, out.dim)``; None for a gradient without pairs. With `shared_weights`, ``gw`` is summed
    over rows."""
    return kernels_for(desc).backward_sum(desc, g, arrays, terms=terms, shared_weights=shared_weights, config=config)


def fuses_second(desc, dtype, triples, pairs, config: Config = DEFAULT) -> bool:
    """Whether :func:`second_sum` runs `desc`'s double backward (:func:`.heuristics.fuses_second`;
    the row-block kernels have no fused form)."""
    return kernels_for(desc) is per_row and heuristics.fuses_second(desc, dtype, triples, pairs, config)


def second_sum(desc, g, arrays, *, triples, terms, shared_weights: bool, config: Config = DEFAULT):
    """``(gx, gy, gw, dgz)``: :func:`backward_sum` over `terms` and :func:`forward_sum` over
    `triples` in one kernel (where :func:`fuses_second`)."""
    return per_row.second_sum(
        desc, g, arrays, triples=triples, terms=terms, shared_weights=shared_weights, config=config
    )


def forward(desc, x, y, w, config: Config = DEFAULT):
    """``z (N, out.dim)`` from ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, nw)`` or ``(nw,)``."""
    return forward_sum(desc, (x, y, w), config=config)


def backward(desc, x, y, w, gz, needs=ALL, config: Config = DEFAULT):
    """``(gx, gy, gw)``, None for those not flagged in `needs`; shared weights get ``gw``
    summed over rows."""
    return backward_sum(desc, gz, (x, y, w), terms=backward_terms(needs), shared_weights=w.ndim == 1, config=config)
