"""Pallas kernels for the batched CG tensor product that walk a program's rows one at a time.

A program owns ``rows_per_program`` batch rows (:func:`.heuristics.rows_per_program`) and
runs each row's instruction stream (:mod:`.row_code`), its channels vectorized. Each kernel
computes the sums of a :class:`~jequi.sums.Sums` (:func:`forward_sum`, :func:`backward_sum`):
the first-order ops have one term, the fused double backward of :mod:`jequi.autodiff` up to
three per result, sharing every load of a row. The forward splits wide outputs over programs by
output segment (:func:`.heuristics.forward_groups`); the backward runs a program per ``x``
segment (:func:`.heuristics.backward_groups`) and per window of its channels
(:func:`.heuristics.channel_windows`) where that was measured to pay. Products of
one-channel inputs run on :mod:`.row_blocks` instead (:mod:`.ops` picks).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from jequi.dtypes import compute_dtype
from jequi.sums import W, Sums

from .config import Config
from .heuristics import backward_groups, batched_warps, channel_windows, forward_groups, fused_forward, rows_per_program
from .lowering import multiply_adds, pallas_call
from .row_code import (
    Row, add_parts, backward_row, forward_values, needed_outputs, pairs_of, row_refs, rows_loop, slots, storer,
    triples_of, weight_gradient, zero_weights,
)  # fmt: skip


@functools.partial(jax.jit, static_argnames=("desc", "sums", "config"))
def forward_sum(desc, arrays, *, sums: Sums, config: Config):
    """``z (N, out.dim) = sum of f(arrays[a], arrays[b], arrays[c]) over (a, b, c) in
    sums.out`` (forward-like sums): ``x``-like arrays ``(N, in1.dim)``, ``y``-like ``(N,
    in2.dim)``, ``w``-like ``(N, nw)`` or shared ``(nw,)`` (None where no term reads it)."""
    used = sums.reads
    first = sums.out[0][0]
    n = arrays[first].shape[0]
    do = desc.dims[2]
    rpp = rows_per_program(desc, n, config, forward=True)
    dtype = arrays[first].dtype  # stored; computed in compute_dtype(dtype)
    math = compute_dtype(dtype)
    groups = forward_groups(desc, math, config)
    fused = fused_forward(math, config)

    def kernel(*refs):
        *in_refs, z_ref = refs
        group = pl.program_id(0)  # read outside the loops (interpret mode needs it there)

        def row(b):
            for gi, outputs in enumerate(groups):

                @pl.when(group == gi)
                def _():  # loads cached inside the branch: a group loads only its paths' inputs
                    r = row_refs(arrays, dict(zip(used, in_refs)), b)
                    with multiply_adds(fused):
                        values = forward_values(desc, triples_of(sums, r), outputs)
                    store = storer(z_ref, b * do)
                    for idx, value in zip(slots([desc.out[s] for s in outputs]), values):
                        store(idx, value)

        rows_loop(n, rpp, row, axis=1)

    # groups first, so the programs of one block of rows are launched side by side and can
    # share its x and y reads in L2 (the other order was not measured)
    grid = (len(groups), pl.cdiv(n, rpp))
    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * do,), dtype), grid, batched_warps(desc, config), name="jequi_tp_fwd")(
        *(arrays[a].reshape(-1) for a in used)
    )
    return z.reshape(n, do)


def backward_sum(desc, g, arrays, *, sums: Sums, config: Config):
    """``(gx, gy, gw)``: each the sum of the backward over its pairs in ``sums.pairs``
    (backward-like sums; positions in `arrays`, which :func:`pairs_of` turns into the rows of a
    :class:`Pairs`) against the output cotangent ``g (N, out.dim)``; None for a gradient
    without pairs. Shared weights (a 1-D ``arrays[W]``) get ``gw`` summed over rows."""
    return _backward(desc, g, arrays, sums=sums, config=config)[:3]


def second_sum(desc, g, arrays, *, sums: Sums, config: Config):
    """``(gx, gy, gw, dgz)``: :func:`backward_sum` and :func:`forward_sum` of `sums` in one
    kernel, whose programs read each row's operands once for both (see
    :func:`.heuristics.fuses_second` for where it pays)."""
    return _backward(desc, g, arrays, sums=sums, config=config)


@functools.partial(jax.jit, static_argnames=("desc", "sums", "config"))
def _backward(desc, g, arrays, *, sums: Sums, config: Config):
    """:func:`backward_sum`, and with a forward-like sum in `sums` that sum too (last)."""
    n = g.shape[0]
    d1, d2, do = desc.dims
    nw = desc.weight_numel
    rpp = rows_per_program(desc, n, config)
    dtype = g.dtype  # stored; computed in `math`, and so are the partial sums added after the kernel
    math = compute_dtype(dtype)
    triples = sums.out
    used = sums.reads
    needs = sums.needs
    shared_weights = arrays[W].ndim == 1
    windows = channel_windows(desc, math, config)
    assert not triples or windows == [None], "a channel window's forward would split its outputs' channels"
    groups = [(*group, window) for group in backward_groups(desc, math, config) for window in windows]
    sizes = (d1, len(groups) * d2, nw)
    stored = (dtype, math, math if shared_weights else dtype)  # gy in partials, a shared gw summed over rows
    shapes, unpack = needed_outputs(needs, [jax.ShapeDtypeStruct((n * d,), t) for d, t in zip(sizes, stored)])
    if triples:  # a partial dgz row per program, over its paths
        shapes.append(jax.ShapeDtypeStruct((len(groups) * n * do,), math))

    def kernel(g_ref, *refs):
        in_refs, out_refs = refs[: len(used)], refs[len(used) :]
        gx_ref, gy_ref, gw_ref = unpack(out_refs)
        dgz_ref = out_refs[-1] if triples else None
        group = pl.program_id(1)  # read outside the loops (interpret mode needs it there)

        def row(b):
            store_gw = None if gw_ref is None else storer(gw_ref, b * nw)
            for gi, (segments, paths, window) in enumerate(groups):

                @pl.when(group == gi)
                def _():  # loads cached inside the branch: a group never sees another's values
                    r = row_refs(arrays, dict(zip(used, in_refs)), b)
                    gx, gy = backward_row(
                        desc, Row(g_ref, b * do), pairs_of(sums, r), store_gw, paths, window,
                        tile_min_lanes=config.tile_min_lanes,
                    )
                    if gi == 0 and gw_ref is not None:
                        zero_weights(desc.untouched.inactive_weights, store_gw, math)
                    if gx_ref is not None:
                        gx.store([desc.in1[s] for s in segments], storer(gx_ref, b * d1), math, window)
                    if gy_ref is not None:
                        gy.store(desc.in2, storer(gy_ref, (gi * n + b) * d2), math)
                    if dgz_ref is not None:
                        with multiply_adds(fused_forward(math, config)):
                            values = forward_values(desc, triples_of(sums, r), paths=paths)
                        store = storer(dgz_ref, (gi * n + b) * do)
                        for idx, value in zip(slots(desc.out), values):
                            store(idx, value)

        rows_loop(n, rpp, row)

    grid = (pl.cdiv(n, rpp), len(groups))
    results = pallas_call(kernel, shapes, grid, batched_warps(desc, config, backward=True), name="jequi_tp_bwd")(
        g.reshape(-1), *(arrays[a].reshape(-1) for a in used)
    )
    gx, gy, gw = unpack(results)
    if gy is not None:
        gy = add_parts(gy.reshape(len(groups), n, d2)).astype(dtype)
    gx = None if gx is None else gx.reshape(n, d1)
    gw = weight_gradient(gw, n, nw, shared_weights)
    return (
        gx,
        gy,
        None if gw is None else gw.astype(dtype),
        add_parts(results[-1].reshape(len(groups), n, do)).astype(dtype) if triples else None,
    )

