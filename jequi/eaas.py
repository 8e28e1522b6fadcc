"""``jequi.sh_tensor_product``: e3nn's tensor product of features with the spherical harmonics of a
vector, computed in the vector's frame (EAAS, E2Former-V2).

``sh_tensor_product(x, r, irreps_sh)`` equals ``e3nn.tensor_product(x,
e3nn.spherical_harmonics(irreps_sh, r, normalize))``: the same output irreps, order, zero flags and
values. It rotates each degree of ``x`` into the frame whose pole is ``r`` (one small matrix per
degree and vector, :func:`jequi.so2.wigner_d`), applies each path's sparse per-m map
(:func:`jequi.so2.coupling`: one multiply per output component) and rotates each output degree back:
O(L^3) work per channel where the dense product costs O(L^6). Pure ``jnp``: differentiable to any
order, forward and reverse, on and near the poles +-y (:func:`jequi.so2.edge_rotation`).
"""

from __future__ import annotations

import dataclasses
import functools

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np

from . import eaas_autodiff, so2
from .eaas_reference import frame, product
from .dtypes import plan as dtype_plan
from .drop_in import _filter_irreps, _regrouped, _reorder, _simplified_flags
from .irreps import Irreps


@dataclasses.dataclass(frozen=True)
class _Piece:
    """One output chunk ``(mul_x * mul_f) x l_o`` of e3nn's loop: input block `block` of the
    regrouped ``x`` times ``Y^{l_f}`` (repeated `mul_f` times). Its per-m map, for ``|m| <= k =
    min(l_i, l_o)``: ``y~[l_o + m] = coefficient[k + m] * x~[l_i + m]``, or ``x~[l_i - m]`` when
    `reverse` (odd paths); components ``|m| > k`` are zero. ``coefficient`` None: a zero-flagged
    input, the chunk is zero."""

    block: int
    l_f: int
    mul_f: int
    reverse: bool
    coefficient: tuple | None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one case runs: the regrouping of ``x`` (`order`), the degrees rotated into the frame
    (``rotate_in``: (l, input blocks of that degree)), and per output degree, in e3nn's sorted
    output order, its pieces (``out``: (l_o, pieces)); the output irreps and zero flags."""

    order: tuple | None
    irreps_in: Irreps
    rotate_in: tuple
    out: tuple
    lmax: int
    irreps_out: Irreps
    zero_flags: tuple


def _tp_factor(l1: int, l2: int, lo: int, irrep_normalization: str) -> float:
    """e3nn.tensor_product's factor on the raw Clebsch-Gordan coefficients."""
    return {"component": np.sqrt(2 * lo + 1), "norm": np.sqrt((2 * l1 + 1) * (2 * l2 + 1)), "none": 1.0}[irrep_normalization]


@functools.lru_cache(maxsize=256)
def _plan(irreps_x: Irreps, flags_x: tuple, irreps_sh: Irreps, filter_irs, irrep_normalization: str, sh_normalization: str) -> _Plan:
    order, irreps_in, flags_in = _regrouped(irreps_x, flags_x, True)
    _, sh, _ = _regrouped(irreps_sh, (False,) * len(irreps_sh), True)
    chunks = []  # e3nn's loop order: blocks of x, blocks of sh, then ir_x * ir_f
    for b, (mul, ir) in enumerate(irreps_in):
        for mul_f, ir_f in sh:
            for ir_o in ir * ir_f:
                if filter_irs is not None and ir_o not in filter_irs:
                    continue
                c = so2.coupling(ir.l, ir_f.l, ir_o.l)
                coefficient = None
                if not flags_in[b] and mul * mul_f > 0:
                    k = min(ir.l, ir_o.l)
                    scale = so2.pole_value(ir_f.l, sh_normalization) * _tp_factor(ir.l, ir_f.l, ir_o.l, irrep_normalization)
                    coefficient = tuple(scale * v for v in c.coefficient[ir_o.l - k : ir_o.l + k + 1])
                piece = _Piece(b, ir_f.l, mul_f, not c.even, coefficient)
                chunks.append(((mul * mul_f, ir_o), piece, bool(flags_in[b])))
    irreps_out, _, inv = Irreps([irrep for irrep, _, _ in chunks]).sort()  # stable, as e3nn's
    pieces = [chunks[k][1] for k in inv]
    flags = tuple(chunks[k][2] for k in inv)
    out = []  # the sorted output keeps each degree contiguous
    for (mul, ir), piece in zip(irreps_out, pieces):
        if out and out[-1][0] == ir.l:
            out[-1][1].append(piece)
        else:
            out.append((ir.l, [piece]))
    out = tuple((l, tuple(p for p in ps if irreps_in[p.block].mul * p.mul_f > 0)) for l, ps in out)
    used = sorted({p.block for _, ps in out for p in ps if p.coefficient is not None})
    rotate_in = tuple(
        (l, tuple(b for b in used if irreps_in[b].ir.l == l)) for l in sorted({irreps_in[b].ir.l for b in used})
    )
    lmax = max([l for l, _ in rotate_in] + [l for l, _ in out] + [0])
    simple = irreps_out.simplify()
    return _Plan(order, irreps_in, rotate_in, out, lmax, simple, _simplified_flags(irreps_out, flags, simple))


