"""An e3nn ``IrrepsArray`` split into attention heads and back.

Head ``h`` of ``H`` takes, from every irrep block ``m x ir``, the channels ``[h m/H, (h+1) m/H)``
(in e3nn's ``mul_ir`` layout: a block is ``[m, ir.dim]`` row-major), concatenated in block
order: a head's values are ``(m/H) x ir`` for each block, so a rotation acts on each head as on
the whole array, and attention weights shared by a head's channels keep the map equivariant.
"""

from __future__ import annotations

import e3nn_jax as e3nn
import jax.numpy as jnp


def _check(irreps: e3nn.Irreps, heads: int):
    bad = [str(mul_ir) for mul_ir in irreps if mul_ir.mul % heads]
    if bad:
        raise ValueError(f"every multiplicity of the values' irreps must be divisible by the {heads} heads; not {bad}")


def head_irreps(irreps, heads: int) -> e3nn.Irreps:
    """The irreps of one head."""
    irreps = e3nn.Irreps(irreps)
    _check(irreps, heads)
    return e3nn.Irreps([(mul // heads, ir) for mul, ir in irreps])


def split_heads(x: e3nn.IrrepsArray, heads: int):
    """``[..., irreps.dim]`` -> ``[..., heads, head_irreps.dim]``."""
    _check(x.irreps, heads)
    lead = x.shape[:-1]
    parts = [
        x.array[..., sl].reshape(*lead, heads, (mul // heads) * ir.dim) for sl, (mul, ir) in zip(x.irreps.slices(), x.irreps)
    ]
    return jnp.concatenate(parts, axis=-1)


def merge_heads(y, irreps) -> e3nn.IrrepsArray:
    """The inverse of :func:`split_heads`: ``[..., heads, head_irreps.dim]`` -> an
    ``IrrepsArray`` ``[..., irreps.dim]``."""
    irreps = e3nn.Irreps(irreps)
    heads = y.shape[-2]
    _check(irreps, heads)
    lead = y.shape[:-2]
    widths = [(mul // heads) * ir.dim for mul, ir in irreps]
    if sum(widths) != y.shape[-1]:
        raise ValueError(f"values of width {y.shape[-1]} per head do not match the irreps {irreps} ({sum(widths)} per head)")
    starts = [sum(widths[:i]) for i in range(len(widths))]
    blocks = [y[..., s : s + w].reshape(*lead, heads * w) for s, w in zip(starts, widths)]
    return e3nn.IrrepsArray(irreps, jnp.concatenate(blocks, axis=-1))
