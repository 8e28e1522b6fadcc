"""The Pallas kernels' schedule knobs as one frozen value, passed to every kernel entry point
(``config=``) and to the rules of :mod:`.heuristics` that read it.

A field left at None defers to its rule in :mod:`.heuristics`; a value forces the choice
(benchmarks/tune_conv.py sweeps them by building configs). The measurements behind each rule
and default: docs/tuning.md, under the rule's name.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of the Pallas kernels (None: :mod:`.heuristics`' rule of the same name).

    Batched per-row kernels (:mod:`.per_row`):

    * ``rows_per_program``: batch rows a program walks (:func:`.heuristics.rows_per_program`).
    * ``forward_warps`` / ``backward_warps``: warps per program (:func:`.heuristics.num_warps`,
      :func:`.heuristics.batched_warps`; also the conv forward's, :func:`.heuristics.conv_forward_warps`).
    * ``forward_accumulators``: the batched forward's output elements per thread before its
      outputs split over programs (0: a program per segment; :func:`.heuristics.forward_groups`).
    * ``backward_groups``: the batched backward runs a program per ``x`` segment
      (:func:`.heuristics.backward_groups`).
    * ``channel_windows``: the most x-channel windows of the batched backward
      (:func:`.heuristics.channel_windows`).
    * ``fused_forward``: the batched forward's multiply-adds fused (:func:`.heuristics.fused_forward`).
    * ``fused_second``: the batched double backward's ``dgz`` summed in its backward kernel
      (:func:`.heuristics.fuses_second`).
    * ``tile_min_lanes``: lane vectors narrower than this keep their cross-lane sums per element
      instead of joining a tile: Triton's compiler crashed on joins of 4- and 1-lane vectors
      (docs/tuning.md#tensor_product-tile_min_lanes).

    Fused convolution (:mod:`.conv`):

    * ``accumulator_registers``: 32-bit registers per thread for a forward program's sums
      (:func:`.heuristics.conv_output_groups`; docs/tuning.md#conv-accumulator_registers).
    * ``fill_warps``: the warps a small graph's rows are split to fill (:func:`.heuristics.fill_edges`).
    * ``chained_forward``: the forward's multiply-adds start from the edge loop's running sums
      (:func:`.heuristics.chained_forward`).
    * ``backward_chunks``: the most backward programs per ``x`` segment
      (:func:`.heuristics.conv_backward_programs`).

    Row-block kernels (:mod:`.row_blocks`; docs/tuning.md#row_blocks-rows-and-warps-per-program):

    * ``block_forward_rows`` / ``block_forward_warps``: rows and warps per forward program.
    * ``block_backward_rows`` / ``block_backward_warps``: the same for the backward (rows None:
      128 bytes of values, :func:`.heuristics.block_backward_rows`).
    """

    rows_per_program: int | None = None
    forward_warps: int | None = None
    backward_warps: int | None = None
    forward_accumulators: int | None = None
    backward_groups: bool | None = None
    channel_windows: int | None = None
    fused_forward: bool | None = None
    fused_second: bool | None = None
    tile_min_lanes: int = 32
    accumulator_registers: int = 64
    fill_warps: int = 4096
    chained_forward: bool | None = None
    backward_chunks: int | None = None
    block_forward_rows: int = 16
    block_forward_warps: int = 8
    block_backward_rows: int | None = None
    block_backward_warps: int = 4


DEFAULT = Config()
