"""Pallas kernels for the batched CG tensor product, generated per descriptor at trace time.

OpenEquivariance/B3 style: every nonzero CG coefficient (normalization folded in, read from
the descriptor) is a literal of an unrolled instruction stream; block offsets are static.
A program owns ``rows_per_program`` batch rows and walks them one at a time; within a row the
multiplicity channels are vectorized in power-of-two chunks (Triton tensors must have
power-of-two sizes; exact chunks need no masks). Each input element of a row is loaded
once per program (loads are cached per row), each output element is stored once, and the backward
recomputes what it needs instead of reading stored intermediates. Sums of products are chains
of fused multiply-adds (:func:`~.lowering.fma`), started from the running sum they add to where
the kernel passes one in (reductions over tiles, ``uvw``'s, stay a multiply and a tree of adds;
:data:`FUSED_FORWARD` and the conv's ``CHAINED_FORWARD`` say where measurements kept them apart).

Modes: ``uvu`` and ``uuu`` (channelwise, vectors over ``u``) and ``uvw`` and ``uuw``
(a per-row weight matrix contracted over ``u``: 2-D ``(u, w)`` tiles reduced on chip).
The kernels take the descriptor's :attr:`~jequi.TensorProductDescriptor.trilinear` view, in
which every path is weighted.

Each kernel computes a sum of trilinear terms (:func:`forward_sum`, :func:`backward_sum`):
the first-order ops have one term, the fused double backward of :mod:`jequi.autodiff` up to
three per result, sharing every load of a row. The forward splits wide outputs over
programs by output segment (:func:`forward_groups`); the backward runs a program per ``x``
segment (:func:`backward_groups`) and per window of its channels (:func:`channel_windows`)
where that was measured to pay.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .lowering import fma, multiply_adds, pallas_call

SUPPORTED_MODES = ("uvu", "uuu", "uvw", "uuw")
# Which of ``(gx, gy, gw)`` a backward kernel computes (``needs``): a backward for a
# derivative that cannot use all three generates no code, and no output, for the others.
ALL = (True, True, True)
_MAX_CHUNK = 128


def chunks(mul: int, window: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """``range(mul)``, or its part in the channel `window` ``(start, stop)``, as ``(start,
    size)`` pieces of power-of-two sizes (at most 128)."""
    start, stop = (0, mul) if window is None else (min(window[0], mul), min(window[1], mul))
    out = []
    while start < stop:
        size = min(_MAX_CHUNK, 1 << ((stop - start).bit_length() - 1))
        out.append((start, size))
        start += size
    return out


def unsupported_modes(desc) -> set[str]:
    return {p.mode for p in desc.active_paths} - set(SUPPORTED_MODES)


def _iota(idx: np.ndarray):
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


def _key(idx: np.ndarray):
    return idx.shape, idx.tobytes()


def storer(ref, base):
    """``store(idx, value)``: write `value` at static positions `idx` after `base` in `ref`."""

    def store(idx, value):
        ref[base + _iota(idx)] = value

    return store


class Row:
    """Cached loads from one row of a flat ref (``base`` = row offset, or 0 for shared refs).
    Loads name elements by their positions in the descriptor's layout; a row stored in
    another layout gives ``positions`` (:func:`jequi.descriptor.layout_positions`)."""

    def __init__(self, ref, base, positions: np.ndarray | None = None):
        self.ref, self.base, self.positions, self.cache = ref, base, positions, {}

    def load(self, idx):
        idx = np.asarray(idx)
        if _key(idx) not in self.cache:
            at = idx if self.positions is None else self.positions[idx]
            self.cache[_key(idx)] = self.ref[self.base + _iota(at)]
        return self.cache[_key(idx)]


def _add(a, b):
    return b if a is None else a + b


def _madd(acc, a, b):
    """``acc + a * b`` as one fused multiply-add (:func:`~.lowering.fma`); ``a * b`` when
    `acc` is None."""
    return a * b if acc is None else fma(a, b, acc)


def _dot(pairs, zeros=None, start=None):
    """``start + sum(a * b for a, b in pairs)`` as a chain of multiply-adds (`start` None:
    no start; then ``zeros()`` when there are no pairs; without `zeros`, there must be
    some)."""
    total = start
    for a, b in pairs:
        total = _madd(total, a, b)
    return zeros() if total is None else total


def _sum(values, zeros=None):
    """The sum of `values` (arrays) without a leading ``0 +`` (a float add the compiler
    must keep); ``zeros()`` when there are none (without `zeros`, there must be some)."""
    total = None
    for v in values:
        total = _add(total, v)
    return zeros() if total is None else total


def _cg_terms(p):
    """The path's nonzeros as a list of (i, j, k, coeff) with Python scalars."""
    return [(int(i), int(j), int(k), float(c)) for i, j, k, c in zip(*p.nonzeros())]


