"""Edge frames, Wigner D matrices and the sparse per-m coupling tables of the SO(2) (EAAS) products.

A Clebsch-Gordan product of ``x`` with the spherical harmonic ``Y^{l_f}(r)`` is, exactly, a
rotation of ``x`` into a frame whose pole is ``r``, a sparse map that couples only ``m_i = +-m_o``
there (``Y^{l_f}`` of the pole is nonzero at ``m_f = 0`` only), and a rotation back: O(L^3) per
channel instead of the dense product's O(L^6). e3nn's pole is +y (its real harmonics put
``m = 0`` on y). See ``docs/so2.md``.

* :func:`edge_rotation`: a rotation ``R`` with ``R @ y_hat = r_hat``, built from ``r`` directly
  (no Euler angles): two charts, each rational in ``r_hat`` with a denominator >= 1, picked by
  the sign of ``r_y``. Products in the frame do not depend on the roll about ``r``, so a
  product's derivatives of every order are right everywhere, on and near +-y included.
* :func:`wigner_d`: e3nn's ``D_l(R)`` for ``l = 0..lmax``, by the recursion
  ``D_l = (2l+1) C^T (D_{l-1} (x) R) C`` with ``C = clebsch_gordan(l-1, 1, l)``: polynomials in
  ``R``'s entries, so smooth to every order.
* :func:`coupling`: the per-m map of one path ``(l_i, l_f, l_o)``, read numerically from
  ``e3nn.clebsch_gordan`` (some couplings are accidentally zero).
"""

from __future__ import annotations

import dataclasses
import functools

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np


def _cross_matrix(v):
    """``[v]_x`` (..., 3, 3): ``[v]_x @ u = v x u``."""
    v1, v2, v3 = v[..., 0], v[..., 1], v[..., 2]
    z = jnp.zeros_like(v1)
    return jnp.stack(
        [jnp.stack([z, -v3, v2], -1), jnp.stack([v3, z, -v1], -1), jnp.stack([-v2, v1, z], -1)], -2
    )


def edge_rotation(directions):
    """Rotations ``R`` (..., 3, 3) with ``R @ (0, 1, 0) = d`` for unit vectors ``d`` (..., 3).

    For ``d_y >= 0``: the smallest rotation taking +y to ``d``, ``I + K + K^2 / (1 + d_y)`` with
    ``K = [y x d]_x``; for ``d_y < 0``: the smallest rotation taking -y to ``d``, after a half
    turn about z (which takes +y to -y). Both denominators are >= 1 where they are used, and the
    unused one is replaced by 1, so values and derivatives of every order are finite. A zero
    ``d`` gives the identity.
    """
    dx, dy, dz = directions[..., 0], directions[..., 1], directions[..., 2]
    upper = dy >= 0
    zero = jnp.zeros_like(dx)
    # chart A: +y -> d, v = y x d = (d_z, 0, -d_x); chart B: -y -> d, v = (-y) x d
    sign = jnp.where(upper, 1.0, -1.0).astype(directions.dtype)
    v = sign[..., None] * jnp.stack([dz, zero, -dx], -1)
    denominator = jnp.where(upper, 1.0 + dy, 1.0 - dy)
    k = _cross_matrix(v)
    eye = jnp.eye(3, dtype=directions.dtype)
    rot = eye + k + (k @ k) / denominator[..., None, None]
    # chart B composes with the half turn about z, diag(-1, -1, 1): columns 0 and 1 change sign
    flip = jnp.where(upper[..., None], jnp.ones(3, directions.dtype), jnp.asarray([-1.0, -1.0, 1.0], directions.dtype))
    return rot * flip[..., None, :]


@functools.lru_cache(maxsize=None)
def _recursion_cg(l: int) -> np.ndarray:
    """``(2l+1)^(1/2) clebsch_gordan(l-1, 1, l)``: one factor of the recursion of :func:`wigner_d`."""
    return np.sqrt(2 * l + 1) * np.asarray(e3nn.clebsch_gordan(l - 1, 1, l), np.float64)


def wigner_d(rotation, lmax: int) -> list:
    """e3nn's Wigner D matrices ``[D_0, ..., D_lmax]`` of proper rotations (..., 3, 3); ``D_l`` is
    (..., 2l+1, 2l+1), ``D_1 = R`` (e3nn's l = 1 basis is x, y, z)."""
    lead = rotation.shape[:-2]
    ds = [jnp.ones((*lead, 1, 1), rotation.dtype)]
    if lmax >= 1:
        ds.append(rotation)
    for l in range(2, lmax + 1):
        c = jnp.asarray(_recursion_cg(l), rotation.dtype)  # (2l-1, 3, 2l+1)
        # D_l[k, n] = sum_{i,j,a,b} C[i,j,k] D_{l-1}[i,a] R[j,b] C[a,b,n]
        t = jnp.einsum("...ia,abn->...ibn", ds[-1], c)  # one matrix product with a constant
        # the per-row 3 x 3 factor as broadcast multiply-adds (a batched product of tiny matrices is slow)
        t = sum(rotation[..., None, :, b, None] * t[..., :, None, b, :] for b in range(3))  # (..., i, j, n)
        ds.append(jnp.einsum("ijk,...ijn->...kn", c, t))
    return ds


