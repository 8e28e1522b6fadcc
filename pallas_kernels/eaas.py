"""Pallas kernel of the EAAS product's forward (prototype): one row's frame, Wigner D matrices,
rotation into the frame, per-m map and rotation back, with the channels vectorized and nothing
but ``x``, ``r`` and the output in HBM. ``plan`` is :func:`jequi.eaas._plan`'s."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from jequi import so2

from .lowering import fma, pallas_call
from .row_code import chunks, iota, rows_loop


def _frame(rx, ry, rz, normalize: bool):
    """(R as 3 x 3 nested lists of scalars, norm) of one row, as :func:`jequi.so2.edge_rotation`
    and :func:`jequi.so2.safe_directions`."""
    r2 = rx * rx + ry * ry + rz * rz
    one = jnp.ones_like(r2)
    nonzero = (r2 > 0).astype(r2.dtype)  # selects as arithmetic: Triton multiplies no booleans
    length = jnp.sqrt(r2 + (one - nonzero))
    inv = one / length
    dx, dy, dz = rx * inv, ry * inv, rz * inv
    norm = nonzero if normalize else nonzero * length
    upper = (dy >= 0).astype(r2.dtype)
    sign = 2.0 * upper - one
    v = (sign * dz, 0.0, -sign * dx)
    k = [[0.0, -v[2], v[1]], [v[2], 0.0, -v[0]], [-v[1], v[0], 0.0]]
    vv = v[0] * v[0] + v[2] * v[2]
    inv_den = one / (one + sign * dy)
    flip = sign
    rot = []
    for i in range(3):
        row = []
        for j in range(3):
            value = (1.0 if i == j else 0.0) + k[i][j] + (v[i] * v[j] - (vv if i == j else 0.0)) * inv_den
            row.append(value * flip if j < 2 else value)
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
                t[i, b, n] = t.get((i, b, n), 0.0) + prev[i][a] * float(c[a, b, n])
        u = {}  # u[i, j, n] = sum_b R[j][b] t[i, b, n]
        for (i, b, n), val in t.items():
            for j in range(3):
                u[i, j, n] = u.get((i, j, n), 0.0) + rot[j][b] * val
        d = [[0.0] * (2 * l + 1) for _ in range(2 * l + 1)]
        for i, j, kk in nz:
            for n in range(2 * l + 1):
                if (i, j, n) in u:
                    d[kk][n] = d[kk][n] + float(c[i, j, kk]) * u[i, j, n]
        ds.append(d)
    return ds


def _dot(pairs):
    total = None
    for a, b in pairs:
        total = a * b if total is None else fma(a, b, total)
    return total


@functools.partial(jax.jit, static_argnames=("plan", "normalize", "rows_per_program", "num_warps"))
def forward(plan, x, r, *, normalize: bool = True, rows_per_program: int = 4, num_warps: int = 4):
    """``(N, out.dim)``: the EAAS product of the regrouped ``x (N, in.dim)`` with the harmonics of
    ``r (N, 3)``."""
    n = x.shape[0]
    d_in = plan.irreps_in.dim
    d_out = plan.irreps_out.dim
    slices = plan.irreps_in.slices()
    dtype = x.dtype

    def kernel(x_ref, r_ref, z_ref):
        def row(b):
            rx, ry, rz = (r_ref[b * 3 + i] for i in range(3))
            rot, norm = _frame(rx, ry, rz, normalize)
            ds = _wigner(rot, plan.lmax)
            powers = {0: None}
            out_offset = 0
            for lo, pieces in plan.out:
                chan = 0
                for p in pieces:
                    mul_in = plan.irreps_in[p.block].mul
                    li = plan.irreps_in[p.block].ir.l
                    width = mul_in * p.mul_f
                    if p.coefficient is None:
                        for start, size in chunks(width):
                            for i in range(2 * lo + 1):
                                idx = out_offset + (chan + start + np.arange(size)) * (2 * lo + 1) + i
                                z_ref[b * d_out + iota(idx)] = jnp.zeros((size,), dtype)
                        chan += width
                        continue
                    if p.l_f not in powers:
                        powers[p.l_f] = functools.reduce(lambda a, _: a * norm, range(p.l_f - 1), norm)
                    k = len(p.coefficient) // 2
                    # y[i] = sum_m D_lo[i][lo + m] coeff[k + m] norm^lf x~[src(m)], x~[j] = sum_n x[n] D_li[n][j]
                    dli, dlo = ds[li], ds[lo]
                    for start, size in chunks(mul_in):
                        base = slices[p.block].start
                        xs = [x_ref[b * d_in + iota(base + (start + np.arange(size)) * (2 * li + 1) + nn)] for nn in range(2 * li + 1)]
                        xt = {}
                        for m in range(-k, k + 1):
                            if p.coefficient[k + m] == 0.0:
                                continue
                            j = li - m if p.reverse else li + m
                            if j not in xt:
                                xt[j] = _dot([(dli[nn][j], xs[nn]) for nn in range(2 * li + 1)]) if li > 0 else xs[0]
                        for i in range(2 * lo + 1):
                            terms = []
                            for m in range(-k, k + 1):
                                c = p.coefficient[k + m]
                                if c == 0.0:
                                    continue
                                j = li - m if p.reverse else li + m
                                scale = dlo[i][lo + m] * c if lo > 0 else c
                                if powers[p.l_f] is not None:
                                    scale = scale * powers[p.l_f]
                                terms.append((scale, xt[j]))
                            value = _dot(terms) if terms else jnp.zeros((size,), dtype)
                            value = value.astype(dtype)
                            for f in range(p.mul_f):
                                idx = out_offset + (chan + (start + np.arange(size)) * p.mul_f + f) * (2 * lo + 1) + i
                                z_ref[b * d_out + iota(idx)] = value
                    chan += width
                out_offset += chan * (2 * lo + 1)

        rows_loop(n, rows_per_program, row)

    grid = (pl.cdiv(n, rows_per_program),)
    z = pallas_call(kernel, jax.ShapeDtypeStruct((n * d_out,), dtype), grid, num_warps, name="jequi_eaas_fwd")(
        x.reshape(-1), r.reshape(-1)
    )
    return z.reshape(n, d_out)
