"""The rules that pick the Pallas kernels' launch shapes per problem: programs per row (or
node) and what each computes, warps per program, rows per program.

Each rule reads the descriptor, the dtype and a :class:`~.config.Config`, whose field of the
same name, where set, overrides the rule. The measurements behind each rule: docs/tuning.md,
under its name.
"""

from __future__ import annotations

import jax.numpy as jnp

from .config import DEFAULT, Config
from .row_code import chunks


# --- EAAS kernels (.eaas) ------------------------------------------------------------------


def eaas_warps(plan) -> int:
    """Warps per program of the EAAS kernels (``plan``: :func:`jequi.eaas._plan`'s): one thread
    per lane of the widest channel chunk of ``x``, as :func:`num_warps` (4 warps for 128
    channels, 2 for 64); at 64 channels 2 warps ran forward and backward faster than 4
    (benchmarks/results/2026-11-28-nvidia-h100-80gb-hbm3-eaas-launch-tile-store.md and
    ...-eaas-launch.md; docs/tuning.md#eaas-num_warps)."""
    return width_warps(max((size for mul_ir in plan.irreps_in for _, size in chunks(mul_ir.mul)), default=32))


def width_warps(channels: int) -> int:
    """One thread per lane of a `channels`-wide chunk, 1 to 4 warps."""
    return max(1, min(4, channels // 32))


# --- batched per-row kernels (.per_row) ---------------------------------------------------
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


def channel_windows(desc, dtype, config: Config = DEFAULT) -> list[tuple[int, int] | None]:
    """The x-channel windows of the batched backward's programs: ``[None]`` (all channels in
    one program), or windows of one power-of-two width over the widest x segment (forced:
    ``config.channel_windows`` of them at most), each a program of its own with fewer live
    values. Only for products whose paths are all ``uvu`` or ``uvw``: there ``gx`` and ``gw``
    split by x channel and ``gy`` (one slot per y channel, summed over x channels) is a
    partial per program; a ``uu*`` path's ``gy`` would split by channel too. The rule: two
    windows for channelwise (``uvu``) products in float64 where every x segment has at least
    128 channels (two or more per lane of their one-warp backward programs); else one. Two
    windows paid for MACE-large in float64 and lost for narrower or mixed products and in
    float32 (docs/tuning.md#tensor_product-channel_windows). The conv's backward splits its
    programs by paths instead (:func:`conv_backward_programs`)."""
    modes = {p.mode for p in desc.active_paths}
    n = config.channel_windows
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


def rows_per_program(desc, n: int, config: Config = DEFAULT, *, forward: bool = False) -> int:
    """Rows per program of the batched kernels: 8 for a channelwise product from 8,192 rows
    (2 for its `forward` in ``ir_mul`` on one warp per program), else 1: several rows paid for
    channelwise products and lost for ``uvw`` ones, and the one-warp ``ir_mul`` forwards were
    fastest, or close to it, at two (results/2026-11-21-h200-ab.md;
    docs/tuning.md#tensor_product-rows_per_program)."""
    if config.rows_per_program is not None:
        return config.rows_per_program
    if not channelwise(desc) or n < 8 * 1024:
        return 1
    return 2 if forward and desc.layout == "ir_mul" and batched_warps(desc, config) == 1 else 8


def num_warps(desc, config: Config = DEFAULT, *, backward: bool = False) -> int:
    """Warps per program (``config.forward_warps`` / ``backward_warps`` where set): one thread
    per lane of the widest channel chunk (4 warps for 128 channels, 1 for 32):
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
    ``forward_warps`` knob. Narrower products keep the width rule (two warps for 64
    channels), faster there (docs/tuning.md#tensor_product-num_warps). The conv forward has
    its own rule, :func:`conv_forward_warps`. Fewer warps give each thread several channels,
    over which the per-row scalar work (the CG coefficients times y, the same in every thread)
    is shared."""
    knob = config.backward_warps if backward else config.forward_warps
    if knob is not None:
        return knob
    if channelwise(desc) and (
        backward and "uvu" in {p.mode for p in desc.active_paths}
        or not backward and desc.layout == "ir_mul" and widest_chunk(desc) >= 128
    ):
        return 1
    return width_warps(widest_chunk(desc))


# The most values of a uvw/uuw path's (u, w) tile (:func:`largest_tile`) for which its product
# runs the batched kernels on one warp per program (:func:`batched_warps`); DiffDock's 32 x 32
# tiles ran one warp already.
ONE_WARP_TILE = 1024


def batched_warps(desc, config: Config = DEFAULT, *, backward: bool = False) -> int:
    """Warps per program of the batched forward (or `backward`): :func:`num_warps`, but one
    for a product of ``uvw``/``uuw`` paths only whose ``(u, w)`` tiles all hold at most
    :data:`ONE_WARP_TILE` values, forward and backward: the tiles' sums over ``u`` then stay in
    warp shuffles, faster in both dtypes (docs/tuning.md#tensor_product-batched_warps). The
    conv keeps :func:`num_warps` (not measured there)."""
    knob = config.backward_warps if backward else config.forward_warps
    modes = {p.mode for p in desc.active_paths}
    if knob is None and modes and modes <= {"uvw", "uuw"} and largest_tile(desc) <= ONE_WARP_TILE:
        return 1
    return num_warps(desc, config, backward=backward)


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


# float32 rows with more output elements per thread than this get a program per segment.
FORWARD_OUTPUTS_PER_THREAD = 128


def forward_groups(desc, dtype, config: Config = DEFAULT) -> list[list[int]]:
    """The batched forward's program groups of output segments (``config.forward_accumulators``
    where set: groups of at most that many output elements per thread, 0 a program per
    segment, :func:`output_groups`): a program per segment in
    float64 (measured faster, whatever the width), for a product with paths that contract over
    channels (``uvw``, ``uuw``), and in float32 where a row's outputs exceed
    :data:`FORWARD_OUTPUTS_PER_THREAD` per thread
    (a row's outputs stay in registers until its stores: storing each segment early was
    slower, the loads after a store no longer overlap, results/2026-11-21-h200-ab.md); else
    one. A program reads only its paths' inputs, and a ``uvw`` product's programs hold fewer
    sums. Groups under a budget of outputs per thread were no better than one of the two
    (docs/tuning.md#tensor_product-forward_groups)."""
    warps = batched_warps(desc, config)
    if config.forward_accumulators is not None:
        return output_groups(desc, config.forward_accumulators, warps)
    wide = desc.dims[2] > FORWARD_OUTPUTS_PER_THREAD * 32 * warps
    if jnp.dtype(dtype) == jnp.float64 or not channelwise(desc) or wide:
        return output_groups(desc, 0, warps)
    return [list(range(len(desc.out)))]


def fused_forward(dtype, config: Config = DEFAULT) -> bool:
    """Whether the batched forward's multiply-adds are fused instructions
    (:func:`~.lowering.fma`; ``config.fused_forward`` where set): except in float64, where
    separate ones were the faster; in float32 the two are close but for one product, faster
    fused (docs/tuning.md#tensor_product-fused_forward)."""
    return jnp.dtype(dtype) != jnp.float64 if config.fused_forward is None else config.fused_forward


def backward_groups(desc, dtype, config: Config = DEFAULT) -> list[tuple[list[int], list]]:
    """The batched backward's programs per block of rows: one for the whole row, or one per
    :func:`input_groups` group (each program holds one x segment's gradients and paths, fewer
    live values, and writes a partial gy, added after; ``config.backward_groups`` where set):
    :func:`input_groups` for channelwise products,
    and in float64 for products whose x segments are all at least 8 channels wide; else one.
    Groups paid there (each program holds fewer live values) and lost for float32 ``uvw``
    products and for x segments of one channel (docs/tuning.md#tensor_product-backward_groups)."""
    grouped = config.backward_groups
    if grouped is None:
        wide = all(seg.mul >= 8 for seg in desc.in1)
        grouped = channelwise(desc) or (jnp.dtype(dtype) == jnp.float64 and wide)
    return input_groups(desc) if grouped else [(list(range(len(desc.in1))), desc.active_paths)]


# Whether the batched double backward sums ``dgz`` (a forward over its triples) in the
# backward's programs (:func:`.per_row.second_sum`, where :func:`fuses_second`) rather than in a
# forward kernel of its own that reads the rows again: by default where a row's outputs number at
# most SECOND_OUTPUTS. Each fused program holds its partial ``dgz`` row, every output, beside
# the backward's sums, where the forward kernel holds one output segment per program in
# float64 and for ``uvw``. Fusing paid for a product of 7 outputs and lost for one of 156; none
# between was timed: 32 (a warp's lanes) is a choice inside that gap, not a measured edge
# (docs/tuning.md#tensor_product-fused_second).
SECOND_OUTPUTS = 32


def fuses_second(desc, dtype, sums, config: Config = DEFAULT) -> bool:
    """Whether :func:`.per_row.second_sum` computes the double backward's ``dgz`` (``sums.out``)
    with its gradients (``sums.pairs``): both wanted, ``config.fused_second`` (or its rule), the programs not split
    by channel windows, and their partial ``dgz`` rows (one per program, added after as
    ``gy``'s) fewer values than the row of ``x, y, w`` the forward kernel would read again."""
    d1, d2, do = desc.dims
    wanted = do <= SECOND_OUTPUTS if config.fused_second is None else config.fused_second
    if not (wanted and sums.out and any(sums.pairs)) or channel_windows(desc, dtype, config) != [None]:
        return False
    return len(backward_groups(desc, dtype, config)) * do <= d1 + d2 + desc.weight_numel



# --- fused convolution (.conv) -------------------------------------------------------------
# Rows of a graph too small to fill the GPU (a few hundred rows for 132 SMs) are split further:
# :func:`fill_edges` lowers the most edges per part (:func:`jequi.graph.part_edges`) until the
# grid has about ``config.fill_warps`` warps, half of what the GPU holds resident; splitting
# measured faster on small batches (benchmarks/results/2026-11-21-h200-tune.md).
def fill_edges(num_edges: int, programs_per_part: int, warps: int, config: Config = DEFAULT) -> int:
    """Edges per part that give the grid about ``config.fill_warps`` warps."""
    return -(-num_edges * programs_per_part * warps // config.fill_warps)


def conv_output_groups(desc, dtype, config: Config = DEFAULT) -> list[list[int]]:
    """The forward's programs per receiver, as groups of output segments: the sums live in
    registers for a whole edge loop, and a wide output would spill. They get
    ``config.accumulator_registers`` 32-bit registers per thread (a float64 sum takes two): 64
    was the fastest in float64, and float32 is indifferent
    (docs/tuning.md#conv-accumulator_registers)."""
    per_thread = config.accumulator_registers * 4 // jnp.dtype(dtype).itemsize
    return output_groups(desc, per_thread, conv_forward_warps(desc, dtype, config))


def conv_forward_warps(desc, dtype, config: Config = DEFAULT) -> int:
    """Warps per conv forward program: :func:`num_warps`, but for a channelwise
    product in ``ir_mul`` one warp, or two in float64 when it is at least 128 channels wide.
    A program walks a whole row's edges, enough work per warp that one warp holding several
    neighbouring channels per thread pays even where the batched forward prefers the width
    rule. The sums get ``config.accumulator_registers`` per thread, and a float64 sum takes two:
    one warp splits MACE-large's outputs over twice the programs of two, each repeating the
    edge loop's index, x and y loads (docs/tuning.md#conv-forward_warps)."""
    if config.forward_warps is None and channelwise(desc) and desc.layout == "ir_mul":
        return 2 if jnp.dtype(dtype) == jnp.float64 and widest_chunk(desc) >= 128 else 1
    return num_warps(desc, config)


def chained_forward(dtype, config: Config = DEFAULT) -> bool:
    """Whether the conv forward's multiply-adds start from the running sums of the edge loop
    (each product fused into the sum it feeds) rather than an edge's values summed first and
    then added to them (``config.chained_forward`` where set): chained in float64 only, where
    it was the faster; in float32 separate sums were (docs/tuning.md#conv-chained_forward)."""
    return jnp.dtype(dtype) == jnp.float64 if config.chained_forward is None else config.chained_forward


# A conv backward program loads about this many output cotangent elements per lane per edge, at most.
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


def conv_backward_programs(desc, config: Config = DEFAULT) -> tuple[list[tuple[list[int], list, int, int]], int]:
    """``(programs, partials)``: the conv backward's programs per sender as ``(in1 segments,
    paths, chunk, chunks of the group)``, each :func:`input_groups` group split into chunks of
    its paths by output segment, and the number of partial ``gx`` they write (chunk ``c``
    writes partial ``c`` of its segments; chunk 0 writes zeros into the partials its group has
    no chunk for).

    Chunks per group (at most ``config.backward_chunks`` where set): as many as its output
    cotangent needs at :data:`COTANGENT_PER_THREAD` elements per lane, in either dtype (2, 3
    and 4 for MACE-large's three x segments). The backward runs one warp per program at the
    register limit: a smaller live set pays where the extra programs' repeated per-edge work
    (indices, x and y, the gy lane sums and partials) costs less than it saves
    (docs/tuning.md#conv-backward_programs)."""
    lanes = 32 * num_warps(desc, config, backward=True)
    programs, partials = [], 1
    for segments, paths in input_groups(desc):
        size = sum(desc.out[s].size for s in {p.i_out for p in paths})
        n = config.backward_chunks
        if n is None:
            n = -(-size // (lanes * COTANGENT_PER_THREAD))
        pieces = _path_chunks(desc, paths, max(1, n)) if paths else [[]]
        programs.extend((segments, chunk, c, len(pieces)) for c, chunk in enumerate(pieces))
        partials = max(partials, len(pieces))
    return programs, partials


# --- row-block kernels (.row_blocks) -------------------------------------------------------
def block_backward_rows(dtype, config: Config = DEFAULT) -> int:
    """Rows per row-block backward program: ``config.block_backward_rows``, or 128 bytes of
    values (32 float32, 16 float64; docs/tuning.md#row_blocks-rows-and-warps-per-program)."""
    return config.block_backward_rows or 128 // jnp.dtype(dtype).itemsize
