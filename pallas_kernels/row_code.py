"""The row-code generators the Pallas kernels share: the instruction stream of one row of a
tensor product (or of its backward), generated per descriptor at trace time.

OpenEquivariance/B3 style: every nonzero CG coefficient (normalization folded in, read from
the descriptor) is a literal of an unrolled instruction stream; block offsets are static.
Within a row the multiplicity channels are vectorized in power-of-two chunks (Triton tensors
must have power-of-two sizes; exact chunks need no masks). Each input element of a row is
loaded once (loads are cached per row, :class:`Row`), each output element is stored once, and
the backward recomputes what it needs instead of reading stored intermediates. Sums of
products are chains of fused multiply-adds (:func:`~.lowering.fma`), started from the running
sum they add to where the kernel passes one in (reductions over tiles, ``uvw``'s, stay a
multiply and a tree of adds).

Modes: ``uvu`` and ``uuu`` (channelwise, vectors over ``u``) and ``uvw`` and ``uuw``
(a per-row weight matrix contracted over ``u``: 2-D ``(u, w)`` tiles reduced on chip).
The kernels take the descriptor's :attr:`~jequi.TensorProductDescriptor.trilinear` view, in
which every path is weighted. Each kernel computes the sums of a :class:`~jequi.sums.Sums` (the
first-order ops one term, the fused double backward of :mod:`jequi.autodiff` up to three per
result, sharing every load of a row): :func:`forward_values` and :func:`backward_row` take the
rows of each term. :mod:`.per_row`, :mod:`.conv` and :mod:`.row_blocks` build their kernels
from these.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi.dtypes import compute_dtype
from jequi.row_fixup import pieces

from .lowering import fma

SUPPORTED_MODES = ("uvu", "uuu", "uvw", "uuw")


def chunks(mul: int, window: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """``range(mul)``, or its part in the channel `window` ``(start, stop)``, as ``(start,
    size)`` pieces of power-of-two sizes (at most 128: :func:`jequi.row_fixup.pieces`)."""
    start, stop = (0, mul) if window is None else (min(window[0], mul), min(window[1], mul))
    return pieces(start, stop)


def unsupported_modes(desc) -> set[str]:
    return {p.mode for p in desc.active_paths} - set(SUPPORTED_MODES)


def iota(idx: np.ndarray):
    """A static index array as in-kernel iota arithmetic (Pallas kernels capture no array
    constants). Every index array here is affine in its axes (a strided block slice)."""
    idx = np.asarray(idx)
    if idx.ndim == 0:
        return int(idx)
    out, check = int(idx.flat[0]), idx.flat[0]
    for a, n in enumerate(idx.shape):
        stride = int(np.take(idx, 1, axis=a).flat[0] - idx.flat[0]) if n > 1 else 0
        shape = [n if b == a else 1 for b in range(idx.ndim)]
        out = out + (jnp.arange(n, dtype=jnp.int32) * stride).reshape(shape)
        check = check + (np.arange(n) * stride).reshape(shape)
    assert np.array_equal(np.broadcast_to(check, idx.shape), idx), "index array is not affine"
    return jnp.broadcast_to(out, idx.shape)


def key(idx: np.ndarray):
    return idx.shape, idx.tobytes()


def storer(ref, base):
    """``store(idx, value)``: write `value` at static positions `idx` after `base` in `ref`."""

    def store(idx, value):
        ref[base + iota(idx)] = value.astype(ref.dtype)

    return store


class Row:
    """Cached loads from one row of a flat ref (``base`` = row offset, or 0 for shared refs).
    Loads name elements by their positions in the descriptor's layout; a row stored in
    another layout gives ``positions`` (:func:`jequi.descriptor.layout_positions`)."""

    def __init__(self, ref, base, positions: np.ndarray | None = None):
        self.ref, self.base, self.positions, self.cache = ref, base, positions, {}
        self.dtype = compute_dtype(ref.dtype)  # half-precision rows are widened as they load

    def load(self, idx):
        idx = np.asarray(idx)
        if key(idx) not in self.cache:
            at = idx if self.positions is None else self.positions[idx]
            self.cache[key(idx)] = self.ref[self.base + iota(at)].astype(self.dtype)
        return self.cache[key(idx)]


def add(a, b):
    return b if a is None else a + b


def _madd(acc, a, b):
    """``acc + a * b`` as one fused multiply-add (:func:`~.lowering.fma`); ``a * b`` when
    `acc` is None."""
    return a * b if acc is None else fma(a, b, acc)


def dot(pairs, zeros=None, start=None):
    """``start + sum(a * b for a, b in pairs)`` as a chain of multiply-adds (`start` None:
    no start; then ``zeros()`` when there are no pairs; without `zeros`, there must be
    some)."""
    total = start
    for a, b in pairs:
        total = _madd(total, a, b)
    return zeros() if total is None else total


def sum_of(values, zeros=None):
    """The sum of `values` (arrays) without a leading ``0 +`` (a float add the compiler
    must keep); ``zeros()`` when there are none (without `zeros`, there must be some)."""
    total = None
    for v in values:
        total = add(total, v)
    return zeros() if total is None else total


def cg_terms(p):
    """The path's nonzeros as a list of (i, j, k, coeff) with Python scalars."""
    return [(int(i), int(j), int(k), float(c)) for i, j, k, c in zip(*p.nonzeros())]


