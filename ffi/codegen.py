"""CUDA source of jequi's kernels, generated per descriptor from its schedule.

Its kinds, each one ``extern "C" __global__`` function ``jequi_<kind>``:

* ``tp_forward`` / ``tp_backward``: the batched product; a block owns a chunk of rows.
* ``tp_second``: a batched backward that also writes the forward sum of its
  :class:`~.schedule.Sums`' ``out`` (force training's double backward: ``dgz`` beside ``dx, dy,
  dw``), reading each row's operands once for both. It runs the backward's programs, which own
  ``x`` segments, so every output segment must be reached from one ``x`` segment
  (:func:`~.schedule.outputs_follow_x`).
* ``conv_forward``: a block owns a receiver and walks its edges (receiver order) in chunks,
  keeping the sums in registers and writing the output row once.
* ``conv_backward``: a block owns a sender and walks its edges (sender order); it writes
  ``gy`` and ``gw`` per edge and the sender's ``gx`` once. One extra block zeroes the rows of
  dropped edges (out-of-range indices), which no sender walks.
* ``conv_atomic_backward``: the same gradients from a receiver walk (the forward's order): the
  receiver's cotangent row is read once, each edge's sender row is gathered, and ``gx`` is
  added to the sender's row with vector atomics (the caller zeroes it). Its ``gx`` sums run in
  no fixed order, so it is not bitwise deterministic; it moves the gathered ``x`` rows through
  L2 where ``conv_backward`` moves the (``DOUT / D1`` times wider) cotangent rows.

Each computes the sums of a :class:`~.schedule.Sums`: by default the product (forward kinds)
or its vector-Jacobian product (backward kinds); with substituted cotangents, the fused
double backward's terms (an ``A`` table per ``y``-like operand, the ``x``- and ``w``-like
rows loaded side by side).

Per chunk of edges (rows; 32, or fewer where the tables would not fit :data:`SMEM_BUDGET`;
a batched kernel's block takes ``Config.batched_forward_rows`` / ``batched_backward_rows``,
a float32 ``ir_mul`` forward ``unstaged_float32_forward_rows``)
every warp first builds ``A`` (:mod:`.schedule`) for some of the chunk's terms, one edge per
lane, with the CG coefficients as literals; after a barrier each warp runs its
:class:`~.schedule.Program` over the chunk's edges, its channels per lane at once, reading ``A`` from
shared memory by broadcast, with the next edge's operands loaded before this one's arithmetic
(not in a float32 batched backward with per-row weights: ``Config.batched_float32_backward_prefetch``) and the weight rows a few edges ahead requested into L2 (a batched forward in ``mul_ir`` moves
each row segment through the warp's shared memory, loaded and stored whole; its lanes' own
components are strided). Data used once streams past the caches (but a batched backward's
rows, read through L1: measured faster); the gathered rows keep L2. ``gy`` (a sum over
channels) is reduced within a warp by a butterfly that halves the values each step, and
across warps in a fixed order: every kernel is
deterministic. A product with many programs spreads them over several blocks per node,
its groups (``Config.block_warps``; a conv kernel's, a batched backward's and the double
backward's forward sum's until their code fits the instruction caches, ``Config.code_bytes``,
``Config.batched_code_bytes``). They run group-major (``blockIdx.x = group
* nodes + node``) in the conv kernels but the float64 forward, in a float64 batched backward (one
program per block, ``Config.split_float64_backward``) and in a batched kernel whose code does not
fit otherwise (``Config.batched_group_major``); else node by node (``blockIdx.x = node * groups +
group``). The groups' ``gy`` partials are summed by the caller.
Batches from ``jax.vmap`` arrive as grid rows ``blockIdx.y``.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from jequi.descriptor import Segment

from jequi.autodiff import GGW, GGX, GGY, GZ, W, X, Y

from . import schedule
from .schedule import LANES, Program, Sums, Term

# Dynamic shared memory a block may take: the largest chunk (32, 16 or 8 edges, one per lane
# while A is built; at most Config.batched_*_rows rows of a batched kernel) whose A tables
# and gy partials fit in it.
SMEM_BUDGET = 64 * 1024
CHUNKS = (LANES, 16, 8, 4, 2, 1)
MAX_THREADS = 1024
KINDS = ("tp_forward", "tp_backward", "tp_second", "conv_forward", "conv_backward", "conv_atomic_backward")
# C names by operand position (jequi.autodiff's (x, y, w, gz, ggx, ggy, ggw)): the kernel
# parameter, the prefix of a lane's loaded values, and (y-like operands) the A table's.
PARAM = {X: "x", Y: "y", W: "w", GZ: "gz", GGX: "ggx", GGY: "ggy", GGW: "ggw"}
VALUE = {X: "x", W: "w", GGX: "q", GGW: "h"}  # gz's values are always "g"
TABLE = {Y: "a", GGY: "b"}


def computed(kind: str, sums: Sums) -> Sums:
    """What a `kind` kernel computes of `sums`: a forward kind its ``out``, a backward kind its
    gradients, ``tp_second`` both."""
    return sums if kind == "tp_second" else sums.of_kind(kind.endswith("backward"))


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A generated kernel: its source and launch shape (threads per block, dynamic shared
    memory bytes; the grid is the caller's)."""

    kind: str
    source: str
    threads: int
    smem: int
    chunk: int  # edges (rows) per chunk; a batched kernel's block owns one chunk of rows
    groups: int  # blocks per node (row chunk), see the module docstring for their order
    group_major: bool  # all nodes' blocks of a group run before the next group's (else node by node)
    programs: tuple[Program, ...]
    arrays: tuple[int, ...]  # the operand positions it takes, in parameter order (Sums.arrays)

    @property
    def entry(self) -> str:
        return f"jequi_{self.kind}"


