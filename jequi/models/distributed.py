"""Energy, forces and stress of one structure split over several devices (spatial decomposition).

The host splits the structure (:mod:`jequi.models.decomposition`: regions, ghosts, padded
per-device arrays); the device side is one ``jax.shard_map`` over a 1-D mesh of the devices
(axis :data:`AXIS`). Inside it each device sends the positions of the atoms that other
devices read as ghosts (one ``jax.lax.ppermute`` per device offset), evaluates its atoms'
energies and differentiates them: the transpose of each ``ppermute`` returns the ghosts' force
contributions to their owners, so every device ends with the whole force on its own atoms, and
the energy and virial are ``psum``-ed. With the ``"exchange"`` scheme the same ``ppermute``-s
send the ghosts' features before every convolution (and their gradients back); with ``"halo"``
the ghosts reach ``num_layers`` cutoffs and the model runs without communication.

Entry points: :func:`sharded_energy_and_forces` (one call), :func:`split_atoms` +
:func:`evaluate` (the host and device halves), and :class:`ShardedCalculator` (an ase
calculator; molecular dynamics compiles once per size bucket).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from ase.calculators.calculator import Calculator, all_changes
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..atoms import exact_matmul
from ..graph import Graph
from .calculator import calculator_model, calculator_results, check_stress_request, load_model
from .data import neighbour_edges
from .decomposition import Decomposition, Layout, Shards, split
from .mesh import AXIS, CHECK_VMA, device_mesh, to_host
from .nequip import NequIPConfig



def exchange(layout: Layout, sends, values):
    """``values`` of this device's own rows ``(owned, ...)`` followed by its ghost rows, each
    block received from the device ``shift`` below (``ppermute``; inside ``shard_map``)."""
    blocks = [values]
    for shift, rows in zip(layout.shifts, sends):
        pairs = [(d, (d + shift) % layout.devices) for d in range(layout.devices)]
        blocks.append(jax.lax.ppermute(values[rows], AXIS, pairs))
    return jnp.concatenate(blocks)


def device_energy(config: NequIPConfig, layout: Layout, params, species, positions, cell, senders, receivers, shifts,
                  atom_mask, strain, send):  # fmt: skip
    """One device's energy and per-atom energies of its own atoms, at ``strain`` (positions and
    cell deformed by ``1 + strain``); ``send(values)`` appends the ghost rows to own rows (the
    ``ppermute`` exchange, or a local stand-in to time the computation alone)."""
    deform = jnp.eye(3, dtype=positions.dtype) + 0.5 * (strain + strain.T)
    local_positions = send(exact_matmul(positions, deform))
    graph = Graph.build(senders, receivers, layout.nodes, num_senders=layout.local, shifts=shifts)
    per_atom = config.energies(params, species, local_positions, graph, exact_matmul(cell, deform),
                               exchange=send if layout.scheme == "exchange" else None)  # fmt: skip
    per_atom = jnp.where(atom_mask, per_atom[: layout.owned], 0.0)
    return per_atom.sum(), per_atom


def _sharded(config: NequIPConfig, layout: Layout, params, species, positions, cell, senders, receivers, shifts, atom_mask, sends):
    """Inside ``shard_map``: this device's energy terms differentiated; energy and virial summed."""
    first = lambda a: a[0]  # noqa: E731  (each device holds a leading axis of one)
    species, positions, senders, receivers, shifts, atom_mask = map(first, (species, positions, senders, receivers, shifts, atom_mask))
    sends = tuple(map(first, sends))
    send = functools.partial(exchange, layout, sends)
    energy = functools.partial(device_energy, config, layout, params, species)
    strain = jax.lax.pcast(jnp.zeros((3, 3), positions.dtype), AXIS, to="varying")  # this device's share of the virial

    def total(positions, strain):
        return energy(positions, cell, senders, receivers, shifts, atom_mask, strain, send)

    (e, per_atom), (grad, virial) = jax.value_and_grad(total, argnums=(0, 1), has_aux=True)(positions, strain)
    return jax.lax.psum(e, AXIS), per_atom[None], -grad[None], jax.lax.psum(virial, AXIS)




def _evaluate(config: NequIPConfig, mesh: Mesh, layout: Layout, params, species, positions, cell, senders, receivers, shifts, atom_mask, sends):
    split_ = P(AXIS)
    fn = jax.shard_map(
        functools.partial(_sharded, config, layout),
        mesh=mesh,
        in_specs=(P(), split_, split_, P(), split_, split_, split_, split_, split_),
        out_specs=(P(), split_, split_, P()),
        check_vma=CHECK_VMA,
    )
    return fn(params, species, positions, cell, senders, receivers, shifts, atom_mask, sends)


@functools.lru_cache(maxsize=32)
def compiled(config: NequIPConfig, mesh: Mesh):
    """The jitted sharded evaluation for `config` on `mesh`: ``f(layout, params, *device_arrays(shards))
    -> (energy, per_atom (D, owned), forces (D, owned, 3), virial (3, 3))``; one compilation per
    :class:`Layout` (its cache size counts them)."""
    return jax.jit(functools.partial(_evaluate, config, mesh), static_argnums=0)


