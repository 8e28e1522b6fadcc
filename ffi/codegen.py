"""CUDA source of jequi's kernels, generated per descriptor from its schedule.

Its kinds, each one ``extern "C" __global__`` function ``jequi_<kind>``:

* ``tp_forward`` / ``tp_backward``: the batched product; a block owns a chunk of rows.
* ``tp_second``: a batched backward that also writes the forward sum of its
  :class:`~jequi.sums.Sums`' ``out`` (force training's double backward: ``dgz`` beside ``dx, dy,
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

Each computes the sums of a :class:`~jequi.sums.Sums`: by default the product (forward kinds)
or its vector-Jacobian product (backward kinds); with substituted cotangents, the fused
double backward's terms (an ``A`` table per ``y``-like operand, the ``x``- and ``w``-like
rows loaded side by side).

Per chunk of edges (rows; 32, or fewer where the tables would not fit ``Config.smem_budget``;
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
program per block, :mod:`.launch`) and in a batched kernel whose code does not
fit otherwise (``Config.batched_group_major``); else node by node (``blockIdx.x = node * groups +
group``). The groups' ``gy`` partials are summed by the caller.
Batches from ``jax.vmap`` arrive as grid rows ``blockIdx.y``.

Operands stored in bfloat16 or float16 (type ``S``) are read by vector loads of the same lanes
and channels as float32's and widened to float32 (``T``) where they are used; a register that
prefetches the next edge's keeps them raw (:func:`.ctext.half_helpers`). The kernel is float32's,
with half the bytes read. The results it completes are rounded to ``S`` as
they are stored; the partial sums its caller adds stay in float32
(:meth:`.launch.Plan._result_dtypes`).
"""

from __future__ import annotations

import dataclasses

from jequi.sums import GGW, GGX, GGY, W, X, Y, Sums

from . import schedule
from .config import DEFAULT, Config
from .ctext import PARAM, Names, store_stmt, table_name, vtype
from .emit import Emitter
from .launch import FIRST_ORDER, MAX_THREADS
from .schedule import LANES, Program


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
    arrays: tuple[int, ...]  # the operand positions it takes, in parameter order (Plan.arrays)
    results: tuple[tuple[str, object], ...] = ()  # (parameter name, numpy dtype) of each result (Plan.results)

    @property
    def entry(self) -> str:
        return f"jequi_{self.kind}"

    def result_dtype(self, name: str):
        """The dtype of result `name` (``out``, ``extra``, ``gx``, ``gxe``, ``gy``, ``gw``): the
        operands' but for the partial sums a half-precision kernel leaves in float32."""
        return dict(self.results)[name]


class _Kernel(Emitter):
    """Emits one kernel's source: the pieces of :class:`~.emit.Emitter` assembled per kind."""

    # --- kernels -----------------------------------------------------------------------------
    def params(self) -> list[str]:
        params = [f"const {self.operand_ctype}* __restrict__ {PARAM[pos]}" for pos in self.arrays]
        if self.conv:
            params += [f"const int* __restrict__ {a}" for a in ("order", "other", "offsets", "rows", "slots")]
        if self.backward:
            grads = ("gx", "gxe", "gy", "gw") if self.conv and not self.atomic else ("gx", "gy", "gw")
            needs = {"gx": self.needs_gx, "gxe": self.needs_gx, "gy": self.needs_gy, "gw": self.needs_gw}
            params += [f"{self.ctype(g)}* __restrict__ {g}" for g in grads if needs[g]]
        if not self.backward or self.fused:
            params.append(f"{self.ctype('out')}* __restrict__ out")
            if self.conv:
                params.append(f"{self.ctype('extra')}* __restrict__ extra")
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
                            w(f"T* {table_name(pos)} = {at};")
                            at = f"{table_name(pos)} + K * NA"
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
        used = self.arrays
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
                names = Names(p)
                if self.shared:
                    for name, width, expr in self.w_loads(p, names, lambda pos: PARAM[pos], self.sums.w_likes, stream=False):
                        w(f"const {vtype(width)} {name} = {expr};")
                body(q, p, names)

    def _chunk_a(self):
        """Build ``A`` for the chunk's edges (and note their edge and node ids), then wait."""
        w = self.w
        with w.block("if (lane < n)"):
            w("const int e = order[base + lane];")
            w("if (warp == 0) { s_edge[lane] = e; s_node[lane] = other[base + lane]; }")
            for pos in self.tables:
                w(f"build_a{self.gi}(warp, {PARAM[pos]} + (long long)e * D2, {table_name(pos)} + lane * NA);")
        w("__syncthreads();")

    def _row_tables(self):
        """A batched kind's block: its rows ``row0 .. row0 + n`` and their ``A`` tables (a lane
        builds its row's), then the barrier before any program reads them."""
        w = self.w
        w("const long long row0 = (long long)node * K;", "const int n = (int)min((long long)K, num_rows - row0);")
        for pos in self.tables:
            w(f"if (lane < n) build_a{self.gi}(warp, {PARAM[pos]} + (row0 + lane) * D2, {table_name(pos)} + lane * NA);")
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

    def _receiver_walk(self, p: Program, names: Names, math, after_chunk=lambda: None):
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
                self.w(f"if (active) {store_stmt(row, t.weight_position('u'), [f'gw{tag}_{c}' for c in range(p.channels)], half=self.half)}")

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
                zero = lambda name: f"{self.ctype(name)}(0.0f)" if self.half else "0"  # noqa: E731
                if self.needs_gy:
                    w(f"for (int j = lane; j < D2; j += 32) gy[e * D2 + j] = {zero('gy')};")
                if self.needs_gw and not self.shared and self.gi == 0:
                    w(f"for (int j = lane; j < NW; j += 32) gw[e * NW + j] = {zero('gw')};")
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
                w(f"const {vtype(width)} {name} = {expr};")
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
                w(f"const {vtype(width)} {name} = {expr};")

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


def generate(desc, dtype, kind: str, sums: Sums = FIRST_ORDER, shared: bool = False,
             config: Config = DEFAULT) -> Kernel:  # fmt: skip
    """The `kind` kernel of (trilinear, ``uvu``-only) descriptor `desc` in `dtype`, computing
    the sums `sums` says (a forward kind its ``out``, a backward kind its ``dx, dy, dw``;
    the default: the product and all three gradients); `shared`: one weight vector for all
    rows (or edges)."""
    if schedule.unsupported(desc):
        raise ValueError(f"the CUDA kernels run modes {schedule.SUPPORTED_MODES}, not {sorted(schedule.unsupported(desc))}")
    k = _Kernel(desc, dtype, kind, sums, shared, config)
    if k.warps * LANES > MAX_THREADS:
        raise ValueError(f"{desc!r} needs {k.warps} warps per block in the CUDA kernels (at most {MAX_THREADS // LANES})")
    programs = tuple(p for g in k.groups for p in g.programs)
    return Kernel(kind, k.source(), k.warps * LANES, k.smem, k.chunk, len(k.groups), k.group_major, programs, k.arrays,
                  tuple(k.results.items()))
