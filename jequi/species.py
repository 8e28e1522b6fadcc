"""Rows grouped by species: the schedule of the species-indexed ops (the symmetric contraction's
kernels, :class:`jequi.IndexedLinear`) and the deterministic per-species sum of per-block partials."""

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np


def species_blocks(species, num_species: int, block: int):
    """``(rows (num_blocks * block,), block_species (num_blocks,))``: the rows sorted by species
    (stably) into blocks of `block` rows of one species each, -1 in the slots left over; rows
    whose species is outside ``[0, num_species)`` go to species ``num_species`` (whose weights
    the callers set to zero: such rows give zero and get zero gradient, as out-of-range graph
    indices do). ``num_blocks = ceil(N / block) + num_species + 1`` bounds every distribution
    of species; the unused blocks hold no rows. Works under ``jit``."""
    n = species.shape[0]
    groups = num_species + 1
    s = jnp.where((species >= 0) & (species < num_species), species, num_species).astype(jnp.int32)
    # Few groups: counts and block ranges as one comparison against every group (fused by XLA;
    # a scatter-add and searchsorted's loop cost more than the kernels at 4k rows,
    # benchmarks/results/2026-12-01-nvidia-h200-symmetric-probe.md).
    ids = jnp.arange(groups, dtype=jnp.int32)
    counts = jnp.sum(s[:, None] == ids[None, :], axis=0, dtype=jnp.int32)
    blocks_per = (counts + block - 1) // block
    block_end = jnp.cumsum(blocks_per)
    block_start = block_end - blocks_per
    order = jnp.argsort(s, stable=True).astype(jnp.int32)
    sorted_s = s[order]
    first = jnp.cumsum(counts) - counts  # first sorted position of each species
    rank = jnp.arange(n, dtype=jnp.int32) - first[sorted_s]
    slot = block_start[sorted_s] * block + rank
    num_blocks = -(-n // block) + groups
    rows = jnp.full((num_blocks * block,), -1, jnp.int32).at[slot].set(order, mode="drop", unique_indices=True)
    blocks = jnp.arange(num_blocks, dtype=jnp.int32)
    block_species = jnp.minimum(jnp.sum(blocks[:, None] >= block_end[None, :], axis=1, dtype=jnp.int32), num_species)
    return rows, block_species.astype(jnp.int32)


def species_sum(partials, block_species, num_species: int):
    """``(num_species, ...)``: the per-block `partials` added per species (a one-hot product in
    full precision: a fixed order, so the same bits every run); the out-of-range group is dropped."""
    onehot = (block_species[None, :] == jnp.arange(num_species, dtype=jnp.int32)[:, None]).astype(partials.dtype)
    flat = partials.reshape(partials.shape[0], -1)
    return jnp.matmul(onehot, flat, precision=jax.lax.Precision.HIGHEST).reshape(num_species, *partials.shape[1:])


def node_inputs(x, species, irreps_in, num_species: int, layout: str = "mul_ir"):
    """``(x, species, was_irreps_array)`` of a species-indexed op's call, checked: `x` floating
    with last axis ``irreps_in.dim`` (an ``e3nn_jax.IrrepsArray`` of those irreps, in ``mul_ir``),
    `species` integer with `x`'s leading dims and, where concrete, in ``[0, num_species)`` (under
    ``jit`` the callers treat other values as no species: zero out, zero gradient)."""
    wrap = isinstance(x, e3nn.IrrepsArray)
    if wrap:
        if layout != "mul_ir":
            raise ValueError(f"an e3nn_jax.IrrepsArray is mul_ir: build the op with layout='mul_ir', not {layout!r}")
        if x.irreps.simplify() != irreps_in.simplify():
            raise ValueError(f"x has irreps {x.irreps}, expected {irreps_in}")
        x = x.array
    x, species = jnp.asarray(x), jnp.asarray(species)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {x.dtype}")
    if x.ndim == 0 or x.shape[-1] != irreps_in.dim:
        raise ValueError(f"x has shape {x.shape}; its last axis must be {irreps_in}.dim={irreps_in.dim}")
    if not jnp.issubdtype(species.dtype, jnp.integer):
        raise TypeError(f"species must be an integer array, got dtype {species.dtype}")
    if species.shape != x.shape[:-1]:
        raise ValueError(f"species has shape {species.shape}; expected x's leading dims {x.shape[:-1]}")
    try:
        values = np.asarray(species)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        values = None
    if values is not None and values.size and (values.min() < 0 or values.max() >= num_species):
        raise ValueError(f"species must lie in [0, {num_species}), got values in [{values.min()}, {values.max()}]")
    return x, species, wrap
