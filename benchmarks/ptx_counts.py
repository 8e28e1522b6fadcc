"""The instruction mix of generated CUDA kernels, per dtype, without a GPU: each kernel compiled
to PTX for sm_90 (nvcc -ptx) and its global loads and stores counted by kind, with the total
instruction count and the float32 arithmetic. It shows what half-precision storage changes in a
kernel (the same loads, of half the bytes, and the widening instructions) before a GPU measures
what that buys.

    python benchmarks/ptx_counts.py [--problems nequix-main,mace-large] [--dtypes float32,bfloat16]
"""

import argparse
import collections
import pathlib
import re
import subprocess
import tempfile

import jax.numpy as jnp
import numpy as np

import jequi
from ffi import build, ops
from jequi.sums import FORWARD, Sums

KINDS = {"conv_forward": FORWARD, "conv_backward": Sums.gradients((True, True, True))}


def counts(source: str, folder: pathlib.Path) -> collections.Counter:
    """PTX instruction names (with their type suffixes) of `source` and their counts."""
    src, ptx = folder / "k.cu", folder / "k.ptx"
    src.write_text(source)
    subprocess.run([build.nvcc(), "-ptx", "-O3", "-std=c++17", "-arch=sm_90", *build.nvcc_includes(build.nvcc()), str(src), "-o", str(ptx)],
                   check=True, capture_output=True)  # fmt: skip
    return collections.Counter(re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\s", ptx.read_text(), re.M))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", default="nequix-main,mace-large")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    folder = pathlib.Path(tempfile.mkdtemp())
    build.CACHE_DIR = folder
    print("| problem | kernel | dtype | PTX instructions | global loads | operand bytes the loads carry (one pass of the code) | float32 arithmetic |")
    print("|---|---|---|---|---|---|---|")
    for problem in a.problems.split(","):
        desc = jequi.problems.get(problem).descriptor.trilinear
        for kind, sums in KINDS.items():
            for dtype in a.dtypes.split(","):
                c = counts(ops.kernel(desc, jnp.dtype(dtype), kind, sums).source, folder)
                loads = {k: v for k, v in c.items() if k.startswith("ld.global")}
                width = lambda k: (int(m.group(1)) if (m := re.search(r"\.v(\d)", k)) else 1) * int(re.search(r"(\d+)$", k).group(1)) // 8  # noqa: E731
                # scalar u32 loads are the graph's indices (order, other, offsets) in every dtype
                loaded = sum(v * width(k) for k, v in loads.items() if not re.fullmatch(r"ld\.global(\.nc)?\.u32", k))
                arith = sum(v for k, v in c.items() if re.match(r"(fma|mul|add|sub)\.(rn\.)?f32", k))
                print(f"| {problem} | {kind} | {dtype} | {sum(c.values())} | {sum(loads.values())} | {loaded} | {arith} |")


if __name__ == "__main__":
    main()