def contract_y(terms, y):
    """``T[(i, k)] = sum_j c_ijk * y(j)`` (y returns a scalar or a vector)."""
    t = {}
    for i, j, k, c in terms:
        t[(i, k)] = _madd(t.get((i, k)), c, y(j))
    return t


def contract_x(t, x):
    """``A[k] = sum_i x(i) * T[(i, k)]``."""
    a = {}
    for (i, k), v in t.items():
        a[k] = _madd(a.get(k), x(i), v)
    return a


def slots(segments, window=None) -> list[np.ndarray]:
    """The vectors a row of `segments` (their channels in `window`, :func:`chunks`) is stored
    as: one static index array per (segment, channel chunk, irrep component), in the order the
    generators return values."""
    out = []
    for seg in segments:
        index = seg.index()
        for c0, cs in chunks(seg.mul, window):
            out.extend(index[c0 : c0 + cs, k] for k in range(seg.ir_dim))
    return out


# --- forward ---------------------------------------------------------------------------------
def forward_values(desc, triples, outputs=None, start=None, paths=None) -> list:
    """One row of ``z = sum of f(x, y, w) over (x, y, w) in triples`` (rows of
    :class:`Row`): a value per slot of :func:`slots` ``([desc.out[s] for s in outputs])``
    (default: every output segment), added to `start` (a value per slot: a running sum) if
    given; over `paths` only if given (a partial sum). The first-order forward has one
    triple; the double backward's ``d gz`` term has up to three (:mod:`jequi.autodiff`)."""
    outputs = range(len(desc.out)) if outputs is None else outputs
    if start is not None:
        assert len(start) == len(slots([desc.out[s] for s in outputs])), "a start value per slot"
        start = iter(start)
    by_out = {}
    for p in desc.active_paths if paths is None else paths:
        by_out.setdefault(p.i_out, []).append(p)
    values = []
    for s in outputs:
        seg = desc.out[s]
        for c0, cs in chunks(seg.mul):
            acc = [next(start) if start is not None else None for _ in range(seg.ir_dim)]
            for p in by_out.get(s, []):
                for rx, ry, rw in triples:
                    _forward_path(desc, p, c0, cs, rx, ry, rw, acc)
            values.extend(a if a is not None else jnp.zeros((cs,), triples[0][0].dtype) for a in acc)
    return values


