"""MACE's element-dependent linear (``jequi.IndexedLinear``): an equivariant linear map whose
weights depend on each row's species, equal to e3nn's fully connected product of the features
with the one-hot species (mace-torch's ``skip_tp``), with that product's weights.

>>> lin = jequi.IndexedLinear("128x0e+128x1o", "128x0e", num_species=89)
>>> w = lin.init_weights(key)              # (lin.weight_numel,): mace-torch's skip_tp.weight
>>> y = lin(x, species, w)                 # x (..., 512), species (...,) -> (..., 128)

The rows are sorted into blocks of one species (:func:`jequi.species.species_blocks`) and each
path is one batched matrix product: per block, its rows' ``(mul_in, dim)`` components times that
species' ``(mul_in, mul_out)`` matrix, instead of the one-hot product's ``num_species`` times the
work. Plain JAX ops: every derivative order and ``vmap`` (``jax.lax.ragged_dot``, the grouped
product's natural op, has no ``vmap`` over its groups).
"""

from __future__ import annotations

import math

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np

from .dtypes import plan
from .irreps import as_irreps
from .products import fully_connected
from .species import node_inputs, species_blocks

# Rows per block, all of one species (each species' last block is partly empty).
BLOCK = 32


class IndexedLinear:
    """``y[n] = fully_connected(irreps_in, num_species x 0e, irreps_out)(x[n], onehot(species[n]), w)``.

    Args:
        irreps_in, irreps_out: the features' irreps (e3nn notation), layout ``mul_ir``.
        num_species: the one-hot's length.

    ``w`` is that product's flat weight vector (e3nn's order: per ``(i_in, i_out)`` path of equal
    irreps, a ``(mul_in, num_species, mul_out)`` block row-major), so mace-torch's
    ``skip_tp.weight`` loads unchanged. A species outside ``[0, num_species)`` raises where
    concrete; under ``jit`` its row gives zero (its one-hot is zero)."""

    def __init__(self, irreps_in, irreps_out, num_species: int):
        if not isinstance(num_species, (int, np.integer)) or num_species < 1:
            raise ValueError(f"num_species must be a positive integer, got {num_species!r}")
        self.irreps_in, self.irreps_out = as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out")
        self.num_species = int(num_species)
        self.product = fully_connected(self.irreps_in, f"{self.num_species}x0e", self.irreps_out)
        paths = []
        for p in self.product.descriptor.paths:
            if p.is_empty:
                continue
            scale = float(p.cg[0, 0, 0])
            assert np.allclose(p.cg[:, 0, :], scale * np.eye(p.ir_out.dim)), "a scalar path is a multiple of the identity"
            paths.append(p)
        self._paths = tuple(paths)
        self._in_offsets = np.cumsum([0] + [m * ir.dim for m, ir in self.irreps_in])
        self._out_offsets = np.cumsum([0] + [m * ir.dim for m, ir in self.irreps_out])

    @property
    def weight_numel(self) -> int:
        return self.product.weight_numel

    def __repr__(self) -> str:
        return f"IndexedLinear({self.irreps_in} -> {self.irreps_out}, num_species={self.num_species}, {self.weight_numel} weights)"

    def init_weights(self, key, dtype=jnp.float32):
        """Standard normal (e3nn's and mace-torch's initialisation; the normalization is in the map)."""
        return jax.random.normal(key, (self.weight_numel,), dtype)

    def __call__(self, x, species, w, *, out_dtype=None, math_dtype=None):
        """``out_dtype`` and ``math_dtype``: :func:`jequi.dtypes.plan`
        (default: the result in the inputs' dtype, half precision computed in float32)."""
        x, species, wrap = node_inputs(x, species, self.irreps_in, self.num_species)
        w = jnp.asarray(w)
        if w.shape != (self.weight_numel,):
            raise ValueError(f"w has shape {w.shape}; expected ({self.weight_numel},)")
        batch = x.shape[:-1]
        n = math.prod(batch)
        p = plan(x.dtype, out_dtype, math_dtype)  # computed in p.math, rounded once
        if n == 0:
            return jnp.zeros((*batch, self.irreps_out.dim), p.out)
        out = self._rows(x.reshape(n, -1).astype(p.math), species.reshape(n).astype(jnp.int32), w.astype(p.math))
        out = out.reshape(*batch, self.irreps_out.dim).astype(p.out)
        return e3nn.IrrepsArray(self.irreps_out, out) if wrap else out

    def _rows(self, x, species, w):
        n, s_count = x.shape[0], self.num_species
        rows, block_species = species_blocks(species, s_count, BLOCK)
        slots = jnp.where(rows < 0, n, rows)  # empty slots read the zero row n and are dropped
        xb = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])[slots].reshape(-1, BLOCK, x.shape[1])
        blocks = [None] * len(self.irreps_out)
        for p in self._paths:
            mi, mo, dim = p.mul_in1, p.mul_out, p.ir_in1.dim
            a = self._in_offsets[p.i_in1]
            lhs = xb[:, :, a : a + mi * dim].reshape(xb.shape[0], BLOCK, mi, dim)
            rhs = w[p.weight_offset : p.weight_offset + mi * s_count * mo].reshape(mi, s_count, mo)
            rhs = jnp.swapaxes(rhs, 0, 1) * jnp.asarray(float(p.cg[0, 0, 0]), x.dtype)
            rhs = jnp.concatenate([rhs, jnp.zeros((1, mi, mo), x.dtype)])[block_species]  # (blocks, mi, mo)
            prod = jnp.einsum("brid,bio->brod", lhs, rhs, precision=jax.lax.Precision.HIGHEST)
            blocks[p.i_out] = prod if blocks[p.i_out] is None else blocks[p.i_out] + prod
        parts = [
            jnp.zeros((xb.shape[0], BLOCK, m * ir.dim), x.dtype) if blk is None else blk.reshape(xb.shape[0], BLOCK, -1)
            for blk, (m, ir) in zip(blocks, self.irreps_out)
        ]
        out = jnp.concatenate(parts, axis=-1).reshape(-1, self.irreps_out.dim)
        return jnp.zeros((n + 1, self.irreps_out.dim), x.dtype).at[slots].set(out, mode="drop")[:n]
