"""Wall-clock timing of jitted calls, shared by the benchmark scripts."""

from __future__ import annotations

import importlib.metadata
import platform
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


def save(result: dict, kind: str, markdown: str, out) -> str:
    """Write ``<date>-<device>-<kind>.{json,md}`` into `out` (and into $OUT on the GPU machine,
    when that is another folder); returns the stem."""
    import json
    import os
    import pathlib
    import re
    import shutil

    out = pathlib.Path(out)
    stem = f"{result['date']}-{re.sub('[^a-z0-9]+', '-', result['device'].lower()).strip('-')}-{kind}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(markdown)
    if os.environ.get("OUT") and pathlib.Path(os.environ["OUT"]).resolve() != out.resolve():
        for f in (out / f"{stem}.json", out / f"{stem}.md"):
            shutil.copy(f, os.environ["OUT"])
    return stem


def versions(*dists: str) -> dict:
    """Python, jax and jequi versions, and those of the installed distributions `dists` (None
    where one is not installed): the header of every results file."""
    import jequi

    v = {"python": platform.python_version(), "jax": jax.__version__, "jequi": jequi.__version__}
    for dist in dists:
        try:
            v[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[dist] = None
    return v
