"""Pallas kernels for the fused tensor-product convolution, deterministic, with on-chip sums.

``out[r] = sum over edges e into r of tp(x[senders[e]], y[e], w[e])``, on a
:class:`jequi.Graph` (edges in any order; the graph holds both CSR orders):

* :func:`conv_forward` walks receivers: a program owns a part of a receiver's edges (the
  whole row unless it is a hub or the graph is small, :func:`split_rows`) and a group of
  output segments (:func:`conv_output_groups`), loops over its edges in receiver order (a
  dynamic-length loop), computes each edge's product with the generated instruction stream
  of :mod:`.tensor_product`, keeps the sum in registers and writes it once; the parts of a
  split row are added in a fixed order after (:func:`add_extras`). No per-edge output buffer,
  no atomics: the summation order is fixed by the graph, so results are bitwise reproducible.
* :func:`conv_backward` walks senders (in parts, as the forward) through the transpose order, and
  the parts of the dropped edges (out-of-range indices) to zero their gradients: for each edge it writes
  ``gy[e]`` and ``gw[e]`` (per-edge, no reduction) and adds the edge's ``gx`` contribution
  to the sender's sum, written once. One kernel (programs split by ``x`` segment and by
  chunks of its paths, :func:`backward_programs`; a partial ``gy`` each),
  deterministic, no ``|E| x in1.dim`` buffer. It reads a copy of the
  output cotangent in the ``ir_mul`` layout (:data:`COTANGENT_LAYOUT`).

Both walk sums of trilinear terms (:func:`conv_forward_sum`, :func:`conv_backward_sum`), as
the batched kernels do: the fused double backward runs the seven-op identity's sums through
them (``jequi.backends.pallas.conv_second``). Optional Kahan (compensated) summation of the
on-chip sums, for f32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi.descriptor import layout_positions

from jequi.graph import RowParts, part_edges, row_parts

from . import tensor_product
from .lowering import on_gpu, pallas_call
from .tensor_product import (
    ALL,
    _iota,
    FORWARD_TERMS,
    Row,
    add_parts,
    backward_row,
    backward_terms,
    channelwise,
    forward_values,
    inactive_paths,
    input_groups,
    needed_outputs,
    num_warps,
    output_groups,
    pairs_of,
    row_refs,
    slots,
    storer,
    used_positions,
    widest_chunk,
    zero_weights,
)


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


# Schedule knobs (benchmarks/tune_conv.py sweeps them). 1, 2 or 4 edges per step and 32, 64 or
# 128 accumulators per thread ran about alike, so the cheapest to compile is the default; letting
# Triton software-pipeline the edge loop (num_stages 2 or 3 instead of 1) changed neither
# (docs/tuning.md#conv-edges_per_step).
EDGES_PER_STEP = 1


def _edge_loop(start, end, body, init, kahan):
    """`init` plus the values of the edges ``k in [start, end)`` (lists of vectors):
    ``body(k, acc)`` returns `acc` plus edge k's values (its multiply-adds start from the
    running sum), or with `kahan` ``body(k, None)`` the values alone, added here compensated.
    :data:`EDGES_PER_STEP` edges per loop step (their loads overlap), then the remainder."""

    def step(edges):
        def run(i, carry):
            acc, comp = carry
            for k in edges(i):
                if kahan:
                    acc, comp = _kahan_add(acc, comp, body(k, None))
                else:
                    acc = body(k, acc)
            return acc, comp

        return run

    comp0 = [jnp.zeros_like(v) for v in init] if kahan else []
    carry = (init, comp0)
    u = EDGES_PER_STEP
    if u > 1:
        steps = (end - start) // u
        carry = jax.lax.fori_loop(0, steps, step(lambda i: [start + u * i + j for j in range(u)]), carry)
        start = start + u * steps
    acc, comp = jax.lax.fori_loop(start, end, step(lambda k: [k]), carry)
    return [a + c for a, c in zip(acc, comp)] if kahan else acc


# 32-bit registers per thread for a forward program's sums (a float64 sum takes two); the
# other outputs go to other programs (:func:`conv_output_groups`). 64 was the fastest in
# float64, and float32 is indifferent (docs/tuning.md#conv-accumulator_registers).
ACCUMULATOR_REGISTERS = 64

# Rows of a graph too small to fill the GPU (a few hundred rows for 132 SMs) are split further:
# :func:`fill_edges` lowers the most edges per part (:func:`jequi.graph.part_edges`) until the
# grid has about FILL_WARPS warps, half of what the GPU holds resident; splitting measured faster
# on small batches (benchmarks/results/2026-11-21-h200-tune.md).
FILL_WARPS = 4096


def fill_edges(num_edges: int, programs_per_part: int, warps: int) -> int:
    """Edges per part that give the grid about :data:`FILL_WARPS` warps."""
    return -(-num_edges * programs_per_part * warps // FILL_WARPS)


def split_rows(offsets, num_edges: int, programs_per_part: int, warps: int, kahan: bool = False) -> RowParts:
    """The parts a conv kernel walks (:func:`jequi.graph.row_parts`): hubs split, and rows split
    further on a graph too small to fill the GPU (:func:`fill_edges`); with `kahan` whole rows,
    since the fixup's plain sum of the parts would lose what the compensated sums gained."""
    num_rows = offsets.shape[-1] - 1
    most = part_edges(num_rows, num_edges, fill_edges(num_edges, programs_per_part, warps))
    return row_parts(offsets, num_edges, max(num_edges, 1) if kahan else most)


