"""``jequi.so2_conv``: the weighted SO(2) convolution of eSCN / EquiformerV2, with O(3) parity, and
the exact map between its weights and those of a path-weighted CG product with harmonics.

In the frame of the vector ``r`` (:mod:`jequi.so2`), per order ``m`` and pair of blocks
``(in, out)``, with channel-mixing matrices ``(mul_in, mul_out)``::

    y~(out, 0)  = sum_in x~(in, 0) W0
    y~(out, +m) = sum_in x~(in, +m) Wr[m] - x~(in, -m) Wi[m]
    y~(out, -m) = sum_in x~(in, -m) Wr[m] + x~(in, +m) Wi[m]

then ``y = D y~``. A pair ``(in, out)`` couples through harmonics ``Y^{l_f}`` of parity
``(-1)^{l_f} = p_in p_out``: when that is ``(-1)^{l_in + l_out}`` only the paths with
``l_in + l_f + l_out`` even exist and the pair has ``W0, Wr[m]`` ("real" blocks, m = 0..min(l));
otherwise only the odd paths, giving ``Wi[m]`` ("imag" blocks, m = 1..min(l)), as ``1o x Y^1 -> 1e``
(the cross product). Either way the pair's SO(2) weights and its CG path weights (one per
allowed ``l_f``) are in a square, invertible linear relation: :func:`so2_weights_from_path_weights`
and :func:`path_weights_from_so2_weights`, for the product :func:`so2_path_product`.
"""

from __future__ import annotations

import dataclasses
import functools

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np

from . import so2
from .dtypes import plan
from .eaas_reference import frame
from .irreps import Irreps, as_irreps
from .products import TensorProduct, fully_connected


@dataclasses.dataclass(frozen=True)
class SO2Block:
    """The weights of one order `m` and pair of blocks (`i_in`, `i_out`): ``weights[...,
    offset : offset + mul_in * mul_out]``, row-major ``(mul_in, mul_out)``; `kind` is ``"real"``
    (``W0`` at m = 0, ``Wr[m]``) or ``"imag"`` (``Wi[m]``)."""

    m: int
    i_in: int
    i_out: int
    kind: str
    offset: int
    mul_in: int
    mul_out: int


def pair_kind(ir_in, ir_out) -> str:
    """``"real"`` when ``p_in p_out = (-1)^(l_in + l_out)`` (the even paths), else ``"imag"``."""
    return "real" if ir_in.p * ir_out.p == (-1) ** (ir_in.l + ir_out.l) else "imag"


def _pair_orders(ir_in, ir_out, m_max: int) -> range:
    top = min(ir_in.l, ir_out.l, m_max)
    return range(0, top + 1) if pair_kind(ir_in, ir_out) == "real" else range(1, top + 1)


@dataclasses.dataclass(frozen=True)
class SO2Layout:
    """The flat weight vector of :func:`so2_conv` for `irreps_in` -> `irreps_out`: its blocks
    (:class:`SO2Block`) ordered by ``m``, then output block, then input block, so that the
    weights of one ``(m, out)`` are one ``(sum of mul_in, mul_out)`` matrix."""

    irreps_in: Irreps
    irreps_out: Irreps
    m_max: int
    blocks: tuple
    weight_numel: int

    @property
    def weight_std(self) -> np.ndarray:
        """Per-weight init standard deviation, ``1 / sqrt(fan_in)`` of the weight's output
        component (the input channels that reach it), shape ``(weight_numel,)``."""
        fan_in = {}
        for b in self.blocks:
            fan_in[b.m, b.i_out] = fan_in.get((b.m, b.i_out), 0) + b.mul_in
        return np.concatenate(
            [np.full(b.mul_in * b.mul_out, 1.0 / np.sqrt(fan_in[b.m, b.i_out])) for b in self.blocks] or [np.zeros(0)]
        )

    def init_weights(self, key, dtype=jnp.float32):
        """Normal weights scaled by :attr:`weight_std` (outputs of about unit variance)."""
        return jax.random.normal(key, (self.weight_numel,), dtype) * jnp.asarray(self.weight_std, dtype)

    def orders(self, m: int, i_out: int) -> tuple:
        """The blocks of order `m` into output block `i_out`, in layout order."""
        return tuple(b for b in self.blocks if b.m == m and b.i_out == i_out)


