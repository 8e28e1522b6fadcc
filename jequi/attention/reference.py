"""The materialised plain-JAX neighbour attention: the oracle, the ``xla`` backend, and the
function whose autodiff gives the fused kernels' derivatives of second and higher order.

It gathers ``k[nbr]`` and ``v[nbr]`` (``[N, K, H, d]`` and ``[N, K, H, D_v]``), computes the
logits ``[N, K, H]`` and a masked softmax, and sums: the plain-JAX "gather" form that the
fused kernels replace. Every ``where`` that masks a padding slot also keeps the masked
branch finite, so gradients of every order are free of NaN (rows without a valid neighbour,
huge logits, zero envelopes).
"""

from __future__ import annotations

import jax.numpy as jnp


def valid_slots(nbr, n_src: int):
    """``[N, K]`` bool: the slots whose neighbour index is in ``[0, n_src)``."""
    return (nbr >= 0) & (nbr < n_src)


def neighbor_attention(q, k, v, nbr, bias=None, gate=None, envelope=None, post_scale=None, *, scale: float,
                       eps: float = 0.0):  # fmt: skip
    """``out [N, H, D_v]`` for ``q [N, H, d]``, ``k [N_src, H, d]``, ``v [N_src, H, D_v]``,
    ``nbr [N, K]`` (out-of-range entries are padding) and optional per-edge scalars
    ``[N, K, 1]`` or ``[N, K, H]`` (``b``, ``g``, ``e``, ``u`` of the definition in
    :func:`jequi.neighbor_attention`). ``mu`` is the value at the first maximal slot, so the
    eps term of the derivatives goes to that slot, as in the kernels."""
    n_src = k.shape[0]
    valid = valid_slots(nbr, n_src)[..., None]  # [N, K, 1]
    j = jnp.where(valid[..., 0], nbr, 0)
    kj, vj = k[j], v[j]  # [N, K, H, d], [N, K, H, D_v]
    s = jnp.einsum("nhd,nkhd->nkh", q, kj) * scale
    if gate is not None:
        s = s * gate
    if bias is not None:
        s = s + bias
    s_masked = jnp.where(valid, s, -jnp.inf)
    first = jnp.argmax(s_masked, axis=1)[:, None, :]  # [N, 1, H]
    mu = jnp.take_along_axis(s_masked, first, axis=1)  # [N, 1, H], -inf without a valid slot
    mu = jnp.where(jnp.isfinite(mu), mu, 0.0)
    a = jnp.exp(jnp.where(valid, s, mu) - mu)
    if envelope is not None:
        a = a * envelope
    a = jnp.where(valid, a, 0.0)
    z = jnp.sum(a, axis=1) + eps  # [N, H]
    weights = a if post_scale is None else a * post_scale
    acc = jnp.einsum("nkh,nkhd->nhd", weights, vj)
    ok = (z > 0)[..., None]
    return jnp.where(ok, acc / jnp.where(ok, z[..., None], 1.0), 0.0)