def add_extras(out, extras, firsts):
    """``out`` ``(R, d)`` plus the extras of the rows split in parts: ``out[r] += extras[firsts[r]
    - r] + ... + extras[firsts[r + 1] - r - 2]``, in that order (bitwise reproducible; ``firsts``
    as :class:`jequi.graph.RowParts`): on the GPU a kernel that updates ``out`` in place
    (:func:`add_extras_kernel`), on the CPU XLA's segment sum, which adds in index order there
    (an interpreted kernel launch per conv cost seconds of every CPU test)."""
    num_rows, d = out.shape
    if on_gpu():
        return add_extras_kernel(out, extras, firsts)
    ends = firsts - jnp.arange(num_rows + 1, dtype=firsts.dtype)  # row r's extras: ends[r]:ends[r + 1]
    extras = extras.reshape(-1, d)
    k = jnp.arange(extras.shape[0])
    row, real = jnp.searchsorted(ends, k, side="right") - 1, k < ends[-1]
    return out + jax.ops.segment_sum(jnp.where(real[:, None], extras, 0), jnp.where(real, row, num_rows), num_rows)


def add_extras_kernel(out, extras, firsts):
    """:func:`add_extras` as a Pallas kernel: a program per row and block of columns, in place;
    rows of one part return at once."""
    num_rows, d = out.shape
    pieces = tensor_product.chunks(d)
    blocks = [pieces[i : i + FIXUP_PIECES] for i in range(0, len(pieces), FIXUP_PIECES)]

    def kernel(firsts_ref, out_ref, extras_ref, o_ref):
        r, block = pl.program_id(0), pl.program_id(1)
        lo, hi = firsts_ref[r] - r, firsts_ref[r + 1] - r - 1
        for bi, cols in enumerate(blocks):

            @pl.when((block == bi) & (hi > lo))
            def _():
                def add(k, acc):
                    return [a + extras_ref[k * d + _iota(np.arange(c0, c0 + cs))] for a, (c0, cs) in zip(acc, cols)]

                init = [out_ref[r * d + _iota(np.arange(c0, c0 + cs))] for c0, cs in cols]
                for (c0, cs), value in zip(cols, jax.lax.fori_loop(lo, hi, add, init)):
                    o_ref[r * d + _iota(np.arange(c0, c0 + cs))] = value

    out = pallas_call(
        kernel, jax.ShapeDtypeStruct((num_rows * d,), out.dtype), (num_rows, len(blocks)), 4, name="jequi_conv_parts",
        aliases={1: 0},
    )(firsts, out.reshape(-1), extras.reshape(-1))
    return out.reshape(num_rows, d)


# Column pieces (of at most 128 elements, :func:`~.tensor_product.chunks`) per fixup program.
FIXUP_PIECES = 8


def _extras_rows(parts: RowParts) -> int:
    return max(1, parts.num_extras)  # a kernel output has at least one row


