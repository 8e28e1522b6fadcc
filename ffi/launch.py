"""The launch plan of one generated CUDA kernel: from the descriptor, the dtype, the kind, its
sums and a :class:`~.config.Config`, the programs (:mod:`.schedule`), how they are grouped into
blocks and in which order the blocks run, the rows (edges) per chunk and the shared memory
(:class:`Plan`). :mod:`.emit` and :mod:`.codegen` write the source from it."""

from __future__ import annotations

import numpy as np

from jequi.dtypes import HALF, compute_dtype
from jequi.sums import BACKWARD, FORWARD, GZ, W, X, Y, Sums

from . import schedule
from .config import Config
from .schedule import LANES, Program

CHUNKS = (LANES, 16, 8, 4, 2, 1)
MAX_THREADS = 1024
KINDS = ("tp_forward", "tp_backward", "tp_second", "conv_forward", "conv_backward", "conv_atomic_backward")

# The sums every kind computes its part of by default (:func:`computed`): the product and its
# vector-Jacobian product.
FIRST_ORDER = Sums(FORWARD.out, *BACKWARD.pairs)


def computed(kind: str, sums: Sums) -> Sums:
    """What a `kind` kernel computes of `sums`: a forward kind its ``out``, a backward kind its
    gradients, ``tp_second`` both."""
    return sums if kind == "tp_second" else sums.of_kind(kind.endswith("backward"))



class Group:
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



class Plan:
    """What a kernel of `kind` computes and how it is launched (see :mod:`.codegen` for the
    kinds)."""

    def __init__(self, desc, dtype, kind: str, sums: Sums, shared: bool, config: Config):
        assert kind in KINDS, kind
        self.desc, self.kind, self.shared = desc, kind, shared
        # Half-precision operands are stored as `storage` and widened as they load: the kernel
        # computes, schedules, sizes its registers and shared memory, in `dtype`, the math dtype
        # (jequi.dtypes.compute_dtype), as a float32 kernel does.
        self.storage = np.dtype(dtype)
        self.half = self.storage in HALF
        self.dtype = compute_dtype(self.storage)
        self.fused = kind == "tp_second"
        self.backward = kind.endswith("backward") or self.fused
        self.conv = kind.startswith("conv")
        self.atomic = kind == "conv_atomic_backward"
        self.sums = computed(kind, sums)
        if self.fused and not (self.sums.out and schedule.outputs_follow_x(desc)):
            raise ValueError(f"tp_second needs a forward sum and output segments each reached from one x segment, not {self.sums} of {desc!r}")
        # A batched backward in float64 with per-row weights runs one program per block, all
        # blocks of a program before the next program's, so a multiprocessor runs one program's
        # code at a time; forward kinds and float32 backwards lose so
        # (docs/tuning.md#schedule-split_float64_backward).
        self.split = not (self.conv or shared) and self.backward and self.dtype == np.float64
        self.needs_gx, self.needs_gy, self.needs_gw = self.sums.needs
        # the operand positions the kernel takes, in parameter order: x, y, w always (one
        # parameter list for every kernel of a kind; x sizes the batch), gz for a backward, and
        # the cotangents its sums read
        self.arrays = tuple(sorted({X, Y, W, *([GZ] if any(self.sums.needs) else []), *self.sums.reads}))
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
        self.groups = [Group(ps, self.vector, self.backward and self.needs_gy, len(self.tables))
                       for ps in schedule.block_groups(programs, 1 if self.split else config.block_warps)]  # fmt: skip
        self.warps = max(g.warps for g in self.groups)
        # a conv kernel's groups run group-major but a float64 forward's, node by node: faster on
        # NequIP-benzene, whose per-edge weight rows are then read in one pass instead of one per
        # group; in float32 group-major was faster (docs/tuning.md#schedule-node_major_float64_conv_forward)
        node_major = not self.backward and self.dtype == np.float64
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
        self.chunk = next(k for k in CHUNKS if k <= most and (size(k) <= config.smem_budget or k <= 8))
        self.smem = size(self.chunk)
        self.config = config
        self.results = self._result_dtypes()

    def _result_dtypes(self) -> dict[str, np.dtype]:
        """The dtype of each result array, by parameter name. A half-precision kernel rounds
        into the storage dtype only the results it completes: a batched row's ``out`` and
        ``gx``, an edge's ``gw``, and ``gy`` where one group owns every edge's. The partial sums
        its caller still adds (a conv's node rows, which a hub's parts split; ``extra`` and
        ``gxe``; the groups' ``gy``; shared weights' per-block ``gw``) stay in the math dtype,
        so each result is rounded once (jequi.dtypes)."""
        partial = {"extra", "gxe"} | ({"out", "gx"} if self.conv else set())
        partial |= {"gy"} if len(self.groups) > 1 else set()
        partial |= {"gw"} if self.shared else set()
        names = ("out", "extra", "gx", "gxe", "gy", "gw")
        return {n: self.dtype if n in partial else self.storage for n in names}

    def ctype(self, result: str) -> str:
        """C type of result `result`'s elements: ``T`` (the math type), or ``S`` (storage) in a
        half-precision kernel (:meth:`_result_dtypes`)."""
        return "S" if self.results[result] != self.dtype else "T"

    @property
    def operand_ctype(self) -> str:
        """C type of the operands' elements (``S``: stored in half precision)."""
        return "S" if self.half else "T"
