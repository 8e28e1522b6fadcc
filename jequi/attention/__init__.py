"""Node-centric equivariant attention over a padded neighbour list (E2Former-V2's attention).

:func:`neighbor_attention` is the public op; :mod:`.reference` the materialised plain-JAX form
(the ``xla`` backend and the oracle); :mod:`.autodiff` the primitives that run the fused
Pallas kernels of :mod:`pallas_kernels.attention` with derivatives of every order; :mod:`.heads`
splits an e3nn ``IrrepsArray`` into heads and back.
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import e3nn_jax as e3nn
import jax.numpy as jnp
import numpy as np

from jequi.dtypes import plan
from jequi.pallas_launch import on_gpu

from . import reference
from .autodiff import Spec, _kernels, fused_attention
from .heads import merge_heads, split_heads

if TYPE_CHECKING:
    from pallas_kernels.attention import AttentionConfig

BACKENDS = ("xla", "pallas", "pallas-atomic")


def neighbor_attention(
    q, k, v, neighbors, *, mask=None, logit_bias=None, logit_gate=None, envelope=None, post_scale=None, scale=None,
    eps: float = 0.0, backend: str | None = None, config: AttentionConfig | None = None, out_dtype=None, math_dtype=None,
):  # fmt: skip
    """Attention of each target node over its neighbours, per head (E2Former-V2, section 2 of
    E2FORMER.md). For target ``i``, slot ``t`` of its neighbour list (``j = neighbors[i, t]``)
    and each head::

        s_it  = scale * g_it * <q_i, k_j> + b_it          (scale = 1/sqrt(d) by default)
        a_it  = exp(s_it - mu_i) * e_it                   (mu_i: the largest valid s_it)
        Z_i   = sum_t a_it + eps
        out_i = sum_t (a_it / Z_i) * u_it * v_j

    Args:
      q: ``[N, H, d]`` queries (invariant scalars per node).
      k: ``[N_src, H, d]`` keys.
      v: ``[N_src, H, D_v]`` values, or an ``e3nn.IrrepsArray`` ``[N_src, irreps.dim]`` whose
        every multiplicity is divisible by ``H``: head ``h`` gets channels ``[h m/H, (h+1) m/H)``
        of each irrep block of multiplicity ``m`` (:func:`split_heads`), and the result is an
        ``IrrepsArray`` with ``v``'s irreps (:func:`merge_heads`). Attention weights are
        invariant scalars shared by a head's channels, so the map is equivariant.
      neighbors: ``[N, K]`` integers; an entry outside ``[0, N_src)`` (``-1``, ``N_src``) is a
        padding slot. Duplicates and self loops are ordinary edges.
      mask: optional ``[N, K]`` bool, False marks more padding slots.
      logit_bias ``b``, logit_gate ``g``, envelope ``e``, post_scale ``u``: optional per-edge
        scalars ``[N, K]`` (shared by the heads) or ``[N, K, H]``; defaults 0, 1, 1, 1.
      scale: a Python number (static); default ``1 / sqrt(d)``.
      eps: a Python number >= 0 (static) added to ``Z``.
      backend: ``"pallas"`` (fused kernels; the default on a GPU), ``"pallas-atomic"`` (the
        same, the backward's ``dk``, ``dv`` added with atomics: faster on hubs, not bitwise
        reproducible) or ``"xla"`` (the materialised reference; the default elsewhere).
      config: the Pallas kernels' :class:`pallas_kernels.attention.AttentionConfig`.
      out_dtype, math_dtype: :func:`jequi.dtypes.plan` (default: the result in the inputs'
        dtype, half precision computed in float32).

    Returns ``[N, H, D_v]`` (an ``IrrepsArray`` ``[N, irreps.dim]`` for an ``IrrepsArray`` ``v``).
    A node with no valid neighbour (or with ``Z = 0``: every envelope 0 and ``eps = 0``) gets 0,
    and zero gradients. ``mu`` is taken at the first maximal slot: with ``eps > 0`` the
    derivatives' term from ``mu`` goes to that slot.

    Derivatives: ``jax.grad`` runs the fused backward kernels, ``jax.jvp`` the fused tangent
    kernel; second and higher orders (force training) are exact, and run the fused kernels for
    the parts linear in a cotangent or tangent and autodiff of the materialised reference for
    the rest (:mod:`jequi.attention.autodiff`). ``jax.jit`` and ``jax.vmap`` work on every
    backend.
    """
    irreps = None
    if isinstance(v, e3nn.IrrepsArray):
        irreps = v.irreps
        heads = _shape(q, "q", 3)[1]
        v = split_heads(v, heads)
    for name, a, ndim in (("q", q, 3), ("k", k, 3), ("v", v, 3)):
        _shape(a, name, ndim)
        _floating(a, name)
    n, h, d = q.shape
    n_src = k.shape[0]
    if k.shape[1:] != (h, d):
        raise ValueError(f"k must have shape [N_src, H, d] = [N_src, {h}, {d}] like q {q.shape}, got {k.shape}")
    if v.shape[:2] != (n_src, h):
        raise ValueError(f"v must have shape [N_src, H, D_v] = [{n_src}, {h}, D_v] like k {k.shape}, got {v.shape}")
    nbr = _neighbors(neighbors, n)
    kslots = nbr.shape[1]
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise TypeError(f"mask must be a bool array, got dtype {mask.dtype}")
        if mask.shape != nbr.shape:
            raise ValueError(f"mask must have the neighbours' shape {nbr.shape}, got {mask.shape}")
        nbr = jnp.where(mask, nbr, -1)
    edges = []
    for name, a in (("logit_bias", logit_bias), ("logit_gate", logit_gate), ("envelope", envelope), ("post_scale", post_scale)):
        edges.append(None if a is None else _edge_scalar(a, name, n, kslots, h))
    scale = 1.0 / math.sqrt(d) if scale is None else _number(scale, "scale")
    eps = _number(eps, "eps")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    backend = ("pallas" if on_gpu() else "xla") if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r} for neighbor_attention; choose one of {BACKENDS}")
    if config is not None and not isinstance(config, _kernels().AttentionConfig):
        raise TypeError(f"config must be a pallas_kernels.attention.AttentionConfig, got {type(config).__name__}")
    stored = jnp.result_type(q, k, v, *(a for a in edges if a is not None))
    p = plan(stored, out_dtype, math_dtype)  # computed in p.math, rounded once
    dtype = p.math
    q, k, v = (jnp.asarray(a, dtype) for a in (q, k, v))
    edges = [None if a is None else a.astype(dtype) for a in edges]
    if kslots == 0 or n == 0:
        out = jnp.zeros((n, h, v.shape[2]), dtype)
    elif backend == "xla":
        out = reference.neighbor_attention(q, k, v, nbr, *edges, scale=scale, eps=eps)
    else:
        spec = Spec(tuple(a is not None for a in edges), scale, eps, backend == "pallas-atomic", config or _kernels().DEFAULT)
        if n_src == 0:
            k, v = jnp.zeros((1, h, d), dtype), jnp.zeros((1, h, v.shape[2]), dtype)
            nbr = jnp.full_like(nbr, -1)
        out = fused_attention(spec, (q, k, v, *(a for a in edges if a is not None)), nbr)
    out = out.astype(p.out)
    return out if irreps is None else merge_heads(out, irreps)


def _shape(a, name: str, ndim: int):
    shape = np.shape(a)
    if len(shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {shape}")
    return shape


def _floating(a, name: str):
    dtype = jnp.asarray(a).dtype if not hasattr(a, "dtype") else a.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")


def _neighbors(neighbors, n: int):
    dtype = neighbors.dtype if hasattr(neighbors, "dtype") else np.asarray(neighbors).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(f"neighbors must be an integer array, got dtype {dtype}")
    shape = np.shape(neighbors)
    if len(shape) != 2 or shape[0] != n:
        raise ValueError(f"neighbors must have shape [N, K] with N = {n} (q's nodes), got {shape}")
    return jnp.asarray(neighbors, jnp.int32)


def _edge_scalar(a, name: str, n: int, kslots: int, h: int):
    _floating(a, name)
    a = jnp.asarray(a)
    if a.shape == (n, kslots):
        return a[..., None]
    if a.ndim == 3 and a.shape[:2] == (n, kslots) and a.shape[2] in (1, h):
        return a
    raise ValueError(f"{name} must have shape [N, K] = [{n}, {kslots}] or [N, K, H] = [{n}, {kslots}, {h}], got {a.shape}")


def _number(x, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a Python number (static), got {type(x).__name__}")
    return float(x)


__all__ = ["BACKENDS", "merge_heads", "neighbor_attention", "split_heads"]