class _Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, *lines: str):
        self.lines.extend("  " * self.depth + line for line in lines)

    @contextlib.contextmanager
    def block(self, head: str):
        self(head + " {")
        self.depth += 1
        yield
        self.depth -= 1
        self("}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _lit(c: float) -> str:
    return f"T({float(c)!r})"


def _vtype(width: int) -> str:
    return "T" if width == 1 else f"T{width}"


def _load(row: str, index: str, stream: bool, width: int = 1) -> str:
    """A load of `width` adjacent values (one vector load: the index is a multiple of it)."""
    address = f"{row} + {index}" if width == 1 else f"reinterpret_cast<const {_vtype(width)}*>({row} + {index})"
    return f"__ldcs({address})" if stream else f"__ldg({address})"


def _store(row: str, index: str, values: list[str], fn: str = "__stcs") -> str:
    """A streaming store of adjacent `values` (one vector store), or with `fn` ``"red_add"``
    an atomic add of them (:data:`RED_ADD`)."""
    if len(values) == 1:
        return f"{fn}({row} + {index}, {values[0]});"
    return f"{fn}(reinterpret_cast<{_vtype(len(values))}*>({row} + {index}), MAKE{len(values)}({', '.join(values)}));"


# Reductions without a result (PTX red; atomicAdd compiles to atom, which returns the old
# value); the vector forms need sm_90.
RED_ADD = r"""
__device__ __forceinline__ void red_add(float* p, float a) { asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(a)); }
__device__ __forceinline__ void red_add(double* p, double a) { asm volatile("red.global.add.f64 [%0], %1;" :: "l"(p), "d"(a)); }
__device__ __forceinline__ void red_add(float2* p, float2 a) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a.x), "f"(a.y));
}
__device__ __forceinline__ void red_add(float4* p, float4 a) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a.x), "f"(a.y), "f"(a.z), "f"(a.w));
}
""".strip().splitlines()


def _table(pos: int) -> str:
    """C name of the shared-memory ``A`` table of ``y``-like operand `pos`."""
    return f"{TABLE[pos].upper()}s"


def _sum(products) -> str:
    """C expression of the sum of `products` (pairs of C names), as fused multiply-adds."""
    expr = None
    for a, b in products:
        expr = f"fma({a}, {b}, {expr})" if expr else f"{a} * {b}"
    return expr


def _suffix(pos: int) -> str:
    """Suffix of the C names derived from operand `pos`: none for the product's own operands
    (y, w), the cotangent's letter for a substituted one."""
    return "" if pos in (X, Y, W) else VALUE.get(pos, TABLE.get(pos))


def _base(s: Segment, u: str) -> str:
    """C expression of channel `u`'s first element of segment `s`."""
    return f"{s.offset} + {u} * {s.ir_dim}" if s.layout == "mul_ir" else f"{s.offset} + {u}"


def _vectors(s: Segment, v: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """A lane's `v` channels of segment `s` as vectors of `v` adjacent values: per vector, its
    offset from the lane's first element and the ``(component, channel)`` of each value."""
    if s.layout == "mul_ir":  # the lane's channels' components are v * ir_dim adjacent values
        return [(n * v, [((n * v + m) % s.ir_dim, (n * v + m) // s.ir_dim) for m in range(v)]) for n in range(s.ir_dim)]
    return [(i * s.mul, [(i, c) for c in range(v)]) for i in range(s.ir_dim)]


class _Names:
    """C names of a program's per-lane values (its `channels` channels), by segment and term:
    loaded vectors are named per vector, their values by component."""

    def __init__(self, p: Program):
        self.v = p.channels
        self.term = {id(t): n for n, t in enumerate(p.terms)}
        self.place = {}
        for s in p.x_segments + p.out_segments:
            for n, (_, values) in enumerate(_vectors(s, self.v)):
                for m, (i, c) in enumerate(values):
                    self.place[id(s), i, c] = (n, m)

    def _part(self, var: str, m: int) -> str:
        return var if self.v == 1 else f"{var}.{'xyzw'[m]}"

    def x(self, s: Segment, i: int, c: int, pos: int = X) -> str:
        """Value of component `i` of channel `c` of the ``x``-like operand at `pos`."""
        n, m = self.place[id(s), i, c]
        return self._part(f"{VALUE[pos]}{s.offset}_{n}", m)

    def g(self, s: Segment, k: int, c: int) -> str:
        n, m = self.place[id(s), k, c]
        return self._part(f"g{s.offset}_{n}", m)

    def w(self, t: Term, c: int, pos: int = W) -> str:
        return self._part(f"{VALUE[pos]}{self.term[id(t)]}", c)


class _Group:
    """The programs one block runs (a wide product's programs are spread over several blocks
    per node, :attr:`Config.block_warps` warps at most), with its ``A`` tables and its slots
    for ``gy`` partials (a row of ``gy_stride`` per edge: per program, warp and y position)."""

    def __init__(self, programs: list[Program], vector: int, gy: bool, tables: int):
        self.programs = programs
        self.first_warp = [int(v) for v in np.cumsum([0] + [p.warps for p in programs[:-1]])]
        self.warps = sum(p.warps for p in programs)
        self.layout = schedule.a_layout(programs, vector)
        self.gy_offsets, at = [], 0
        for p in programs:
            self.gy_offsets.append(at)
            at += p.warps * len(p.y_positions) if gy else 0
        self.gy_stride = at
        self.tables = tables

    def smem(self, chunk: int, itemsize: int) -> int:
        return chunk * (self.tables * self.layout.length * itemsize + self.gy_stride * itemsize + 2 * 4)


class _Kernel:
    """Emits one kernel's source."""

    def __init__(self, desc, dtype, kind: str, sums: Sums, shared: bool, config: schedule.Config):
        assert kind in KINDS, kind
        self.desc, self.kind, self.shared = desc, kind, shared
        self.dtype = np.dtype(dtype)
        self.fused = kind == "tp_second"
        self.backward = kind.endswith("backward") or self.fused
        self.conv = kind.startswith("conv")
        self.atomic = kind == "conv_atomic_backward"
        self.sums = computed(kind, sums)
        if self.fused and not (self.sums.out and schedule.outputs_follow_x(desc)):
            raise ValueError(f"tp_second needs a forward sum and output segments each reached from one x segment, not {self.sums} of {desc!r}")
        self.split = not (self.conv or shared) and self.backward and self.dtype == np.float64 and config.split_float64_backward
        self.needs_gx, self.needs_gy, self.needs_gw = self.sums.needs
        self.tables = self.sums.y_likes
        # A batched forward in mul_ir keeps one channel per lane and moves its rows through
        # shared memory (:meth:`stage_x`, :meth:`store_acc`): a warp's 32 channels of a segment
        # are 32 * ir_dim adjacent values, loaded and stored whole, where a lane's own components
        # are ir_dim apart (as many cache lines per load); both measured faster. Its backward
        # kinds take their channels like every other kernel and read the rows through L1 (a
        # lane's adjacent values arrive over several vector loads, lines shared between lanes),
        # faster too. A batched backward in ``ir_mul`` reads its rows through L1 too, though no
        # lane shares them: a little faster than streamed; forward rows and weights read so
        # gained nothing (benchmarks/results/2026-11-24-h200-batched-rows.md,
        # 2026-11-25-h200-cached-rows.md; docs/tuning.md#codegen-batched-rows).
        batched_mul_ir = not self.conv and any(s.layout == "mul_ir" for s in (*desc.in1, *desc.out))
        self.staged = batched_mul_ir and not self.backward
        self.cached_rows = not self.conv and self.backward
        # its programs keep the sizes schedule.backward_programs gives prefetched ones: measured so
        batched_float32_backward = self.cached_rows and not shared and self.dtype == np.float32
        self.prefetch = config.batched_float32_backward_prefetch if batched_float32_backward else config.prefetch
        # A batched forward in float64 keeps one channel per lane too: much faster for
        # NequIP-benzene, no slower for the others (2026-11-25-h200-batched-forward-segments.md;
        # docs/tuning.md#codegen-float64-batched-forward-channels).
        one = self.staged or (not self.conv and not self.backward and self.dtype == np.float64)
        channels = 1 if one else config.forward_channels if self.conv and not self.backward else config.channels
        if self.backward:
            values = config.batched_float32_backward_values if batched_float32_backward else config.backward_values
            heaviest = config.conv_backward_heaviest_channels if self.conv else 1
            programs = schedule.backward_programs(desc, self.dtype, values, channels, self.sums, heaviest)
        else:
            regs = (config.forward_registers if self.conv
                    else config.unstaged_float32_forward_sum_registers if self.sums.summed and self.dtype == np.float32 and not self.staged
                    else config.batched_forward_registers)  # fmt: skip
            programs = schedule.forward_programs(desc, self.dtype, regs, channels, self.sums, one_segment=not self.conv)
        self.vector = 16 // self.dtype.itemsize
        self.groups = [_Group(ps, self.vector, self.backward and self.needs_gy, len(self.tables))
                       for ps in schedule.block_groups(programs, 1 if self.split else config.block_warps)]  # fmt: skip
        self.warps = max(g.warps for g in self.groups)
        # a conv kernel's groups run group-major but a float64 forward's (Config.code_bytes)
        node_major = not self.backward and self.dtype == np.float64 and config.node_major_float64_conv_forward
        several = len(self.groups) > 1
        self.group_major = self.split or several and (not node_major if self.conv else config.batched_group_major)
        # per warp, one segment's values of its 32 channels (the widest segment's)
        self.stage = LANES * max(s.ir_dim for p in programs for s in (*p.x_segments, *p.out_segments)) if self.staged else 0
        size = lambda chunk: self.warps * self.stage * self.dtype.itemsize + max(g.smem(chunk, self.dtype.itemsize) for g in self.groups)  # noqa: E731
        rows = (config.batched_backward_rows if self.backward
                else config.unstaged_float32_forward_rows if self.dtype == np.float32 and not self.staged
                else config.batched_forward_rows)  # fmt: skip
        if rows not in CHUNKS:
            raise ValueError(f"batched rows per block must be one of {CHUNKS}, not {rows}")
        most = LANES if self.conv or shared else rows
        self.chunk = next(k for k in CHUNKS if k <= most and (size(k) <= SMEM_BUDGET or k <= 8))
        self.smem = size(self.chunk)
        self.config = config
        self.g = self.groups[0]  # the group being emitted
        self.w = _Writer()

    # --- pieces ----------------------------------------------------------------------------
    def header(self):
        d1, d2, dout = self.desc.dims
        w = self.w
        w(f"// jequi {self.kind}: {self.desc!r}, {self.dtype.name}, {self.sums}, shared weights {self.shared}")
        base = "float" if self.dtype == np.float32 else "double"
        w(f"typedef {base} T;")
        for n in (2, 4) if self.dtype == np.float32 else (2,):
            w(f"typedef {base}{n} T{n};", f"#define MAKE{n} make_{base}{n}")
        w(f"typedef T{self.vector} TV;")
        w("#define FULL 0xffffffffu")
        w(f"constexpr int K = {self.chunk}, D1 = {d1}, D2 = {d2}, DOUT = {dout}, NW = {self.desc.weight_numel}, G = {len(self.groups)};")
        if self.atomic:
            w(*RED_ADD)
        w("")

    def build_a(self, gi: int):
        """``build_a<gi>``: the lane's edge row of group `gi`'s ``A`` for the terms this warp
        builds."""
        w = self.w
        with w.block(f"__device__ __forceinline__ void build_a{gi}(const int warp, const T* __restrict__ yr, T* __restrict__ a)"):
            with w.block("switch (warp)"):
                for n, terms in enumerate(self.g.layout.builders):
                    if not terms:
                        continue
                    with w.block(f"case {n}:"):
                        used = sorted({p for t in terms for i, k in t.entries for p, _ in t.entry_terms(i, k)})
                        for p in used:
                            w(f"const T y{p} = yr[{p}];")
                        for t in terms:
                            base = self.g.layout.slots[id(t)]
                            for m, (i, k) in enumerate(t.entries):
                                expr = " + ".join(f"{_lit(c)} * y{p}" for p, c in t.entry_terms(i, k))
                                w(f"a[{base + m}] = {expr};")
                        w("break;")

    def channel(self, q: int, p: Program):
        """The lane's first channel ``u`` (clamped into range: lanes past ``mul`` load valid
        data, compute, and store nothing; only programs of one channel per lane have them) and
        its segments' first elements."""
        w = self.w
        width = LANES * p.channels
        w(f"const int u0 = {'0' if p.warps == 1 else f'(warp - {self.g.first_warp[q]}) * {width}'};")
        if p.mul % width == 0:
            w(f"const int u = u0 + lane * {p.channels};", "const bool active = true;")
        else:
            assert p.channels == 1, p
            w(f"const int u = min(u0 + lane, {p.mul - 1});", f"const bool active = u0 + lane < {p.mul};")
        if self.staged and p.mul % LANES:  # the channels a partial warp moves
            w(f"const int staged = min({LANES}, {p.mul} - u0);")
        for prefix, segments in (("bx", p.x_segments), ("bo", p.out_segments)):
            for s in segments:
                w(f"const int {prefix}{s.offset} = {_base(s, 'u0' if self.staged else 'u')};")

    # Loads and stores of data read or written once (a row of the batched product, an edge's
    # weights and gradients, an output row) stream past the caches (.cs): the gathered rows
    # (x by sender, the cotangent by receiver) keep L2 to themselves. A batched backward's rows
    # are the exception (:attr:`cached_rows`).
    # Loads return (name, vector width, expression) of each vector; _Names names its values.
    @staticmethod
    def _segment_loads(prefix: str, base: str, segments, v: int, row: str, stream: bool):
        return [(f"{prefix}{s.offset}_{n}", v, _load(row, f"{base}{s.offset} + {offset}", stream, v))
                for s in segments for n, (offset, _) in enumerate(_vectors(s, v))]  # fmt: skip

    def x_loads(self, p: Program, row, stream: bool, positions):
        """Loads of the ``x``-like operands at `positions` (``row(pos)``: C pointer of the row);
        staged (:attr:`staged`): the warp's values of each segment, ``lane + 32 * j``-th of them
        in the lane's ``j``-th register."""
        if self.staged:
            return [(f"c{VALUE[pos]}{s.offset}_{j}", 1, self._staged_load(row(pos), s, j, p, stream))
                    for pos in positions for s in p.x_segments for j in range(s.ir_dim)]  # fmt: skip
        return [load for pos in positions
                for load in self._segment_loads(VALUE[pos], "bx", p.x_segments, p.channels, row(pos), stream)]  # fmt: skip

    @staticmethod
    def _staged_in_range(p: Program, s: Segment, j: int) -> str | None:
        """C condition that a lane's `j`-th staged value of segment `s` is one of the warp's
        channels (None: a program of whole warps, always)."""
        return None if p.mul % LANES == 0 else f"lane + {LANES * j} < staged * {s.ir_dim}"

    def _staged_load(self, row: str, s: Segment, j: int, p: Program, stream: bool) -> str:
        load = _load(row, f"bx{s.offset} + lane + {LANES * j}", stream)
        cond = self._staged_in_range(p, s, j)
        return f"({cond} ? {load} : T(0))" if cond else load

    def stage_x(self, p: Program):
        """Staged rows: each ``x``-like segment's loaded values through the warp's shared
        memory into the lane's own components (odd strides: no bank conflicts)."""
        w = self.w
        for pos in self.sums.x_likes:
            for s in p.x_segments:
                if s.ir_dim == 1:  # loaded as the lane's own
                    w(f"const T {VALUE[pos]}{s.offset}_0 = c{VALUE[pos]}{s.offset}_0;")
                    continue
                w(*(f"tb[lane + {LANES * j}] = c{VALUE[pos]}{s.offset}_{j};" for j in range(s.ir_dim)), "__syncwarp();")
                w(*(f"const T {VALUE[pos]}{s.offset}_{m} = tb[lane * {s.ir_dim} + {m}];" for m in range(s.ir_dim)), "__syncwarp();")

    def g_loads(self, p: Program, row: str, stream: bool):
        return self._segment_loads("g", "bo", p.out_segments, p.channels, row, stream)

    @staticmethod
    def w_loads(p: Program, names: _Names, row, positions, stream: bool = True):
        # lane_channels keeps a lane's channels' weights adjacent (one vector) where it has several
        return [(f"{VALUE[pos]}{names.term[id(t)]}", p.channels, _load(row(pos), t.weight_position("u"), stream, p.channels))
                for pos in positions for t in p.terms]  # fmt: skip

    def operand_loads(self, p: Program, names: _Names, sfx: str, stream: bool, xs=True, gz=False):
        """Loads of an edge's (row's) operands from the row pointers of :meth:`operand_rows`
        (named with suffix `sfx`): its ``x``-like rows where `xs`, ``gz``'s where `gz` (these
        streamed where `stream`, but never by a batched backward), and the
        ``w``-like rows unless the weights are shared."""
        stream = stream and not self.cached_rows
        out = self.x_loads(p, lambda pos: f"{VALUE[pos]}r{sfx}", stream, self.sums.x_likes) if xs else []
        out += self.g_loads(p, f"gr{sfx}", stream) if gz else []
        return out + ([] if self.shared else self.w_loads(p, names, lambda pos: f"{VALUE[pos]}r{sfx}", self.sums.w_likes))

    def operand_rows(self, sfx: str, x_row: str | None, w_row: str, g_row: str | None = None) -> list[str]:
        """C lines declaring the row pointers :meth:`operand_loads` reads: the ``x``-like rows
        at element `x_row` (None: none), the ``w``-like at `w_row`, ``gz``'s at `g_row`."""
        lines = [f"const T* {VALUE[pos]}r{sfx} = {PARAM[pos]} + {x_row} * D1;" for pos in self.sums.x_likes] if x_row else []
        if g_row:
            lines.append(f"const T* gr{sfx} = gz + {g_row} * DOUT;")
        return lines + [f"const T* {VALUE[pos]}r{sfx} = {PARAM[pos]} + {w_row} * NW;" for pos in self.sums.w_likes]

    def store_segments(self, segments, base: str, row: str, value, v: int, fn: str = "__stcs"):
        """Store (:func:`_store`'s `fn`) `value(segment, component, channel)` (a C name) of
        each of the lane's channels of `segments` (``{base}{offset}``: the lane's first element
        of each), by vectors."""
        for s in segments:
            for offset, values in _vectors(s, v):
                self.w(f"if (active) {_store(row, f'{base}{s.offset} + {offset}', [value(s, i, c) for i, c in values], fn)}")

    def load_a(self, t: Term, names: _Names, pos: int) -> list[str]:
        """Vector loads of term `t`'s entries of the ``A`` table of operand `pos` (the current
        edge's row); returns the C name of each entry."""
        base, n = self.g.layout.slots[id(t)], len(t.entries)
        tag = names.term[id(t)]
        out = []
        for q in range(-(-n // self.vector)):
            self.w(f"const TV {TABLE[pos]}{tag}_{q} = *reinterpret_cast<const TV*>(({_table(pos)} + kk * NA) + {base + q * self.vector});")
            out += [f"{TABLE[pos]}{tag}_{q}.{c}" for c in "xyzw"[: self.vector]]
        return out[:n]

    def prefetched_loop(self, p: Program, n: str, pointers, loads, body):
        """``for kk < n: body(kk)`` with edge (row) kk + 1's `loads` issued before edge kk's
        arithmetic where program `p` has the registers for them. ``pointers(k)``: C lines
        declaring edge k's row pointers (names ending in the suffix it is given);
        ``loads(suffix)``: ``(name, width, expression)`` of each vector."""
        w = self.w
        values = loads("_n")
        if not p.prefetch or sum(width for _, width, _ in values) * (self.dtype.itemsize // 4) > self.prefetch:
            with w.block(f"for (int kk = 0; kk < {n}; ++kk)"):
                w(*pointers("kk", "_n"))
                for name, width, expr in values:
                    w(f"const {_vtype(width)} {name} = {expr};")
                body()
            return
        for name, width, _ in values:
            w(f"{_vtype(width)} p{name};")
        with w.block(f"if ({n} > 0)"):
            w(*pointers("0", "_n"))
            for name, _, expr in values:
                w(f"p{name} = {expr};")
        with w.block(f"for (int kk = 0; kk < {n}; ++kk)"):
            for name, width, _ in values:
                w(f"const {_vtype(width)} {name} = p{name};")
            with w.block(f"if (kk + 1 < {n})"):
                w(*pointers("kk + 1", "_n"))
                for name, _, expr in values:
                    w(f"p{name} = {expr};")
            body()

    def l2_prefetch(self, d: int):
        """Ask L2 for the weight rows of the edge `d` steps ahead (0, or shared weights: none),
        the block's threads a 128-byte line each."""
        if not d or self.shared:
            return
        w = self.w
        with w.block(""):
            w(f"const int pk = base + kk + {d};")
            with w.block("if (pk < end)"):
                for pos in self.sums.w_likes:
                    pr = f"pr{VALUE[pos]}"
                    w(f"const char* {pr} = reinterpret_cast<const char*>({PARAM[pos]} + (long long)order[pk] * NW);")
                    w("for (int l = threadIdx.x * 128; l < NW * (int)sizeof(T); l += blockDim.x * 128) "
                      f'asm volatile("prefetch.global.L2 [%0];" :: "l"({pr} + l));')

    # --- forward ---------------------------------------------------------------------------
    def forward_math(self, p: Program, names: _Names, store=None):
        """One edge's (row's) multiply-adds into the ``acc`` sums (of each of the lane's
        channels: one read of ``A`` serves them all). Per ``A`` table, the triples reading
        it first sum their ``w * x`` products. With `store` (a batched forward, whose sums
        are one row's) each output segment's sums are declared, computed and handed to
        ``store(segment)`` before the next segment's begin: a lane holds one segment's sums,
        not the program's: fewer live values, faster on a wide product
        (benchmarks/results/2026-11-25-h200-batched-forward-segments.md;
        docs/tuning.md#codegen-one-output-segment-at-a-time)."""
        if store is None:
            self._forward_terms(p.terms, p.channels, names)
            return
        for s in p.out_segments:
            self.declare_acc([s], p.channels)
            self._forward_terms([t for t in p.terms if t.out is s], p.channels, names)
            store(s)

    def _forward_terms(self, terms: list[Term], channels: int, names: _Names):
        for b in self.forward_tables:
            for t in terms:
                self._wx(t, b, channels, names)
        for b in self.forward_tables:
            for t in terms:
                self._accumulate(t, b, self.load_a(t, names, b), channels, names)

    @property
    def forward_tables(self) -> list[int]:
        """The ``A`` tables the forward sum reads."""
        return sorted({b for _, b, _ in self.sums.out})

    def _wx(self, t: Term, b: int, channels: int, names: _Names):
        """Term `t`'s ``wx[i, c] = sum w * x`` over the triples of ``A`` table `b`."""
        tag = names.term[id(t)]
        pairs = [(a, c) for a, table, c in self.sums.out if table == b]
        for i in sorted({i for i, _ in t.entries}):
            for c in range(channels):
                products = [(names.w(t, c, wp), names.x(t.x, i, c, xp)) for xp, wp in pairs]
                self.w(f"const T wx{_suffix(b)}{tag}_{i}_{c} = {_sum(products)};")

    def _accumulate(self, t: Term, b: int, entries: list[str], channels: int, names: _Names):
        """``acc[k, c] += A_b[i, k] wx[i, c]`` over term `t`'s entries (C names, :meth:`load_a`)."""
        tag = names.term[id(t)]
        for (i, k), a in zip(t.entries, entries):
            for c in range(channels):
                acc = f"acc{t.out.offset}_{k}_{c}"
                self.w(f"{acc} = fma({a}, wx{_suffix(b)}{tag}_{i}_{c}, {acc});")

    def declare_acc(self, segments, channels: int):
        for s in segments:
            self.w(f"T {', '.join(f'acc{s.offset}_{k}_{c} = 0' for k in range(s.ir_dim) for c in range(channels))};")

    def store_acc(self, p: Program, row: str, segments):
        if not self.staged:
            self.store_segments(segments, "bo", row, lambda s, k, c: f"acc{s.offset}_{k}_{c}", p.channels)
            return
        w = self.w
        for s in segments:
            guard = lambda j: f"if ({cond}) " if (cond := self._staged_in_range(p, s, j)) else ""  # noqa: E731
            if s.ir_dim == 1:
                w(f"{guard(0)}__stcs({row} + bo{s.offset} + lane, acc{s.offset}_0_0);")
                continue
            w(*(f"tb[lane * {s.ir_dim} + {k}] = acc{s.offset}_{k}_0;" for k in range(s.ir_dim)), "__syncwarp();")
            w(*(f"{guard(j)}__stcs({row} + bo{s.offset} + lane + {LANES * j}, tb[lane + {LANES * j}]);" for j in range(s.ir_dim)))
            w("__syncwarp();")

    # --- backward --------------------------------------------------------------------------
    def backward_math(self, q: int, p: Program, names: _Names, gwrow: str, gyrow: str, outrow: str | None = None):
        """One edge's (row's) gradients: ``gw`` stored (or summed, shared weights), ``gx``
        added to the ``gx`` sums, ``gy``'s warp sums written to shared memory row `gyrow`.
        Each sum runs over its pairs of :class:`~.schedule.Sums`: per ``A`` table ``b``,
        ``v_b[i] = sum_k A_b[i, k] gz[k]``; ``gx[i] += c v_b[i]`` over the ``(b, c)`` of
        ``dx``; ``gw = sum_i a[i] v_b[i]`` over the ``(a, b)`` of ``dw``; ``gy`` from the
        coefficients and ``sum c a`` over the ``(a, c)`` of ``dy``. ``tp_second`` also sums
        its ``out`` triples from the same reads of ``A``, each output segment stored to row
        `outrow` after its program's last term reaching it."""
        w = self.w
        channels = range(p.channels)
        sums = self.sums
        forward = self.forward_tables if self.fused else []
        backward = {b for b, _ in sums.dx} | {b for _, b in sums.dw}
        first, last = {id(t.out): t for t in reversed(p.terms)}, {id(t.out): t for t in p.terms}
        if self.needs_gx or self.needs_gw or forward:
            for t in p.terms:
                tag = names.term[id(t)]
                rows = sorted({i for i, _ in t.entries})
                if forward and first[id(t.out)] is t:
                    self.declare_acc([t.out], p.channels)
                for b in forward:
                    self._wx(t, b, p.channels, names)
                for b in sorted(backward | set(forward)):
                    entries = self.load_a(t, names, b)
                    if b in forward:
                        self._accumulate(t, b, entries, p.channels, names)
                    if b not in backward:
                        continue
                    v = {}
                    for (i, k), a in zip(t.entries, entries):
                        for c in channels:
                            g = names.g(t.out, k, c)
                            v[i, c] = f"fma({a}, {g}, {v[i, c]})" if (i, c) in v else f"{a} * {g}"
                    for (i, c), expr in v.items():
                        w(f"const T v{_suffix(b)}{tag}_{i}_{c} = {expr};")
                if forward and last[id(t.out)] is t:
                    self.store_acc(p, outrow, [t.out])
                if self.needs_gw:
                    for c in channels:
                        expr = _sum((names.x(t.x, i, c, a), f"v{_suffix(b)}{tag}_{i}_{c}") for a, b in sums.dw for i in rows)
                        w(f"{'' if self.shared else 'const T '}gw{tag}_{c} {'+' if self.shared else ''}= {expr};")
                    if not self.shared:  # lane_channels keeps the lane's channels' weights adjacent
                        w(f"if (active) {_store(gwrow, t.weight_position('u'), [f'gw{tag}_{c}' for c in channels])}")
                if self.needs_gx:
                    for i in rows:
                        for c in channels:
                            for b, wp in sums.dx:
                                w(f"gx{t.x.offset}_{i}_{c} = fma({names.w(t, c, wp)}, v{_suffix(b)}{tag}_{i}_{c}, gx{t.x.offset}_{i}_{c});")
        if self.needs_gy:
            ys = p.y_positions
            w(f"T {', '.join(f'gy{j} = 0' for j in ys)};")
            for t in p.terms:
                tag = names.term[id(t)]
                for wp in sorted({c for _, c in sums.dy}):
                    for c in channels:
                        w(f"const T wm{_suffix(wp)}{tag}_{c} = active ? {names.w(t, c, wp)} : T(0);")
                pairs: dict[tuple[int, int], list] = {}
                for i, j, k, coeff in t.nonzeros:
                    pairs.setdefault((i, k), []).append((j, coeff))
                for c in channels:
                    for i in sorted({i for i, _ in pairs}):
                        products = [(f"wm{_suffix(wp)}{tag}_{c}", names.x(t.x, i, c, a)) for a, wp in sums.dy]
                        w(f"const T xw{tag}_{i}_{c} = {_sum(products)};")
                # the lane's channels' products are summed per (i, k) before the coefficients
                # spread them into gy: those multiply-adds are paid once per lane
                for (i, k), js in pairs.items():
                    expr = None
                    for c in channels:
                        g = names.g(t.out, k, c)
                        expr = f"fma(xw{tag}_{i}_{c}, {g}, {expr})" if expr else f"xw{tag}_{i}_{c} * {g}"
                    w(f"const T p{tag}_{i}_{k} = {expr};")
                    for j, coeff in js:
                        y = int(t.y_positions[j])
                        w(f"gy{y} = fma({_lit(coeff)}, p{tag}_{i}_{k}, gy{y});")
            slot = f"{self.g.gy_offsets[q]} + (warp - {self.g.first_warp[q]}) * {len(ys)}"
            self.warp_sum([f"gy{j}" for j in ys], f"{gyrow} + {slot}")

    def warp_sum(self, values: list[str], dest: str):
        """Sum each of `values` over the warp's lanes and write sum n to ``dest[n]``: a
        butterfly that sends half the values at each step (one shuffle per value overall)."""
        w = self.w
        for c0 in range(0, len(values), LANES):
            chunk = values[c0 : c0 + LANES]
            n = 1 << (len(chunk) - 1).bit_length()
            cur = chunk + ["T(0)"] * (n - len(chunk))
            offset, level = LANES // 2, 0
            with w.block(""):
                while len(cur) > 1:
                    half = len(cur) // 2
                    w(f"const bool up{level} = lane & {offset};")
                    nxt = []
                    for i in range(half):
                        lo, hi = cur[i], cur[i + half]
                        name = f"s{level}_{i}"
                        w(f"const T {name} = (up{level} ? {hi} : {lo}) + __shfl_xor_sync(FULL, up{level} ? {lo} : {hi}, {offset});")
                        nxt.append(name)
                    cur, offset, level = nxt, offset // 2, level + 1
                w(f"T total = {cur[0]};")
                while offset >= 1:
                    w(f"total += __shfl_xor_sync(FULL, total, {offset});")
                    offset //= 2
                shift = (LANES // n).bit_length() - 1
                w(f"const int idx = lane >> {shift};")
                cond = f"(lane & {(1 << shift) - 1}) == 0 && " if shift else ""
                w(f"if ({cond}idx < {len(chunk)}) ({dest})[{c0} + idx] = total;")

    def gy_finalize(self, n: str, edge_of: str):
        """The chunk's `n` edges' ``gy`` rows: the warps' partials summed in a fixed order,
        one thread per edge (``edge_of``: C expression of edge kk's row)."""
        w = self.w
        _, d2, _ = self.desc.dims
        owners: dict[int, list[int]] = {}
        for q, p in enumerate(self.g.programs):
            for c in range(p.warps):
                for idx, j in enumerate(p.y_positions):
                    owners.setdefault(j, []).append(self.g.gy_offsets[q] + c * len(p.y_positions) + idx)
        with w.block(f"for (int kk = threadIdx.x; kk < {n}; kk += {self.g.warps * LANES})"):
            w("const T* g = gyp + kk * GY;", f"T* out = gy + (long long)({edge_of}) * D2;")
            for j in range(d2):
                w(f"__stcs(out + {j}, {' + '.join(f'g[{o}]' for o in owners[j]) if j in owners else 'T(0)'});")

    # --- kernels -----------------------------------------------------------------------------
    def params(self) -> list[str]:
        params = [f"const T* __restrict__ {PARAM[pos]}" for pos in self.sums.arrays]
        if self.conv:
            params += [f"const int* __restrict__ {a}" for a in ("order", "other", "offsets", "rows", "slots")]
        if self.backward:
            grads = ("gx", "gxe", "gy", "gw") if self.conv and not self.atomic else ("gx", "gy", "gw")
            needs = {"gx": self.needs_gx, "gxe": self.needs_gx, "gy": self.needs_gy, "gw": self.needs_gw}
            params += [f"T* __restrict__ {g}" for g in grads if needs[g]]
        if not self.backward or self.fused:
            params.append("T* __restrict__ out")
            if self.conv:
                params.append("T* __restrict__ extra")
        scalars = ["num_nodes", "num_senders", "num_edges", "num_parts", "num_extras"] if self.conv else ["num_rows"]
        return params + [f"const long long {s}" for s in scalars]

    def source(self) -> str:
        self.header()
        for self.gi, self.g in enumerate(self.groups):
            self.build_a(self.gi)
        w = self.w
        w("")
        bounds = f"{self.warps * LANES}, {max(1, -(-self.config.min_warps // self.warps))}"
        with w.block(f'extern "C" __global__ void __launch_bounds__({bounds}) jequi_{self.kind}({", ".join(self.params())})'):
            w("extern __shared__ __align__(16) unsigned char smem[];")
            w("const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;", "const long long b = blockIdx.y;")
            if self.group_major:
                w("const int nodes = gridDim.x / G;", "const int group = blockIdx.x / nodes, node = blockIdx.x % nodes;")
            else:
                w("const int group = blockIdx.x % G, node = blockIdx.x / G;")
            self._batch_offsets()
            with w.block("switch (group)"):
                for self.gi, self.g in enumerate(self.groups):
                    with w.block(f"case {self.gi}:"):
                        w(f"constexpr int NA = {self.g.layout.length}, GY = {self.g.gy_stride};")
                        at = "reinterpret_cast<T*>(smem)"
                        if self.staged:
                            w(f"T* tb = {at} + warp * {self.stage};")
                            at += f" + {self.warps * self.stage}"
                        for pos in self.tables:
                            w(f"T* {_table(pos)} = {at};")
                            at = f"{_table(pos)} + K * NA"
                        w(f"T* gyp = {at};")
                        w("int* s_edge = reinterpret_cast<int*>(gyp + K * GY);", "int* s_node = s_edge + K;")
                        w(f"if (threadIdx.x >= {self.g.warps * LANES}) return;" if self.g.warps < self.warps else "")
                        getattr(self, self.kind)()
                        w("break;")
        return w.text()

    def _batch_offsets(self):
        """Advance every pointer to batch element ``b`` (jax.vmap's grid rows); ``gy`` to
        the block's group's partial sums (one ``(edges, D2)`` array per group)."""
        w = self.w
        rows = "num_nodes" if self.conv else "num_rows"
        edges = "num_edges" if self.conv else "num_rows"
        used = self.sums.arrays
        for pos in (X, GGX):
            if pos in used:
                w(f"{PARAM[pos]} += b * {rows if not self.conv else 'num_senders'} * D1;")
        w(*(f"{PARAM[pos]} += b * {edges} * D2;" for pos in (Y, GGY) if pos in used))
        w(*(f"{PARAM[pos]} += b * {'NW' if self.shared else f'{edges} * NW'};" for pos in (W, GGW) if pos in used))
        if self.backward:
            w(f"gz += b * {'num_nodes' if self.conv else rows} * DOUT;")
            if self.needs_gx:
                w(f"gx += b * {'num_senders' if self.conv else rows} * D1;")
                if self.conv and not self.atomic:
                    w("gxe += b * num_extras * D1;")
            if self.needs_gy:
                w(f"gy += (b * G + group) * {edges} * D2;")
            if self.needs_gw:
                parts = ("num_parts" if self.conv else "(gridDim.x / G)") if self.shared else edges
                w(f"gw += b * {parts} * NW;")
        if not self.backward or self.fused:
            w(f"out += b * {'num_nodes' if self.conv else rows} * DOUT;")
            if self.conv:
                w("extra += b * num_extras * DOUT;")
        if self.conv:
            w("order += b * num_edges;", "other += b * num_edges;")
            w("offsets += b * (num_parts + 1);", "rows += b * num_parts;", "slots += b * num_parts;")

    def _programs(self, body):
        """Each program's code, run by its warps."""
        w = self.w
        for q, p in enumerate(self.g.programs):
            head = "if" if q == 0 else "else if"
            cond = f"warp < {self.g.first_warp[q] + p.warps}" if q < len(self.g.programs) - 1 else None
            with w.block(f"{head} ({cond})" if cond else ("else" if q else "")):
                self.channel(q, p)
                names = _Names(p)
                if self.shared:
                    for name, width, expr in self.w_loads(p, names, lambda pos: PARAM[pos], self.sums.w_likes, stream=False):
                        w(f"const {_vtype(width)} {name} = {expr};")
                body(q, p, names)

    def _chunk_a(self):
        """Build ``A`` for the chunk's edges (and note their edge and node ids), then wait."""
        w = self.w
        with w.block("if (lane < n)"):
            w("const int e = order[base + lane];")
            w("if (warp == 0) { s_edge[lane] = e; s_node[lane] = other[base + lane]; }")
            for pos in self.tables:
                w(f"build_a{self.gi}(warp, {PARAM[pos]} + (long long)e * D2, {_table(pos)} + lane * NA);")
        w("__syncthreads();")

    def _row_tables(self):
        """A batched kind's block: its rows ``row0 .. row0 + n`` and their ``A`` tables (a lane
        builds its row's), then the barrier before any program reads them."""
        w = self.w
        w("const long long row0 = (long long)node * K;", "const int n = (int)min((long long)K, num_rows - row0);")
        for pos in self.tables:
            w(f"if (lane < n) build_a{self.gi}(warp, {PARAM[pos]} + (row0 + lane) * D2, {_table(pos)} + lane * NA);")
        w("__syncthreads();")

    def tp_forward(self):
        self._row_tables()

        def body(q, p, names):
            def math():
                if self.staged:
                    self.stage_x(p)
                self.forward_math(p, names, store=lambda s: self.store_acc(p, "(out + (row0 + kk) * DOUT)", [s]))

            pointers = lambda k, sfx: self.operand_rows(sfx, f"(row0 + {k})", f"(row0 + {k})")  # noqa: E731
            self.prefetched_loop(p, "n", pointers, lambda sfx: self.operand_loads(p, names, sfx, True), math)

        self._programs(body)

    def _row_part(self, row: str):
        """The block's part of a row (:class:`jequi.graph.RowParts`): the row (C name `row`), its
        edges ``start .. end``, and ``slot``, where its partial sums go."""
        self.w(f"const int {row} = rows[node], slot = slots[node];", "const int start = offsets[node], end = offsets[node + 1];")

    def conv_forward(self):
        w = self.w
        self._row_part("r")
        w("T* const dst = slot < num_nodes ? out + (long long)slot * DOUT : extra + (long long)(slot - num_nodes) * DOUT;")

        def body(q, p, names):
            self.declare_acc(p.out_segments, p.channels)

            def math():
                self.l2_prefetch(self.config.l2_prefetch)
                self.forward_math(p, names)

            self._receiver_walk(p, names, math)
            self.store_acc(p, "dst", p.out_segments)

        self._programs(body)

    def _receiver_walk(self, p: Program, names: _Names, math, after_chunk=lambda: None):
        """Receiver ``r``'s edges in chunks (their ``A`` tables built per chunk): `math` per
        edge, the edge's sender (``x``-like) and weight rows loaded one edge ahead;
        `after_chunk` after each chunk's barrier."""
        w = self.w
        with w.block("for (int base = start; base < end; base += K)"):
            w("const int n = min(K, end - base);")
            self._chunk_a()
            pointers = lambda k, sfx: self.operand_rows(sfx, f"(long long)s_node[{k}]", f"(long long)s_edge[{k}]")  # noqa: E731
            self.prefetched_loop(p, "n", pointers, lambda sfx: self.operand_loads(p, names, sfx, False), math)
            w("__syncthreads();")
            after_chunk()

    def _declare_gx(self, p):
        if self.needs_gx:
            for s in p.x_segments:
                self.w(f"T {', '.join(f'gx{s.offset}_{i}_{c} = 0' for i in range(s.ir_dim) for c in range(p.channels))};")

    def _declare_shared_gw(self, p, names):
        if self.needs_gw and self.shared:
            self.w(f"T {', '.join(f'gw{names.term[id(t)]}_{c} = 0' for t in p.terms for c in range(p.channels))};")

    def _store_gx(self, p, row, fn: str = "__stcs"):
        if self.needs_gx:
            self.store_segments(p.x_segments, "bx", row, lambda s, i, c: f"gx{s.offset}_{i}_{c}", p.channels, fn)

    def _store_shared_gw(self, p, names, row):
        if self.needs_gw and self.shared:
            for t in p.terms:
                tag = names.term[id(t)]
                self.w(f"if (active) {_store(row, t.weight_position('u'), [f'gw{tag}_{c}' for c in range(p.channels)])}")

    def tp_backward(self):
        w = self.w
        self._row_tables()

        def body(q, p, names):
            self._declare_shared_gw(p, names)

            def math():
                self._declare_gx(p)
                self.backward_math(q, p, names, "(gw + (row0 + kk) * NW)", "(gyp + kk * GY)", "(out + (row0 + kk) * DOUT)")
                self._store_gx(p, "(gx + (row0 + kk) * D1)")

            pointers = lambda k, sfx: self.operand_rows(sfx, f"(row0 + {k})", f"(row0 + {k})", f"(row0 + {k})")  # noqa: E731
            self.prefetched_loop(p, "n", pointers, lambda sfx: self.operand_loads(p, names, sfx, True, gz=True), math)
            self._store_shared_gw(p, names, "(gw + (long long)node * NW)")

        self._programs(body)
        if self.needs_gy:
            w("__syncthreads();")
            self.gy_finalize("n", "row0 + kk")

    tp_second = tp_backward

    def _dropped_edges(self, node: str, last: str):
        """The blocks of row `last` (one past the walked ones) zero the gradients of the dropped
        edges (an index out of range), which no walk reaches, each its part of them, and return."""
        w = self.w
        with w.block(f"if ({node} == {last})"):
            w("// the dropped edges (an index out of range): zero gradients")
            with w.block(f"for (int k = start + warp; k < end; k += {self.g.warps})"):
                w("const long long e = order[k];")
                if self.needs_gy:
                    w("for (int j = lane; j < D2; j += 32) gy[e * D2 + j] = 0;")
                if self.needs_gw and not self.shared and self.gi == 0:
                    w("for (int j = lane; j < NW; j += 32) gw[e * NW + j] = 0;")
            if self.needs_gw and self.shared and self.gi == 0:
                w("for (int j = threadIdx.x; j < NW; j += blockDim.x) gw[(long long)node * NW + j] = 0;")
            w("return;")

    def conv_backward(self):
        w = self.w
        self._row_part("s")
        self._dropped_edges("s", "num_senders")
        if self.needs_gx:
            w("T* const gxdst = slot < num_senders ? gx + (long long)slot * D1 : gxe + (long long)(slot - num_senders - 1) * D1;")

        def body(q, p, names):
            self._declare_gx(p)
            self._declare_shared_gw(p, names)
            for name, width, expr in self.x_loads(p, lambda pos: f"({PARAM[pos]} + (long long)s * D1)", False, self.sums.x_likes):
                w(f"const {_vtype(width)} {name} = {expr};")
            with w.block("for (int base = start; base < end; base += K)"):
                w("const int n = min(K, end - base);")
                self._chunk_a()

                pointers = lambda k, sfx: self.operand_rows(sfx, None, f"(long long)s_edge[{k}]", f"(long long)s_node[{k}]")  # noqa: E731
                def math():
                    # the gathered cotangent rows mostly hit L2 already: asking for them ahead
                    # measured no faster (docs/tuning.md#codegen-conv-backward-cotangent-rows)
                    # and doubles the L2 requests of the largest stream
                    self.l2_prefetch(self.config.backward_l2_prefetch)
                    self.backward_math(q, p, names, "(gw + (long long)s_edge[kk] * NW)", "(gyp + kk * GY)")

                self.prefetched_loop(p, "n", pointers, lambda sfx: self.operand_loads(p, names, sfx, False, xs=False, gz=True), math)
                w("__syncthreads();")
                if self.needs_gy:
                    self.gy_finalize("n", "s_edge[kk]")
                    w("__syncthreads();")
            self._store_gx(p, "gxdst")
            self._store_shared_gw(p, names, "(gw + (long long)node * NW)")

        self._programs(body)

    def conv_atomic_backward(self):
        w = self.w
        self._row_part("r")
        self._dropped_edges("r", "num_nodes")

        def body(q, p, names):
            self._declare_shared_gw(p, names)
            for name, width, expr in self.g_loads(p, "(gz + (long long)r * DOUT)", False):
                w(f"const {_vtype(width)} {name} = {expr};")

            def math():
                self.l2_prefetch(self.config.backward_l2_prefetch)
                self._declare_gx(p)
                self.backward_math(q, p, names, "(gw + (long long)s_edge[kk] * NW)", "(gyp + kk * GY)")
                self._store_gx(p, "(gx + (long long)s_node[kk] * D1)", "red_add")

            def gy_rows():
                if self.needs_gy:
                    self.gy_finalize("n", "s_edge[kk]")
                    w("__syncthreads();")

            self._receiver_walk(p, names, math, gy_rows)
            self._store_shared_gw(p, names, "(gw + (long long)node * NW)")

        self._programs(body)


def generate(desc, dtype, kind: str, sums: Sums = Sums(), shared: bool = False,
             config: schedule.Config | None = None) -> Kernel:  # fmt: skip
    """The `kind` kernel of (trilinear, ``uvu``-only) descriptor `desc` in `dtype`, computing
    the sums `sums` says (a forward kind its ``out``, a backward kind its ``dx, dy, dw``;
    the default: the product and all three gradients); `shared`: one weight vector for all
    rows (or edges)."""
    if schedule.unsupported(desc):
        raise ValueError(f"the CUDA kernels run modes {schedule.SUPPORTED_MODES}, not {sorted(schedule.unsupported(desc))}")
    k = _Kernel(desc, dtype, kind, sums, shared, config or schedule.DEFAULT)
    if k.warps * LANES > MAX_THREADS:
        raise ValueError(f"{desc!r} needs {k.warps} warps per block in the CUDA kernels (at most {MAX_THREADS // LANES})")
    programs = tuple(p for g in k.groups for p in g.programs)
    return Kernel(kind, k.source(), k.warps * LANES, k.smem, k.chunk, len(k.groups), k.group_major, programs, k.sums.arrays)
