"""Data-parallel training: each batch split over devices, gradients summed with ``psum``.

A batch of structures (:func:`jequi.models.train.make_batches`' order) is cut into one
sub-batch per device, all padded to one shape (atoms, edges and structures) and stacked on a
leading device axis (:func:`sharded_batches`). :func:`train_step` runs inside ``jax.shard_map``:
each device differentiates its share of the loss, whose means are taken over the whole batch
(``psum`` of the structure and atom counts), and the gradients are ``psum``-ed; so the loss, the
metrics and the update equal the single-device step on the whole batch, to float rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .data import Batch, Structure, batch, structure_edges
from .mesh import AXIS, CHECK_VMA, device_mesh
from .nequip import NequIPConfig
from .loss import errors


def sharded_batches(structures: list[Structure], config: NequIPConfig, batch_size: int, devices: int) -> list[Batch]:
    """Batches of `batch_size` consecutive structures (as :func:`~jequi.models.train.make_batches`),
    each cut into `devices` sub-batches of consecutive structures (sizes differing by one at
    most) and stacked: every leaf has a leading axis of `devices`, and all batches share one shape
    (one compilation). A sub-batch may hold no structure (a batch smaller than `devices`)."""
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    edges = structure_edges(structures, config.cutoff)
    groups = []
    for start in range(0, len(structures), batch_size):
        ids = np.arange(start, min(start + batch_size, len(structures)))
        groups.append(np.array_split(ids, devices))
    n_node = max(1, max(sum(len(structures[i].numbers) for i in part) for parts in groups for part in parts))
    n_edge = max(1, max(sum(len(edges[i][0]) for i in part) for parts in groups for part in parts))
    num_graphs = -(-batch_size // devices)
    subs = []
    for parts in groups:
        for part in parts:
            b = batch([structures[i] for i in part], config, n_node, n_edge, [edges[i] for i in part], num_graphs)
            subs.append(dataclasses.replace(b, graph=dataclasses.replace(b.graph, edges_sorted=False)))
    subs = config.prepare_batches(subs)  # the model's graph form, one shape for all (E2Former: Neighbors)
    return [jax.tree.map(lambda *leaves: jnp.stack(leaves), *subs[i : i + devices]) for i in range(0, len(subs), devices)]


def sharded_loss_and_grad(params, config: NequIPConfig, b: Batch, energy_weight=1.0, force_weight=1.0):
    """Inside ``shard_map`` over :data:`~jequi.models.mesh.AXIS` (each leaf of `b` with a
    leading axis of one): ``(grads, metrics)`` of the whole batch's loss, summed over devices."""
    b = jax.tree.map(lambda a: a[0], b)
    num_graphs = jax.lax.psum(jnp.sum(b.num_atoms > 0), AXIS).astype(b.positions.dtype)
    num_atoms = jax.lax.psum(jnp.sum(b.node_mask), AXIS).astype(b.positions.dtype)
    params = jax.tree.map(lambda p: jax.lax.pcast(p, AXIS, to="varying"), params)  # this device's gradient
    grads, metrics = jax.grad(errors, has_aux=True)(params, config, b, energy_weight, force_weight, num_graphs, num_atoms)
    return jax.lax.psum((grads, metrics), AXIS)


def train_step(config: NequIPConfig, optimizer, mesh: Mesh | None = None, energy_weight: float = 1.0, force_weight: float = 1.0):
    """A jitted ``step(params, opt_state, stacked_batch) -> (params, opt_state, metrics)`` on
    `mesh` (default: all devices) for batches of :func:`sharded_batches` (:func:`put`): the optax
    update of :func:`jequi.models.train.train`'s step with the gradient summed over devices.
    Pass params and optimizer state :func:`replicate`-d (as the step returns them): an array's
    placement is part of the compiled function's key."""
    import optax

    mesh = device_mesh() if mesh is None else mesh

    def grads(params, b):
        return sharded_loss_and_grad(params, config, b, energy_weight, force_weight)

    sharded = jax.shard_map(grads, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=CHECK_VMA)

    @jax.jit
    def step(params, opt_state, b):
        g, metrics = sharded(params, b)
        updates, opt_state = optimizer.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return step


def replicate(tree, mesh: Mesh):
    """Every leaf of `tree` (parameters, optimizer state) copied to all devices of `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def put(b: Batch, mesh: Mesh) -> Batch:
    """A stacked batch with each device's sub-batch on its device."""
    if jax.tree.leaves(b)[0].shape[0] != mesh.devices.size:
        raise ValueError(f"the batch is split {jax.tree.leaves(b)[0].shape[0]} ways but the mesh has {mesh.devices.size} devices")
    return jax.device_put(b, NamedSharding(mesh, P(AXIS)))
