"""The tensor-product descriptor: the one source of truth every backend compiles from.

A descriptor holds, for one `(irreps_in1, irreps_in2, irreps_out, instructions,
normalization, layout)` problem:

* the validated instructions as :class:`Path` objects, each with its Clebsch-Gordan block
  (e3nn-jax's real basis and values, times the path's normalization, in float64),
* where every irrep block lives in the flat inputs and output (:class:`Segment`, for the
  ``mul_ir`` and ``ir_mul`` layouts),
* the flat weight layout (e3nn's instruction order, each path's weights row-major),
* each path's nonzero CG entries with its normalization folded in (:meth:`Path.nonzeros`),
  which the kernel generators unroll.

Backends read these fields; none of them recomputes a CG value or a normalization factor.
The normalization formulas are those of ``e3nn_jax.legacy.FunctionalTensorProduct``.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import math
import numbers
from typing import NamedTuple, Sequence

import e3nn_jax as e3nn
import numpy as np

from .irreps import Irrep, Irreps, as_irreps

#: Connection modes: how the multiplicity channels of the two inputs meet the output's.
MODES = ("uvw", "uvu", "uvv", "uuw", "uuu", "uvuv")
LAYOUTS = ("mul_ir", "ir_mul")
IRREP_NORMALIZATIONS = ("component", "norm", "none")
_NAMED_EXPONENTS = {"element": 0.0, "path": 1.0}

#: Entries of |CG| below this (relative to 1) are e3nn's numerical noise, not structure.
CG_ZERO = 1e-12


@dataclasses.dataclass(frozen=True)
class Segment:
    """One ``mul x ir`` block of a flat feature vector.

    ``index()[u, m]`` is the flat position of channel ``u``, component ``m``: ``offset +
    u * ir_dim + m`` in the ``mul_ir`` layout (e3nn's), ``offset + m * mul + u`` in ``ir_mul``
    (cuEquivariance's).
    """

    offset: int
    mul: int
    ir: Irrep
    layout: str

    @property
    def ir_dim(self) -> int:
        return self.ir.dim

    @property
    def size(self) -> int:
        return self.mul * self.ir.dim

    def index(self) -> np.ndarray:
        u = np.arange(self.mul)[:, None]
        m = np.arange(self.ir.dim)[None, :]
        if self.layout == "mul_ir":
            return self.offset + u * self.ir.dim + m
        return self.offset + m * self.mul + u


def segments_of(irreps: Irreps, layout: str) -> tuple[Segment, ...]:
    """The blocks of a flat vector with these irreps, in order."""
    out, offset = [], 0
    for mul, ir in irreps:
        out.append(Segment(offset, mul, ir, layout))
        offset += mul * ir.dim
    return tuple(out)


def layout_positions(segments: Sequence[Segment], layout: str) -> np.ndarray:
    """``positions[q]``: where the element at flat position ``q`` of `segments` sits when the
    same irreps are stored in `layout` (``a_in_layout[..., positions] = a``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    positions = np.zeros(sum(s.size for s in segments), dtype=np.int64)
    for s in segments:
        positions[s.index()] = dataclasses.replace(s, layout=layout).index()
    return positions


@dataclasses.dataclass(frozen=True, eq=False)
class Path:
    """One validated instruction.

    ``cg[i, j, k]`` is e3nn's Clebsch-Gordan coefficient times :attr:`path_weight` (the
    normalization), so a path contributes, e.g. for ``uvu``,
    ``z[u, k] += sum_{v, i, j} w[u, v] * cg[i, j, k] * x1[u, i] * x2[v, j]``.
    Weights of the path live at ``w[weight_offset : weight_offset + prod(weight_shape)]``,
    row-major in :attr:`weight_shape` (e3nn's ``path_shape``); unweighted paths have an empty
    ``weight_shape`` and use weight 1.
    """

    index: int
    i_in1: int
    i_in2: int
    i_out: int
    mode: str
    has_weight: bool
    mul_in1: int
    mul_in2: int
    mul_out: int
    ir_in1: Irrep
    ir_in2: Irrep
    ir_out: Irrep
    path_weight: float
    weight_std: float
    weight_offset: int
    weight_shape: tuple[int, ...]
    cg: np.ndarray

    @property
    def weight_numel(self) -> int:
        return math.prod(self.weight_shape) if self.has_weight else 0

    @property
    def is_empty(self) -> bool:
        """True when the path touches no data (a zero multiplicity)."""
        return 0 in (self.mul_in1, self.mul_in2, self.mul_out)

    def nonzeros(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(i, j, k, coeff)`` of the nonzero CG entries, ordered by ``k`` then ``(i, j)``."""
        k, i, j = np.nonzero(np.abs(self.cg.transpose(2, 0, 1)) > CG_ZERO)
        return i, j, k, self.cg[i, j, k]


def _exponent(value, name: str) -> float:
    if isinstance(value, str):
        if value not in _NAMED_EXPONENTS:
            raise ValueError(f"{name} must be 'element', 'path' or a number, got {value!r}")
        return _NAMED_EXPONENTS[value]
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"{name} must be 'element', 'path' or a number, got {value!r}")


def _check_instruction(n: int, ins, irreps_in1: Irreps, irreps_in2: Irreps, irreps_out: Irreps):
    """Validate one instruction tuple; return it as (i1, i2, io, mode, has_weight, path_weight)."""
    if not isinstance(ins, (tuple, list)) or len(ins) not in (5, 6):
        raise ValueError(
            f"instruction {n}: expected (i_in1, i_in2, i_out, mode, has_weight[, path_weight]), got {ins!r}"
        )
    i1, i2, io, mode, has_weight = ins[:5]
    path_weight = ins[5] if len(ins) == 6 else 1.0
    for name, idx, irreps in (("i_in1", i1, irreps_in1), ("i_in2", i2, irreps_in2), ("i_out", io, irreps_out)):
        if not isinstance(idx, numbers.Integral) or isinstance(idx, bool):
            raise ValueError(f"instruction {n}: {name}={idx!r} is not an integer")
        if not 0 <= idx < len(irreps):
            raise ValueError(
                f"instruction {n}: {name}={idx} is out of range for irreps {irreps} ({len(irreps)} entries)"
            )
    if mode not in MODES:
        raise ValueError(f"instruction {n}: unknown mode {mode!r}; supported modes are {', '.join(MODES)}")
    if not isinstance(has_weight, (bool, np.bool_)):
        raise ValueError(f"instruction {n}: has_weight must be a bool, got {has_weight!r}")
    if not isinstance(path_weight, numbers.Real) or isinstance(path_weight, bool) or not math.isfinite(path_weight):
        raise ValueError(f"instruction {n}: path_weight must be a finite number, got {path_weight!r}")
    if path_weight < 0:
        raise ValueError(f"instruction {n}: path_weight must be >= 0 (it is a variance), got {path_weight}")

    (m1, ir1), (m2, ir2), (mo, iro) = irreps_in1[i1], irreps_in2[i2], irreps_out[io]
    if ir1.p * ir2.p != iro.p or not abs(ir1.l - ir2.l) <= iro.l <= ir1.l + ir2.l:
        raise ValueError(
            f"instruction {n}: {ir1} x {ir2} -> {iro} breaks the selection rules "
            f"(need |l1-l2| <= l_out <= l1+l2 and p_out = p1*p2; {ir1} x {ir2} gives {list(ir1 * ir2)})"
        )
    need = {
        "uvw": (True, "any multiplicities"),
        "uvu": (m1 == mo, f"mul_in1 == mul_out (got {m1} and {mo})"),
        "uvv": (m2 == mo, f"mul_in2 == mul_out (got {m2} and {mo})"),
        "uuw": (m1 == m2, f"mul_in1 == mul_in2 (got {m1} and {m2})"),
        "uuu": (m1 == m2 == mo, f"mul_in1 == mul_in2 == mul_out (got {m1}, {m2}, {mo})"),
        "uvuv": (m1 * m2 == mo, f"mul_in1 * mul_in2 == mul_out (got {m1}*{m2} and {mo})"),
    }[mode]
    if not need[0]:
        raise ValueError(f"instruction {n}: mode {mode!r} needs {need[1]}")
    if mode == "uvw" and not has_weight:
        raise ValueError(f"instruction {n}: mode 'uvw' needs weights (has_weight=True)")
    if mode == "uuw" and not has_weight and mo != 1:
        raise ValueError(f"instruction {n}: unweighted 'uuw' sums over u and needs mul_out == 1 (got {mo})")
    return int(i1), int(i2), int(io), mode, bool(has_weight), float(path_weight)


def _variances(values, irreps, name: str) -> tuple[float, ...]:
    """Per-irrep variances (e3nn's ``in1_var`` / ``in2_var`` / ``out_var``): one for each of
    `irreps`' entries, finite and >= 0; None means all one."""
    if values is None:
        return (1.0,) * len(irreps)
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a list of {len(irreps)} numbers (one per irrep of {irreps}), got {values!r}") from None
    if len(out) != len(irreps) or not all(math.isfinite(v) and v >= 0 for v in out):
        raise ValueError(f"{name} must be {len(irreps)} finite numbers >= 0 (one per irrep of {irreps}), got {values!r}")
    return out


def _fan_in(mode: str, m1: int, m2: int) -> int:
    """e3nn's ``num_elements``: fan-in of one output component, for ``path_normalization``."""
    return {"uvw": m1 * m2, "uvu": m2, "uvv": m1, "uuw": m1, "uuu": 1, "uvuv": 1}[mode]


def _weight_shape(mode: str, m1: int, m2: int, mo: int) -> tuple[int, ...]:
    return {
        "uvw": (m1, m2, mo),
        "uvu": (m1, m2),
        "uvv": (m1, m2),
        "uuw": (m1, mo),
        "uuu": (m1,),
        "uvuv": (m1, m2),
    }[mode]


@functools.lru_cache(maxsize=None)
def _clebsch_gordan(l1: int, l2: int, l3: int) -> np.ndarray:
    cg = np.asarray(e3nn.clebsch_gordan(l1, l2, l3), dtype=np.float64)
    cg.setflags(write=False)
    return cg


class Untouched(NamedTuple):
    """What no term of a product reaches (:attr:`TensorProductDescriptor.untouched`): a kernel
    that writes only what its terms reach leaves these results unwritten, so its caller (or
    the kernel) zeroes them."""

    x: bool  # some element of x is in no active path with a nonzero coefficient: gx is zero there
    w: bool  # some weight is in no such path: gw is zero there
    out: bool  # some output element is reached by no such path: the output is zero there
    inactive_weights: tuple  # the weighted paths that touch no data (not active): their gw is zero


class TensorProductDescriptor:
    """Validated, normalized description of a CG tensor product (see module docstring).

    Equal arguments give equal (and equally hashed) descriptors, so compiled backend plans
    can be cached on them.
    """

    def __init__(
        self,
        irreps_in1,
        irreps_in2,
        irreps_out,
        instructions: Sequence[tuple],
        *,
        in1_var=None,
        in2_var=None,
        out_var=None,
        irrep_normalization: str | None = None,
        path_normalization=None,
        gradient_normalization=None,
        layout: str = "mul_ir",
    ):
        self.irreps_in1 = as_irreps(irreps_in1, "irreps_in1")
        self.irreps_in2 = as_irreps(irreps_in2, "irreps_in2")
        self.irreps_out = as_irreps(irreps_out, "irreps_out")
        # As e3nn's FunctionalTensorProduct: None reads e3nn.config (at construction, so the
        # descriptor keeps the values it was built with), variances default to one per irrep.
        if irrep_normalization is None:
            irrep_normalization = e3nn.config("irrep_normalization")
        if path_normalization is None:
            path_normalization = e3nn.config("path_normalization")
        if gradient_normalization is None:
            gradient_normalization = e3nn.config("gradient_normalization")
        self.in1_var = _variances(in1_var, self.irreps_in1, "in1_var")
        self.in2_var = _variances(in2_var, self.irreps_in2, "in2_var")
        self.out_var = _variances(out_var, self.irreps_out, "out_var")
        if irrep_normalization not in IRREP_NORMALIZATIONS:
            raise ValueError(
                f"irrep_normalization must be one of {IRREP_NORMALIZATIONS}, got {irrep_normalization!r}"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.irrep_normalization = irrep_normalization
        self.path_normalization = path_normalization
        self.gradient_normalization = gradient_normalization
        self.layout = layout
        path_exp = _exponent(path_normalization, "path_normalization")
        grad_exp = _exponent(gradient_normalization, "gradient_normalization")

        if isinstance(instructions, (str, bytes)) or not isinstance(instructions, Sequence):
            raise ValueError(f"instructions must be a list of tuples, got {instructions!r}")
        checked = [
            _check_instruction(n, ins, self.irreps_in1, self.irreps_in2, self.irreps_out)
            for n, ins in enumerate(instructions)
        ]
        self.instructions = tuple(checked)
        self.paths = self._make_paths(checked, path_exp, grad_exp)
        self.weight_numel = sum(p.weight_numel for p in self.paths)
        self.in1 = segments_of(self.irreps_in1, layout)
        self.in2 = segments_of(self.irreps_in2, layout)
        self.out = segments_of(self.irreps_out, layout)
        self._key = (
            str(self.irreps_in1),
            str(self.irreps_in2),
            str(self.irreps_out),
            self.instructions,
            irrep_normalization,
            path_exp,
            grad_exp,
            layout,
            self.in1_var,
            self.in2_var,
            self.out_var,
        )

    def _make_paths(self, checked, path_exp: float, grad_exp: float) -> tuple[Path, ...]:
        # Exactly e3nn_jax.legacy.FunctionalTensorProduct's _normalize_instruction_path_weights.
        muls = [
            (self.irreps_in1[i1].mul, self.irreps_in2[i2].mul, self.irreps_out[io].mul)
            for i1, i2, io, *_ in checked
        ]
        fan_in = [
            self.in1_var[ins[0]] * self.in2_var[ins[1]] * _fan_in(ins[3], m1, m2) for ins, (m1, m2, _) in zip(checked, muls)
        ]
        sums = collections.defaultdict(float)
        for ins, var in zip(checked, fan_in):
            sums[ins[2]] += var ** (1.0 - path_exp)

        paths, offset = [], 0
        for n, ((i1, i2, io, mode, has_weight, user_weight), (m1, m2, mo), var) in enumerate(
            zip(checked, muls, fan_in)
        ):
            ir1, ir2, iro = self.irreps_in1[i1].ir, self.irreps_in2[i2].ir, self.irreps_out[io].ir
            alpha = {"component": iro.dim, "norm": ir1.dim * ir2.dim, "none": 1}[self.irrep_normalization]
            x = var**path_exp * sums[io]
            if x > 0.0:
                alpha /= x
            alpha *= self.out_var[io]
            alpha *= user_weight
            if has_weight:
                path_weight = math.sqrt(alpha) ** grad_exp
                weight_std = math.sqrt(alpha) ** (1.0 - grad_exp)
            else:
                path_weight, weight_std = math.sqrt(alpha), 1.0
            shape = _weight_shape(mode, m1, m2, mo) if has_weight else ()
            cg = path_weight * _clebsch_gordan(ir1.l, ir2.l, iro.l)
            cg.setflags(write=False)
            path = Path(
                n, i1, i2, io, mode, has_weight, m1, m2, mo, ir1, ir2, iro,
                path_weight, weight_std, offset, shape, cg,
            )
            offset += path.weight_numel
            paths.append(path)
        return tuple(paths)

    # --- identity -------------------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return isinstance(other, TensorProductDescriptor) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return (
            f"TensorProductDescriptor({self.irreps_in1} x {self.irreps_in2} -> {self.irreps_out}, "
            f"{len(self.paths)} paths, {self.weight_numel} weights, {self.layout})"
        )

    # --- derived views ----------------------------------------------------------------------
    @property
    def dims(self) -> tuple[int, int, int]:
        """(in1.dim, in2.dim, out.dim)."""
        return self.irreps_in1.dim, self.irreps_in2.dim, self.irreps_out.dim

    @property
    def active_paths(self) -> tuple[Path, ...]:
        """Paths that touch data (no zero multiplicity, nonzero normalization)."""
        return tuple(p for p in self.paths if not p.is_empty and p.path_weight != 0.0)

    @functools.cached_property
    def trilinear(self) -> "TensorProductDescriptor":
        """This product with each unweighted path given explicit weights, all fixed to one.

        Kernels and derivative rules use this view: it is linear in each of x, y and w (an
        unweighted path makes the product affine, not linear, in w). Its flat weights are this
        descriptor's followed by ``trilinear.weight_numel - weight_numel`` ones.
        """
        if all(p.has_weight for p in self.paths):
            return self
        new = copy.copy(self)
        for cached in ("trilinear", "untouched"):  # self's cached properties, not new's
            new.__dict__.pop(cached, None)
        paths, offset = [], self.weight_numel
        for p in self.paths:
            if not p.has_weight:
                shape = _weight_shape(p.mode, p.mul_in1, p.mul_in2, p.mul_out)
                p = dataclasses.replace(p, has_weight=True, weight_offset=offset, weight_shape=shape)
                offset += p.weight_numel
            paths.append(p)
        new.paths, new.weight_numel, new._key = tuple(paths), offset, self._key + ("trilinear",)
        return new

    @functools.cached_property
    def untouched(self) -> Untouched:
        """Which of ``x``, ``w`` and the output hold an element that no active path with a
        nonzero coefficient (above :data:`CG_ZERO`) touches (an input or output segment that no
        path reaches, a path whose normalization is zero or whose coefficients all vanish),
        and the weighted paths that are not active. The kernels read it once per descriptor:
        the CUDA ones zero those results before they run, the Pallas ones store zero ``gw``
        for the inactive paths."""
        reached = [p for p in self.active_paths if np.any(np.abs(p.cg) > CG_ZERO)]
        d1, _, dout = self.dims
        active = set(map(id, self.active_paths))
        return Untouched(
            x=sum(self.in1[s].size for s in {p.i_in1 for p in reached}) < d1,
            w=sum(p.weight_numel for p in reached) < self.weight_numel,
            out=sum(self.out[s].size for s in {p.i_out for p in reached}) < dout,
            inactive_weights=tuple(p for p in self.paths if p.weight_numel and id(p) not in active),
        )
