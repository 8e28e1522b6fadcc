"""The pieces of a generated CUDA kernel's source (:class:`Emitter`): its header and ``A``
table builders, the loads, stores and arithmetic of a program's lanes, the ``gy`` lane sums.
:mod:`.codegen` assembles them into the kernels of each kind."""

from __future__ import annotations

import numpy as np

from jequi.descriptor import Segment

from .ctext import (
    PARAM, RED_ADD, TABLE, VALUE, Names, Writer, fma_sum, half_helpers, lane_vectors, lit, load_expr, raw_holder, segment_base,
    store_stmt, suffix, table_name, vtype,
)  # fmt: skip
from .launch import Plan
from .schedule import LANES, Program, Term


class Emitter(Plan):
    """Emits one kernel's source, piece by piece, from its launch plan (:class:`~.launch.Plan`)."""

    def __init__(self, *args):
        super().__init__(*args)
        self.g = self.groups[0]  # the group being emitted
        self.w = Writer()

    # --- pieces ----------------------------------------------------------------------------
    def header(self):
        d1, d2, dout = self.desc.dims
        w = self.w
        w(f"// jequi {self.kind}: {self.desc!r}, {self.storage.name}, {self.sums}, shared weights {self.shared}")
        base = "float" if self.dtype == np.float32 else "double"
        w(f"typedef {base} T;")
        for n in (2, 4) if self.dtype == np.float32 else (2,):
            w(f"typedef {base}{n} T{n};", f"#define MAKE{n} make_{base}{n}")
        w(f"typedef T{self.vector} TV;")
        if self.half:
            w(*half_helpers(self.storage.name))
        w("#define FULL 0xffffffffu")
        w(f"constexpr int K = {self.chunk}, D1 = {d1}, D2 = {d2}, DOUT = {dout}, NW = {self.desc.weight_numel}, G = {len(self.groups)};")
        if self.atomic:
            w(*RED_ADD)
        w("")

    def build_a(self, gi: int):
        """``build_a<gi>``: the lane's edge row of group `gi`'s ``A`` for the terms this warp
        builds."""
        w = self.w
        with w.block(f"__device__ __forceinline__ void build_a{gi}(const int warp, const {self.operand_ctype}* __restrict__ yr, T* __restrict__ a)"):
            with w.block("switch (warp)"):
                for n, terms in enumerate(self.g.layout.builders):
                    if not terms:
                        continue
                    with w.block(f"case {n}:"):
                        used = sorted({p for t in terms for i, k in t.entries for p, _ in t.entry_terms(i, k)})
                        for p in used:
                            w(f"const T y{p} = {f'tof(yr[{p}])' if self.half else f'yr[{p}]'};")
                        for t in terms:
                            base = self.g.layout.slots[id(t)]
                            for m, (i, k) in enumerate(t.entries):
                                expr = " + ".join(f"{lit(c)} * y{p}" for p, c in t.entry_terms(i, k))
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
                w(f"const int {prefix}{s.offset} = {segment_base(s, 'u0' if self.staged else 'u')};")

    # Loads and stores of data read or written once (a row of the batched product, an edge's
    # weights and gradients, an output row) stream past the caches (.cs): the gathered rows
    # (x by sender, the cotangent by receiver) keep L2 to themselves. A batched backward's rows
    # are the exception (:attr:`cached_rows`).
    # Loads return (name, vector width, expression) of each vector; Names names its values.
    def _segment_loads(self, prefix: str, base: str, segments, v: int, row: str, stream: bool):
        return [(f"{prefix}{s.offset}_{n}", v, load_expr(row, f"{base}{s.offset} + {offset}", stream, v, self.half))
                for s in segments for n, (offset, _) in enumerate(lane_vectors(s, v))]  # fmt: skip

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
        load = load_expr(row, f"bx{s.offset} + lane + {LANES * j}", stream, half=self.half)
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

    def w_loads(self, p: Program, names: Names, row, positions, stream: bool = True):
        # lane_channels keeps a lane's channels' weights adjacent (one vector) where it has several
        return [(f"{VALUE[pos]}{names.term[id(t)]}", p.channels, load_expr(row(pos), t.weight_position("u"), stream, p.channels, self.half))
                for pos in positions for t in p.terms]  # fmt: skip

    def operand_loads(self, p: Program, names: Names, sfx: str, stream: bool, xs=True, gz=False):
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
        t = self.operand_ctype
        lines = [f"const {t}* {VALUE[pos]}r{sfx} = {PARAM[pos]} + {x_row} * D1;" for pos in self.sums.x_likes] if x_row else []
        if g_row:
            lines.append(f"const {t}* gr{sfx} = gz + {g_row} * DOUT;")
        return lines + [f"const {t}* {VALUE[pos]}r{sfx} = {PARAM[pos]} + {w_row} * NW;" for pos in self.sums.w_likes]

    def store_segments(self, segments, base: str, row: str, value, v: int, fn: str = "__stcs"):
        """Store (:func:`store_stmt`'s `fn`) `value(segment, component, channel)` (a C name) of
        each of the lane's channels of `segments` (``{base}{offset}``: the lane's first element
        of each), by vectors."""
        for s in segments:
            for offset, values in lane_vectors(s, v):
                self.w(f"if (active) {store_stmt(row, f'{base}{s.offset} + {offset}', [value(s, i, c) for i, c in values], fn, self.half)}")

    def load_a(self, t: Term, names: Names, pos: int) -> list[str]:
        """Vector loads of term `t`'s entries of the ``A`` table of operand `pos` (the current
        edge's row); returns the C name of each entry."""
        base, n = self.g.layout.slots[id(t)], len(t.entries)
        tag = names.term[id(t)]
        out = []
        for q in range(-(-n // self.vector)):
            self.w(f"const TV {TABLE[pos]}{tag}_{q} = *reinterpret_cast<const TV*>(({table_name(pos)} + kk * NA) + {base + q * self.vector});")
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
                    w(f"const {vtype(width)} {name} = {expr};")
                body()
            return
        for name, width, expr in values:  # half precision: the raw values (ctext.half_helpers)
            w(f"{(self.half and raw_holder(expr, width)) or vtype(width)} p{name};")
        with w.block(f"if ({n} > 0)"):
            w(*pointers("0", "_n"))
            for name, _, expr in values:
                w(f"p{name} = {expr};")
        with w.block(f"for (int kk = 0; kk < {n}; ++kk)"):
            for name, width, _ in values:
                w(f"const {vtype(width)} {name} = p{name};")
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
                    w(f"for (int l = threadIdx.x * 128; l < NW * (int)sizeof({self.operand_ctype}); l += blockDim.x * 128) "
                      f'asm volatile("prefetch.global.L2 [%0];" :: "l"({pr} + l));')

    # --- forward ---------------------------------------------------------------------------
    def forward_math(self, p: Program, names: Names, store=None):
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

    def _forward_terms(self, terms: list[Term], channels: int, names: Names):
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

    def _wx(self, t: Term, b: int, channels: int, names: Names):
        """Term `t`'s ``wx[i, c] = sum w * x`` over the triples of ``A`` table `b`."""
        tag = names.term[id(t)]
        pairs = [(a, c) for a, table, c in self.sums.out if table == b]
        for i in sorted({i for i, _ in t.entries}):
            for c in range(channels):
                products = [(names.w(t, c, wp), names.x(t.x, i, c, xp)) for xp, wp in pairs]
                self.w(f"const T wx{suffix(b)}{tag}_{i}_{c} = {fma_sum(products)};")

    def _accumulate(self, t: Term, b: int, entries: list[str], channels: int, names: Names):
        """``acc[k, c] += A_b[i, k] wx[i, c]`` over term `t`'s entries (C names, :meth:`load_a`)."""
        tag = names.term[id(t)]
        for (i, k), a in zip(t.entries, entries):
            for c in range(channels):
                acc = f"acc{t.out.offset}_{k}_{c}"
                self.w(f"{acc} = fma({a}, wx{suffix(b)}{tag}_{i}_{c}, {acc});")

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
                w(f"{guard(0)}{store_stmt(row, f'bo{s.offset} + lane', [f'acc{s.offset}_0_0'], half=self.half)}")
                continue
            w(*(f"tb[lane * {s.ir_dim} + {k}] = acc{s.offset}_{k}_0;" for k in range(s.ir_dim)), "__syncwarp();")
            w(*(f"{guard(j)}{store_stmt(row, f'bo{s.offset} + lane + {LANES * j}', [f'tb[lane + {LANES * j}]'], half=self.half)}" for j in range(s.ir_dim)))
            w("__syncwarp();")

    # --- backward --------------------------------------------------------------------------
    def backward_math(self, q: int, p: Program, names: Names, gwrow: str, gyrow: str, outrow: str | None = None):
        """One edge's (row's) gradients: ``gw`` stored (or summed, shared weights), ``gx``
        added to the ``gx`` sums, ``gy``'s warp sums written to shared memory row `gyrow`.
        Each sum runs over its pairs of :class:`~jequi.sums.Sums`: per ``A`` table ``b``,
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
                        w(f"const T v{suffix(b)}{tag}_{i}_{c} = {expr};")
                if forward and last[id(t.out)] is t:
                    self.store_acc(p, outrow, [t.out])
                if self.needs_gw:
                    for c in channels:
                        expr = fma_sum((names.x(t.x, i, c, a), f"v{suffix(b)}{tag}_{i}_{c}") for a, b in sums.dw for i in rows)
                        w(f"{'' if self.shared else 'const T '}gw{tag}_{c} {'+' if self.shared else ''}= {expr};")
                    if not self.shared:  # lane_channels keeps the lane's channels' weights adjacent
                        w(f"if (active) {store_stmt(gwrow, t.weight_position('u'), [f'gw{tag}_{c}' for c in channels], half=self.half)}")
                if self.needs_gx:
                    for i in rows:
                        for c in channels:
                            for b, wp in sums.dx:
                                w(f"gx{t.x.offset}_{i}_{c} = fma({names.w(t, c, wp)}, v{suffix(b)}{tag}_{i}_{c}, gx{t.x.offset}_{i}_{c});")
        if self.needs_gy:
            ys = p.y_positions
            w(f"T {', '.join(f'gy{j} = 0' for j in ys)};")
            for t in p.terms:
                tag = names.term[id(t)]
                for wp in sorted({c for _, c in sums.dy}):
                    for c in channels:
                        w(f"const T wm{suffix(wp)}{tag}_{c} = active ? {names.w(t, c, wp)} : T(0);")
                pairs: dict[tuple[int, int], list] = {}
                for i, j, k, coeff in t.nonzeros:
                    pairs.setdefault((i, k), []).append((j, coeff))
                for c in channels:
                    for i in sorted({i for i, _ in pairs}):
                        products = [(f"wm{suffix(wp)}{tag}_{c}", names.x(t.x, i, c, a)) for a, wp in sums.dy]
                        w(f"const T xw{tag}_{i}_{c} = {fma_sum(products)};")
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
                        w(f"gy{y} = fma({lit(coeff)}, p{tag}_{i}_{k}, gy{y});")
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
            w("const T* g = gyp + kk * GY;", f"{self.ctype('gy')}* out = gy + (long long)({edge_of}) * D2;")
            for j in range(d2):
                w(store_stmt("out", str(j), [' + '.join(f'g[{o}]' for o in owners[j]) if j in owners else 'T(0)'], half=self.half))