def _contract_y(terms, y):
    """``T[(i, k)] = sum_j c_ijk * y(j)`` (y returns a scalar or a vector)."""
    t = {}
    for i, j, k, c in terms:
        t[(i, k)] = _madd(t.get((i, k)), c, y(j))
    return t


def _contract_x(t, x):
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
            values.extend(a if a is not None else jnp.zeros((cs,), triples[0][0].ref.dtype) for a in acc)
    return values


def _forward_path(desc, p, c0, cs, rx, ry, rw, acc):
    in1, in2 = desc.in1[p.i_in1].index(), desc.in2[p.i_in2].index()
    terms = _cg_terms(p)
    m2, mo = p.mul_in2, p.mul_out
    if p.mode in ("uvu", "uuu"):
        u = np.arange(c0, c0 + cs)
        x = lambda i: rx.load(in1[c0 : c0 + cs, i])  # noqa: E731
        if p.mode == "uvu":
            for v in range(m2):
                a = _contract_x(_contract_y(terms, lambda j: ry.load(in2[v, j])), x)
                wv = rw.load(p.weight_offset + u * m2 + v)
                for k, val in a.items():
                    acc[k] = _madd(acc[k], wv, val)
        else:
            a = _contract_x(_contract_y(terms, lambda j: ry.load(in2[c0 : c0 + cs, j])), x)
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
                t = _contract_x(_contract_y(terms, lambda j: ry.load(in2[v, j])), x)
                widx = p.weight_offset + (u[:, None] * m2 + v) * mo + w[None, :]
            else:
                t = _contract_x(_contract_y(terms, lambda j: ry.load(in2[u0 : u0 + cu, j])), x)
                widx = p.weight_offset + u[:, None] * mo + w[None, :]
            wt = rw.load(widx)
            for k, val in t.items():
                acc[k] = _add(acc[k], jnp.sum(wt * val[:, None], axis=0))


# --- backward -------------------------------------------------------------------------------
# How the backward's cross-lane sums (``gy`` of ``uv*`` modes: one sum over ``u`` per ``y``
# element) are taken: "tile" joins the lane vectors of consecutive positions into one
# (lanes, positions) tile and reduces it once (one shared-memory round trip across warps);
# "element" reduces each lane vector on its own (a round trip and barriers per element).
# "tile" halves the barrier stalls and is the faster (benchmarks/tune_conv.py --lane-sums
# element,tile; docs/tuning.md#tensor_product-lane_sums).
LANE_SUMS = "tile"
# Lane vectors narrower than a warp stay per element: Triton's compiler crashed (segfault,
# JAX 0.11.2) on the joins of 4- and 1-lane vectors (docs/tuning.md#tensor_product-tile_min_lanes).
TILE_MIN_LANES = 32


def _bit_reversed(n: int) -> list[int]:
    bits = n.bit_length() - 1
    return [int(format(k, f"0{bits}b")[::-1], 2) if bits else 0 for k in range(n)]


def lane_tile_sum(vectors: list) -> jax.Array:
    """``[sum(v) for v in vectors]`` as one vector, by a single reduction of a
    ``(lanes, len(vectors))`` tile (``len(vectors)`` a power of two, equal lane counts). The
    tile is built by pairwise ``stack`` (Triton's ``join``, the one stacking its lowering
    has); each join adds an innermost axis, so the flat tile order is bit-reversed and the
    input is fed in bit-reversed order."""
    n = len(vectors)
    level = [vectors[k] for k in _bit_reversed(n)]
    while len(level) > 1:
        level = [jnp.stack([a, b], axis=-1) for a, b in zip(level[::2], level[1::2])]
    return jnp.sum(level[0].reshape(vectors[0].shape[0], n), axis=0)