def device_arrays(shards: Shards, mesh: Mesh, dtype=jnp.float32) -> tuple:
    """The arrays :func:`compiled` takes after ``params``, each device's slice put on its device."""
    if mesh.devices.size != shards.layout.devices:
        raise ValueError(f"the shards are for {shards.layout.devices} devices but the mesh has {mesh.devices.size}")
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(AXIS)))  # noqa: E731
    return (
        put(shards.species), put(np.asarray(shards.positions, dtype)), jax.device_put(np.asarray(shards.cell, dtype), NamedSharding(mesh, P())),
        put(shards.senders), put(shards.receivers), put(np.asarray(shards.shifts, dtype)), put(shards.atom_mask),
        tuple(put(s) for s in shards.sends),
    )  # fmt: skip


def split_atoms(atoms, config: NequIPConfig, decomposition: Decomposition) -> Shards:
    """:func:`jequi.models.decomposition.split` of ase ``atoms`` with vesin's radius graph at
    ``config.cutoff`` (the same edges as :class:`~jequi.models.JequiCalculator`)."""
    senders, receivers, edge_shifts = neighbour_edges(atoms, config.cutoff)
    return split(atoms.positions, atoms.cell.array, atoms.pbc, config.species_index(atoms.numbers), senders, receivers,
                 edge_shifts, decomposition, config.num_layers)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Result:
    """A structure's ``energy`` (eV), per-atom ``energies`` ``(N,)``, ``forces`` ``(N, 3)``
    (eV/Å) and ``virial`` ``dE/d strain`` ``(3, 3)`` (eV), in the structure's atom order."""

    energy: float
    energies: np.ndarray
    forces: np.ndarray
    virial: np.ndarray


def evaluate(params, config: NequIPConfig, shards: Shards, mesh: Mesh | None = None, dtype=jnp.float32) -> Result:
    """Energy, per-atom energies, forces and virial of a split structure on ``mesh`` (default:
    the first ``shards.layout.devices`` devices), in ``dtype``. ``params``: the linen model's
    (``{"params": ...}``, as :class:`~jequi.models.JequiCalculator` takes) or the Haiku model's."""
    mesh = device_mesh(shards.layout.devices) if mesh is None else mesh
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
    energy, per_atom, forces, virial = compiled(config, mesh)(shards.layout, params, *device_arrays(shards, mesh, dtype))
    return Result(float(to_host(energy)), shards.gather(to_host(per_atom)).astype(np.float64),
                  shards.gather(to_host(forces)).astype(np.float64), to_host(virial).astype(np.float64))  # fmt: skip


def sharded_energy_and_forces(atoms, model="nequip-emt", devices: int | None = None, scheme: str = "exchange",
                              dtype="float32") -> tuple[float, np.ndarray]:  # fmt: skip
    """Energy (eV) and forces ``(N, 3)`` (eV/Å) of ase ``atoms`` with the model split over
    `devices` devices (None: all JAX sees) by the `scheme` of
    :mod:`jequi.models.decomposition`; equal to the single-device result. ``model``: as
    :class:`~jequi.models.JequiCalculator`'s."""
    params, config = load_model(model)
    mesh = device_mesh(devices)
    shards = split_atoms(atoms, config, Decomposition(mesh.devices.size, scheme))
    result = evaluate(params, config, shards, mesh, jnp.dtype(dtype))
    return result.energy, result.forces


class ShardedCalculator(Calculator):
    """ASE calculator of a jequi NequIP-style potential with each structure split over devices.

    ``model``, ``backend``, ``dtype``: as :class:`~jequi.models.JequiCalculator`'s;
    ``devices``: how many (None: all JAX sees); ``scheme``: ``"exchange"`` (default) or
    ``"halo"``; ``grid``: regions along the cell axes (None: chosen per structure); ``growth``,
    ``min_atoms``, ``min_edges``: the per-device size buckets. Properties: ``energy``,
    ``free_energy``, ``energies``, ``forces``, ``stress`` (cells periodic in 3 directions).
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(self, model="nequip-emt", devices: int | None = None, scheme: str = "exchange", grid=None, backend=None,
                 dtype="float32", growth: float = 1.25, min_atoms: int = 8, min_edges: int = 64, precision: str | None = None,
                 **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        self.params, self.config, self.dtype = calculator_model(model, backend, dtype, precision)
        self.mesh = device_mesh(devices)
        self.decomposition = Decomposition(self.mesh.devices.size, scheme, grid, growth, min_atoms, min_edges)
        # shared by the calculators of one model and mesh: its cache holds one entry per layout
        self.compiled = compiled(self.config, self.mesh)
        self.shards = None

    @property
    def compilations(self) -> int:
        """How many layouts (size buckets; and dtypes) the evaluation of this model on this mesh
        has been compiled for, by this calculator and any other of the same model and mesh."""
        return self.compiled._cache_size()

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        check_stress_request(atoms, properties)
        self.shards = shards = split_atoms(atoms, self.config, self.decomposition)
        energy, per_atom, forces, virial = self.compiled(shards.layout, self.params, *device_arrays(shards, self.mesh, self.dtype))
        self.results = calculator_results(atoms, to_host(energy), shards.gather(to_host(per_atom)), shards.gather(to_host(forces)), to_host(virial))