@functools.lru_cache(maxsize=256)
def _layout(irreps_in: Irreps, irreps_out: Irreps, m_max: int | None) -> SO2Layout:
    lmax = max([ir.l for _, ir in irreps_in] + [ir.l for _, ir in irreps_out] + [0])
    top = lmax if m_max is None else min(m_max, lmax)
    blocks, offset = [], 0
    for m in range(top + 1):
        for io, (mul_o, ir_o) in enumerate(irreps_out):
            for ii, (mul_i, ir_i) in enumerate(irreps_in):
                if mul_i * mul_o == 0 or m not in _pair_orders(ir_i, ir_o, top):
                    continue
                blocks.append(SO2Block(m, ii, io, pair_kind(ir_i, ir_o), offset, mul_i, mul_o))
                offset += mul_i * mul_o
    return SO2Layout(irreps_in, irreps_out, top, tuple(blocks), offset)


def _m_max(m_max) -> int | None:
    if m_max is None:
        return None
    if isinstance(m_max, bool) or not isinstance(m_max, (int, np.integer)) or m_max < 0:
        raise ValueError(f"m_max must be None or an int >= 0, got {m_max!r}")
    return int(m_max)


def so2_layout(irreps_in, irreps_out, m_max: int | None = None) -> SO2Layout:
    """The :class:`SO2Layout` of :func:`so2_conv` (orders ``|m| > m_max`` dropped; None keeps all)."""
    return _layout(as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out"), _m_max(m_max))


def _vectors(vectors):
    if isinstance(vectors, e3nn.IrrepsArray):
        if vectors.irreps != Irreps("1x1o"):
            raise ValueError(f"vectors: expected irreps 1x1o, got {vectors.irreps}")
        return vectors.array
    vectors = jnp.asarray(vectors)
    if vectors.ndim == 0 or vectors.shape[-1] != 3:
        raise ValueError(f"vectors: expected shape (..., 3), got {vectors.shape}")
    return vectors


def so2_conv(x, vectors, weights, irreps_out, *, m_max: int | None = None, irreps_in=None, out_dtype=None, math_dtype=None):
    """The SO(2) convolution of `x` along `vectors` (see the module docstring).

    Args:
        x: ``e3nn_jax.IrrepsArray`` (..., irreps_in.dim), or a plain array with `irreps_in`.
        vectors: array (..., 3) or ``IrrepsArray`` ``1x1o``; only the direction is used (a zero
            vector gives the frame of +y).
        weights: ``(weight_numel,)`` shared, or ``(..., weight_numel)`` per row (e.g. from a
            radial MLP), laid out as :func:`so2_layout` says.
        irreps_out: the output irreps (any order, multiplicities and parities).
        m_max: keep orders ``|m| <= m_max`` only (eSCN's truncation); None keeps all.
        irreps_in: the irreps of a plain-array `x`.
        out_dtype, math_dtype: :func:`jequi.dtypes.plan` (default: the result in the inputs'
            dtype, half precision computed in float32).

    Returns:
        ``IrrepsArray`` of `irreps_out` (a plain array for a plain `x`), leading dims broadcast
        from those of `x`, `vectors` and per-row `weights`. With
        ``weights = so2_weights_from_path_weights(w, ...)`` it equals
        ``so2_path_product(...)(x, spherical_harmonics(r / |r|), w)``. Pure ``jnp``:
        differentiable to every order, in every input.
    """
    is_irreps_array = isinstance(x, e3nn.IrrepsArray)
    if is_irreps_array:
        if irreps_in is not None and as_irreps(irreps_in, "irreps_in") != x.irreps:
            raise ValueError(f"irreps_in {irreps_in} differs from x.irreps {x.irreps}")
        irreps_in, array = x.irreps, x.array
    else:
        if irreps_in is None:
            raise TypeError("so2_conv: x is a plain array, pass irreps_in= (or an e3nn_jax.IrrepsArray)")
        irreps_in, array = as_irreps(irreps_in, "irreps_in"), jnp.asarray(x)
    if array.ndim == 0 or array.shape[-1] != irreps_in.dim:
        raise ValueError(f"x: last dim {array.shape[-1:]} does not match irreps_in {irreps_in} (dim {irreps_in.dim})")
    layout = so2_layout(irreps_in, irreps_out, m_max)
    vec = _vectors(vectors)
    weights = jnp.asarray(weights)
    if weights.ndim == 0 or weights.shape[-1] != layout.weight_numel:
        raise ValueError(
            f"weights: last dim {weights.shape[-1:]} is not weight_numel = {layout.weight_numel} of {irreps_in} -> {layout.irreps_out} (m_max={m_max})"
        )
    dtype = jnp.result_type(array, vec, weights)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.ones(()).dtype
    shared = weights.ndim == 1
    try:
        leading = jnp.broadcast_shapes(array.shape[:-1], vec.shape[:-1], () if shared else weights.shape[:-1])
    except ValueError as exc:
        raise ValueError(f"leading dims of x {array.shape}, vectors {vec.shape} and weights {weights.shape} do not broadcast") from exc
    p = plan(dtype, out_dtype, math_dtype)  # computed in p.math, rounded once
    z = _run(layout, array.astype(p.math), vec.astype(p.math), weights.astype(p.math), tuple(leading), p.math)
    z = z.astype(p.out)
    return e3nn.IrrepsArray(layout.irreps_out, z) if is_irreps_array else z


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _run(layout: SO2Layout, x, vec, weights, leading: tuple, dtype):
    """The convolution as one compiled function (op-by-op dispatch would compile each op)."""
    irreps_in, irreps_out = layout.irreps_in, layout.irreps_out
    used_in = sorted({b.i_in for b in layout.blocks})
    lmax = max([irreps_in[i].ir.l for i in used_in] + [ir.l for _, ir in irreps_out] + [0])
    ds, _ = frame(vec, lmax)
    # rotate each input degree into the frame (x~ = D^T x), all blocks of a degree at once
    slices = irreps_in.slices()
    rotated = {}
    for l in sorted({irreps_in[i].ir.l for i in used_in}):
        blocks = [i for i in used_in if irreps_in[i].ir.l == l]
        parts = [x[..., slices[i]].reshape(*x.shape[:-1], irreps_in[i].mul, 2 * l + 1) for i in blocks]
        xl = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)
        xt = xl if l == 0 else so2.rotate(xl, ds[l], transpose=True)
        start = 0
        for i, part in zip(blocks, parts):
            rotated[i] = xt[..., start : start + part.shape[-2], :]
            start += part.shape[-2]

    def component(i, m):  # x~(in, m): (..., mul_in)
        return rotated[i][..., irreps_in[i].ir.l + m]

    # per (m, out): one (..., 2, K) x (K, mul_out) product
    parts = {}  # (i_out, m) -> (..., mul_out)
    for m in range(layout.m_max + 1):
        for io in range(len(irreps_out)):
            blocks = layout.orders(m, io)
            if not blocks:
                continue
            start, stop = blocks[0].offset, blocks[-1].offset + blocks[-1].mul_in * blocks[-1].mul_out
            k = sum(b.mul_in for b in blocks)
            w = weights[..., start:stop].reshape(*weights.shape[:-1], k, irreps_out[io].mul)
            if m == 0:
                xin = jnp.concatenate([component(b.i_in, 0) for b in blocks], axis=-1)
                parts[io, 0] = jnp.einsum("...k,...ko->...o", xin, w)
                continue
            plus = [component(b.i_in, m) if b.kind == "real" else -component(b.i_in, -m) for b in blocks]
            minus = [component(b.i_in, -m) if b.kind == "real" else component(b.i_in, m) for b in blocks]
            xin = jnp.stack([jnp.concatenate(plus, axis=-1), jnp.concatenate(minus, axis=-1)], axis=-2)
            y = jnp.einsum("...sk,...ko->...so", xin, w)
            parts[io, m], parts[io, -m] = y[..., 0, :], y[..., 1, :]

    # assemble y~ per output block, rotate back per degree (y = D y~), lay out in irreps_out's order
    outputs = [None] * len(irreps_out)
    for lo in sorted({ir.l for _, ir in irreps_out}):
        blocks = [io for io, (mul, ir) in enumerate(irreps_out) if ir.l == lo and mul > 0]
        if not blocks:
            continue
        tilde = []
        for io in blocks:
            mul = irreps_out[io].mul
            zero = jnp.zeros((*leading, mul), dtype)
            comps = [jnp.broadcast_to(parts.get((io, m), zero), (*leading, mul)) for m in range(-lo, lo + 1)]
            tilde.append(jnp.stack(comps, axis=-1))
        yt = tilde[0] if len(tilde) == 1 else jnp.concatenate(tilde, axis=-2)
        y = yt if lo == 0 else so2.rotate(yt, ds[lo], transpose=False)
        y = jnp.broadcast_to(y, (*leading, *y.shape[-2:]))
        start = 0
        for io in blocks:
            mul = irreps_out[io].mul
            outputs[io] = y[..., start : start + mul, :].reshape(*leading, mul * (2 * lo + 1))
            start += mul
    outputs = [o for o in outputs if o is not None]
    if not outputs:
        return jnp.zeros((*leading, irreps_out.dim), dtype)
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=-1)


