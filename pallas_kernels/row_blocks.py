"""Pallas kernels for products of one-channel inputs: a program computes a block of rows side
by side.

:mod:`.per_row`'s batched kernels vectorize a row over its channels and walk a
program's rows one after the other. A ``uvw`` product whose ``x`` and ``y`` segments have one
channel each (spherical harmonics times spherical harmonics, as in e3nn's tetris-poly) leaves
them one-element vectors: every CG contraction is a scalar chain, and only the output
channels of a row are vectors. Here a program owns a block of rows (``Config.block_forward_rows``,
``block_backward_rows``) side by side: each per-row scalar (an input component, a contraction
``t[k] = sum c_ijk x[i] y[j]``) is a vector over the rows, and each run of output channels a
``(rows, channels)`` tile.

* forward: ``z[:, w, k] += W[:, w] * t[:, k]`` per path, an output segment at a time (its
  tiles stay on chip until stored);
* backward: the cotangent pulled back through each path's weights, ``h[:, k] = sum_w W[:, w]
  gz[:, w, k]`` (a reduction along the tile), then spread by the coefficients into ``gx`` and
  ``gy``; ``gw[:, w] = sum_k t[:, k] gz[:, w, k]``.

Both compute the sums of a :class:`~jequi.sums.Sums` (the fused double backward's too), as the
kernels of :mod:`.per_row` do, with the same signatures. Rows past the end are clamped onto the
last row: those lanes recompute it and store the same values again.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi.dtypes import compute_dtype
from jequi.sums import W, Sums

from .config import Config
from .heuristics import block_backward_rows
from .lowering import pallas_call
from .row_code import (
    add, cg_terms, chunks, contract_x, contract_y, dot, iota, key, needed_outputs, sum_of, weight_gradient, zero_weights,
)  # fmt: skip


def applies(desc) -> bool:
    """Whether the batched product of `desc` runs on these kernels: every path ``uvw`` and
    every ``x`` and ``y`` segment one channel wide."""
    paths = desc.active_paths
    return bool(paths) and all(p.mode == "uvw" for p in paths) and all(s.mul == 1 for s in (*desc.in1, *desc.in2))


def _block_rows(n: int, rows_per_block: int):
    """This program's row indices, clamped into ``[0, n)``."""
    return jnp.minimum(pl.program_id(0) * rows_per_block + jnp.arange(rows_per_block, dtype=jnp.int32), n - 1)


class Block:
    """Cached loads from a block of rows (``rows``, a vector of row indices) of a flat ref of
    rows of length `width`, or from the whole of a shared 1-D ref (`width` None)."""

    def __init__(self, ref, rows, width: int | None):
        self.ref, self.rows, self.width, self.cache = ref, rows, width, {}
        self.dtype = compute_dtype(ref.dtype)  # half-precision rows are widened as they load

    def column(self, pos: int):
        """Element `pos` of every row: a vector over the rows."""
        assert self.width is not None, "a shared operand is read as tiles only"
        if pos not in self.cache:
            self.cache[pos] = self.ref[self.rows * self.width + int(pos)].astype(self.dtype)
        return self.cache[pos]

    def tile(self, positions: np.ndarray):
        """Elements `positions` (a static vector) of every row: a ``(rows, n)`` tile; of a
        shared ref, an ``(n,)`` vector (which broadcasts against the tiles)."""
        at = key(np.asarray(positions))
        if at not in self.cache:
            idx = iota(positions)
            shared = self.width is None
            tile = self.ref[idx] if shared else self.ref[self.rows[:, None] * self.width + idx[None, :]]
            self.cache[at] = tile.astype(self.dtype)
        return self.cache[at]


def _store_tile(ref, rows, width: int, positions, value):
    ref[rows[:, None] * width + iota(positions)[None, :]] = value.astype(ref.dtype)


def _path_operands(desc, p):
    """Per path: the flat positions of its (one-channel) ``x`` and ``y`` components, and its
    nonzero coefficients."""
    return desc.in1[p.i_in1].index()[0], desc.in2[p.i_in2].index()[0], cg_terms(p)