def _forward_path(desc, p, c0, cs, rx, ry, rw, acc):
    in1, in2 = desc.in1[p.i_in1].index(), desc.in2[p.i_in2].index()
    terms = cg_terms(p)
    m2, mo = p.mul_in2, p.mul_out
    if p.mode in ("uvu", "uuu"):
        u = np.arange(c0, c0 + cs)
        x = lambda i: rx.load(in1[c0 : c0 + cs, i])  # noqa: E731
        if p.mode == "uvu":
            for v in range(m2):
                a = contract_x(contract_y(terms, lambda j: ry.load(in2[v, j])), x)
                wv = rw.load(p.weight_offset + u * m2 + v)
                for k, val in a.items():
                    acc[k] = _madd(acc[k], wv, val)
        else:
            a = contract_x(contract_y(terms, lambda j: ry.load(in2[c0 : c0 + cs, j])), x)
            wu = rw.load(p.weight_offset + u)
            for k, val in a.items():
                acc[k] = _madd(acc[k], wu, val)
        return
    w = np.arange(c0, c0 + cs)
    for u0, cu in chunks(p.mul_in1):
        u = np.arange(u0, u0 + cu)
        x = lambda i: rx.load(in1[u0 : u0 + cu, i])  # noqa: E731
        for v in range(m2 if p.mode == "uvw" else 1):
            if p.mode == "uvw":
                t = contract_x(contract_y(terms, lambda j: ry.load(in2[v, j])), x)
                widx = p.weight_offset + (u[:, None] * m2 + v) * mo + w[None, :]
            else:
                t = contract_x(contract_y(terms, lambda j: ry.load(in2[u0 : u0 + cu, j])), x)
                widx = p.weight_offset + u[:, None] * mo + w[None, :]
            wt = rw.load(widx)
            for k, val in t.items():
                acc[k] = add(acc[k], jnp.sum(wt * val[:, None], axis=0))




def _bit_reversed(n: int) -> list[int]:
    bits = n.bit_length() - 1
    return [int(format(k, f"0{bits}b")[::-1], 2) if bits else 0 for k in range(n)]


def lane_tile(vectors: list) -> jax.Array:
    """The ``(lanes, len(vectors))`` tile whose column `k` is ``vectors[k]`` (``len(vectors)`` a
    power of two, equal lane counts). It is built by pairwise ``stack`` (Triton's ``join``, the
    one stacking its lowering has); each join adds an innermost axis, so the flat tile order is
    bit-reversed and the input is fed in bit-reversed order."""
    n = len(vectors)
    level = [vectors[k] for k in _bit_reversed(n)]
    while len(level) > 1:
        level = [jnp.stack([a, b], axis=-1) for a, b in zip(level[::2], level[1::2])]
    return level[0].reshape(vectors[0].shape[0], n)


def lane_tile_sum(vectors: list) -> jax.Array:
    """``[sum(v) for v in vectors]`` as one vector, by a single reduction of a
    :func:`lane_tile`."""
    return jnp.sum(lane_tile(vectors), axis=0)


class _Grads:
    """Per-row gradient accumulators, stored once at the end of the row; they start from
    `start`, a value per slot of :func:`slots` ``(segments)`` (a running sum; no channel
    window), if given. Cross-lane sums (``gy`` of ``uv*`` modes: one sum over ``u`` per ``y``
    element) of lane vectors at least `tile_min_lanes` wide are taken as tiles
    (:meth:`_tile_sums`): one reduction of a (lanes, positions) tile instead of one per element
    halved the barrier stalls (docs/tuning.md#tensor_product-lane_sums)."""

    def __init__(self, segments=(), start=(), tile_min_lanes: int = 32):
        self.tile_min_lanes = tile_min_lanes
        # key(index array) -> vector; seeds are keyed by slots without a channel window
        self.vec = {key(idx): value for idx, value in zip(slots(segments), start, strict=True)} if start else {}
        self.scalar = {}  # (flat position, lanes) -> lane vector, summed at the end

    def add_vec(self, idx, pairs):
        """Add ``sum(a * b for a, b in pairs)`` at the positions `idx`."""
        self.vec[key(idx)] = dot(pairs, start=self.vec.get(key(idx)))

    def add_lanes(self, pos, pairs):
        """Add the sum over lanes of ``sum(a * b for a, b in pairs)`` (lane vectors) at a flat
        position; the cross-lane sum is taken once, in store."""
        pairs = list(pairs)
        at = (int(pos), np.broadcast_shapes(*(np.shape(v) for pair in pairs for v in pair))[0])
        self.scalar[at] = dot(pairs, start=self.scalar.get(at))

    def values(self, segments, dtype) -> list:
        """The row as a value per slot of :func:`slots` ``(segments)`` (zeros where nothing
        accumulated)."""
        return [self._value(idx, dtype) for idx in slots(segments)]

    def _value(self, idx, dtype):
        lanes = jnp.arange(idx.shape[0])
        value = self.vec.get(key(idx))
        for n, pos in enumerate(idx):
            parts = [jnp.sum(v) for (p, _), v in self.scalar.items() if p == int(pos)]
            if parts:
                value = add(value, jnp.where(lanes == n, sum_of(parts), 0).astype(dtype))
        return value if value is not None else jnp.zeros(idx.shape, dtype)

    def _tile_sums(self, segments, store, dtype, window) -> set:
        """Store the slots whose elements have lane sums only, all at least
        ``tile_min_lanes`` wide, in contiguous power-of-two runs of positions, one tile
        reduction per run and lane count; returns the positions stored."""
        vec_positions = {int(q) for idx in slots(segments, window) if key(idx) in self.vec for q in idx}
        wide = {n for _, n in self.scalar if n >= self.tile_min_lanes}
        lane_positions = {p for p, n in self.scalar if n in wide} - {p for p, n in self.scalar if n not in wide}
        lane_only = lane_positions - vec_positions
        eligible = sorted(int(q) for idx in slots(segments, window) if set(map(int, idx)) <= lane_only for q in idx)
        runs, done = [], set(eligible)
        for q in eligible:
            if runs and q == runs[-1][0] + runs[-1][1]:
                runs[-1][1] += 1
            else:
                runs.append([q, 1])
        for start, length in runs:
            for c0, cs in chunks(length):
                positions = range(start + c0, start + c0 + cs)
                total = None
                for n in sorted(wide):
                    if any((p, n) in self.scalar for p in positions):
                        zero = jnp.zeros((n,), dtype)
                        total = add(total, lane_tile_sum([self.scalar.get((p, n), zero) for p in positions]))
                store(np.asarray(positions), total.astype(dtype))
        return done

    def store(self, segments, store, dtype, window=None):
        """Store every element of the row (of its channels in `window`)."""
        done = self._tile_sums(segments, store, dtype, window)
        for idx in slots(segments, window):
            if not set(map(int, idx)) <= done:
                store(idx, self._value(idx, dtype))


