"""The EAAS product in XLA: each vector's frame and the product of ``x`` rotated into it. What
:mod:`jequi.eaas` (its ``xla`` backend) and :mod:`jequi.eaas_autodiff` (the kernels' reference
rules) share, below both."""

from __future__ import annotations

import jax.numpy as jnp

from . import so2


def frame(vectors, lmax: int, normalize: bool = True):
    """The frame of each vector: ``(D, norm)`` with ``D = [D_0, ..., D_lmax]`` the Wigner D matrices
    of :func:`jequi.so2.edge_rotation` of ``r / |r|``, and ``norm`` the norm of the spherical
    harmonics' argument (1, or 0 for ``r = 0``, if `normalize`; else ``|r|``): ``Y^l(r) =
    norm^l D_l Y^l(+y)``."""
    direction = so2.unit(vectors)
    _, norm = so2.safe_directions(vectors, normalize)
    return so2.wigner_d(so2.edge_rotation(direction), lmax), norm


def power(norm, l: int):
    return None if l == 0 else norm**l


def product(plan, x, ds, norm, leading, dtype):
    """The EAAS product of the regrouped ``x`` in the frames ``ds`` (`plan`: a :class:`jequi.eaas._Plan`)."""
    slices = plan.irreps_in.slices()
    x_lead = x.shape[:-1]
    rotated = {}
    for l, blocks in plan.rotate_in:
        parts = [x[..., slices[b]].reshape(*x_lead, plan.irreps_in[b].mul, 2 * l + 1) for b in blocks]
        xl = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)
        xt = xl if l == 0 else so2.rotate(xl, ds[l], transpose=True)  # D^T x
        start = 0
        for b, part in zip(blocks, parts):
            rotated[b] = xt[..., start : start + part.shape[-2], :]
            start += part.shape[-2]
    powers = {}
    outputs = []
    for lo, pieces in plan.out:
        chunks = []
        for p in pieces:
            mul = plan.irreps_in[p.block].mul
            if p.coefficient is None:
                chunks.append(jnp.zeros((*leading, mul * p.mul_f, 2 * lo + 1), dtype))
                continue
            li, k = plan.irreps_in[p.block].ir.l, len(p.coefficient) // 2
            chunk = rotated[p.block][..., li - k : li + k + 1]  # static slices, reversal and padding:
            if p.reverse:  # cheap to transpose, no gathers
                chunk = chunk[..., ::-1]
            chunk = chunk * jnp.asarray(p.coefficient, dtype)
            if lo > k:
                chunk = jnp.pad(chunk, [(0, 0)] * (chunk.ndim - 1) + [(lo - k, lo - k)])
            if p.l_f not in powers:
                powers[p.l_f] = power(norm, p.l_f)
            if powers[p.l_f] is not None:
                chunk = chunk * powers[p.l_f][..., None, None]
            if p.mul_f > 1:
                chunk = jnp.repeat(chunk, p.mul_f, axis=-2)
            chunks.append(jnp.broadcast_to(chunk, (*leading, *chunk.shape[-2:])))
        yt = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=-2)
        y = yt if lo == 0 else so2.rotate(yt, ds[lo], transpose=False)  # D y~
        outputs.append(jnp.broadcast_to(y, (*leading, *y.shape[-2:])).reshape(*leading, y.shape[-2] * y.shape[-1]))  # no -1: zero rows
    if not outputs:
        return jnp.zeros((*leading, 0), dtype)
    return outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs, axis=-1)