def _weight_chunks(p):
    """A path's weight positions (channel ``w`` of ``u = v = 0``) by output channel chunk."""
    return [(c0, cs, p.weight_offset + np.arange(c0, c0 + cs)) for c0, cs in chunks(p.mul_out)]


def _contraction(terms, x1, y1, bx: Block, by: Block) -> dict:
    """``t[k] = sum c_ijk x[i] y[j]`` of one row pair (vectors over rows)."""
    return contract_x(contract_y(terms, lambda j: by.column(y1[j])), lambda i: bx.column(x1[i]))


def _forward_segment(desc, s: int, triples, rows_per_block: int, dtype):
    """``(positions, tile)`` of output segment `s`: the sum over `triples` (Blocks of the
    ``x``-, ``y``- and ``w``-like operands) and its paths, each contraction taken once for all
    of the segment's channel chunks."""
    seg = desc.out[s]
    index = seg.index()
    acc = {}  # (c0, k) -> tile
    for p in desc.active_paths:
        if p.i_out != s:
            continue
        x1, y1, terms = _path_operands(desc, p)
        for bx, by, bw in triples:
            t = _contraction(terms, x1, y1, bx, by)
            for c0, _, positions in _weight_chunks(p):
                for k, tk in t.items():
                    acc[c0, k] = dot([(bw.tile(positions), tk[:, None])], start=acc.get((c0, k)))
    for c0, cs in chunks(seg.mul):
        for k in range(seg.ir_dim):
            yield index[c0 : c0 + cs, k], acc[c0, k] if (c0, k) in acc else jnp.zeros((rows_per_block, cs), dtype)


def _blocks(arrays, refs: dict, rows) -> dict:
    """A :class:`Block` per array position in `refs` (position -> ref)."""
    return {a: Block(ref, rows, None if arrays[a].ndim == 1 else arrays[a].shape[1]) for a, ref in refs.items()}


@functools.partial(jax.jit, static_argnames=("desc", "sums", "config"))
def forward_sum(desc, arrays, *, sums: Sums, config: Config):
    """:func:`.per_row.forward_sum` of a product :func:`applies` holds for (its multiply-adds
    always fused, ``Config.fused_forward`` aside: not measured apart here)."""
    used = sums.reads
    first = sums.out[0][0]
    n = arrays[first].shape[0]
    do = desc.dims[2]
    dtype = arrays[first].dtype  # stored; computed in compute_dtype(dtype)
    rows_per_block = config.block_forward_rows

    def kernel(*refs):
        *in_refs, z_ref = refs
        rows = _block_rows(n, rows_per_block)
        blocks = _blocks(arrays, dict(zip(used, in_refs)), rows)
        triples = [(blocks[a], blocks[b], blocks[c]) for a, b, c in sums.out]
        for s in range(len(desc.out)):
            for positions, tile in _forward_segment(desc, s, triples, rows_per_block, compute_dtype(dtype)):
                _store_tile(z_ref, rows, do, positions, tile)

    z = pallas_call(
        kernel, jax.ShapeDtypeStruct((n * do,), dtype), (pl.cdiv(n, rows_per_block),), config.block_forward_warps,
        name="jequi_tp_rows_fwd",
    )(*(arrays[a].reshape(-1) for a in used))
    return z.reshape(n, do)