def zero_weights(paths, store_gw, dtype, lead=()):
    """Store zero ``gw`` for `paths` (vectors of their weight chunks, with leading shape `lead`)."""
    for p in paths:
        for c0, cs in chunks(p.weight_numel):
            store_gw(p.weight_offset + np.arange(c0, c0 + cs), jnp.zeros((*lead, cs), dtype))


class Pairs(NamedTuple):
    """What a backward row sums, as pairs of input rows (:class:`Row`; the pairs of a
    :class:`~jequi.sums.Sums`, :func:`pairs_of`): ``gx`` is the sum of ``B_x(y, w)`` over its
    ``(y, w)`` pairs, ``gy`` of ``B_y(x, w)`` over ``(x, w)``, ``gw`` of ``B_w(x, y)`` over
    ``(x, y)``, all against the output cotangent ``g``. The first-order backward has one pair
    per gradient it needs, the double backward's ``d x, d y, d w`` two each
    (:mod:`jequi.autodiff`); an empty tuple: that gradient is not computed."""

    gx: tuple = ()
    gy: tuple = ()
    gw: tuple = ()


def _unique(rows) -> list:
    return list(dict.fromkeys(rows))


def backward_row(desc, rg: Row, pairs: Pairs, store_gw, paths, window=None, gx_start=((), ()), tile_min_lanes=32):
    """One row of the backward of `paths` (of their x channels in `window`, for products with
    ``uv*`` paths only, :func:`.heuristics.channel_windows`): stores their ``gw`` and returns
    the ``gx`` and ``gy`` accumulators (:class:`_Grads`, with `tile_min_lanes`) of `pairs`
    (``store_gw`` is unused without ``gw`` pairs); ``gx`` starts from ``gx_start = (in1
    segments, a value per slot)``."""
    gx, gy = _Grads(*gx_start, tile_min_lanes), _Grads(tile_min_lanes=tile_min_lanes)
    for p in paths:
        _backward_path(desc, p, rg, pairs, gx, gy, store_gw, window)
    return gx, gy


