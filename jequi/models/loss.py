"""A model's energies and forces on a batch and the training loss on them: what single-device
training (:mod:`jequi.models.train`) and data-parallel training
(:mod:`jequi.models.data_parallel`) share, below both."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .data import Batch
from .nequip import NequIPConfig


def predict(params, config: NequIPConfig, b: Batch):
    """Per-structure energies ``(num_graphs,)`` and forces ``(n_node, 3)`` of a batch."""
    model = config.module()
    num_graphs = b.energy.shape[0]

    def total(positions):
        e = jnp.where(b.node_mask, model.apply(params, b.species, positions, b.graph, b.cell), 0.0)
        return e.sum(), e

    (_, per_atom), grad = jax.value_and_grad(total, has_aux=True)(b.positions)
    energies = jax.ops.segment_sum(per_atom, b.node_graph, num_graphs + 1)[:num_graphs]
    return energies, -grad


def errors(params, config, b: Batch, energy_weight: float = 1.0, force_weight: float = 1.0, num_graphs=None, num_atoms=None):
    """``(loss, metrics)``: weighted MSE of energy per atom and force components; MAEs. Padding
    structures (``num_atoms == 0``, :func:`~jequi.models.data.batch`'s ``n_graph``) count for
    nothing. The means divide by `num_graphs` structures and `num_atoms` atoms, by default the
    batch's own; data-parallel training passes the whole batch's, so that the devices' losses sum
    to it (:mod:`jequi.models.data_parallel`)."""
    energies, forces = predict(params, config, b)
    real = b.num_atoms > 0
    de = jnp.where(real, (energies - b.energy) / jnp.where(real, b.num_atoms, 1), 0.0)
    df = (forces - b.forces) * b.node_mask[:, None]
    num_graphs = jnp.sum(real) if num_graphs is None else num_graphs
    n = 3 * (jnp.sum(b.node_mask) if num_atoms is None else num_atoms)
    loss = energy_weight * jnp.sum(de**2) / num_graphs + force_weight * jnp.sum(df**2) / n
    return loss, {"loss": loss, "energy_mae": jnp.sum(jnp.abs(de)) / num_graphs, "force_mae": jnp.sum(jnp.abs(df)) / n}