def sh_irreps(irreps_sh, vector_parity: int | None = None) -> Irreps:
    """The irreps of ``e3nn.spherical_harmonics(irreps_sh, ...)``: an irreps string or ``Irreps``,
    an int ``l`` or a list of ints (each ``1 x l`` with the vector's parity to the power ``l``;
    a plain array of vectors counts as ``1o``). Raises ValueError for harmonics e3nn does not
    define (even ``l`` must be ``e``; all odd ``l`` share the vector's parity)."""
    p = -1 if vector_parity is None else vector_parity
    if isinstance(irreps_sh, range):
        irreps_sh = list(irreps_sh)
    if isinstance(irreps_sh, (int, np.integer)) and not isinstance(irreps_sh, bool):
        irreps_sh = [int(irreps_sh)]
    if isinstance(irreps_sh, (list, tuple)) and irreps_sh and all(isinstance(l, (int, np.integer)) and not isinstance(l, bool) for l in irreps_sh):
        if any(l < 0 for l in irreps_sh):
            raise ValueError(f"irreps_sh: degrees must be >= 0, got {irreps_sh}")
        irreps_sh = [(1, (int(l), p**l)) for l in irreps_sh]
    try:
        irreps = Irreps(irreps_sh)
    except Exception as exc:  # e3nn raises ValueError, AssertionError or TypeError
        raise ValueError(f"irreps_sh: cannot interpret {irreps_sh!r} as irreps ({exc})") from exc
    for _, ir in irreps:
        if ir.l % 2 == 0 and ir.p != 1:
            raise ValueError(f"irreps_sh: spherical harmonics of even degree are even, got {ir}")
        if ir.l % 2 == 1 and vector_parity is not None and ir.p != vector_parity:
            raise ValueError(f"irreps_sh: {ir} does not have the parity of the vectors ({'1o' if vector_parity == -1 else '1e'})")
    if len({ir.p for _, ir in irreps if ir.l % 2 == 1}) > 1:
        raise ValueError(f"irreps_sh: odd degrees must share one parity, got {irreps}")
    return irreps


def _vectors(vectors):
    """(array (..., 3), parity or None) of the `vectors` argument."""
    if isinstance(vectors, e3nn.IrrepsArray):
        if len(vectors.irreps) != 1 or vectors.irreps[0].mul != 1 or vectors.irreps[0].ir.l != 1:
            raise ValueError(f"vectors: expected a single vector, 1x1o or 1x1e, got irreps {vectors.irreps}")
        return vectors.array, vectors.irreps[0].ir.p
    vectors = jnp.asarray(vectors)
    if vectors.ndim == 0 or vectors.shape[-1] != 3:
        raise ValueError(f"vectors: expected shape (..., 3), got {vectors.shape}")
    return vectors, None


BACKENDS = ("xla", "pallas")


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6))
def _run(plan: _Plan, x, vectors, normalize: bool, leading: tuple, dtype, backend: str):
    """Frames and product as one compiled function (op-by-op dispatch would compile each op)."""
    if backend == "pallas" and plan.irreps_out.dim > 0 and int(np.prod(leading)) > 0:
        rows = int(np.prod(leading))
        x = jnp.broadcast_to(x, (*leading, x.shape[-1])).reshape(rows, -1)
        r = jnp.broadcast_to(vectors, (*leading, 3)).reshape(rows, 3)
        z = eaas_autodiff.fused_product(eaas_autodiff.Spec(plan, normalize), x, r)
        return z.reshape(*leading, -1)
    ds, norm = frame(vectors, plan.lmax, normalize)
    return product(plan, x, ds, norm, leading, dtype)