def _contract_xg(terms, x, g):
    """``Q[j] = sum_{i, k} c_ijk x(i) g[k]``, summed first over ``k`` (pairs ``(i, j)``) or
    over ``i`` (pairs ``(j, k)``), whichever leaves fewer pairs.

    Channelwise backward: with ``Q`` (shared by every ``y`` channel ``v``), ``gw = sum_j
    y(j) Q[j]`` and ``gy[j] = w Q[j]`` (then summed over channels for ``uvu``), instead of
    ``c x(i) w g[k]`` per term and an ``a[k]`` for ``gw``: MACE-large's backward row has 881
    instead of 1,043 vector multiplies (jaxpr count; its forward row has 284)."""
    by_ij = len({(i, j) for i, j, _, _ in terms}) <= len({(j, k) for _, j, k, _ in terms})
    partial = {}
    for i, j, k, c in terms:
        at, value = ((i, j), g[k]) if by_ij else ((j, k), x(i))
        partial[at] = _madd(partial.get(at), c, value)
    q = {}
    for (a, b), value in partial.items():
        j, other = (b, x(a)) if by_ij else (a, g[b])
        q[j] = _madd(q.get(j), other, value)
    return q


def _backward_path(desc, p, rg, pairs: Pairs, gx, gy, store_gw, window):
    assert window is None or p.mode in ("uvu", "uvw"), "a uu* path's gy would split by x channel"
    in1, in2 = desc.in1[p.i_in1].index(), desc.in2[p.i_in2].index()
    out = desc.out[p.i_out].index()
    terms = cg_terms(p)
    m2, mo = p.mul_in2, p.mul_out
    ks = sorted({k for _, _, k, _ in terms})
    x_rows = _unique([rx for rx, _ in pairs.gy + pairs.gw])
    if p.mode in ("uvu", "uuu"):
        for c0, cs in chunks(p.mul_in1, window):
            u = np.arange(c0, c0 + cs)
            g = {k: rg.load(out[c0 : c0 + cs, k]) for k in ks}
            # Q is independent of v: shared by the y channels
            q = {rx: _contract_xg(terms, lambda i, rx=rx: rx.load(in1[c0 : c0 + cs, i]), g) for rx in x_rows}
            for v in range(m2 if p.mode == "uvu" else 1):
                if p.mode == "uvu":
                    y_at = lambda ry, j: ry.load(in2[v, j])  # noqa: E731
                    widx = p.weight_offset + u * m2 + v
                else:
                    y_at = lambda ry, j: ry.load(in2[c0 : c0 + cs, j])  # noqa: E731
                    widx = p.weight_offset + u
                if pairs.gw:
                    zeros = lambda: jnp.zeros((cs,), rg.dtype)  # noqa: E731
                    store_gw(widx, dot(((y_at(ry, j), qj) for rx, ry in pairs.gw for j, qj in q[rx].items()), zeros))
                if pairs.gx:
                    t = {ry: contract_y(terms, lambda j, ry=ry: y_at(ry, j)) for ry in _unique(ry for ry, _ in pairs.gx)}
                    for i in sorted({i for i, _, _, _ in terms}):
                        gx.add_vec(
                            in1[c0 : c0 + cs, i],
                            (
                                (rw.load(widx), dot((g[k], tv) for (i2, k), tv in t[ry].items() if i2 == i))
                                for ry, rw in pairs.gx
                            ),
                        )
                for j in sorted({j for _, j, _, _ in terms}) if pairs.gy else ():
                    products = [(rw.load(widx), q[rx][j]) for rx, rw in pairs.gy]
                    if p.mode == "uvu":
                        gy.add_lanes(in2[v, j], products)
                    else:
                        gy.add_vec(in2[c0 : c0 + cs, j], products)
        return
    w_rows = _unique([rw for _, rw in pairs.gx + pairs.gy])
    for c0, cs in chunks(mo):
        w = np.arange(c0, c0 + cs)
        g = {k: rg.load(out[c0 : c0 + cs, k]) for k in ks}
        for u0, cu in chunks(p.mul_in1, window):
            u = np.arange(u0, u0 + cu)
            x_at = lambda rx, i: rx.load(in1[u0 : u0 + cu, i])  # noqa: E731
            for v in range(m2 if p.mode == "uvw" else 1):
                if p.mode == "uvw":
                    y_at = lambda ry, j: ry.load(in2[v, j])  # noqa: E731
                    widx = p.weight_offset + (u[:, None] * m2 + v) * mo + w[None, :]
                else:
                    y_at = lambda ry, j: ry.load(in2[u0 : u0 + cu, j])  # noqa: E731
                    widx = p.weight_offset + u[:, None] * mo + w[None, :]
                t = {
                    ry: contract_y(terms, lambda j, ry=ry: y_at(ry, j))
                    for ry in _unique([ry for ry, _ in pairs.gx] + [ry for _, ry in pairs.gw])
                }
                if pairs.gw:
                    a = {}
                    for rx, ry in pairs.gw:
                        for k, value in contract_x(t[ry], lambda i, rx=rx: x_at(rx, i)).items():
                            a[k] = add(a.get(k), value)
                    zeros = lambda: jnp.zeros((cu, cs), rg.dtype)  # noqa: E731
                    store_gw(widx, sum_of((a[k][:, None] * g[k][None, :] for k in a), zeros))
                # the output cotangent pulled back through each weight matrix (a vector over u)
                h = {rw: {k: jnp.sum(rw.load(widx) * g[k][None, :], axis=1) for k in ks} for rw in w_rows}
                for ry, rw in pairs.gx:
                    for (i, k), tv in t[ry].items():
                        gx.add_vec(in1[u0 : u0 + cu, i], [(h[rw][k], tv)])
                by_j = {}
                for rx, rw in pairs.gy:
                    for i, j, k, c in terms:
                        by_j.setdefault(j, []).append((c * x_at(rx, i), h[rw][k]))
                for j, products in by_j.items():
                    # for uvw, y has no u index: gy is reduced over u on chip
                    if p.mode == "uvw":
                        gy.add_lanes(in2[v, j], products)
                    else:
                        gy.add_vec(in2[u0 : u0 + cu, j], products)