def _backward_path(desc, p, gz: Block, pairs, gx: dict, gy: dict, store_gw):
    """Path `p`'s part of a row block's backward: ``gw`` stored, ``gx`` and ``gy`` added to
    (flat position -> vector over rows). `pairs`: ``(gx pairs, gy pairs, gw pairs)`` of Blocks."""
    gx_pairs, gy_pairs, gw_pairs = pairs
    x1, y1, terms = _path_operands(desc, p)
    out = desc.out[p.i_out].index()
    ks = sorted({k for _, _, k, _ in terms})
    weights = _weight_chunks(p)
    g = {(c0, k): gz.tile(out[c0 : c0 + cs, k]) for c0, cs, _ in weights for k in ks}
    if gw_pairs:
        t = {}
        for bx, by in gw_pairs:
            for k, value in _contraction(terms, x1, y1, bx, by).items():
                t[k] = add(t.get(k), value)
        for c0, cs, positions in weights:
            zeros = lambda: jnp.zeros((gz.rows.shape[0], cs), gz.dtype)  # noqa: E731
            store_gw(positions, dot(((t[k][:, None], g[c0, k]) for k in t), zeros))
    # the cotangent pulled back through the weights: a vector over rows per component k
    h = {
        bw: {k: sum_of(jnp.sum(bw.tile(pos) * g[c0, k], axis=1) for c0, _, pos in weights) for k in ks}
        for bw in dict.fromkeys(bw for _, bw in gx_pairs + gy_pairs)
    }
    for by, bw in gx_pairs:  # gx[i] += sum_{j, k} c y[j] h[k]
        for (i, k), value in contract_y(terms, lambda j, by=by: by.column(y1[j])).items():
            gx[int(x1[i])] = dot([(value, h[bw][k])], start=gx.get(int(x1[i])))
    swapped = [(j, i, k, c) for i, j, k, c in terms]
    for bx, bw in gy_pairs:  # gy[j] += sum_{i, k} c x[i] h[k]
        for (j, k), value in contract_y(swapped, lambda i, bx=bx: bx.column(x1[i])).items():
            gy[int(y1[j])] = dot([(value, h[bw][k])], start=gy.get(int(y1[j])))


@functools.partial(jax.jit, static_argnames=("desc", "sums", "config"))
def backward_sum(desc, g, arrays, *, sums: Sums, config: Config):
    """:func:`.per_row.backward_sum` of a product :func:`applies` holds for."""
    n = g.shape[0]
    d1, d2, do = desc.dims
    nw = desc.weight_numel
    dtype = g.dtype  # stored; computed in `math`, and so is a shared gw summed over rows after the kernel
    math = compute_dtype(dtype)
    used = sums.reads
    needs = sums.needs
    shared_weights = arrays[W].ndim == 1
    stored = (dtype, dtype, math if shared_weights else dtype)
    shapes, unpack = needed_outputs(needs, [jax.ShapeDtypeStruct((n * d,), t) for d, t in zip((d1, d2, nw), stored)])

    rows_per_block = block_backward_rows(math, config)

    def kernel(g_ref, *refs):
        in_refs, out_refs = refs[: len(used)], refs[len(used) :]
        gx_ref, gy_ref, gw_ref = unpack(out_refs)
        rows = _block_rows(n, rows_per_block)
        blocks = _blocks(arrays, dict(zip(used, in_refs)), rows)
        pairs = [[(blocks[a], blocks[b]) for a, b in pairs] for pairs in sums.pairs]
        store_gw = None if gw_ref is None else functools.partial(_store_tile, gw_ref, rows, nw)
        gx, gy = {}, {}
        for p in desc.active_paths:
            # a cotangent cache per path: a path's tiles are not kept live for the next paths
            # (one cache for all was not measured)
            _backward_path(desc, p, Block(g_ref, rows, do), pairs, gx, gy, store_gw)
        if store_gw is not None:
            zero_weights(desc.untouched.inactive_weights, store_gw, math, (rows_per_block,))
        for ref, values, width in ((gx_ref, gx, d1), (gy_ref, gy, d2)):
            if ref is not None:
                for q in range(width):
                    ref[rows * width + q] = (values[q] if q in values else jnp.zeros((rows_per_block,), math)).astype(dtype)

    gx, gy, gw = unpack(
        pallas_call(kernel, shapes, (pl.cdiv(n, rows_per_block),), config.block_backward_warps, name="jequi_tp_rows_bwd")(
            g.reshape(-1), *(arrays[a].reshape(-1) for a in used)
        )
    )
    gx, gy = (None if a is None else a.reshape(n, d) for a, d in ((gx, d1), (gy, d2)))
    gw = weight_gradient(gw, n, nw, shared_weights)
    return gx, gy, None if gw is None else gw.astype(dtype)