# Whether the forward's multiply-adds start from the running sums of the edge loop (each
# product fused into the sum it feeds) or an edge's values are summed first and then added to
# the running sums. None: chained in float64 only, where it was the faster; in float32 separate
# sums were. The backward's gx starts from the running sums but with Kahan summation, which paid
# (docs/tuning.md#conv-chained_forward).
CHAINED_FORWARD: bool | None = None


def conv_output_groups(desc, dtype) -> list[list[int]]:
    """The forward's programs per receiver, as groups of output segments: the sums live in
    registers for a whole edge loop, and a wide output would spill
    (:data:`ACCUMULATOR_REGISTERS`)."""
    return output_groups(desc, ACCUMULATOR_REGISTERS * 4 // jnp.dtype(dtype).itemsize, forward_warps(desc, dtype))


def forward_warps(desc, dtype) -> int:
    """Warps per forward program: :func:`~.tensor_product.num_warps`, but for a channelwise
    product in ``ir_mul`` one warp, or two in float64 when it is at least 128 channels wide.
    A program walks a whole row's edges, enough work per warp that one warp holding several
    neighbouring channels per thread pays even where the batched forward prefers the width
    rule. The sums get :data:`ACCUMULATOR_REGISTERS` per thread, and a float64 sum takes two:
    one warp splits MACE-large's outputs over twice the programs of two, each repeating the
    edge loop's index, x and y loads (docs/tuning.md#conv-forward_warps)."""
    if tensor_product.FORWARD_WARPS is None and channelwise(desc) and desc.layout == "ir_mul":
        return 2 if jnp.dtype(dtype) == jnp.float64 and widest_chunk(desc) >= 128 else 1
    return num_warps(desc)


# The backward reads, per edge, the output cotangent's row of the edge's receiver, a vector
# per irrep component and channel chunk: strided by the irrep's dimension in ``mul_ir``,
# contiguous in ``ir_mul``. It reads a copy of the cotangent in this layout (one pass over
# num_nodes rows, outside the kernel): contiguous reads paid in both dtypes. The forward's
# per-edge x gains nothing from it, nor does the backward from loading the sender's x once
# before its edge loop instead of per edge (docs/tuning.md#conv-cotangent_layout).
COTANGENT_LAYOUT = "ir_mul"


# Backward programs per x segment (:func:`backward_programs`): None, the rule; a number forces
# (at most) that many per segment (tune_conv.py --backward-chunks).
BACKWARD_CHUNKS: int | None = None
# A program loads about this many output cotangent elements per lane per edge, at most.
COTANGENT_PER_THREAD = 32


def _path_chunks(desc, paths, n: int) -> list[list]:
    """`paths` in at most `n` non-empty lists, split by output segment into runs of about
    equal output size (a segment goes where its midpoint falls): a program then loads only
    its chunk's output cotangent."""
    outs = sorted({p.i_out for p in paths})
    total = sum(desc.out[s].size for s in outs)
    chunk_of, size = {}, 0
    for s in outs:
        chunk_of[s] = min(n - 1, (2 * size + desc.out[s].size) * n // (2 * total))
        size += desc.out[s].size
    return [chunk for c in range(n) if (chunk := [p for p in paths if chunk_of[p.i_out] == c])]


def backward_programs(desc) -> tuple[list[tuple[list[int], list, int, int]], int]:
    """``(programs, partials)``: the backward's programs per sender as ``(in1 segments, paths,
    chunk, chunks of the group)``, each :func:`input_groups` group split into chunks of its
    paths by output segment, and the number of partial ``gx`` they write (chunk ``c`` writes
    partial ``c`` of its segments; chunk 0 writes zeros into the partials its group has no
    chunk for).

    Chunks per group: as many as its output cotangent needs at :data:`COTANGENT_PER_THREAD`
    elements per lane, in either dtype (2, 3 and 4 for MACE-large's three x segments). The
    backward runs one warp per program at the register limit: a smaller live set pays where
    the extra programs' repeated per-edge work (indices, x and y, the gy lane sums and
    partials) costs less than it saves (docs/tuning.md#conv-backward_programs)."""
    lanes = 32 * num_warps(desc, backward=True)
    programs, partials = [], 1
    for segments, paths in input_groups(desc):
        size = sum(desc.out[s].size for s in {p.i_out for p in paths})
        n = BACKWARD_CHUNKS
        if n is None:
            n = -(-size // (lanes * COTANGENT_PER_THREAD))
        chunks = _path_chunks(desc, paths, max(1, n)) if paths else [[]]
        programs.extend((segments, chunk, c, len(chunks)) for c, chunk in enumerate(chunks))
        partials = max(partials, len(chunks))
    return programs, partials


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


@functools.partial(jax.jit, static_argnames=("desc", "terms", "edges_sorted", "kahan"))
def conv_forward_sum(
    desc, arrays, receiver_senders, receiver_order, receiver_offsets, *, terms=FORWARD_TERMS,
    edges_sorted: bool = False, kahan: bool = False,
):  # fmt: skip
    """``out (num_nodes, out.dim)``, the conv of the sum of the trilinear `terms` (positions
    in `arrays`, as :func:`~pallas_kernels.tensor_product.forward_sum`): ``x``-like arrays
    are per node (read at the edge's sender), ``y``- and ``w``-like ones per edge. The index
    arrays as in :class:`jequi.Graph` (``edges_sorted``: ``receiver_order`` is the identity
    and is not read). A program owns a part of a receiver's edges (:func:`split_rows`) and a
    group of output segments (:func:`conv_output_groups`)."""
    do = desc.dims[2]
    used = used_positions(terms)
    node_positions = {i for i, _, _ in terms}
    num_edges = arrays[terms[0][1]].shape[0]
    dtype = arrays[terms[0][0]].dtype
    warps = forward_warps(desc, dtype)
    groups = conv_output_groups(desc, dtype)
    parts = split_rows(receiver_offsets, num_edges, len(groups), warps, kahan)
    num_nodes = parts.num_rows
    chained = jnp.dtype(dtype) == jnp.float64 if CHAINED_FORWARD is None else CHAINED_FORWARD

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
                    triples = [(rows[i], rows[j], rows[c]) for i, j, c in terms]
                    if acc is None or chained:
                        return forward_values(desc, triples, outputs, acc)
                    return [a + v for a, v in zip(acc, forward_values(desc, triples, outputs))]

                init = [jnp.zeros(idx.shape, dtype) for idx in out_slots]
                total = _edge_loop(off_ref[v], off_ref[v + 1], edge, init, kahan)
                _store_row((z_ref, extras_ref), slot_ref[v], num_nodes, do, total, out_slots)

    z, extras = pallas_call(
        kernel, [jax.ShapeDtypeStruct((num_nodes * do,), dtype), jax.ShapeDtypeStruct((_extras_rows(parts) * do,), dtype)],
        (parts.num_parts, len(groups)), warps, name="jequi_conv_fwd",
    )(*(arrays[a].reshape(-1) for a in used), receiver_senders, receiver_order, parts.offsets, parts.slots)
    return add_extras(z.reshape(num_nodes, do), extras, parts.firsts)


def conv_forward(desc, x, y, w, receiver_senders, receiver_order, receiver_offsets, **options):
    """``out (num_nodes, out.dim)`` (`options` as :func:`conv_forward_sum`'s)."""
    return conv_forward_sum(desc, (x, y, w), receiver_senders, receiver_order, receiver_offsets, **options)


@functools.partial(jax.jit, static_argnames=("desc", "terms", "shared_weights", "kahan"))
def conv_backward_sum(
    desc, gout, arrays, sender_receivers, sender_order, sender_offsets, *, terms, shared_weights: bool,
    kahan: bool = False,
):  # fmt: skip
    """``(gx, gy, gw)`` of the conv for the output cotangent ``gout``, each the sum over its
    pairs in ``terms = (gx pairs, gy pairs, gw pairs)`` (positions in `arrays`, as
    :func:`~pallas_kernels.tensor_product.backward_sum`; ``x``-like arrays per node, the
    others per edge), None for a gradient without pairs; the index arrays as in
    :class:`jequi.Graph` (the last bucket of ``sender_offsets`` holds the dropped edges, which
    get zero ``gy`` and ``gw``). A program owns a part of a sender's edges (or of the dropped
    edges; :func:`split_rows`) and a :func:`backward_programs` entry (an x segment's chunk of
    paths); each group writes its own partial ``gy`` and each chunk its own partial ``gx``,
    summed here. With `shared_weights`, ``gw`` is summed over edges."""
    used = used_positions(pair for pairs in terms for pair in pairs)
    node_positions = {a for a, _ in terms[1] + terms[2]}
    g_positions = layout_positions(desc.out, COTANGENT_LAYOUT)
    if not np.array_equal(g_positions, np.arange(g_positions.size)):
        gout = gout[:, np.argsort(g_positions)]
    num_senders = sender_offsets.shape[0] - 2
    num_edges = sender_order.shape[0]
    d1, d2, do = desc.dims
    nw = desc.weight_numel
    dtype = gout.dtype
    needs = tuple(bool(pairs) for pairs in terms)
    in2_slots = slots(desc.in2)
    groups, partials = backward_programs(desc)
    inactive = inactive_paths(desc) if needs[2] else []
    warps = num_warps(desc, backward=True)
    parts = split_rows(sender_offsets, num_edges, len(groups), warps, kahan)
    extras_rows = _extras_rows(parts)
    shapes, unpack = needed_outputs(
        needs,
        [
            (jax.ShapeDtypeStruct((partials * num_senders * d1,), dtype),
             jax.ShapeDtypeStruct((partials * extras_rows * d1,), dtype)),  # gx: rows' first parts, extras
            jax.ShapeDtypeStruct((len(groups) * num_edges * d2,), dtype),
            jax.ShapeDtypeStruct((num_edges * nw,), dtype),
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
                        desc, Row(g_ref, r_ref[k] * do, g_positions), pairs_of(terms, rows), store_gw, paths,
                        gx_start=(in1, () if acc is None else acc),
                    )  # fmt: skip
                    if gi == 0:
                        zero_weights(inactive, store_gw, dtype)
                    if gy_ref is not None:
                        gy.store(desc.in2, storer(gy_ref, gy_base + e * d2), dtype)
                    return gx.values(in1, dtype) if gx_ref is not None else []

                if gx_ref is None:

                    def each(k, carry):
                        edge(k, None)
                        return carry

                    jax.lax.fori_loop(start, end, each, 0)
                    return
                def partial_gx(c, values):  # partial c of this part's row
                    refs = ((gx_ref[0], c * num_senders * d1), (gx_ref[1], c * extras_rows * d1))
                    _store_row(refs, slot, num_senders + 1, d1, values, in1_slots)

                partial_gx(chunk, _edge_loop(start, end, edge, [jnp.zeros(i.shape, dtype) for i in in1_slots], kahan))
                for absent in range(group_chunks, partials) if chunk == 0 else ():
                    partial_gx(absent, [jnp.zeros(i.shape, dtype) for i in in1_slots])

            @pl.when((group == gi) & (n == num_senders))
            def _():  # dropped edges: zero gradients
                def zero(k, carry):
                    e = order_ref[k]
                    for idx in in2_slots if gy_ref is not None else ():
                        storer(gy_ref, gy_base + e * d2)(idx, jnp.zeros(idx.shape, dtype))
                    if gw_ref is not None:
                        zero_weights(paths + (inactive if gi == 0 else []), storer(gw_ref, e * nw), dtype)
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
        gx = add_extras(main, extras, parts.firsts[: num_senders + 1])
    if gy is not None:
        gy = add_parts(gy.reshape(len(groups), num_edges, d2))
    if gw is not None:
        gw = gw.reshape(num_edges, nw)
        gw = gw.sum(0) if shared_weights else gw
    return gx, gy, gw


def conv_backward(desc, x, y, w, gout, sender_receivers, sender_order, sender_offsets, *, needs=ALL, kahan=False):
    """``(gx, gy, gw)`` of :func:`conv_forward` for the output cotangent ``gout``, None for
    those not flagged in `needs`."""
    return conv_backward_sum(
        desc, gout, (x, y, w), sender_receivers, sender_order, sender_offsets, terms=backward_terms(needs),
        shared_weights=w.ndim == 1, kahan=kahan,
    )  # fmt: skip
