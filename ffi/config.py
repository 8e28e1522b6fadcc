"""The CUDA kernels' schedule knobs as one frozen value (:class:`Config`), passed to
:func:`ffi.codegen.generate`, to the build search (:mod:`.build_search`) and to every op of
:mod:`.ops` (``config=``; :data:`DEFAULT` where not given). benchmarks/tune_cuda.py sweeps them
by building configs."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of the generated kernels (benchmarks/tune_cuda.py sweeps them; the measurements
    behind the defaults: docs/tuning.md#ffischedulepy-config).

    * ``forward_registers``: 32-bit registers per lane for the values a conv forward's
      program holds per edge (its sums, its ``x`` values, its weights; a float64 value takes
      two, see :func:`forward_programs`); more values are split over more programs.
    * ``forward_channels``: the most channels a conv forward's lane computes (``channels``
      for the other kernels). Two channels and 160 registers put each of MACE-large's ``x``
      segments in one program, read once per edge rather than by two or three warps
      (docs/tuning.md#schedule-forward_channels).
    * ``batched_forward_registers``: the same for the batched forward, whose lane holds one
      output segment's sums at a time (:func:`forward_programs`' `one_segment`). 96 is within a
      few percent of the best on each channelwise product measured, but a wide float64 one
      (NequIP-benzene) wants more and loses much with fewer
      (docs/tuning.md#schedule-batched_forward_registers); see the next knob.
    * ``batched_float64_forward_registers`` / ``batched_float64_forward_rows``: a float64
      batched forward is built a second time with these registers and rows per block (0
      registers: not), and :func:`ffi.build_search.make` keeps the build that does not spill (more
      than ``float32_spill_bytes`` / ``float64_spill_bytes``), then the one with more warps resident per multiprocessor,
      on a tie the one with fewer programs, then this one. No one setting wins: few registers
      cut a wide product into many programs, many leave few warps resident; the rule keeps
      the faster build, or one close to it (docs/tuning.md#schedule-batched_float64_forward_registers).
    * ``backward_values``: the values (of either dtype) a backward program holds per edge
      (:func:`backward_programs`; measured on MACE-large, the same programs in float32 and
      float64 beat a budget in registers).
    * ``conv_backward_heaviest_channels``: channels per lane (a power of two) of the heaviest
      ``x`` segment in a float32 conv backward (:func:`backward_programs`' `heaviest`; lighter
      segments take proportionally more, within :func:`lane_channels`, the value budget and a
      double backward's two). At 2, MACE-large's ``2e`` segment runs on two warps of two channels
      instead of four of one (and without the register prefetch of the next edge's operands),
      so its CG coefficients spread ``gy`` once per two channels, in fewer warps and without
      spilling. The batched backward keeps one: its double backward lost at 2
      (docs/tuning.md#schedule-conv_backward_heaviest_channels).
    * ``batched_float32_backward_values``: ``backward_values`` for a float32 batched backward
      with per-row weights, apart so that it can move without the conv's and float64's
      programs. At 96 NequIP-LiPS' kernels run four-warp blocks without spilling; at 128 the
      register cap of ``min_warps`` cut them to three-warp blocks and its second-order kernel
      spilled (docs/tuning.md#schedule-batched_float32_backward_values).
    * ``prefetch``: load the next edge's (row's) operands before this one's arithmetic where
      they take at most this many 32-bit registers per lane (0: never).
    * ``batched_float32_backward_prefetch``: ``prefetch`` for a float32 batched backward with
      per-row weights (0: each row's operands are loaded where they are used). Without the early
      loads the compiler gives these kernels fewer registers, and the more resident warps hide
      the latency the early loads hid; float64 keeps ``prefetch``
      (docs/tuning.md#schedule-batched_float32_backward_prefetch).
    * ``float32_spill_bytes`` / ``float64_spill_bytes``: spill stores (bytes per thread) a
      kernel under the register cap of ``min_warps`` may have before it is rebuilt under a looser
      one: in float32 a few words in L1 cost less than half the warps; in float64 none is let
      through (docs/tuning.md#ops-spill_bytes).
    * ``smem_budget``: dynamic shared memory a block may take: the largest chunk (32, 16 or 8
      edges, one per lane while ``A`` is built; at most ``batched_*_rows`` rows of a batched
      kernel) whose ``A`` tables and ``gy`` partials fit in it.
    * ``min_warps``: warps per multiprocessor the compiler must leave registers for (whole
      blocks, ``__launch_bounds__``); a kernel that would spill more is rebuilt uncapped.
    * ``l2_prefetch``: the conv forward asks L2 for the weight row of the edge this many steps
      ahead (0: never); ``backward_l2_prefetch`` the same for the conv backward, where one step
      ahead was the fastest (docs/tuning.md#schedule-l2_prefetch).
    * ``block_warps``: warps per block; more programs are spread over several blocks per
      node (:func:`block_groups`); a conv or batched backward kernel's blocks may take fewer
      (``code_bytes``, ``batched_code_bytes``).
    * ``channels``: the most channels a lane computes (a power of two; at most 16 bytes of
      them, one vector load or store per component). Each lane of a program takes
      :func:`lane_channels` of them: the shared-memory reads of ``A``, the loads, stores and
      the ``gy`` shuffles are paid once for them all, and their arithmetic is independent.
    * ``batched_forward_rows`` / ``batched_backward_rows``: rows per block of the batched
      forward / backward kernels with per-row weights (a power of two up to 32; fewer where
      the ``A`` tables would not fit ``smem_budget``). Small blocks keep more of them
      resident per multiprocessor and leave no tail wave
      (benchmarks/results/2026-11-24-h200-batched-rows.md; docs/tuning.md#schedule-batched_forward_rows).
      Shared weights keep 32 (each block writes a partial ``gw``); a conv's chunks take 32
      edges.
    * ``unstaged_float32_forward_rows``: rows per block of a float32 batched forward that is
      not staged (``ir_mul``): one row, faster there once a forward holds one output segment's
      sums at a time. The other forwards keep two: one row loses staged and in float64
      (docs/tuning.md#schedule-unstaged_float32_forward_rows).
    * ``unstaged_float32_forward_sum_registers``: ``batched_forward_registers`` for a float32
      batched forward sum that is not staged (``ir_mul``): the double backward's ``dgz``, whose
      lanes load two ``x``-like and two ``w``-like rows and so want more registers than a
      forward. A staged (``mul_ir``) sum keeps ``batched_forward_registers``: more did not pay
      there (docs/tuning.md#schedule-unstaged_float32_forward_sum_registers).
    * ``code_bytes``: the machine code a conv kernel may keep running on two neighbouring
      multiprocessors. A product as wide as NequIP-benzene unrolls
      into more code than the instruction caches hold, and its warps stall on instruction
      fetch, so the build search (:mod:`.build_search`) builds a conv kernel with
      ``block_warps`` and then fewer warps per block (8, 6, 4, 3, 2, 1) until the code of the
      groups two multiprocessors run at once fits (0: never split for it). A conv kernel's
      groups run group-major (all nodes' blocks of
      a group before the next group's: one group's code at a time), so that is one group's
      code; node by node (a float64 conv forward, :mod:`.launch`), one group per block two
      multiprocessors hold, up to all of them. The budget, as if each pair of multiprocessors
      had 128 KB of instruction cache, fits every measurement (docs/tuning.md#schedule-code_bytes).
    * ``batched_code_bytes``: ``code_bytes`` for the batched backward kinds and the double
      backward's forward sum (``dgz``, which force training runs: ``g`` is then perturbed);
      :mod:`.build_search` builds them first with their groups group-major
      (``batched_group_major``), then with fewer warps per block. The forward of one product is
      built as configured (split, NequIP-benzene's lost). The batched kinds have a budget of
      their own, below the conv's: split at it, the widest products' backward kinds ran
      faster, and one budget this small would split the conv's NequIP-OAM float64 kernels,
      which lose split (see ``code_bytes``; docs/tuning.md#schedule-batched_code_bytes).
      Shared-weight backward kinds split too, not measured (shared weights default to Pallas).
    * ``batched_group_major``: a batched kernel of several groups runs them group-major (all
      row blocks of a group before the next group's); :mod:`.build_search` sets it where a
      backward kind's (or ``dgz``'s) code does not fit ``batched_code_bytes`` node by node. A
      float64 backward with per-row weights runs group-major either way (one program per
      block, :mod:`.launch`).
    * ``atomic_conv_backward``: the conv's backward walks receivers, as the forward does
      (``conv_atomic_backward``): each receiver's cotangent row is read once and ``gx`` is
      added to the senders' rows with atomics, faster where the output is much wider than
      ``x``, but ``gx`` is not bitwise reproducible; opt-in (backend ``"cuda-atomic"``).
    """

    forward_registers: int = 160
    forward_channels: int = 2
    batched_forward_registers: int = 96
    batched_float64_forward_registers: int = 256
    batched_float64_forward_rows: int = 1
    backward_values: int = 128
    conv_backward_heaviest_channels: int = 2
    batched_float32_backward_values: int = 96
    prefetch: int = 64
    batched_float32_backward_prefetch: int = 0
    min_warps: int = 16
    float32_spill_bytes: int = 64
    float64_spill_bytes: int = 0
    smem_budget: int = 64 * 1024
    l2_prefetch: int = 4
    backward_l2_prefetch: int = 1
    block_warps: int = 12
    channels: int = 4
    batched_forward_rows: int = 2
    batched_backward_rows: int = 4
    unstaged_float32_forward_rows: int = 1
    unstaged_float32_forward_sum_registers: int = 192
    code_bytes: int = 128 * 1024
    batched_code_bytes: int = 96 * 1024
    batched_group_major: bool = False
    atomic_conv_backward: bool = False


DEFAULT = Config()
