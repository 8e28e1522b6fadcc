"""Wall-clock timing of jitted calls, shared by the benchmark scripts."""

from __future__ import annotations

import statistics
import time

import jax


def median_ms(fn, args, repeat: int = 5, calls: int = 5) -> float:
    """Median over `repeat` runs of `calls` calls of ``fn(*args)`` (each run ended by a
    block), in ms per call; ``fn`` is already compiled and warm."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / calls)
        del out
    return 1e3 * statistics.median(times)


def timed(fn, args, repeat: int = 5, calls: int = 5) -> tuple[float, float]:
    """``(median ms per call, first call in s)``: the first call (compilation) is timed
    apart, then :func:`median_ms`."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first_s = time.perf_counter() - t0
    return median_ms(fn, args, repeat, calls), first_s