def sh_tensor_product(x, vectors, irreps_sh, *, filter_ir_out=None, normalize: bool = True, backend: str = "xla",
                      out_dtype=None, math_dtype=None):  # fmt: skip
    """``e3nn.tensor_product(x, e3nn.spherical_harmonics(irreps_sh, vectors, normalize),
    filter_ir_out=filter_ir_out)``, computed in each vector's frame (EAAS).

    On a GPU, ``backend="pallas"`` is 2.2-4x e3nn-jax at harmonics of degree 2-4 and, at 128
    channels, the fastest forward and backward (:func:`jequi.tensor_product` of ``x`` and the
    harmonics, the dense kernels, is faster at 64 channels and forward at degree 2), but
    compiles for minutes at degree 4 (docs/e2former.md#eaas-jequish_tensor_product).

    Args:
        x: ``e3nn_jax.IrrepsArray`` (..., dim) (a plain array is ``Nx0e``, as in e3nn).
        vectors: array (..., 3) (a ``1o`` vector), or an ``IrrepsArray`` ``1x1o`` / ``1x1e``; its
            leading dims broadcast with those of ``x``.
        irreps_sh: the harmonics, as e3nn's ``spherical_harmonics`` takes them: irreps (string or
            ``Irreps``), an int ``l`` or a list of ints.
        filter_ir_out: keep only these output irreps (irreps string, ``Irreps``, an ``Irrep`` or a
            list of them); None keeps all.
        normalize: harmonics of ``r / |r|`` (True) or the polynomials of ``r`` (False).
        backend: ``"xla"`` (pure ``jnp``) or ``"pallas"`` (the kernels of
            :mod:`pallas_kernels.eaas`: one pass per row over ``x``, the frames XLA computes and
            the output; first derivatives and forward mode by kernels, second derivatives in
            ``(x, r)`` through the XLA product).
        out_dtype, math_dtype: :func:`jequi.dtypes.plan` (default: the result in the inputs'
            dtype, half precision computed in float32).

    Returns:
        ``IrrepsArray`` with e3nn's output irreps (sorted and merged), zero flags and values; the
        normalizations are e3nn's configured ones (``irrep_normalization``,
        ``spherical_harmonics_normalization``). Derivatives of every order are those of the dense
        product, except at ``r = 0`` exactly, where those with respect to ``vectors`` are zero.
    """
    filter_irs = _filter_irreps(filter_ir_out)
    irrep_normalization = e3nn.config("irrep_normalization")
    sh_normalization = e3nn.config("spherical_harmonics_normalization")
    if irrep_normalization not in ("component", "norm", "none"):
        raise ValueError(f"e3nn's irrep_normalization must be 'component', 'norm' or 'none', got {irrep_normalization!r}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for sh_tensor_product; choose one of {BACKENDS}")
    vec, parity = _vectors(vectors)
    irreps_sh = sh_irreps(irreps_sh, parity)
    x = e3nn.as_irreps_array(x)
    dtype = jnp.result_type(x.array, vec)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.ones(()).dtype
    try:
        leading = jnp.broadcast_shapes(x.shape[:-1], vec.shape[:-1])
    except ValueError as exc:
        raise ValueError(f"leading dims of x {x.shape} and vectors {vec.shape} do not broadcast") from exc
    plan = _plan(x.irreps, tuple(bool(f) for f in x.zero_flags), irreps_sh, filter_irs, irrep_normalization, sh_normalization)
    p = dtype_plan(dtype, out_dtype, math_dtype)  # computed in p.math, rounded once
    array = _reorder(x.array.astype(p.math), x.irreps, plan.order)
    z = _run(plan, array, vec.astype(p.math), bool(normalize), tuple(leading), p.math, backend)
    return e3nn.IrrepsArray(plan.irreps_out, z.astype(p.out), zero_flags=plan.zero_flags)
