"""Pallas kernels for the fused tensor-product convolution, deterministic, with on-chip sums.

``out[r] = sum over edges e into r of tp(x[senders[e]], y[e], w[e])``, on a
:class:`jequi.Graph` (edges in any order; the graph holds both CSR orders):

* :func:`conv_forward_sum` walks receivers: a program owns a part of a receiver's edges (the
  whole row unless it is a hub or the graph is small, :func:`split_rows`) and a group of
  output segments (:func:`.heuristics.conv_output_groups`), loops over its edges in receiver order (a
  dynamic-length loop), computes each edge's product with the generated instruction stream
  of :mod:`.row_code`, keeps the sum in registers and writes it once; the parts of a
  split row are added in a fixed order after (:func:`jequi.row_fixup.add_extras`). No per-edge output buffer,
  no atomics: the summation order is fixed by the graph, so results are bitwise reproducible.
* :func:`conv_backward_sum` walks senders (in parts, as the forward) through the transpose order, and
  the parts of the dropped edges (out-of-range indices) to zero their gradients: for each edge it writes
  ``gy[e]`` and ``gw[e]`` (per-edge, no reduction) and adds the edge's ``gx`` contribution
  to the sender's sum, written once. One kernel (programs split by ``x`` segment and by
  chunks of its paths, :func:`.heuristics.conv_backward_programs`; a partial ``gy`` each),
  deterministic, no ``|E| x in1.dim`` buffer. It reads a copy of the
  output cotangent in the ``ir_mul`` layout (:data:`COTANGENT_LAYOUT`).

Both walk the sums of a :class:`~jequi.sums.Sums`, as the batched kernels do: the fused double
backward runs the seven-op identity's sums through them (:mod:`jequi.backends.kernels`). They
take the graph's index arrays; :mod:`.ops` calls them with a :class:`jequi.Graph`. Optional
Kahan (compensated) summation of the on-chip sums, for f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi.descriptor import layout_positions
from jequi.dtypes import compute_dtype
from jequi.graph import RowParts, part_edges, row_parts
from jequi.row_fixup import add_extras
from jequi.sums import W, Sums

from .config import Config
from .heuristics import chained_forward, conv_backward_programs, conv_forward_warps, conv_output_groups, fill_edges, num_warps
from .lowering import on_gpu, pallas_call
from .row_code import (
    Row, add_parts, backward_row, chunks, forward_values, iota, needed_outputs, pairs_of, row_refs, slots, storer,
    triples_of, zero_weights,
)  # fmt: skip


def _kahan_add(acc, comp, values):
    """``acc += values`` elementwise (lists of vectors), compensated: ``comp`` holds the
    running compensations (Neumaier's variant: exact when a term exceeds the sum)."""
    new_acc, new_comp = [], []
    for a, c, v in zip(acc, comp, values):
        t = a + v
        c = c + jnp.where(jnp.abs(a) >= jnp.abs(v), (a - t) + v, (v - t) + a)
        new_acc.append(t)
        new_comp.append(c)
    return new_acc, new_comp


# One edge per loop step: 2 or 4 edges per step (their loads overlapping) ran about alike and
# compiled several times slower, and letting Triton software-pipeline the loop changed nothing;
# the unrolled steps were removed (docs/tuning.md#conv-edges_per_step).
def _edge_loop(start, end, body, init, kahan):
    """`init` plus the values of the edges ``k in [start, end)`` (lists of vectors):
    ``body(k, acc)`` returns `acc` plus edge k's values (its multiply-adds start from the
    running sum), or with `kahan` ``body(k, None)`` the values alone, added here compensated."""

    def step(k, carry):
        acc, comp = carry
        if kahan:
            acc, comp = _kahan_add(acc, comp, body(k, None))
        else:
            acc = body(k, acc)
        return acc, comp

    comp0 = [jnp.zeros_like(v) for v in init] if kahan else []
    acc, comp = jax.lax.fori_loop(start, end, step, (init, comp0))
    return [a + c for a, c in zip(acc, comp)] if kahan else acc


def split_rows(offsets, num_edges: int, programs_per_part: int, warps: int, kahan: bool, config: Config) -> RowParts:
    """The parts a conv kernel walks (:func:`jequi.graph.row_parts`): hubs split, and rows split
    further on a graph too small to fill the GPU (:func:`.heuristics.fill_edges`); with `kahan` whole rows,
    since the fixup's plain sum of the parts would lose what the compensated sums gained."""
    num_rows = offsets.shape[-1] - 1
    most = part_edges(num_rows, num_edges, fill_edges(num_edges, programs_per_part, warps, config))
    return row_parts(offsets, num_edges, max(num_edges, 1) if kahan else most)


def _extras_rows(parts: RowParts) -> int:
    return max(1, parts.num_extras)  # a kernel output has at least one row


# The backward reads, per edge, the output cotangent's row of the edge's receiver, a vector
# per irrep component and channel chunk: strided by the irrep's dimension in ``mul_ir``,
# contiguous in ``ir_mul``. It reads a copy of the cotangent in ``ir_mul`` (one pass over
# num_nodes rows, outside the kernel): contiguous reads paid in both dtypes; reading it in
# ``mul_ir`` was removed. The forward's per-edge x gains nothing from it, nor does the backward
# from loading the sender's x once before its edge loop instead of per edge
# (docs/tuning.md#conv-cotangent_layout).
COTANGENT_LAYOUT = "ir_mul"


def _split_refs(used, refs, node_positions):
    """``(refs of the node-indexed arrays, refs of the edge-indexed ones)`` as position -> ref."""
    ref_of = dict(zip(used, refs))
    nodes = {a: ref_of[a] for a in used if a in node_positions}
    return nodes, {a: ref for a, ref in ref_of.items() if a not in nodes}


def _store_row(refs, slot, num_rows: int, width: int, values, idx_list):
    """Store a part's partial row: at row `slot` of ``refs = (ref, extras_ref)`` for a row's
    first part, else at row ``slot - num_rows`` of the extras (:class:`jequi.graph.RowParts`);
    a ref given as ``(ref, base)`` starts at element `base`."""
    for is_extra, ref in enumerate(refs):
        ref, base = ref if isinstance(ref, tuple) else (ref, 0)
        row = slot - num_rows if is_extra else slot

        @pl.when((slot >= num_rows) if is_extra else (slot < num_rows))
        def _():
            store = storer(ref, base + row * width)
            for idx, value in zip(idx_list, values):
                store(idx, value)


@functools.partial(jax.jit, static_argnames=("desc", "sums", "edges_sorted", "kahan", "config"))
def conv_forward_sum(
    desc, arrays, receiver_senders, receiver_order, receiver_offsets, *, sums: Sums, edges_sorted: bool, kahan: bool,
    config: Config,
):  # fmt: skip
    """``out (num_nodes, out.dim)``, the conv of the forward-like sum of `sums` (positions in
    `arrays`, as :func:`~pallas_kernels.per_row.forward_sum`): ``x``-like arrays
    are per node (read at the edge's sender), ``y``- and ``w``-like ones per edge. The index
    arrays as in :class:`jequi.Graph` (``edges_sorted``: ``receiver_order`` is the identity
    and is not read). A program owns a part of a receiver's edges (:func:`split_rows`) and a
    group of output segments (:func:`.heuristics.conv_output_groups`)."""
    do = desc.dims[2]
    used = sums.reads
    node_positions = set(sums.x_likes)
    num_edges = arrays[sums.out[0][1]].shape[0]
    dtype = arrays[sums.out[0][0]].dtype
    # computed in `math`, and stored so (the rows' parts added after, then rounded to `dtype`):
    # half-precision operands round their output once
    math = compute_dtype(dtype)
    warps = conv_forward_warps(desc, math, config)
    groups = conv_output_groups(desc, math, config)
    parts = split_rows(receiver_offsets, num_edges, len(groups), warps, kahan, config)
    num_nodes = parts.num_rows
    chained = chained_forward(math, config)

    def kernel(*refs):
        s_ref, order_ref, off_ref, slot_ref, z_ref, extras_ref = refs[len(used) :]
        node_refs, edge_refs = _split_refs(used, refs[: len(used)], node_positions)
        v, group = pl.program_id(0), pl.program_id(1)
        for g, outputs in enumerate(groups):
            out_slots = slots([desc.out[s] for s in outputs])

            @pl.when(group == g)
            def _():
                def edge(k, acc):
                    e = k if edges_sorted else order_ref[k]
                    rows = {**row_refs(arrays, node_refs, s_ref[k]), **row_refs(arrays, edge_refs, e)}
                    triples = triples_of(sums, rows)
                    if acc is None or chained:
                        return forward_values(desc, triples, outputs, acc)
                    return [a + v for a, v in zip(acc, forward_values(desc, triples, outputs))]

                init = [jnp.zeros(idx.shape, math) for idx in out_slots]
                total = _edge_loop(off_ref[v], off_ref[v + 1], edge, init, kahan)
                _store_row((z_ref, extras_ref), slot_ref[v], num_nodes, do, total, out_slots)

    z, extras = pallas_call(
        kernel, [jax.ShapeDtypeStruct((num_nodes * do,), math), jax.ShapeDtypeStruct((_extras_rows(parts) * do,), math)],
        (parts.num_parts, len(groups)), warps, name="jequi_conv_fwd",
    )(*(arrays[a].reshape(-1) for a in used), receiver_senders, receiver_order, parts.offsets, parts.slots)
    return add_extras(z.reshape(num_nodes, do), extras, parts.firsts).astype(dtype)


@functools.partial(jax.jit, static_argnames=("desc", "sums", "kahan", "config"))
def conv_backward_sum(
    desc, gout, arrays, sender_receivers, sender_order, sender_offsets, *, sums: Sums, kahan: bool, config: Config,
):  # fmt: skip
    """``(gx, gy, gw)`` of the conv for the output cotangent ``gout``, each the sum over its
    pairs in ``sums.pairs`` (backward-like sums; positions in `arrays`, as
    :func:`~pallas_kernels.per_row.backward_sum`; ``x``-like arrays per node, the
    others per edge), None for a gradient without pairs; the index arrays as in
    :class:`jequi.Graph` (the last bucket of ``sender_offsets`` holds the dropped edges, which
    get zero ``gy`` and ``gw``). A program owns a part of a sender's edges (or of the dropped
    edges; :func:`split_rows`) and a :func:`.heuristics.conv_backward_programs` entry (an x segment's chunk of
    paths); each group writes its own partial ``gy`` and each chunk its own partial ``gx``,
    summed here. Shared weights (a 1-D ``arrays[W]``) get ``gw`` summed over edges."""
    used = sums.reads
    node_positions = set(sums.x_likes)
    g_positions = layout_positions(desc.out, COTANGENT_LAYOUT)
    if not np.array_equal(g_positions, np.arange(g_positions.size)):
        gout = gout[:, np.argsort(g_positions)]
    num_senders = sender_offsets.shape[0] - 2
    num_edges = sender_order.shape[0]
    d1, d2, do = desc.dims
    nw = desc.weight_numel
    dtype = gout.dtype  # stored; computed in `math`, and so are the partial sums added after the kernel
    math = compute_dtype(dtype)
    shared_weights = arrays[W].ndim == 1
    needs = sums.needs
    in2_slots = slots(desc.in2)
    groups, partials = conv_backward_programs(desc, config)
    inactive = list(desc.untouched.inactive_weights) if needs[2] else []
    warps = num_warps(desc, config, backward=True)
    parts = split_rows(sender_offsets, num_edges, len(groups), warps, kahan, config)
    extras_rows = _extras_rows(parts)
    shapes, unpack = needed_outputs(
        needs,
        [
            (jax.ShapeDtypeStruct((partials * num_senders * d1,), math),
             jax.ShapeDtypeStruct((partials * extras_rows * d1,), math)),  # gx: rows' first parts, extras
            jax.ShapeDtypeStruct((len(groups) * num_edges * d2,), math),
            jax.ShapeDtypeStruct((num_edges * nw,), math if shared_weights else dtype),
        ],
    )  # fmt: skip
    flat = [t for s in shapes for t in (s if isinstance(s, tuple) else (s,))]

    def regroup(items):  # the flat refs or results -> (gx pair or None, gy, gw)
        items = list(items)
        return unpack([tuple(items[:2]), *items[2:]] if needs[0] else items)

    def kernel(g_ref, *refs):
        node_refs, edge_refs = _split_refs(used, refs[: len(used)], node_positions)
        r_ref, order_ref, off_ref, row_ref, slot_ref, *out_refs = refs[len(used) :]
        gx_ref, gy_ref, gw_ref = regroup(out_refs)
        v, group = pl.program_id(0), pl.program_id(1)
        n, start, end, slot = row_ref[v], off_ref[v], off_ref[v + 1], slot_ref[v]
        for gi, (segments, paths, chunk, group_chunks) in enumerate(groups):
            in1 = [desc.in1[s] for s in segments]
            in1_slots = slots(in1)
            gy_base = gi * num_edges * d2

            @pl.when((group == gi) & (n < num_senders))
            def _():
                def edge(k, acc):
                    e = order_ref[k]
                    rows = {**row_refs(arrays, node_refs, n), **row_refs(arrays, edge_refs, e)}
                    store_gw = None if gw_ref is None else storer(gw_ref, e * nw)
                    gx, gy = backward_row(
                        desc, Row(g_ref, r_ref[k] * do, g_positions), pairs_of(sums, rows), store_gw, paths,
                        gx_start=(in1, () if acc is None else acc), tile_min_lanes=config.tile_min_lanes,
                    )  # fmt: skip
                    if gi == 0:
                        zero_weights(inactive, store_gw, math)
                    if gy_ref is not None:
                        gy.store(desc.in2, storer(gy_ref, gy_base + e * d2), math)
                    return gx.values(in1, math) if gx_ref is not None else []

                if gx_ref is None:

                    def each(k, carry):
                        edge(k, None)
                        return carry

                    jax.lax.fori_loop(start, end, each, 0)
                    return
                def partial_gx(c, values):  # partial c of this part's row
                    refs = ((gx_ref[0], c * num_senders * d1), (gx_ref[1], c * extras_rows * d1))
                    _store_row(refs, slot, num_senders + 1, d1, values, in1_slots)

                partial_gx(chunk, _edge_loop(start, end, edge, [jnp.zeros(i.shape, math) for i in in1_slots], kahan))
                for absent in range(group_chunks, partials) if chunk == 0 else ():
                    partial_gx(absent, [jnp.zeros(i.shape, math) for i in in1_slots])

            @pl.when((group == gi) & (n == num_senders))
            def _():  # dropped edges: zero gradients
                def zero(k, carry):
                    e = order_ref[k]
                    for idx in in2_slots if gy_ref is not None else ():
                        storer(gy_ref, gy_base + e * d2)(idx, jnp.zeros(idx.shape, math))
                    if gw_ref is not None:
                        zero_weights(paths + (inactive if gi == 0 else []), storer(gw_ref, e * nw), math)
                    return carry

                jax.lax.fori_loop(start, end, zero, 0)

    results = pallas_call(kernel, flat, (parts.num_parts, len(groups)), warps, name="jequi_conv_bwd")(
        gout.reshape(-1), *(arrays[a].reshape(-1) for a in used), sender_receivers, sender_order, parts.offsets,
        parts.rows, parts.slots,
    )  # fmt: skip
    gx, gy, gw = regroup(results)
    if gx is not None:
        main, extras = gx
        main = add_parts(main.reshape(partials, num_senders, d1))
        extras = add_parts(extras.reshape(partials, extras_rows, d1))
        gx = add_extras(main, extras, parts.firsts[: num_senders + 1]).astype(dtype)
    if gy is not None:
        gy = add_parts(gy.reshape(len(groups), num_edges, d2)).astype(dtype)
    if gw is not None:
        gw = gw.reshape(num_edges, nw)
        gw = (gw.sum(0) if shared_weights else gw).astype(dtype)
    return gx, gy, gw
