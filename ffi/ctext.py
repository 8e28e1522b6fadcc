"""C text helpers of the generated CUDA kernels: an indenting writer, literals, vector loads
and stores, and the C names of a program's per-lane values (:class:`Names`)."""

from __future__ import annotations

import contextlib
import re

from jequi.sums import GGW, GGX, GGY, GZ, W, X, Y
from jequi.descriptor import Segment

from .schedule import Program, Term

# C names by operand position (jequi.autodiff's (x, y, w, gz, ggx, ggy, ggw)): the kernel
# parameter, the prefix of a lane's loaded values, and (y-like operands) the A table's.
PARAM = {X: "x", Y: "y", W: "w", GZ: "gz", GGX: "ggx", GGY: "ggy", GGW: "ggw"}
VALUE = {X: "x", W: "w", GGX: "q", GGW: "h"}  # gz's values are always "g"
TABLE = {Y: "a", GGY: "b"}



class Writer:
    def __init__(self):
        self.lines: list[str] = []
        self.depth = 0

    def __call__(self, *lines: str):
        self.lines.extend("  " * self.depth + line for line in lines)

    @contextlib.contextmanager
    def block(self, head: str):
        self(head + " {")
        self.depth += 1
        yield
        self.depth -= 1
        self("}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def lit(c: float) -> str:
    return f"T({float(c)!r})"


def vtype(width: int) -> str:
    return "T" if width == 1 else f"T{width}"


def load_expr(row: str, index: str, stream: bool, width: int = 1, half: bool = False) -> str:
    """A load of `width` adjacent values (one vector load: the index is a multiple of it);
    `half`: of half-precision values, into a holder that widens them to the math type where
    it is converted (:func:`half_helpers`)."""
    if half:
        return f"{'ldcs' if stream else 'ldg'}{width}({row} + {index})"
    address = f"{row} + {index}" if width == 1 else f"reinterpret_cast<const {vtype(width)}*>({row} + {index})"
    return f"__ldcs({address})" if stream else f"__ldg({address})"


def raw_holder(expr: str, width: int) -> str | None:
    """The ``H<width>`` type that holds `expr`'s raw half-precision values where `expr` is one
    of :func:`half_helpers`' loads (None otherwise, e.g. a load under a condition, which is a
    float): the type of a half-precision kernel's prefetch register."""
    return f"H{width}" if re.fullmatch(rf"(ldcs|ldg){width}\([^()]*\)", expr) else None


def store_stmt(row: str, index: str, values: list[str], fn: str = "__stcs", half: bool = False) -> str:
    """A streaming store of adjacent `values` (one vector store), or with `fn` ``"red_add"``
    an atomic add of them (:data:`RED_ADD`). `half`: a half-precision kernel's store, whose
    helper (:func:`half_helpers`) rounds the values where the row is stored in half precision."""
    if half and fn == "__stcs":
        return f"stcs{len(values)}({row} + {index}, {', '.join(values)});"
    if len(values) == 1:
        return f"{fn}({row} + {index}, {values[0]});"
    return f"{fn}(reinterpret_cast<{vtype(len(values))}*>({row} + {index}), MAKE{len(values)}({', '.join(values)}));"


# A half-precision kernel's storage type S, its pair S2, and their conversions to and from float.
_HALF_TYPES = {
    "bfloat16": ("cuda_bf16.h", "__nv_bfloat16", "__nv_bfloat162", "__bfloat162float", "__bfloat1622float2",
                 "__float2bfloat16_rn", "__floats2bfloat162_rn"),
    "float16": ("cuda_fp16.h", "__half", "__half2", "__half2float", "__half22float2", "__float2half_rn", "__floats2half2_rn"),
}  # fmt: skip


def half_helpers(storage: str) -> list[str]:
    """C lines of a half-precision kernel (`storage`: ``"bfloat16"`` or ``"float16"``): its types
    and the loads and stores :func:`load_expr` and :func:`store_stmt` name. ``ldcs<n>`` /
    ``ldg<n>`` load `n` adjacent values (``n * 2`` bytes, one load) into a holder ``H<n>`` of
    the raw values, which widens them to float where it is converted (to ``T`` / ``T<n>``):
    a prefetch register (:func:`raw_holder`) keeps the raw values, so a load issued one edge
    ahead is waited for where it is used, not where it is issued (the widening right after the
    load stalled the bfloat16 conv forward on it: docs/precision.md#the-bfloat16-forward).
    ``stcs<n>`` stores `n` floats, rounded to nearest even where the pointer is ``S*`` and as
    they are where it is ``float*`` (the partial sums the caller adds)."""
    header, s, s2, tof, tof2, tos, tos2 = _HALF_TYPES[storage]
    lines = [f"#include <{header}>", f"typedef {s} S;", f"typedef {s2} S2;",
             f"__device__ __forceinline__ float tof(S v) {{ return {tof}(v); }}",
             "struct H1 { S v; __device__ __forceinline__ operator float() const { return tof(v); } };",
             f"struct H2 {{ S2 v; __device__ __forceinline__ operator float2() const {{ return {tof2}(v); }} }};",
             "struct H4 {",
             "  uint2 v;",
             "  __device__ __forceinline__ operator float4() const {",
             f"    const float2 a = {tof2}(*reinterpret_cast<const S2*>(&v.x)), b = {tof2}(*reinterpret_cast<const S2*>(&v.y));",
             "    return make_float4(a.x, a.y, b.x, b.y);",
             "  }",
             "};"]  # fmt: skip
    for name, ld in (("ldcs", "__ldcs"), ("ldg", "__ldg")):
        lines += [
            f"__device__ __forceinline__ H1 {name}1(const S* p) {{ return H1{{{ld}(p)}}; }}",
            f"__device__ __forceinline__ H2 {name}2(const S* p) {{ return H2{{{ld}(reinterpret_cast<const S2*>(p))}}; }}",
            f"__device__ __forceinline__ H4 {name}4(const S* p) {{ return H4{{{ld}(reinterpret_cast<const uint2*>(p))}}; }}",
        ]  # fmt: skip
    lines += [
        "__device__ __forceinline__ void stcs1(float* p, float a) { __stcs(p, a); }",
        "__device__ __forceinline__ void stcs2(float* p, float a, float b) { __stcs(reinterpret_cast<float2*>(p), make_float2(a, b)); }",
        "__device__ __forceinline__ void stcs4(float* p, float a, float b, float c, float d) {",
        "  __stcs(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));",
        "}",
        f"__device__ __forceinline__ void stcs1(S* p, float a) {{ __stcs(p, {tos}(a)); }}",
        f"__device__ __forceinline__ void stcs2(S* p, float a, float b) {{ __stcs(reinterpret_cast<S2*>(p), {tos2}(a, b)); }}",
        "__device__ __forceinline__ void stcs4(S* p, float a, float b, float c, float d) {",
        f"  const S2 lo = {tos2}(a, b), hi = {tos2}(c, d);",
        "  __stcs(reinterpret_cast<uint2*>(p), make_uint2(*reinterpret_cast<const unsigned*>(&lo), *reinterpret_cast<const unsigned*>(&hi)));",
        "}",
    ]  # fmt: skip
    return lines


# Reductions without a result (PTX red; atomicAdd compiles to atom, which returns the old
# value); the vector forms need sm_90.
RED_ADD = r"""
__device__ __forceinline__ void red_add(float* p, float a) { asm volatile("red.global.add.f32 [%0], %1;" :: "l"(p), "f"(a)); }
__device__ __forceinline__ void red_add(double* p, double a) { asm volatile("red.global.add.f64 [%0], %1;" :: "l"(p), "d"(a)); }
__device__ __forceinline__ void red_add(float2* p, float2 a) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(p), "f"(a.x), "f"(a.y));
}
__device__ __forceinline__ void red_add(float4* p, float4 a) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(p), "f"(a.x), "f"(a.y), "f"(a.z), "f"(a.w));
}
""".strip().splitlines()


def table_name(pos: int) -> str:
    """C name of the shared-memory ``A`` table of ``y``-like operand `pos`."""
    return f"{TABLE[pos].upper()}s"


def fma_sum(products) -> str:
    """C expression of the sum of `products` (pairs of C names), as fused multiply-adds."""
    expr = None
    for a, b in products:
        expr = f"fma({a}, {b}, {expr})" if expr else f"{a} * {b}"
    return expr


def suffix(pos: int) -> str:
    """Suffix of the C names derived from operand `pos`: none for the product's own operands
    (y, w), the cotangent's letter for a substituted one."""
    return "" if pos in (X, Y, W) else VALUE.get(pos, TABLE.get(pos))


def segment_base(s: Segment, u: str) -> str:
    """C expression of channel `u`'s first element of segment `s`."""
    return f"{s.offset} + {u} * {s.ir_dim}" if s.layout == "mul_ir" else f"{s.offset} + {u}"


def lane_vectors(s: Segment, v: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """A lane's `v` channels of segment `s` as vectors of `v` adjacent values: per vector, its
    offset from the lane's first element and the ``(component, channel)`` of each value."""
    if s.layout == "mul_ir":  # the lane's channels' components are v * ir_dim adjacent values
        return [(n * v, [((n * v + m) % s.ir_dim, (n * v + m) // s.ir_dim) for m in range(v)]) for n in range(s.ir_dim)]
    return [(i * s.mul, [(i, c) for c in range(v)]) for i in range(s.ir_dim)]


class Names:
    """C names of a program's per-lane values (its `channels` channels), by segment and term:
    loaded vectors are named per vector, their values by component."""

    def __init__(self, p: Program):
        self.v = p.channels
        self.term = {id(t): n for n, t in enumerate(p.terms)}
        self.place = {}
        for s in p.x_segments + p.out_segments:
            for n, (_, values) in enumerate(lane_vectors(s, self.v)):
                for m, (i, c) in enumerate(values):
                    self.place[id(s), i, c] = (n, m)

    def _part(self, var: str, m: int) -> str:
        return var if self.v == 1 else f"{var}.{'xyzw'[m]}"

    def x(self, s: Segment, i: int, c: int, pos: int = X) -> str:
        """Value of component `i` of channel `c` of the ``x``-like operand at `pos`."""
        n, m = self.place[id(s), i, c]
        return self._part(f"{VALUE[pos]}{s.offset}_{n}", m)

    def g(self, s: Segment, k: int, c: int) -> str:
        n, m = self.place[id(s), k, c]
        return self._part(f"g{s.offset}_{n}", m)

    def w(self, t: Term, c: int, pos: int = W) -> str:
        return self._part(f"{VALUE[pos]}{self.term[id(t)]}", c)