class _Grads:
    """Per-row gradient accumulators, stored once at the end of the row; they start from
    `start`, a value per slot of :func:`slots` ``(segments)`` (a running sum; no channel
    window), if given."""

    def __init__(self, segments=(), start=()):
        # _key(index array) -> vector; seeds are keyed by slots without a channel window
        self.vec = {_key(idx): value for idx, value in zip(slots(segments), start, strict=True)} if start else {}
        self.scalar = {}  # (flat position, lanes) -> lane vector, summed at the end

    def add_vec(self, idx, pairs):
        """Add ``sum(a * b for a, b in pairs)`` at the positions `idx`."""
        self.vec[_key(idx)] = _dot(pairs, start=self.vec.get(_key(idx)))

    def add_lanes(self, pos, pairs):
        """Add the sum over lanes of ``sum(a * b for a, b in pairs)`` (lane vectors) at a flat
        position; the cross-lane sum is taken once, in store."""
        pairs = list(pairs)
        key = (int(pos), np.broadcast_shapes(*(np.shape(v) for pair in pairs for v in pair))[0])
        self.scalar[key] = _dot(pairs, start=self.scalar.get(key))

    def values(self, segments, dtype) -> list:
        """The row as a value per slot of :func:`slots` ``(segments)`` (zeros where nothing
        accumulated)."""
        return [self._value(idx, dtype) for idx in slots(segments)]

    def _value(self, idx, dtype):
        lanes = jnp.arange(idx.shape[0])
        value = self.vec.get(_key(idx))
        for n, pos in enumerate(idx):
            parts = [jnp.sum(v) for (p, _), v in self.scalar.items() if p == int(pos)]
            if parts:
                value = _add(value, jnp.where(lanes == n, _sum(parts), 0).astype(dtype))
        return value if value is not None else jnp.zeros(idx.shape, dtype)

    def _tile_sums(self, segments, store, dtype, window) -> set:
        """With ``LANE_SUMS == "tile"``: store the slots whose elements have lane sums only,
        all at least :data:`TILE_MIN_LANES` wide, in contiguous power-of-two runs of
        positions, one tile reduction per run and lane count; returns the positions stored."""
        if LANE_SUMS != "tile":
            return set()
        vec_positions = {int(q) for idx in slots(segments, window) if _key(idx) in self.vec for q in idx}
        wide = {n for _, n in self.scalar if n >= TILE_MIN_LANES}
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
                        total = _add(total, lane_tile_sum([self.scalar.get((p, n), zero) for p in positions]))
                store(np.asarray(positions), total.astype(dtype))
        return done

    def store(self, segments, store, dtype, window=None):
        """Store every element of the row (of its channels in `window`)."""
        done = self._tile_sums(segments, store, dtype, window)
        for idx in slots(segments, window):
            if not set(map(int, idx)) <= done:
                store(idx, self._value(idx, dtype))


def inactive_paths(desc) -> list:
    """Weighted paths that touch no data (a zero multiplicity): their gradient is zero."""
    return [p for p in desc.paths if p.weight_numel and p not in desc.active_paths]


def zero_weights(paths, store_gw, dtype, lead=()):
    """Store zero ``gw`` for `paths` (vectors of their weight chunks, with leading shape `lead`)."""
    for p in paths:
        for c0, cs in chunks(p.weight_numel):
            store_gw(p.weight_offset + np.arange(c0, c0 + cs), jnp.zeros((*lead, cs), dtype))


class Pairs(NamedTuple):
    """What a backward row sums, as pairs of input rows (:class:`Row`): ``gx`` is the sum of
    ``B_x(y, w)`` over its ``(y, w)`` pairs, ``gy`` of ``B_y(x, w)`` over ``(x, w)``, ``gw`` of
    ``B_w(x, y)`` over ``(x, y)``, all against the output cotangent ``g``. The first-order
    backward has one pair per gradient it needs, the double backward's ``d x, d y, d w`` two
    each (:mod:`jequi.autodiff`); an empty tuple: that gradient is not computed."""

    gx: tuple = ()
    gy: tuple = ()
    gw: tuple = ()


def _unique(rows) -> list:
    return list(dict.fromkeys(rows))


def backward_row(desc, rg: Row, pairs: Pairs, store_gw, paths, window=None, gx_start=((), ())):
    """One row of the backward of `paths` (of their x channels in `window`, for products with
    ``uv*`` paths only, :func:`channel_windows`): stores their ``gw`` and returns the ``gx``
    and ``gy`` accumulators (:class:`_Grads`) of `pairs` (``store_gw`` is unused without
    ``gw`` pairs); ``gx`` starts from ``gx_start = (in1 segments, a value per slot)``."""
    gx, gy = _Grads(*gx_start), _Grads()
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
        key, value = ((i, j), g[k]) if by_ij else ((j, k), x(i))
        partial[key] = _madd(partial.get(key), c, value)
    q = {}
    for (a, b), value in partial.items():
        j, other = (b, x(a)) if by_ij else (a, g[b])
        q[j] = _madd(q.get(j), other, value)
    return q