# Up to this block size rotate() is one broadcast product summed over the block; above it, a
# batched matrix product. Both are single XLA ops whose transposes (the backward) are single ops
# too; per-component slices, which transpose into one pad-and-add per component, made the backward
# 4-12x the forward (benchmarks/results/2026-11-28-nvidia-h100-80gb-hbm3-eaas-rotate.md).
BROADCAST_MAX_BLOCK = 5


def rotate(x, d, *, transpose: bool):
    """``x @ D`` (``transpose``: each channel's ``D^T x``, into the frame) or ``x @ D^T`` (``D y``,
    back) for features (..., C, n) and per-row matrices (..., n, n): a broadcast product reduced
    over the block for ``n <= BROADCAST_MAX_BLOCK``, a batched matrix product (full float32
    precision) above."""
    m = d if transpose else jnp.swapaxes(d, -1, -2)
    if d.shape[-1] <= BROADCAST_MAX_BLOCK:
        return jnp.sum(x[..., :, :, None] * m[..., None, :, :], axis=-2)
    return jnp.einsum("...ci,...ij->...cj", x, m, precision=jax.lax.Precision.HIGHEST)


def safe_directions(vectors, normalize: bool):
    """``(u, |u|)``: e3nn's argument of the spherical harmonics (``r / |r|`` if `normalize`, a zero
    vector staying zero; else ``r``) and its norm, with finite derivatives at ``r = 0``."""
    r2 = jnp.sum(vectors * vectors, axis=-1)
    nonzero = r2 > 0
    safe_r2 = jnp.where(nonzero, r2, 1.0)
    norm = jnp.sqrt(safe_r2)
    if normalize:
        return vectors / norm[..., None], nonzero.astype(vectors.dtype)
    return vectors, jnp.where(nonzero, norm, 0.0)


def unit(vectors):
    """``r / |r|`` (zero for ``r = 0``), with finite derivatives everywhere."""
    return safe_directions(vectors, True)[0]


@dataclasses.dataclass(frozen=True)
class Coupling:
    """The per-m map of one path ``(l_i, l_f, l_o)`` in the edge frame, for raw CG coefficients
    and ``Y^{l_f}`` of the pole equal to ``e_{m=0}``:
    ``y~[l_o + m] = coefficient[l_o + m] * x~[source[l_o + m]]`` (index ``l + m`` in a block).

    ``source[l_o + m]`` is ``l_i + m`` when ``l_i + l_f + l_o`` is even (``coefficient`` is then
    even in m), ``l_i - m`` when it is odd (then odd in m, and zero at m = 0); where no input
    couples (``|m| > l_i``, or an accidental zero) the coefficient is 0 and the source 0.
    """

    l_in: int
    l_f: int
    l_out: int
    source: tuple
    coefficient: tuple

    @property
    def even(self) -> bool:
        return (self.l_in + self.l_f + self.l_out) % 2 == 0


@functools.lru_cache(maxsize=None)
def coupling(l_in: int, l_f: int, l_out: int) -> Coupling:
    """:class:`Coupling` of a path, from ``e3nn.clebsch_gordan(l_in, l_f, l_out)[:, l_f, :]``
    (``m_f = 0``); checks that no other entry is nonzero."""
    if not abs(l_in - l_f) <= l_out <= l_in + l_f:
        raise ValueError(f"no Clebsch-Gordan path {l_in} x {l_f} -> {l_out}")
    cg = np.asarray(e3nn.clebsch_gordan(l_in, l_f, l_out), np.float64)[:, l_f, :]  # (2l_in+1, 2l_out+1)
    even = (l_in + l_f + l_out) % 2 == 0
    source, coefficient = [], []
    for mo in range(-l_out, l_out + 1):
        mi = mo if even else -mo
        column = cg[:, l_out + mo].copy()
        value = 0.0
        if abs(mi) <= l_in:
            value = float(column[l_in + mi])
            column[l_in + mi] = 0.0
        if np.abs(column).max(initial=0.0) > 1e-12:
            raise AssertionError(f"CG({l_in}, {l_f}, {l_out}) couples m_o={mo} to more than m_i={mi}")
        nonzero = abs(value) > 1e-12
        source.append(l_in + mi if nonzero else 0)
        coefficient.append(value if nonzero else 0.0)
    return Coupling(l_in, l_f, l_out, tuple(source), tuple(coefficient))


def pole_value(l: int, normalization: str = "component") -> float:
    """``Y^l_{m=0}`` of the pole +y in e3nn's `normalization` (``Y^l(y_hat)`` is zero elsewhere):
    ``sqrt(2l+1)`` ("component", unit mean square per component), 1 ("norm"), or
    ``sqrt((2l+1) / (4 pi))`` ("integral")."""
    values = {"component": np.sqrt(2 * l + 1), "norm": 1.0, "integral": np.sqrt((2 * l + 1) / (4 * np.pi))}
    if normalization not in values:
        raise ValueError(f"spherical harmonics normalization must be 'component', 'norm' or 'integral', got {normalization!r}")
    return float(values[normalization])
