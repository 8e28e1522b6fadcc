"""The build search: of the builds of a kernel a :class:`~.config.Config` allows (a float64
batched forward also with ``batched_float64_forward_*``; register caps loosened until it stops
spilling; blocks narrowed until its code fits the instruction caches), the one to run. Each
build is compiled (:mod:`.build`) and ranked by its spills and resident warps."""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from jequi.dtypes import compute_dtype
from jequi.sums import Sums

from . import build, codegen
from .config import Config
from .schedule import LANES

def spill_bytes(config: Config, dtype) -> int:
    """The spill stores (bytes per thread) a build of `dtype` may have (``Config.float32_spill_bytes``,
    ``float64_spill_bytes``; half precision computes in float32)."""
    return config.float32_spill_bytes if compute_dtype(dtype) == np.float32 else config.float64_spill_bytes


# Warps per block a kernel is rebuilt with, in turn, until its code fits (_code_fitting).
BLOCK_WARPS = (8, 6, 4, 3, 2, 1)



def make(desc, dtype, kind: str, sums: Sums, shared: bool, config: Config) -> codegen.Kernel:
    """The kernel `config` gives: of the builds :func:`_configs` lists, one that spills no
    more than :func:`spill_bytes` if any does, then the one with the most warps resident per
    multiprocessor, on a tie the one with the fewest programs (each re-reads its rows), then
    the first; each build with its blocks cut until its code fits (:func:`_code_fitting`)."""
    configs = _configs(config, dtype, kind)
    build_one = lambda c: _code_fitting(desc, dtype, kind, sums, shared, c)  # noqa: E731
    if len(configs) == 1:
        return build_one(configs[0])
    with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:  # nvcc runs beside nvcc
        return min(pool.map(build_one, configs), key=lambda k: _rank(k, dtype, config))


def _rank(k: codegen.Kernel, dtype, config: Config) -> tuple:
    """:func:`make`'s order of builds: not spilling, most resident warps, fewest programs."""
    path = build.cubin(k.source)
    spills = build.resources(path)["spill_stores"] > spill_bytes(config, dtype)
    return spills, -build.resident_warps(path, k.threads, k.smem), len(k.programs)


def _configs(config: Config, dtype, kind: str) -> list[Config]:
    """The configs a kernel is built with: `config`, and for a float64 batched forward also
    (first) with ``Config.batched_float64_forward_registers`` and ``batched_float64_forward_rows``."""
    if kind != "tp_forward" or dtype != np.float64 or not config.batched_float64_forward_registers:
        return [config]
    wide = dataclasses.replace(config, batched_forward_registers=config.batched_float64_forward_registers,
                               batched_forward_rows=config.batched_float64_forward_rows)  # fmt: skip
    return [wide, config]


def _uncapped_enough(desc, dtype, kind, sums, shared, config) -> codegen.Kernel:
    """The kernel under the register cap of ``config.min_warps``, loosened until it (nearly)
    stops spilling."""
    most = config.min_warps
    for warps in dict.fromkeys((most, most * 3 // 4, most // 2, 0)):
        k = codegen.generate(desc, dtype, kind, sums, shared, dataclasses.replace(config, min_warps=warps))
        if build.resources(build.cubin(k.source))["spill_stores"] <= spill_bytes(config, dtype):
            break
    return k


def _code_fitting(desc, dtype, kind, sums, shared, config) -> codegen.Kernel:
    """The kernel built with `config`, then with the changes :func:`_narrower` lists in turn,
    until its code fits ``Config.code_bytes`` (a conv kind) or ``Config.batched_code_bytes``
    (:func:`code_fits`; or each program has its own blocks). A batched forward of one product
    (not a sum, as the double backward's ``dgz``) is built as `config` says (see
    ``Config.batched_code_bytes``)."""
    conv = kind.startswith("conv")
    if conv:
        budget = config.code_bytes
    else:
        budget = 0 if kind == "tp_forward" and not sums.summed else config.batched_code_bytes
    for c in _narrower(config, conv):
        k = _uncapped_enough(desc, dtype, kind, sums, shared, c)
        if code_fits(k, budget):
            break
    return k


def _narrower(config, conv: bool):
    """`config`; for a batched kernel then its groups run group-major; then fewer warps per
    block (:data:`BLOCK_WARPS`)."""
    yield config
    if not conv:
        config = dataclasses.replace(config, batched_group_major=True)
        yield config
    for warps in BLOCK_WARPS:
        if warps < config.block_warps:
            yield dataclasses.replace(config, block_warps=warps)


def code_fits(k: codegen.Kernel, budget: int) -> bool:
    """Whether the code of the groups of `k` that two neighbouring multiprocessors run at once
    is at most `budget` bytes (0: any): one group's where they run group-major, one per block
    the two hold (up to all) node by node; a group's code is the kernel's divided by its groups."""
    if not budget:
        return True
    path = build.cubin(k.source)
    blocks = build.resident_warps(path, k.threads, k.smem) * LANES // k.threads
    running = 1 if k.group_major else min(k.groups, 2 * blocks)
    return build.code_bytes(path) * running <= budget * k.groups
