"""What each warp of a generated CUDA kernel computes, derived from the descriptor.

The CUDA kernels run channelwise (``uvu``) products, a few adjacent channels per lane. A ``uvu`` path
``z[u, k] += sum_{v, i, j} w[u, v] cg[i, j, k] x[u, i] y[v, j]`` splits into :class:`Term`\\ s,
one per ``v``: for a fixed ``y`` row the term's coefficients collapse into a small matrix
``A[i, k] = sum_j cg[i, j, k] y[v, j]`` (the same for every channel), and each lane then computes
``z[u, k] += w[u, v] * sum_i A[i, k] x[u, i]``. The kernels build ``A`` once per edge (or row)
in shared memory, from the coefficients below as literals, and every lane reads it by broadcast.

A :class:`Program` is a set of terms of one multiplicity, run by one warp per ``32 * channels``
channels. Forward programs own output segments (their sums stay in
registers); backward programs own ``x`` segments (their ``gx`` sums), so no two warps write the
same element. :func:`forward_programs` and :func:`backward_programs` partition the terms, balanced
by arithmetic and bounded by a register budget (:class:`~.config.Config`).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from jequi.descriptor import CG_ZERO, Path, Segment, TensorProductDescriptor
from jequi.sums import BACKWARD, FORWARD, Sums

LANES = 32
SUPPORTED_MODES = ("uvu",)


@dataclasses.dataclass(frozen=True, eq=False)
class Term:
    """Slice ``v`` of a ``uvu`` path (see the module docstring)."""

    path: Path
    v: int
    x: Segment
    y: Segment
    out: Segment

    @property
    def cg(self) -> np.ndarray:
        return self.path.cg

    @property
    def y_positions(self) -> np.ndarray:
        """Flat positions of the ``y`` components ``j`` of slice ``v``."""
        return self.y.index()[self.v]

    def weight_position(self, u: str) -> str:
        """C expression of the flat weight index of channel `u` (e3nn's ``(mul1, mul2)``
        row-major path weights)."""
        m2 = self.path.mul_in2
        return f"{self.path.weight_offset + self.v} + {u} * {m2}" if m2 > 1 else f"{self.path.weight_offset} + {u}"

    @functools.cached_property
    def entries(self) -> tuple[tuple[int, int], ...]:
        """The ``(i, k)`` of ``A`` that some coefficient reaches, ``i``-major."""
        nz = np.abs(self.cg).max(axis=1) > CG_ZERO
        return tuple((int(i), int(k)) for i, k in zip(*np.nonzero(nz)))

    def entry_terms(self, i: int, k: int) -> list[tuple[int, float]]:
        """``A[i, k] = sum of coeff * y[position]`` over these ``(position, coeff)``."""
        col = self.cg[i, :, k]
        return [(int(self.y_positions[j]), float(col[j])) for j in np.nonzero(np.abs(col) > CG_ZERO)[0]]

    @functools.cached_property
    def nonzeros(self) -> tuple[tuple[int, int, int, float], ...]:
        """``(i, j, k, coeff)`` of the nonzero coefficients, ``(i, k)``-major."""
        i, j, k = np.nonzero(np.abs(self.cg) > CG_ZERO)
        order = np.lexsort((j, k, i))
        return tuple((int(i[n]), int(j[n]), int(k[n]), float(self.cg[i[n], j[n], k[n]])) for n in order)

    @property
    def forward_cost(self) -> int:
        return len(self.entries) + self.x.ir_dim

    @property
    def backward_cost(self) -> int:
        # per channel, as one channel per lane pays it; lanes of several channels share the
        # coefficients into gy (codegen), but the measured schedules were chosen on this cost
        pairs = len({(i, k) for i, _, k, _ in self.nonzeros})
        return 2 * len(self.entries) + 3 * self.x.ir_dim + pairs + len(self.nonzeros)


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """The terms a group of warps computes, `channels` consecutive channels per lane (a warp
    per ``32 * channels`` channels of `mul`; the warps run one copy of the code: the channel
    offset is the warp's place in the group). `prefetch`: the next edge's (row's) operands
    are loaded into registers before this one's arithmetic, where the kernel's limit allows
    (``Config.prefetch``, ``batched_float32_backward_prefetch``)."""

    mul: int
    terms: tuple[Term, ...]
    channels: int = 1
    prefetch: bool = True

    @property
    def warps(self) -> int:
        return -(-self.mul // (LANES * self.channels))

    @property
    def x_segments(self) -> list[Segment]:
        return _unique(t.x for t in self.terms)

    @property
    def out_segments(self) -> list[Segment]:
        return _unique(t.out for t in self.terms)

    @property
    def y_positions(self) -> list[int]:
        """The ``y`` positions its terms read (its ``gy`` components), sorted."""
        return sorted({int(p) for t in self.terms for p in t.y_positions})


def _unique(items):
    out, seen = [], set()
    for item in items:
        if id(item) not in seen:
            seen.add(id(item))
            out.append(item)
    return out


def unsupported(desc: TensorProductDescriptor) -> set[str]:
    """Modes of `desc` the CUDA kernels do not run."""
    return {p.mode for p in desc.active_paths} - set(SUPPORTED_MODES)


@functools.lru_cache(maxsize=256)
def terms(desc: TensorProductDescriptor) -> tuple[Term, ...]:
    """The terms of the active paths of `desc` (its trilinear view: every path weighted); the
    same objects on every call, so schedules of one descriptor can be compared by identity. A
    path whose coefficients are all below the kernels' zero (a vanishing path weight) has none:
    what it would write is zeroed (:attr:`~jequi.TensorProductDescriptor.untouched`)."""
    out = []
    for p in desc.active_paths:
        assert p.mode == "uvu" and p.has_weight, p
        if not np.any(np.abs(p.cg) > CG_ZERO):
            continue
        for v in range(p.mul_in2):
            out.append(Term(p, v, desc.in1[p.i_in1], desc.in2[p.i_in2], desc.out[p.i_out]))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def outputs_follow_x(desc: TensorProductDescriptor) -> bool:
    """Whether each output segment of `desc` is reached from one ``x`` segment only (as in
    every channelwise product of the catalogue: one path per output segment), so that the
    backward's programs, which own ``x`` segments, own the output segments too."""
    xs: dict[int, set[int]] = {}
    for t in terms(desc):
        xs.setdefault(id(t.out), set()).add(id(t.x))
    return all(len(v) == 1 for v in xs.values())


def _partition(items, cost, size, bins: int, budget: int) -> list[list]:
    """Greedy longest-processing-time partition of `items` into at most `bins` non-empty
    groups, each of total `size` at most `budget` where possible."""
    groups = [[] for _ in range(bins)]
    loads, sizes = [0] * bins, [0] * bins
    for item in sorted(items, key=cost, reverse=True):
        fits = [b for b in range(bins) if sizes[b] + size(item) <= budget] or range(bins)
        b = min(fits, key=lambda b: (loads[b], sizes[b]))
        groups[b].append(item)
        loads[b] += cost(item)
        sizes[b] += size(item)
    return [g for g in groups if g]


def _groups(desc) -> dict[int, list[Term]]:
    """Terms by the multiplicity of their channels (``x`` and output segments share it)."""
    out: dict[int, list[Term]] = {}
    for t in terms(desc):
        out.setdefault(t.x.mul, []).append(t)
    return out


def _binned(items, cost, size, registers: int) -> list[list]:
    """The fewest balanced bins (:func:`_partition`) of `items` whose sizes fit `registers`,
    or one item per bin where an item alone is larger."""
    bins = max(1, -(-sum(map(size, items)) // registers))
    while True:
        parts = _partition(items, cost, size, bins, registers)
        if all(sum(map(size, p)) <= registers for p in parts) or bins >= len(items):
            return parts
        bins += 1


def _contiguous(items, cost, size, registers: int) -> list[list]:
    """`items` cut into the fewest consecutive runs whose ``size(run)`` fits `registers`
    (single items may not), the cuts placed to minimize the largest run's cost."""
    m = len(items)
    fits = [[j == i + 1 or size(items[i:j]) <= registers for j in range(m + 1)] for i in range(m)]
    run_cost = [[sum(map(cost, items[i:j])) for j in range(m + 1)] for i in range(m)]
    for bins in range(1, m + 1):
        # best[k][j]: the smallest largest cost of items[:j] in k runs (None: impossible)
        best = [[None] * (m + 1) for _ in range(bins + 1)]
        cut = [[0] * (m + 1) for _ in range(bins + 1)]
        best[0][0] = 0
        for k in range(1, bins + 1):
            for j in range(1, m + 1):
                for i in range(j):
                    if best[k - 1][i] is not None and fits[i][j]:
                        value = max(best[k - 1][i], run_cost[i][j])
                        if best[k][j] is None or value < best[k][j]:
                            best[k][j], cut[k][j] = value, i
        if best[bins][m] is not None:
            runs, j = [], m
            for k in range(bins, 0, -1):
                runs.append(items[cut[k][j] : j])
                j = cut[k][j]
            return runs[::-1]
    return [[item] for item in items]


def lane_channels(desc, group: list[Term], dtype, most: int) -> int:
    """Channels per lane for a group's programs: the most (a power of two, at most `most` and
    16 bytes) that fill whole warps and keep each lane's vectors aligned (the group's segment
    and weight offsets and the rows' lengths are multiples of it, consecutive channels'
    weights adjacent)."""
    d1, _, dout = desc.dims
    mul = group[0].x.mul
    if any(t.path.mul_in2 > 1 for t in group):
        return 1
    offsets = [d1, dout, desc.weight_numel] + [o for t in group for o in (t.x.offset, t.out.offset, t.path.weight_offset)]
    v = min(most, 16 // np.dtype(dtype).itemsize)
    while v > 1 and not (mul % (LANES * v) == 0 and all(o % v == 0 for o in offsets)):
        v //= 2
    return v


def forward_programs(desc, dtype, registers: int, channels: int = 1, sums: Sums = FORWARD,
                     one_segment: bool = False) -> list[Program]:
    """Programs of a forward: per group, output segments in the order of their terms' ``x``
    segments, cut into the fewest balanced runs whose values per lane fit in `registers`
    32-bit registers: the sums (all the run's, summed over a conv's edges; with `one_segment`,
    the largest segment's: a batched forward stores each segment once it is computed), the
    ``x`` segments read (once each, per ``x``-like operand of `sums`) and the weights (per
    ``w``-like operand; the operands twice: the next edge's are loaded early), for each of
    the lane's channels (at most `channels`, :func:`lane_channels`)."""
    words = np.dtype(dtype).itemsize // 4
    nx, nw = len(sums.x_likes), len(sums.w_likes)
    programs = []
    for mul, group in _groups(desc).items():
        v = lane_channels(desc, group, dtype, channels)
        order = {id(s): n for n, s in enumerate(_unique(t.x for t in group))}
        outs = sorted(_unique(t.out for t in group), key=lambda o: min(order[id(t.x)] for t in group if t.out is o))
        terms_of = {id(o): [t for t in group if t.out is o] for o in outs}

        def size(run):
            terms = [t for o in run for t in terms_of[id(o)]]
            xs = _unique(t.x for t in terms)
            held = max((o.ir_dim for o in run), default=0) if one_segment else sum(o.ir_dim for o in run)
            return (held + 2 * nx * sum(s.ir_dim for s in xs) + 2 * nw * len(terms)) * words * v

        cost = lambda o: sum(t.forward_cost for t in terms_of[id(o)])  # noqa: E731
        runs = _contiguous(outs, cost, size, registers)
        programs += [Program(mul, tuple(t for o in run for t in terms_of[id(o)]), v) for run in runs]
    return programs


def _held(group: list[Term], s: Segment, channels: int = 1, prefetch: bool = True, sums: Sums = BACKWARD) -> int:
    """Values a backward lane holds per edge for ``x`` segment `s`: per channel, the segment
    (per ``x``-like operand of `sums`) and its ``gx`` sums, and the operands (twice where the
    next edge's are loaded early): its terms' weights (per ``w``-like operand) and outputs'
    cotangents."""
    terms = [t for t in group if t.x is s]
    operands = sum(o.ir_dim for o in _unique(t.out for t in terms)) + len(terms) * len(sums.w_likes)
    return channels * ((len(sums.x_likes) + 1) * s.ir_dim + (2 if prefetch else 1) * operands)


def backward_programs(desc, dtype, values: int, channels: int = 1, sums: Sums = BACKWARD,
                      heaviest: int = 1) -> list[Program]:  # fmt: skip
    """Programs of a backward: per group, ``x`` segments binned (each program owns whole
    segments, so its ``gx`` needs no cross-warp sum) so that the values a lane holds per edge
    (:func:`_held`) fit in `values`. Each segment takes as many channels per lane as keep its
    warps' work near the heaviest segment's on `heaviest` channels and fit (at most `channels`,
    :func:`lane_channels`; float64 lanes one), with the next edge's
    operands loaded early where they fit too; segments alike in both are binned together."""
    if heaviest < 1 or heaviest & (heaviest - 1):
        raise ValueError(f"the heaviest segment's channels per lane must be a power of two, not {heaviest}")
    words = np.dtype(dtype).itemsize // 4
    groups = _groups(desc)
    cost = {id(t.x): sum(u.backward_cost for u in g if u.x is t.x) for g in groups.values() for t in g}
    most_cost = max(cost.values(), default=1)
    programs = []
    for mul, group in groups.items():
        # float64 lanes keep one channel: two were slower (docs/tuning.md#schedule-backward-lane-channels)
        most = lane_channels(desc, group, dtype, channels) if words == 1 else 1
        if len(sums.y_likes) > 1:
            # a double backward's lane sums against two A tables: at most two channels, faster
            # than without the cap and than one (docs/tuning.md#schedule-backward-lane-channels)
            most = min(most, 2)
        xs = _unique(t.x for t in group)
        kinds: dict[tuple[int, bool], list[Segment]] = {}
        size = lambda s, v, pf: _held(group, s, v, pf, sums)  # noqa: E731
        for s in xs:
            # a warp's work per edge is its segments' cost times its channels per lane: the
            # heaviest segment of all groups (the longest warp) takes `heaviest` channels, lighter
            # ones proportionally more (within most and the value budget)
            fair = 1 << (max(1, round(most_cost / cost[id(s)])).bit_length() - 1)
            v = min(most, fair * heaviest)
            choices = [(v >> n, pf) for n in range(v.bit_length()) for pf in (True, False)]
            kind = next((c for c in choices if size(s, *c) <= values), (1, False))
            kinds.setdefault(kind, []).append(s)
        for (v, pf), segments in kinds.items():
            parts = _binned(segments, lambda s: cost[id(s)], lambda s: size(s, v, pf), values)
            programs += [Program(mul, tuple(t for t in group if any(t.x is s for s in p)), v, pf) for p in parts]
    return programs


def backward_footprint(desc) -> int:
    """The most values a backward lane of `desc` holds per edge (its widest ``x`` segment)."""
    return max((_held(group, s) for group in _groups(desc).values() for s in _unique(t.x for t in group)), default=0)


def block_groups(programs: list[Program], block_warps: int) -> list[list[Program]]:
    """`programs` spread over the fewest blocks of at most `block_warps` warps each (or one
    program per block), balanced by arithmetic."""
    cost = {id(p): p.mul * sum(t.forward_cost + t.backward_cost for t in p.terms) for p in programs}
    parts = _binned(programs, lambda p: cost[id(p)], lambda p: p.warps, block_warps)
    order = {id(p): n for n, p in enumerate(programs)}
    return [sorted(part, key=lambda p: order[id(p)]) for part in parts]


@dataclasses.dataclass(frozen=True)
class ALayout:
    """Where each term's ``A`` entries sit in a row of the shared-memory table, and which warp
    builds which entries. Rows are padded to a multiple of `vector` elements, and each term's
    block starts at a multiple of it, so lanes read ``A`` with vector loads."""

    slots: dict  # id(term) -> first slot
    length: int  # padded row length
    builders: list[list[Term]]  # per warp: the terms whose entries it builds


def a_layout(programs: list[Program], vector: int) -> ALayout:
    slots, at = {}, 0
    ordered = _unique(t for p in programs for t in p.terms)
    for t in ordered:
        slots[id(t)] = at
        at += -(-len(t.entries) // vector) * vector
    length = max(vector, at)
    if (length // vector) % 2 == 0:  # an odd number of vectors: lanes (one edge each) write rows in distinct banks
        length += vector
    warps = sum(p.warps for p in programs)
    builders = [[] for _ in range(warps)]
    loads = [0] * warps
    for t in sorted(ordered, key=lambda t: len(t.entries), reverse=True):
        b = loads.index(min(loads))
        builders[b].append(t)
        loads[b] += len(t.entries)
    return ALayout(slots, length, builders)
