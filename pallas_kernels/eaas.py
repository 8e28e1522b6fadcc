"""Pallas kernel of the EAAS product's forward (prototype): one row's frame, Wigner D matrices,
rotation into the frame, per-m map and rotation back, with the channels vectorized and nothing
but ``x``, ``r`` and the output in HBM. ``plan`` is :func:`jequi.eaas._plan`'s."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi import so2

from .lowering import fma, pallas_call
from .row_code import chunks, iota, rows_loop


def _zero(a) -> bool:
    return isinstance(a, float) and a == 0.0


def _add(a, b):
    return b if _zero(a) else a if _zero(b) else a + b


def _mul(a, b):
    return 0.0 if _zero(a) or _zero(b) else a * b


class Dual:
    """A scalar and its derivatives in ``(r_x, r_y, r_z)``, for the frame's forward-mode
    derivatives inside a kernel (Python floats are constants; zero derivatives stay 0.0 and
    cost nothing)."""

    __slots__ = ("v", "t")

    def __init__(self, v, t):
        self.v, self.t = v, tuple(t)

    def __add__(self, o):
        if isinstance(o, Dual):
            return Dual(_add(self.v, o.v), (_add(a, b) for a, b in zip(self.t, o.t)))
        return Dual(_add(self.v, o), self.t)

    __radd__ = __add__

    def __neg__(self):
        return Dual(_mul(-1.0, self.v), (_mul(-1.0, a) for a in self.t))

    def __sub__(self, o):
        return self + (-o)

    def __rsub__(self, o):
        return (-self) + o

    def __mul__(self, o):
        if isinstance(o, Dual):
            return Dual(_mul(self.v, o.v), (_add(_mul(a, o.v), _mul(self.v, b)) for a, b in zip(self.t, o.t)))
        return Dual(_mul(self.v, o), (_mul(a, o) for a in self.t))

    __rmul__ = __mul__

    def __rtruediv__(self, o):  # o / self, o a constant
        inv = 1.0 / self.v
        scale = -o * inv * inv
        return Dual(o * inv, (_mul(scale, a) for a in self.t))

    def __truediv__(self, o):
        return self * (1.0 / o)


def value(a):
    return a.v if isinstance(a, Dual) else a


def _sqrt(a):
    if isinstance(a, Dual):
        s = jnp.sqrt(a.v)
        return Dual(s, (_mul(0.5 / s, t) for t in a.t))
    return jnp.sqrt(a)


def _frame(rx, ry, rz, normalize: bool):
    """(R as 3 x 3 nested lists of scalars, norm) of one row, as :func:`jequi.so2.edge_rotation`
    and :func:`jequi.so2.safe_directions`; scalars or :class:`Dual` (then with derivatives)."""
    r2 = rx * rx + ry * ry + rz * rz
    dtype = value(r2).dtype
    nonzero = (value(r2) > 0).astype(dtype)  # selects as arithmetic: Triton multiplies no booleans
    length = _sqrt(r2 + (1.0 - nonzero))
    inv = 1.0 / length
    dx, dy, dz = rx * inv, ry * inv, rz * inv
    norm = nonzero if normalize else nonzero * length
    upper = (value(dy) >= 0).astype(dtype)
    sign = 2.0 * upper - 1.0
    v = (sign * dz, 0.0, -(sign * dx))
    k = [[0.0, -v[2], v[1]], [v[2], 0.0, -v[0]], [-v[1] if not _zero(v[1]) else 0.0, v[0], 0.0]]
    vv = v[0] * v[0] + v[2] * v[2]
    inv_den = 1.0 / (1.0 + sign * dy)
    rot = []
    for i in range(3):
        row = []
        for j in range(3):
            outer = _mul(v[i], v[j])
            if i == j:
                outer = outer - vv
            entry = (1.0 if i == j else 0.0) + k[i][j] + outer * inv_den
            row.append(entry * sign if j < 2 else entry)  # the second chart's half turn about z
        rot.append(row)
    return rot, norm


def _wigner(rot, lmax: int):
    """[D_0, ..., D_lmax] as nested lists of scalars (:func:`jequi.so2.wigner_d`'s recursion,
    unrolled over the nonzero Clebsch-Gordan coefficients)."""
    ds = [[[1.0]]]
    if lmax >= 1:
        ds.append(rot)
    for l in range(2, lmax + 1):
        c = so2._recursion_cg(l)  # (2l-1, 3, 2l+1)
        prev = ds[-1]
        nz = [tuple(int(v) for v in idx) for idx in zip(*np.nonzero(np.abs(c) > 1e-12))]
        t = {}  # t[i, b, n] = sum_a prev[i][a] c[a, b, n]
        for a, b, n in nz:
            for i in range(2 * l - 1):
                t[i, b, n] = _add(t.get((i, b, n), 0.0), _mul(prev[i][a], float(c[a, b, n])))
        u = {}  # u[i, j, n] = sum_b R[j][b] t[i, b, n]
        for (i, b, n), val in t.items():
            for j in range(3):
                u[i, j, n] = _add(u.get((i, j, n), 0.0), _mul(rot[j][b], val))
        d = [[0.0] * (2 * l + 1) for _ in range(2 * l + 1)]
        for i, j, kk in nz:
            for n in range(2 * l + 1):
                if (i, j, n) in u:
                    d[kk][n] = _add(d[kk][n], _mul(float(c[i, j, kk]), u[i, j, n]))
        ds.append(d)
    return ds


def _dot(pairs):
    total = None
    for a, b in pairs:
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


def _store_out(z_ref, base, out: _Out, start, size, i, value):
    for f in range(out.mul_f):
        z_ref[base + iota(out.offset + (out.chan + (start + np.arange(size)) * out.mul_f + f) * (2 * out.lo + 1) + i)] = value


def _powers(norm):
    """``norm^l`` by degree, computed once each (None for l = 0)."""
    cache = {}

    def power(l):
        if l not in cache:
            cache[l] = None if l == 0 else functools.reduce(lambda a, _: a * norm, range(l - 1), norm)
        return cache[l]

    return power


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def forward(plan, x, r, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int = 4):
    """``(N, out.dim)``: the EAAS product of the regrouped ``x (N, in.dim)`` with the harmonics of
    ``r (N, 3)``: per input block, ``x~[j] = sum_n x[n] D_li[n][j]`` once, then per output chunk
    ``y[i] = sum_m D_lo[i][lo + m] c_m norm^lf x~[j(m)]``."""
    n = x.shape[0]
    d_in = plan.irreps_in.dim
    d_out = plan.irreps_out.dim
    slices = plan.irreps_in.slices()
    dtype = x.dtype
    zeros, by_block = _layout(plan)

    def kernel(x_ref, r_ref, z_ref):
        def row(b):
            rot, norm = _frame(*(r_ref[b * 3 + a] for a in range(3)), normalize)
            ds = _wigner(rot, plan.lmax)
            power = _powers(norm)
            _store_zeros(z_ref, b * d_out, zeros, dtype)
            for blk, outs in by_block.items():
                li, base = plan.irreps_in[blk].ir.l, slices[blk].start
                for start, size in chunks(plan.irreps_in[blk].mul):
                    xs = [x_ref[b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn)] for nn in range(2 * li + 1)]
                    xt = {}
                    for out in outs:
                        for _, j, _ in out.pairs:
                            if j not in xt:
                                xt[j] = _dot([(ds[li][nn][j], xs[nn]) for nn in range(2 * li + 1)]) if li > 0 else xs[0]
                        pw = power(out.l_f)
                        for i in range(2 * out.lo + 1):
                            terms = []
                            for m, j, c in out.pairs:
                                scale = _mul(ds[out.lo][i][out.lo + m], c) if out.lo > 0 else c
                                terms.append((scale if pw is None else scale * pw, xt[j]))
                            _store_out(z_ref, b * d_out, out, start, size, i, _dot(terms).astype(dtype))

        rows_loop(n, rows_per_program, row)

    grid = (pl.cdiv(n, rows_per_program),)
    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * d_out,), dtype), grid, num_warps, name="jequi_eaas_fwd")(
        x.reshape(-1), r.reshape(-1)
    )
    return z.reshape(n, d_out)


def _tangent(a, k):
    return a.t[k] if isinstance(a, Dual) else 0.0


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def backward(plan, x, r, g, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int = 4):
    """``(gx (N, in.dim), gr (N, 3))``: the gradients of ``<g, forward(plan, x, r)>``. Per row the
    frame carries its derivatives in ``r`` (:class:`Dual`); the channel sums against the Wigner
    entries (``dL/dD``) are reduced on chip and contracted with them."""
    n = x.shape[0]
    d_in = plan.irreps_in.dim
    d_out = plan.irreps_out.dim
    slices = plan.irreps_in.slices()
    dtype = x.dtype
    _, by_block = _layout(plan)

    def kernel(x_ref, r_ref, g_ref, gx_ref, gr_ref):
        def row(b):
            seeds = [Dual(r_ref[b * 3 + a], tuple(1.0 if c == a else 0.0 for c in range(3))) for a in range(3)]
            rot, norm = _frame(*seeds, normalize)
            ds = _wigner(rot, plan.lmax)
            dv = [[[value(e) for e in row_] for row_ in d] for d in ds]
            sens = {}  # (l, i, j) -> dL/dD_l[i][j]
            gr = [0.0, 0.0, 0.0]
            power = _powers(norm)

            for blk, (mul_in, ir) in enumerate(plan.irreps_in):
                li, base = ir.l, slices[blk].start
                for start, size in chunks(mul_in):
                    def at(nn):
                        return b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn)

                    if blk not in by_block:
                        for nn in range(2 * li + 1):
                            gx_ref[at(nn)] = jnp.zeros((size,), dtype)
                        continue
                    xs = [x_ref[at(nn)] for nn in range(2 * li + 1)]
                    xt, gxt = {}, {}
                    for out in by_block[blk]:
                        lo = out.lo
                        pw = power(out.l_f)
                        pv = 1.0 if pw is None else value(pw)
                        gsum = []
                        for i in range(2 * lo + 1):
                            total = None
                            for f in range(out.mul_f):
                                idx = out.offset + (out.chan + (start + np.arange(size)) * out.mul_f + f) * (2 * lo + 1) + i
                                v = g_ref[b * d_out + iota(idx)]
                                total = v if total is None else total + v
                            gsum.append(total)
                        s_pow = 0.0
                        for m, j, c in out.pairs:
                            if j not in xt:
                                xt[j] = _dot([(dv[li][nn][j], xs[nn]) for nn in range(2 * li + 1)]) if li > 0 else xs[0]
                            gt = _dot([(dv[lo][i][lo + m], gsum[i]) for i in range(2 * lo + 1)]) if lo > 0 else gsum[0]
                            gt = gt * _mul(c, pv)
                            gxt[j] = gt if j not in gxt else gxt[j] + gt
                            for i in range(2 * lo + 1):
                                q = jnp.sum(gsum[i] * xt[j])
                                if lo > 0:
                                    key = (lo, i, lo + m)
                                    sens[key] = _add(sens.get(key, 0.0), q * _mul(c, pv))
                                if isinstance(pw, Dual):
                                    s_pow = _add(s_pow, q * (_mul(c, dv[lo][i][lo + m]) if lo > 0 else c))
                        if isinstance(pw, Dual):
                            gr = [_add(gr[a], _mul(s_pow, pw.t[a])) for a in range(3)]
                    for nn in range(2 * li + 1):
                        terms = [(dv[li][nn][j], gxt[j]) for j in gxt] if li > 0 else [(1.0, gxt[0])]
                        gx_ref[at(nn)] = _dot(terms).astype(dtype)
                        if li > 0:
                            for j in gxt:
                                key = (li, nn, j)
                                sens[key] = _add(sens.get(key, 0.0), jnp.sum(xs[nn] * gxt[j]))
            for (l, i, j), s in sens.items():
                gr = [_add(gr[a], _mul(s, _tangent(ds[l][i][j], a))) for a in range(3)]
            for a in range(3):
                total = gr[a]
                gr_ref[b * 3 + a] = (jnp.zeros((), dtype) if _zero(total) else total).astype(dtype)

        rows_loop(n, rows_per_program, row)

    grid = (pl.cdiv(n, rows_per_program),)
    shapes = (jax.ShapeDtypeStruct((n * d_in,), dtype), jax.ShapeDtypeStruct((n * 3,), dtype))
    gx, gr = pallas_call(kernel, shapes, grid, num_warps, name="jequi_eaas_bwd")(x.reshape(-1), r.reshape(-1), g.reshape(-1))
    return gx.reshape(n, d_in), gr.reshape(n, 3)


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def tangent(plan, x, r, tx, tr, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int = 4):
    """``(N, out.dim)``: the forward's derivative at ``(x, r)`` along ``(tx, tr)`` (linear in
    them): the frame carries its derivative along ``tr`` per row (a one-tangent :class:`Dual`),
    then the product's."""
    n = x.shape[0]
    d_in = plan.irreps_in.dim
    d_out = plan.irreps_out.dim
    slices = plan.irreps_in.slices()
    dtype = x.dtype
    zeros, by_block = _layout(plan)

    def split(e):  # (value, derivative along tr)
        return (e.v, e.t[0]) if isinstance(e, Dual) else (e, 0.0)

    def kernel(x_ref, r_ref, tx_ref, tr_ref, z_ref):
        def row(b):
            seeds = [Dual(r_ref[b * 3 + a], (tr_ref[b * 3 + a],)) for a in range(3)]
            rot, norm = _frame(*seeds, normalize)
            dd = [[[split(e) for e in row_] for row_ in d] for d in _wigner(rot, plan.lmax)]
            power = _powers(norm)
            _store_zeros(z_ref, b * d_out, zeros, dtype)
            for blk, outs in by_block.items():
                li, base = plan.irreps_in[blk].ir.l, slices[blk].start
                for start, size in chunks(plan.irreps_in[blk].mul):
                    at = [b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn) for nn in range(2 * li + 1)]
                    xs = [x_ref[a] for a in at]
                    txs = [tx_ref[a] for a in at]
                    xt, dxt = {}, {}
                    for out in outs:
                        for _, j, _ in out.pairs:
                            if j in xt:
                                continue
                            if li == 0:
                                xt[j], dxt[j] = xs[0], txs[0]
                                continue
                            xt[j] = _dot([(dd[li][nn][j][0], xs[nn]) for nn in range(2 * li + 1)])
                            pairs = [(dd[li][nn][j][0], txs[nn]) for nn in range(2 * li + 1)]
                            pairs += [(dd[li][nn][j][1], xs[nn]) for nn in range(2 * li + 1) if not _zero(dd[li][nn][j][1])]
                            dxt[j] = _dot(pairs)
                        pv, pd = split(power(out.l_f)) if out.l_f > 0 else (1.0, 0.0)
                        for i in range(2 * out.lo + 1):
                            terms = []
                            for m, j, c in out.pairs:
                                dv_, dd_ = dd[out.lo][i][out.lo + m] if out.lo > 0 else (1.0, 0.0)
                                terms.append((_mul(c, _mul(dv_, pv)), dxt[j]))
                                d_scale = _add(_mul(dd_, pv), _mul(dv_, pd))
                                if not _zero(d_scale):
                                    terms.append((_mul(c, d_scale), xt[j]))
                            _store_out(z_ref, b * d_out, out, start, size, i, _dot(terms).astype(dtype))

        rows_loop(n, rows_per_program, row)

    grid = (pl.cdiv(n, rows_per_program),)
    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * d_out,), dtype), grid, num_warps, name="jequi_eaas_jvp")(
        x.reshape(-1), r.reshape(-1), tx.reshape(-1), tr.reshape(-1)
    )
    return z.reshape(n, d_out)