# ---- the exact map to a path-weighted CG product with harmonics -----------------------------


def _sh_irreps(irreps_in: Irreps, irreps_out: Irreps) -> Irreps:
    lmax = max([ir.l for _, ir in irreps_in] + [0]) + max([ir.l for _, ir in irreps_out] + [0])
    return Irreps([(1, (l, (-1) ** l)) for l in range(lmax + 1)])


@functools.lru_cache(maxsize=64)
def _path_product(irreps_in: Irreps, irreps_out: Irreps) -> TensorProduct:
    return fully_connected(irreps_in, _sh_irreps(irreps_in, irreps_out), irreps_out)


def so2_path_product(irreps_in, irreps_out) -> TensorProduct:
    """The path-weighted CG product whose weights :func:`so2_weights_from_path_weights` maps:
    ``jequi.fully_connected(irreps_in, "0e+1o+2e+...", irreps_out)`` (one ``uvw`` path per
    input block, harmonic degree ``l_f`` and output block; harmonics up to ``lmax_in +
    lmax_out``), called as ``tp(x, e3nn.spherical_harmonics(tp.irreps_in2, r, True).array, w)``
    (e3nn's default normalizations)."""
    return _path_product(as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out"))


@dataclasses.dataclass(frozen=True)
class _PairMap:
    """One pair of blocks: its path weights (offsets into the path product's weights, by
    ``l_f``), its SO(2) orders, and ``matrix[m, l_f]`` with ``W[m] = sum_f matrix[m, f] w[f]``."""

    i_in: int
    i_out: int
    path_offsets: tuple
    orders: tuple
    matrix: np.ndarray
    inverse: np.ndarray


@functools.lru_cache(maxsize=64)
def _pair_maps(irreps_in: Irreps, irreps_out: Irreps) -> tuple:
    tp = _path_product(irreps_in, irreps_out)
    lmax = max([ir.l for _, ir in irreps_in] + [ir.l for _, ir in irreps_out] + [0])
    by_pair = {}
    for p in tp.descriptor.paths:
        if p.mul_in1 * p.mul_out == 0:
            continue
        by_pair.setdefault((p.i_in1, p.i_out), []).append(p)
    maps = []
    for (ii, io), paths in sorted(by_pair.items()):
        ir_i, ir_o = irreps_in[ii].ir, irreps_out[io].ir
        orders = tuple(_pair_orders(ir_i, ir_o, lmax))
        matrix = np.zeros((len(orders), len(paths)))
        for f, p in enumerate(paths):
            lf = p.ir_in2.l
            c = so2.coupling(ir_i.l, lf, ir_o.l)
            scale = p.path_weight * so2.pole_value(lf, "component")
            sign = 1.0 if pair_kind(ir_i, ir_o) == "real" else -1.0
            for k, m in enumerate(orders):
                matrix[k, f] = sign * scale * c.coefficient[ir_o.l + m]
        if matrix.shape[0] != matrix.shape[1]:
            raise AssertionError(f"pair {ii} -> {io}: {matrix.shape[1]} paths for {matrix.shape[0]} orders")
        inverse = np.linalg.inv(matrix)
        maps.append(_PairMap(ii, io, tuple(p.weight_offset for p in paths), orders, matrix, inverse))
    return tuple(maps)


def _check_weights(weights, numel: int, what: str):
    weights = jnp.asarray(weights)
    if weights.ndim == 0 or weights.shape[-1] != numel:
        raise ValueError(f"{what}: last dim {weights.shape[-1:]} is not the expected {numel}")
    return weights


def so2_weights_from_path_weights(path_weights, irreps_in, irreps_out):
    """The :func:`so2_conv` weights (all orders, ``m_max=None``) equal to the path-weighted product
    :func:`so2_path_product` with weights `path_weights` (..., its ``weight_numel``)."""
    irreps_in, irreps_out = as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out")
    layout = _layout(irreps_in, irreps_out, None)
    path_weights = _check_weights(path_weights, _path_product(irreps_in, irreps_out).weight_numel, "path_weights")
    lead = path_weights.shape[:-1]
    blocks = {}
    for pm in _pair_maps(irreps_in, irreps_out):
        size = irreps_in[pm.i_in].mul * irreps_out[pm.i_out].mul
        w = jnp.stack([path_weights[..., o : o + size] for o in pm.path_offsets], axis=-2)  # (..., f, size)
        so2_w = jnp.einsum("mf,...fs->...ms", jnp.asarray(pm.matrix, path_weights.dtype), w)
        for k, m in enumerate(pm.orders):
            blocks[m, pm.i_in, pm.i_out] = so2_w[..., k, :]
    parts = [blocks[b.m, b.i_in, b.i_out] for b in layout.blocks]
    return jnp.concatenate(parts, axis=-1) if parts else jnp.zeros((*lead, 0), path_weights.dtype)


def path_weights_from_so2_weights(weights, irreps_in, irreps_out, *, m_max: int | None = None):
    """The inverse of :func:`so2_weights_from_path_weights`: path weights of
    :func:`so2_path_product` equal to :func:`so2_conv` with `weights` (of the layout with
    `m_max`; the dropped orders count as zero weights)."""
    irreps_in, irreps_out = as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out")
    layout = _layout(irreps_in, irreps_out, _m_max(m_max))
    weights = _check_weights(weights, layout.weight_numel, "weights")
    tp = _path_product(irreps_in, irreps_out)
    lead = weights.shape[:-1]
    where = {(b.m, b.i_in, b.i_out): b for b in layout.blocks}
    pieces = {}  # path weight offset -> (..., size)
    for pm in _pair_maps(irreps_in, irreps_out):
        size = irreps_in[pm.i_in].mul * irreps_out[pm.i_out].mul
        kept = [k for k, m in enumerate(pm.orders) if (m, pm.i_in, pm.i_out) in where]
        if kept:
            so2_w = jnp.stack([weights[..., where[pm.orders[k], pm.i_in, pm.i_out].offset :][..., :size] for k in kept], axis=-2)
            path_w = jnp.einsum("fm,...ms->...fs", jnp.asarray(pm.inverse[:, kept], weights.dtype), so2_w)
        else:
            path_w = jnp.zeros((*lead, len(pm.path_offsets), size), weights.dtype)
        for f, offset in enumerate(pm.path_offsets):
            pieces[offset] = path_w[..., f, :]
    # paths that touch no data (zero multiplicities) have no weights; the rest tile the vector
    parts = [pieces[p.weight_offset] for p in tp.descriptor.paths if p.weight_numel > 0]
    return jnp.concatenate(parts, axis=-1) if parts else jnp.zeros((*lead, 0), weights.dtype)