# --- pallas_call wrappers -------------------------------------------------------------------
def add_parts(a):
    """``a[0] + a[1] + ...`` (partial sums of separate programs, in this fixed order)."""
    return functools.reduce(lambda s, t: s + t, [a[k] for k in range(a.shape[0])])


def rows_loop(n_rows: int, rows_per_program: int, body, axis: int = 0):
    """``body(b)`` for the rows of this program (grid `axis` counts blocks of rows)."""
    pid = pl.program_id(axis)

    def step(r, carry):
        b = pid * rows_per_program + r

        @pl.when(b < n_rows)
        def _():
            body(b)

        return carry

    jax.lax.fori_loop(0, rows_per_program, step, 0)



# The kernels compute the sums of a :class:`~jequi.sums.Sums`, whose terms name their operands
# by position in the kernel's ``arrays`` (a kernel gets refs for ``Sums.reads`` only); an array
# with one dimension is shared by every row (shared weights).
def pairs_of(sums, rows: dict) -> Pairs:
    """The :class:`Pairs` of rows (position -> row) of the backward-like sums of `sums`."""
    return Pairs(*(tuple((rows[i], rows[j]) for i, j in pairs) for pairs in sums.pairs))


def triples_of(sums, rows: dict) -> list:
    """The triples of rows (position -> row) of the forward-like sum of `sums`."""
    return [(rows[i], rows[j], rows[k]) for i, j, k in sums.out]


def row_refs(arrays, refs: dict, b) -> dict:
    """A :class:`Row` per array position in `refs` (position -> ref): row `b` of a per-row
    array, the whole of a shared (1-D) one."""
    return {a: Row(ref, 0 if arrays[a].ndim == 1 else b * arrays[a].shape[1]) for a, ref in refs.items()}


def needed_outputs(needs, shapes) -> tuple[list, callable]:
    """The output shapes of a backward kernel that computes `needs` (of ``(gx, gy, gw)``,
    whose shapes are `shapes`) and ``unpack(refs or arrays) -> (gx, gy, gw)`` with None for
    the gradients not computed."""
    if not any(needs):
        raise ValueError("a backward kernel needs at least one of gx, gy, gw")

    def unpack(items):
        items = iter(items)
        return tuple(next(items) if need else None for need in needs)

    return [s for s, need in zip(shapes, needs) if need], unpack



def weight_gradient(gw, n: int, nw: int, shared_weights: bool):
    """The batched backward's flat per-row ``gw`` output as ``(n, nw)``, summed over rows for
    shared weights (by XLA: a pass over ``n x nw``); None stays None."""
    if gw is None:
        return None
    gw = gw.reshape(n, nw)
    return gw.sum(0) if shared_weights else gw