def _backward_path(desc, p, rg, pairs: Pairs, gx, gy, store_gw, window):
    assert window is None or p.mode in ("uvu", "uvw"), "a uu* path's gy would split by x channel"
    in1, in2 = desc.in1[p.i_in1].index(), desc.in2[p.i_in2].index()
    out = desc.out[p.i_out].index()
    terms = _cg_terms(p)
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
                    zeros = lambda: jnp.zeros((cs,), rg.ref.dtype)  # noqa: E731
                    store_gw(widx, _dot(((y_at(ry, j), qj) for rx, ry in pairs.gw for j, qj in q[rx].items()), zeros))
                if pairs.gx:
                    t = {ry: _contract_y(terms, lambda j, ry=ry: y_at(ry, j)) for ry in _unique(ry for ry, _ in pairs.gx)}
                    for i in sorted({i for i, _, _, _ in terms}):
                        gx.add_vec(
                            in1[c0 : c0 + cs, i],
                            (
                                (rw.load(widx), _dot((g[k], tv) for (i2, k), tv in t[ry].items() if i2 == i))
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
                    ry: _contract_y(terms, lambda j, ry=ry: y_at(ry, j))
                    for ry in _unique([ry for ry, _ in pairs.gx] + [ry for _, ry in pairs.gw])
                }
                if pairs.gw:
                    a = {}
                    for rx, ry in pairs.gw:
                        for k, value in _contract_x(t[ry], lambda i, rx=rx: x_at(rx, i)).items():
                            a[k] = _add(a.get(k), value)
                    zeros = lambda: jnp.zeros((cu, cs), rg.ref.dtype)  # noqa: E731
                    store_gw(widx, _sum((a[k][:, None] * g[k][None, :] for k in a), zeros))
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


def input_groups(desc) -> list[tuple[list[int], list]]:
    """``(in1 segments, paths)`` per backward program: one group per ``x`` segment that has
    paths (their ``gx`` slots and ``gw`` blocks are disjoint, so a group needs no other
    group's sums; ``gz`` is only read; ``gy`` is the one shared output). Segments without paths go to
    the first group (their ``gx`` is zero)."""
    groups = [([s], [p for p in desc.active_paths if p.i_in1 == s]) for s in range(len(desc.in1))]
    used = [g for g in groups if g[1]]
    if not used:
        return [(list(range(len(desc.in1))), [])]
    used[0][0].extend(s for s, paths in groups if not paths)
    return used


# The batched backward's programs per group, each for a window of x channels: None, the rule
# of :func:`channel_windows`; a number forces at most that many (tune_conv.py --channel-windows).
CHANNEL_WINDOWS: int | None = None


def channel_windows(desc, dtype) -> list[tuple[int, int] | None]:
    """The x-channel windows of the batched backward's programs: ``[None]`` (all channels in
    one program), or windows of one power-of-two width over the widest x segment (forced:
    :data:`CHANNEL_WINDOWS` of them at most), each a program of its own with fewer live
    values. Only for products whose paths are all ``uvu`` or ``uvw``: there ``gx`` and ``gw``
    split by x channel and ``gy`` (one slot per y channel, summed over x channels) is a
    partial per program; a ``uu*`` path's ``gy`` would split by channel too. The rule: two
    windows for channelwise (``uvu``) products in float64 where every x segment has at least
    128 channels (two or more per lane of their one-warp backward programs); else one. Two
    windows paid for MACE-large in float64 and lost for narrower or mixed products and in
    float32 (docs/tuning.md#tensor_product-channel_windows). The conv's backward splits its
    programs by paths instead (:func:`pallas_kernels.conv.backward_programs`)."""
    modes = {p.mode for p in desc.active_paths}
    n = CHANNEL_WINDOWS
    if n is None:
        wide = min(seg.mul for seg in desc.in1) >= 128
        n = 2 if jnp.dtype(dtype) == jnp.float64 and modes == {"uvu"} and wide else 1
    if n == 1 or not modes <= {"uvu", "uvw"}:
        return [None]
    widest = max(seg.mul for seg in desc.in1)
    width = 1 << max(0, (-(-widest // n) - 1).bit_length())
    return [(a, a + width) for a in range(0, widest, width)]


def output_groups(desc, per_thread: int, warps: int) -> list[list[int]]:
    """Output segments in consecutive groups of at most `per_thread` elements per thread of a
    forward program of `warps` warps, each a program of its own (whose outputs stay in
    registers until its stores); a segment larger than the budget is a group alone."""
    budget = per_thread * 32 * warps
    groups, size = [[]], 0
    for s, seg in enumerate(desc.out):
        if groups[-1] and size + seg.size > budget:
            groups.append([])
            size = 0
        groups[-1].append(s)
        size += seg.size
    return groups


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


# Batch rows per program of the batched product; None: :func:`rows_per_program`'s rule (a
# knob for benchmarks/tune_conv.py --rows).
ROWS_PER_PROGRAM: int | None = None


def rows_per_program(desc, n: int, forward: bool = False) -> int:
    """Rows per program of the batched kernels: 8 for a channelwise product from 8,192 rows
    (2 for its `forward` in ``ir_mul`` on one warp per program), else 1: several rows paid for
    channelwise products and lost for ``uvw`` ones, and the one-warp ``ir_mul`` forwards were
    fastest, or close to it, at two (results/2026-11-21-h200-ab.md;
    docs/tuning.md#tensor_product-rows_per_program)."""
    if ROWS_PER_PROGRAM is not None:
        return ROWS_PER_PROGRAM
    if not channelwise(desc) or n < 8 * 1024:
        return 1
    return 2 if forward and desc.layout == "ir_mul" and batched_warps(desc) == 1 else 8


# Warps per forward / backward program; None: :func:`num_warps`' rule. Knobs for
# benchmarks/tune_conv.py. Fewer warps give each thread several channels, over which the
# per-row scalar work (the CG coefficients times y, the same in every thread) is shared.
FORWARD_WARPS: int | None = None
BACKWARD_WARPS: int | None = None


def num_warps(desc, backward: bool = False) -> int:
    """One thread per lane of the widest channel chunk (4 warps for 128 channels, 1 for 32):
    narrower problems then run more programs per SM instead of idling threads. The backward
    of a channelwise (``uvu``) product runs one warp per program: its ``gy`` cross-lane sums
    then stay in warp shuffles, without shared memory or barriers
    (docs/tuning.md#tensor_product-num_warps). Products with ``uvw``/``uuw``
    paths keep the forward's warps: their 2-D ``(u, w)`` tiles would not fit one warp's
    registers (but see :func:`batched_warps`).

    The forward of a channelwise product in the ``ir_mul`` layout at least 128 channels wide
    runs one warp too: a component's channels are contiguous there, and a thread that owns
    several neighbouring channels loads and stores them as one vector (in ``mul_ir`` they are
    strided by the irrep's dimension, and one warp was slower). With one warp a float32 row
    has 4x the outputs per thread, so :func:`forward_groups` gives MACE-large (and NequIP-OAM)
    a program per output segment; the two changes were measured together, through the
    :data:`FORWARD_WARPS` knob. Narrower products keep the width rule (two warps for 64
    channels), faster there (docs/tuning.md#tensor_product-num_warps). The conv forward has
    its own rule, :func:`pallas_kernels.conv.forward_warps`."""
    knob = BACKWARD_WARPS if backward else FORWARD_WARPS
    if knob is not None:
        return knob
    if channelwise(desc) and (
        backward and "uvu" in {p.mode for p in desc.active_paths}
        or not backward and desc.layout == "ir_mul" and widest_chunk(desc) >= 128
    ):
        return 1
    return max(1, min(4, widest_chunk(desc) // 32))


# The most values of a uvw/uuw path's (u, w) tile (:func:`largest_tile`) for which its product
# runs the batched kernels on one warp per program (:func:`batched_warps`); DiffDock's 32 x 32
# tiles ran one warp already.
ONE_WARP_TILE = 1024


def batched_warps(desc, backward: bool = False) -> int:
    """Warps per program of the batched forward (or `backward`): :func:`num_warps`, but one
    for a product of ``uvw``/``uuw`` paths only whose ``(u, w)`` tiles all hold at most
    :data:`ONE_WARP_TILE` values, forward and backward: the tiles' sums over ``u`` then stay in
    warp shuffles, faster in both dtypes (docs/tuning.md#tensor_product-batched_warps). The
    conv keeps :func:`num_warps` (not measured there)."""
    knob = BACKWARD_WARPS if backward else FORWARD_WARPS
    modes = {p.mode for p in desc.active_paths}
    if knob is None and modes and modes <= {"uvw", "uuw"} and largest_tile(desc) <= ONE_WARP_TILE:
        return 1
    return num_warps(desc, backward)


def largest_tile(desc) -> int:
    """The most values of a ``uvw``/``uuw`` path's ``(u, w)`` tile (channel chunks of ``x``
    times of the output, :func:`chunks`); 0 without such paths."""
    widest = lambda mul: max(size for _, size in chunks(mul))  # noqa: E731
    tiles = [widest(p.mul_in1) * widest(p.mul_out) for p in desc.active_paths if p.mode in ("uvw", "uuw")]
    return max(tiles, default=0)


def channelwise(desc) -> bool:
    """Whether every path of the product is ``uvu`` or ``uuu`` (vectors over channels)."""
    modes = {p.mode for p in desc.active_paths}
    return bool(modes) and modes <= {"uvu", "uuu"}


def widest_chunk(desc) -> int:
    """The most channels of one vector (:func:`chunks`) in the product's x and z rows."""
    return max((size for s in (*desc.in1, *desc.out) for _, size in chunks(s.mul)), default=32)


# The kernels compute sums of trilinear terms (:mod:`jequi.autodiff`): a term names its
# operands by position in the kernel's ``arrays``; an array with one dimension is shared by
# every row (shared weights). The first-order ops, with arrays ``(x, y, w)``:
FORWARD_TERMS = ((0, 1, 2),)


def backward_terms(needs=ALL) -> tuple:
    """The first-order backward's pairs (arrays ``(x, y, w)``) for the gradients in `needs`."""
    return tuple(pair if need else () for pair, need in zip((((1, 2),), ((0, 2),), ((0, 1),)), needs))


def pairs_of(terms, rows: dict) -> Pairs:
    """The :class:`Pairs` of rows for backward `terms` (pairs of array positions per gradient)."""
    return Pairs(*(tuple((rows[i], rows[j]) for i, j in pairs) for pairs in terms))


def used_positions(terms) -> list[int]:
    """The array positions some term reads (the kernel gets refs for these only)."""
    return sorted({a for term in terms for a in term})


def row_refs(arrays, refs: dict, b) -> dict:
    """A :class:`Row` per array position in `refs` (position -> ref): row `b` of a per-row
    array, the whole of a shared (1-D) one."""
    return {a: Row(ref, 0 if arrays[a].ndim == 1 else b * arrays[a].shape[1]) for a, ref in refs.items()}


# The batched forward's programs per block of rows, by output segments (:func:`output_groups`):
# None, the rule of :func:`forward_groups`; a number, groups of at most that many output
# elements per thread (0: a program per segment; tune_conv.py --forward-accumulators).
FORWARD_ACCUMULATORS: int | None = None
# float32 rows with more output elements per thread than this get a program per segment.
FORWARD_OUTPUTS_PER_THREAD = 128


def forward_groups(desc, dtype) -> list[list[int]]:
    """The batched forward's program groups of output segments: a program per segment in
    float64 (measured faster, whatever the width), for a product with paths that contract over
    channels (``uvw``, ``uuw``), and in float32 where a row's outputs exceed
    :data:`FORWARD_OUTPUTS_PER_THREAD` per thread
    (a row's outputs stay in registers until its stores: storing each segment early was
    slower, the loads after a store no longer overlap, results/2026-11-21-h200-ab.md); else
    one. A program reads only its paths' inputs, and a ``uvw`` product's programs hold fewer
    sums. Groups under a budget of outputs per thread were no better than one of the two
    (docs/tuning.md#tensor_product-forward_groups)."""
    if FORWARD_ACCUMULATORS is not None:
        return output_groups(desc, FORWARD_ACCUMULATORS, batched_warps(desc))
    wide = desc.dims[2] > FORWARD_OUTPUTS_PER_THREAD * 32 * batched_warps(desc)
    if jnp.dtype(dtype) == jnp.float64 or not channelwise(desc) or wide:
        return output_groups(desc, 0, batched_warps(desc))
    return [list(range(len(desc.out)))]


# Whether the batched forward's multiply-adds are fused instructions (:func:`~.lowering.fma`);
# None: except in float64, where separate ones were the faster; in float32 the two are close
# but for one product, faster fused (docs/tuning.md#tensor_product-fused_forward).
FUSED_FORWARD: bool | None = None


def fused_forward(dtype) -> bool:
    """Whether a forward's multiply-adds are fused (:data:`FUSED_FORWARD`)."""
    return jnp.dtype(dtype) != jnp.float64 if FUSED_FORWARD is None else FUSED_FORWARD


@functools.partial(jax.jit, static_argnames=("desc", "terms"))
def forward_sum(desc, arrays, *, terms=FORWARD_TERMS):
    """``z (N, out.dim) = sum of f(arrays[a], arrays[b], arrays[c]) over (a, b, c) in terms``:
    ``x``-like arrays ``(N, in1.dim)``, ``y``-like ``(N, in2.dim)``, ``w``-like ``(N, nw)`` or
    shared ``(nw,)`` (None where no term reads it)."""
    used = used_positions(terms)
    n = arrays[terms[0][0]].shape[0]
    do = desc.dims[2]
    rpp = rows_per_program(desc, n, forward=True)
    dtype = arrays[terms[0][0]].dtype
    groups = forward_groups(desc, dtype)
    fused = fused_forward(dtype)

    def kernel(*refs):
        *in_refs, z_ref = refs
        group = pl.program_id(0)  # read outside the loops (interpret mode needs it there)

        def row(b):
            for gi, outputs in enumerate(groups):

                @pl.when(group == gi)
                def _():  # loads cached inside the branch: a group loads only its paths' inputs
                    r = row_refs(arrays, dict(zip(used, in_refs)), b)
                    with multiply_adds(fused):
                        values = forward_values(desc, [(r[i], r[j], r[k]) for i, j, k in terms], outputs)
                    store = storer(z_ref, b * do)
                    for idx, value in zip(slots([desc.out[s] for s in outputs]), values):
                        store(idx, value)

        rows_loop(n, rpp, row, axis=1)

    # groups first, so the programs of one block of rows are launched side by side and can
    # share its x and y reads in L2 (the other order was not measured)
    grid = (len(groups), pl.cdiv(n, rpp))
    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * do,), dtype), grid, batched_warps(desc), name="jequi_tp_fwd")(
        *(arrays[a].reshape(-1) for a in used)
    )
    return z.reshape(n, do)


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


# Programs of the batched backward per block of rows: one for the whole row, or one per
# :func:`input_groups` group (each program holds one x segment's gradients and paths, fewer
# live values, and writes a partial gy; the partials are added after, :func:`add_parts`). None: the rule of
# :func:`backward_groups`; True / False force it (benchmarks/tune_conv.py --backward-groups).
BACKWARD_GROUPS: bool | None = None


def backward_groups(desc, dtype) -> list[tuple[list[int], list]]:
    """The batched backward's program groups: :func:`input_groups` for channelwise products,
    and in float64 for products whose x segments are all at least 8 channels wide; else one.
    Groups paid there (each program holds fewer live values) and lost for float32 ``uvw``
    products and for x segments of one channel (docs/tuning.md#tensor_product-backward_groups)."""
    grouped = BACKWARD_GROUPS
    if grouped is None:
        wide = all(seg.mul >= 8 for seg in desc.in1)
        grouped = channelwise(desc) or (jnp.dtype(dtype) == jnp.float64 and wide)
    return input_groups(desc) if grouped else [(list(range(len(desc.in1))), desc.active_paths)]


# Whether the batched double backward sums ``dgz`` (a forward over its triples) in the
# backward's programs (:func:`second_sum`, where :func:`fuses_second`) rather than in a forward
# kernel of its own that reads the rows again. None: where a row's outputs number at most
# :data:`SECOND_OUTPUTS`. Each fused program holds its partial ``dgz`` row, every output, beside
# the backward's sums, where the forward kernel holds one output segment per program in
# float64 and for ``uvw``. Fusing paid for a product of 7 outputs and lost for one of 156; none
# between was timed: 32 (a warp's lanes) is a choice inside that gap, not a measured edge
# (docs/tuning.md#tensor_product-fused_second).
FUSED_SECOND: bool | None = None
SECOND_OUTPUTS = 32


def fuses_second(desc, dtype, triples, pairs) -> bool:
    """Whether :func:`second_sum` computes the double backward's ``dgz`` (`triples`) with its
    gradients (`pairs`): both wanted, :data:`FUSED_SECOND` (or its rule), the programs not split
    by channel windows, and their partial ``dgz`` rows (one per program, added after as
    ``gy``'s) fewer values than the row of ``x, y, w`` the forward kernel would read again."""
    d1, d2, do = desc.dims
    wanted = do <= SECOND_OUTPUTS if FUSED_SECOND is None else FUSED_SECOND
    if not (wanted and triples and any(pairs)) or channel_windows(desc, dtype) != [None]:
        return False
    return len(backward_groups(desc, dtype)) * do <= d1 + d2 + desc.weight_numel


def backward_sum(desc, g, arrays, *, terms, shared_weights: bool):
    """``(gx, gy, gw)``: each the sum of the backward over its pairs in ``terms = (gx pairs,
    gy pairs, gw pairs)`` (pairs of positions in `arrays`, which :func:`pairs_of` turns into
    the rows of a :class:`Pairs`) against the output cotangent ``g (N, out.dim)``; None for a
    gradient without pairs. With `shared_weights`, ``gw`` is summed over rows."""
    return _backward(desc, g, arrays, terms=terms, triples=(), shared_weights=shared_weights)[:3]


def second_sum(desc, g, arrays, *, triples, terms, shared_weights: bool):
    """``(gx, gy, gw, dgz)``: :func:`backward_sum` over `terms` and :func:`forward_sum` over
    `triples` in one kernel, whose programs read each row's operands once for both (see
    :func:`fuses_second` for where it pays)."""
    return _backward(desc, g, arrays, terms=terms, triples=triples, shared_weights=shared_weights)


@functools.partial(jax.jit, static_argnames=("desc", "terms", "triples", "shared_weights"))
def _backward(desc, g, arrays, *, terms, triples, shared_weights: bool):
    """:func:`backward_sum`, and with `triples` the forward sum over them too (last)."""
    n = g.shape[0]
    d1, d2, do = desc.dims
    nw = desc.weight_numel
    rpp = rows_per_program(desc, n)
    dtype = g.dtype
    used = used_positions([pair for pairs in terms for pair in pairs] + list(triples))
    needs = tuple(bool(pairs) for pairs in terms)
    windows = channel_windows(desc, dtype)
    assert not triples or windows == [None], "a channel window's forward would split its outputs' channels"
    groups = [(*group, window) for group in backward_groups(desc, dtype) for window in windows]
    sizes = (d1, len(groups) * d2, nw)
    shapes, unpack = needed_outputs(needs, [jax.ShapeDtypeStruct((n * d,), dtype) for d in sizes])
    if triples:  # a partial dgz row per program, over its paths
        shapes.append(jax.ShapeDtypeStruct((len(groups) * n * do,), dtype))

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
                    gx, gy = backward_row(desc, Row(g_ref, b * do), pairs_of(terms, r), store_gw, paths, window)
                    if gi == 0 and gw_ref is not None:
                        zero_weights(inactive_paths(desc), store_gw, dtype)
                    if gx_ref is not None:
                        gx.store([desc.in1[s] for s in segments], storer(gx_ref, b * d1), dtype, window)
                    if gy_ref is not None:
                        gy.store(desc.in2, storer(gy_ref, (gi * n + b) * d2), dtype)
                    if dgz_ref is not None:
                        with multiply_adds(fused_forward(dtype)):
                            values = forward_values(desc, [(r[i], r[j], r[k]) for i, j, k in triples], paths=paths)
                        store = storer(dgz_ref, (gi * n + b) * do)
                        for idx, value in zip(slots(desc.out), values):
                            store(idx, value)

        rows_loop(n, rpp, row)

    grid = (pl.cdiv(n, rpp), len(groups))
    results = pallas_call(kernel, shapes, grid, batched_warps(desc, backward=True), name="jequi_tp_bwd")(
        g.reshape(-1), *(arrays[a].reshape(-1) for a in used)
    )
    gx, gy, gw = unpack(results)
    if gy is not None:
        gy = add_parts(gy.reshape(len(groups), n, d2))
    return (
        None if gx is None else gx.reshape(n, d1),
        gy,
        weight_gradient(gw, n, nw, shared_weights),
        add_parts(results[-1].reshape(len(groups), n, do)) if triples else None,
    )


def weight_gradient(gw, n: int, nw: int, shared_weights: bool):
    """The batched backward's flat per-row ``gw`` output as ``(n, nw)``, summed over rows for
    shared weights (by XLA: a pass over ``n x nw``); None stays None."""
    if gw is None:
        return None
    gw = gw.reshape(n, nw)
    return gw.sum(0) if shared_weights else gw
