"""Pallas kernels of the EAAS product (``jequi.sh_tensor_product(..., backend="pallas")``): per
row, each input degree rotated into the vector's frame once, each path's per-m map, each output
degree rotated back, with the channels vectorized; ``x``, the output and the row's frame are all
the kernel reads and writes. ``plan`` is :func:`jequi.eaas._plan`'s.

The frames are XLA's (:func:`jequi.so2.edge_rotation`, :func:`jequi.so2.wigner_d`), packed per
row as ``[D_0, ..., D_lmax]`` (:func:`frames`); they are a small fraction of the row's bytes
(``sum (2l+1)^2`` floats against ``C sum (2l+1)`` per degree of ``x``) and keep the kernels free
of the recursion's scalar code: computed per row in the kernels, with dual numbers for the
backward, they made forward and backward 2x slower at L = 2, and the compile at L = 4 ran past
the run's time limit (over 3 minutes; benchmarks/results/2026-11-28-nvidia-h100-80gb-hbm3-eaas-pallas-frames-in-kernel.md).
Derivatives in ``r``: the tangent kernel reads the frames' tangent
(XLA's jvp); the backward reduces the gradient with respect to the frames to the rotation's
angular velocity ``w`` (``dD_l = D_l J_l(w)``, :func:`generators`): three channel sums a row,
which XLA pulls back to ``r``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi import so2

from .heuristics import eaas_warps
from .lowering import fma, masked_store, pallas_call
from .row_code import chunks, iota, lane_tile, rows_loop


def _zero(a) -> bool:
    return isinstance(a, float) and a == 0.0


def _add(a, b):
    return b if _zero(a) else a if _zero(b) else a + b


def _mul(a, b):
    return 0.0 if _zero(a) or _zero(b) else a * b


def _levi_civita() -> np.ndarray:
    eps = np.zeros((3, 3, 3))
    for a, b, c in ((0, 1, 2), (1, 2, 0), (2, 0, 1)):
        eps[a, b, c], eps[a, c, b] = 1.0, -1.0
    return eps


# so(3)'s generators in e3nn's l = 1 basis (x, y, z): (G_a)_{bc} = -epsilon_{abc}, so that
# R^T dR = sum_a w_a G_a with w_a = <G_a, R^T dR> / 2 (<G_a, G_b> = 2 delta_ab, Frobenius).
GENERATORS = -_levi_civita()


@functools.lru_cache(maxsize=None)
def generators(lmax: int) -> tuple:
    """``(J_0, ..., J_lmax)``, ``J_l`` (3, 2l+1, 2l+1): the derivative of :func:`jequi.so2.wigner_d`'s
    ``D_l`` at the identity along each generator (``J_1 = GENERATORS``), from its recursion
    ``D_l = C^T (D_{l-1} (x) R) C``, so that ``D_l(R (I + sum_a w_a G_a)) = D_l(R) (I + sum_a w_a
    J_l[a])`` to first order in ``w``."""
    js = [np.zeros((3, 1, 1))]
    if lmax >= 1:
        js.append(GENERATORS.copy())
    for l in range(2, lmax + 1):
        c = so2._recursion_cg(l)  # (2l-1, 3, 2l+1)
        js.append(np.einsum("ijk,xia,ajn->xkn", c, js[-1], c) + np.einsum("ijk,xjb,ibn->xkn", c, GENERATORS, c))
    return tuple(js)


def _offsets(lmax: int) -> list:
    """Where ``D_l`` starts in a packed row of frames."""
    return [sum((2 * k + 1) ** 2 for k in range(l)) for l in range(lmax + 2)]


def _rotation_and_norm(r, normalize: bool):
    """The frame's rotation (:func:`jequi.so2.edge_rotation` of ``r / |r|``) and the harmonics'
    norm, as :func:`jequi.eaas.frame`."""
    return so2.edge_rotation(so2.unit(r)), so2.safe_directions(r, normalize)[1]


def _packed(rot, lmax: int):
    return jnp.concatenate([d.reshape(d.shape[0], -1) for d in so2.wigner_d(rot, lmax)], axis=-1)


def frames(r, lmax: int, normalize: bool):
    """``(D (N, sum_l (2l+1)^2), norm (N,))``: each row's ``[D_0, ..., D_lmax]`` packed row-major
    (:func:`jequi.eaas.frame`'s), the kernels' input."""
    rot, norm = _rotation_and_norm(r, normalize)
    return _packed(rot, lmax), norm


def _loader(ref, b, lmax: int):
    """``d(l, i, j)``: ``D_l[i][j]`` of row `b` from a packed ref, each entry loaded once, on first
    use (``D_0 = 1`` is the constant)."""
    width, offsets, cache = _offsets(lmax)[-1], _offsets(lmax), {}

    def d(l, i, j):
        if l == 0:
            return 1.0
        if (l, i, j) not in cache:
            cache[l, i, j] = ref[b * width + offsets[l] + i * (2 * l + 1) + j]
        return cache[l, i, j]

    return d


def _dot(pairs):
    total = None
    for a, b in pairs:
        if _zero(a):
            continue
        total = a * b if total is None else fma(a, b, total)
    return total


class _Out(NamedTuple):
    """One output chunk of the plan, as the kernels walk it: degrees ``lo`` and ``li``, where its
    channels start in the output (``offset`` of the degree's block, ``chan`` within it), the
    harmonics' degree and multiplicity, and its per-m map as ``(m, source j, coefficient)`` with
    the coefficients Python floats (a numpy scalar would promote float32 kernels to float64)."""

    lo: int
    li: int
    offset: int
    chan: int
    l_f: int
    mul_f: int
    pairs: tuple


def _layout(plan):
    """``(zeros, by_block)``: the output chunks that are zero (``(lo, offset, chan, width)``) and,
    per input block, its nonzero chunks (:class:`_Out`); every kernel walks the input blocks so
    that each block of ``x`` is loaded and rotated once per row."""
    zeros, by_block = [], {}
    offset = 0
    for lo, pieces in plan.out:
        chan = 0
        for p in pieces:
            width = plan.irreps_in[p.block].mul * p.mul_f
            if p.coefficient is None:
                zeros.append((lo, offset, chan, width))
            else:
                li = plan.irreps_in[p.block].ir.l
                k = len(p.coefficient) // 2
                pairs = tuple(
                    (m, li - m if p.reverse else li + m, float(p.coefficient[k + m]))
                    for m in range(-k, k + 1) if p.coefficient[k + m] != 0.0
                )  # fmt: skip
                by_block.setdefault(p.block, []).append(_Out(lo, li, offset, chan, p.l_f, p.mul_f, pairs))
            chan += width
        offset += chan * (2 * lo + 1)
    return zeros, by_block


def _store_zeros(z_ref, base, zeros, dtype):
    for lo, offset, chan, width in zeros:
        for start, size in chunks(width):
            for i in range(2 * lo + 1):
                z_ref[base + iota(offset + (chan + start + np.arange(size)) * (2 * lo + 1) + i)] = jnp.zeros((size,), dtype)


def _out_index(out: _Out, start, size, f, i):
    return out.offset + (out.chan + (start + np.arange(size)) * out.mul_f + f) * (2 * out.lo + 1) + i


# Output chunks of at least this many channels are stored as one (channels, 2lo+1) tile, its
# rows contiguous, instead of one store per component strided by 2lo+1, which limited the
# forward; narrower chunks keep the strided stores: Triton tiles of one or two rows made the
# compiled kernel crash (docs/tuning.md#eaas-tile_min_channels).
TILE_MIN_CHANNELS = 4


def _store_chunk(z_ref, base, out: _Out, start, size, totals, dtype):
    """Store row `base`'s output chunk: ``totals[i]`` (a ``(size,)`` vector, or None for zero)
    is component `i` of channels ``start .. start + size`` of `out`."""
    values = [(jnp.zeros((size,), dtype) if t is None else t).astype(dtype) for t in totals]
    width = 2 * out.lo + 1
    if size < TILE_MIN_CHANNELS or width == 1:
        for i, value in enumerate(values):
            for f in range(out.mul_f):
                z_ref[base + iota(_out_index(out, start, size, f, i))] = value
        return
    p = 1 << (width - 1).bit_length()
    tile = lane_tile(values + [jnp.zeros((size,), dtype)] * (p - width))
    valid = (jnp.arange(p, dtype=jnp.int32) < width)[None, :]
    for f in range(out.mul_f):
        idx = out.offset + (out.chan + (start + np.arange(size))[:, None] * out.mul_f + f) * width + np.arange(p)[None, :]
        masked_store(z_ref, base + iota(idx), tile, valid)


def _powers(norm):
    """``power(l) = norm^l`` (None for l = 0) and ``slope(l) = l norm^(l-1)``, each computed once."""
    cache = {0: None, 1: norm}

    def power(l):
        if l not in cache:
            cache[l] = power(l - 1) * norm
        return cache[l]

    def slope(l):
        return 1.0 if l == 1 else float(l) * power(l - 1)

    return power, slope


def _rotated(d, li, xs):
    """``x~[j] = sum_n x[n] D_li[n][j]`` by `j`, each computed once, on first use."""
    cache = {}

    def xt(j):
        if j not in cache:
            cache[j] = xs[0] if li == 0 else _dot([(d(li, nn, j), xs[nn]) for nn in range(2 * li + 1)])
        return cache[j]

    return xt


def _launch(plan, n, rows_per_program, num_warps):
    """``(grid, num_warps)`` of a kernel call; ``num_warps`` None: :func:`~.heuristics.eaas_warps`."""
    return (pl.cdiv(n, rows_per_program),), num_warps or eaas_warps(plan)


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def forward(plan, x, r, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int | None = None):
    """``(N, out.dim)``: the EAAS product of the regrouped ``x (N, in.dim)`` with the harmonics of
    ``r (N, 3)``: per input block, ``x~[j] = sum_n x[n] D_li[n][j]`` once, then per output chunk
    ``y[i] = sum_m D_lo[i][lo + m] c_m norm^lf x~[j(m)]``."""
    n, d_in, d_out = x.shape[0], plan.irreps_in.dim, plan.irreps_out.dim
    slices, dtype = plan.irreps_in.slices(), x.dtype
    zeros, by_block = _layout(plan)
    packed, norms = frames(r, plan.lmax, normalize)

    def kernel(x_ref, d_ref, n_ref, z_ref):
        def row(b):
            d = _loader(d_ref, b, plan.lmax)
            power, _ = _powers(n_ref[b])
            _store_zeros(z_ref, b * d_out, zeros, dtype)
            for blk, outs in by_block.items():
                li, base = plan.irreps_in[blk].ir.l, slices[blk].start
                for start, size in chunks(plan.irreps_in[blk].mul):
                    xt = _rotated(d, li, [x_ref[b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn)] for nn in range(2 * li + 1)])
                    for out in outs:
                        pw = power(out.l_f)
                        totals = []
                        for i in range(2 * out.lo + 1):
                            terms = []
                            for m, j, c in out.pairs:
                                scale = _mul(d(out.lo, i, out.lo + m), c)
                                terms.append((scale if pw is None or _zero(scale) else scale * pw, xt(j)))
                            totals.append(_dot(terms))
                        _store_chunk(z_ref, b * d_out, out, start, size, totals, dtype)

        rows_loop(n, rows_per_program, row)

    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * d_out,), dtype), *_launch(plan, n, rows_per_program, num_warps), name="jequi_eaas_fwd")(
        x.reshape(-1), packed.reshape(-1), norms
    )
    return z.reshape(n, d_out)


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def backward(plan, x, r, g, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int | None = None):
    """``(gx (N, in.dim), gr (N, 3))``: the gradients of ``<g, forward(plan, x, r)>``.

    The kernel writes ``gx``, the gradient in the rotation's angular velocity ``w`` and in the
    norm. With ``g~ = D_lo^T g`` and ``x~ = D_li^T x`` in the frame, ``dL/dw_a`` sums, over the
    channels, ``c pw <(J_lo[a]^T g~)[lo + m], x~[j]>`` per output term and ``<gx~[j], (J_li[a]^T
    x~)[j]>`` per input component; XLA maps ``w`` to the rotation (``dL/dR = R sum_a dL/dw_a
    G_a / 2``) and pulls it back to ``r``."""
    n, d_in, d_out = x.shape[0], plan.irreps_in.dim, plan.irreps_out.dim
    slices, dtype = plan.irreps_in.slices(), x.dtype
    _, by_block = _layout(plan)
    js = generators(plan.lmax)
    (rot, norms), pull = jax.vjp(lambda r_: _rotation_and_norm(r_, normalize), r)
    packed = _packed(rot, plan.lmax)

    def sources(l, a, q):
        """``(k, J_l[a][k][q])``: the nonzero entries of column `q`."""
        return [(k, float(js[l][a, k, q])) for k in range(2 * l + 1) if abs(js[l][a, k, q]) > 1e-12]

    def kernel(x_ref, d_ref, n_ref, g_ref, gx_ref, gw_ref, gn_ref):
        def row(b):
            d = _loader(d_ref, b, plan.lmax)
            power, slope = _powers(n_ref[b])
            acc = {}  # (a or "norm", chunk size) -> per-channel partial sums

            def add(key, size, a, v):
                if not _zero(a):
                    acc[key, size] = a * v if (key, size) not in acc else fma(a, v, acc[key, size])

            for blk, (mul_in, ir) in enumerate(plan.irreps_in):
                li, base = ir.l, slices[blk].start
                for start, size in chunks(mul_in):
                    at = [b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn) for nn in range(2 * li + 1)]
                    if blk not in by_block:
                        for idx in at:
                            gx_ref[idx] = jnp.zeros((size,), dtype)
                        continue
                    xs = [x_ref[idx] for idx in at]
                    xt = _rotated(d, li, xs)
                    gxt = {}
                    for out in by_block[blk]:
                        lo = out.lo
                        pw = power(out.l_f)
                        gsum = []
                        for i in range(2 * lo + 1):
                            parts = [g_ref[b * d_out + iota(_out_index(out, start, size, f, i))] for f in range(out.mul_f)]
                            gsum.append(functools.reduce(lambda p, q: p + q, parts))
                        gt = _rotated(d, lo, gsum)  # g~[k] = sum_i D_lo[i][k] g[i]
                        for m, j, c in out.pairs:
                            q = lo + m
                            scaled = gt(q) * (c if pw is None else c * pw)
                            gxt[j] = scaled if j not in gxt else gxt[j] + scaled
                            weighted = xt(j) * (c if pw is None else c * pw)
                            for a in range(3):  # (J_lo[a]^T g~)[q] against x~[j]
                                src = sources(lo, a, q)
                                if src:
                                    add(a, size, 1.0, weighted * _dot([(v, gt(k)) for k, v in src]))
                            if pw is not None and not normalize:
                                add("norm", size, c * slope(out.l_f), gt(q) * xt(j))
                    for nn in range(2 * li + 1):
                        gx_ref[at[nn]] = _dot([(d(li, nn, j), gxt[j]) for j in gxt]).astype(dtype)
                    for j, v in gxt.items():
                        for a in range(3):  # gx~[j] against (J_li[a]^T x~)[j]
                            src = sources(li, a, j)
                            if src:
                                add(a, size, 1.0, v * _dot([(w, xt(k)) for k, w in src]))

            def total(key):
                parts = [jnp.sum(v) for (k, _), v in acc.items() if k == key]
                return functools.reduce(lambda p, q: p + q, parts) if parts else jnp.zeros((), dtype)

            for a in range(3):
                gw_ref[b * 3 + a] = total(a).astype(dtype)
            gn_ref[b] = total("norm").astype(dtype)

        rows_loop(n, rows_per_program, row)

    shapes = (jax.ShapeDtypeStruct((n * d_in,), dtype), jax.ShapeDtypeStruct((n * 3,), dtype), jax.ShapeDtypeStruct((n,), dtype))
    gx, gw, gn = pallas_call(kernel, shapes, *_launch(plan, n, rows_per_program, num_warps), name="jequi_eaas_bwd")(
        x.reshape(-1), packed.reshape(-1), norms, g.reshape(-1)
    )
    g_rot = rot @ jnp.einsum("na,abc->nbc", gw.reshape(n, 3), jnp.asarray(GENERATORS / 2, dtype))
    (gr,) = pull((g_rot, gn))
    return gx.reshape(n, d_in), gr


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def tangent(plan, x, r, tx, tr, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int | None = None):
    """``(N, out.dim)``: the forward's derivative at ``(x, r)`` along ``(tx, tr)`` (linear in
    them), the frames' tangent from XLA's forward mode."""
    n, d_in, d_out = x.shape[0], plan.irreps_in.dim, plan.irreps_out.dim
    slices, dtype = plan.irreps_in.slices(), x.dtype
    zeros, by_block = _layout(plan)
    (packed, norms), (t_packed, t_norms) = jax.jvp(lambda r_: frames(r_, plan.lmax, normalize), (r,), (tr,))

    def kernel(x_ref, d_ref, n_ref, tx_ref, td_ref, tn_ref, z_ref):
        def row(b):
            d, td = _loader(d_ref, b, plan.lmax), _loader(td_ref, b, plan.lmax)
            power, slope = _powers(n_ref[b])
            t_norm = tn_ref[b]

            def dt(l, i, j):  # the tangent of D_l[i][j] (D_0 = 1 is constant)
                return 0.0 if l == 0 else td(l, i, j)

            _store_zeros(z_ref, b * d_out, zeros, dtype)
            for blk, outs in by_block.items():
                li, base = plan.irreps_in[blk].ir.l, slices[blk].start
                for start, size in chunks(plan.irreps_in[blk].mul):
                    at = [b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn) for nn in range(2 * li + 1)]
                    xs = [x_ref[idx] for idx in at]
                    txs = [tx_ref[idx] for idx in at]
                    xt, txt = _rotated(d, li, xs), _rotated(d, li, txs)
                    dxt = {}

                    def x_dot(j):  # d/dt of x~[j]: D^T tx + dD^T x
                        if j not in dxt:
                            dxt[j] = txt(j) if li == 0 else _dot([(dt(li, nn, j), xs[nn]) for nn in range(2 * li + 1)] + [(1.0, txt(j))])
                        return dxt[j]

                    for out in outs:
                        pw = power(out.l_f)
                        pv = 1.0 if pw is None else pw
                        pd = 0.0 if pw is None or normalize else slope(out.l_f) * t_norm
                        totals = []
                        for i in range(2 * out.lo + 1):
                            terms = []
                            for m, j, c in out.pairs:
                                dv = d(out.lo, i, out.lo + m)
                                terms.append((_mul(c, _mul(dv, pv)), x_dot(j)))
                                d_scale = _add(_mul(dt(out.lo, i, out.lo + m), pv), _mul(dv, pd))
                                if not _zero(d_scale):
                                    terms.append((_mul(c, d_scale), xt(j)))
                            totals.append(_dot(terms))
                        _store_chunk(z_ref, b * d_out, out, start, size, totals, dtype)

        rows_loop(n, rows_per_program, row)

    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * d_out,), dtype), *_launch(plan, n, rows_per_program, num_warps), name="jequi_eaas_jvp")(
        x.reshape(-1), packed.reshape(-1), norms, tx.reshape(-1), t_packed.reshape(-1), t_norms
    )
    return z.reshape(n, d_out)
