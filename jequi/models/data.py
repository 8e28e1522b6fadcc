"""Training data made from real physics offline, and batching of structures into one graph.

Structures are built with ase (perturbed bulk crystals and alloys, surfaces, clusters) and
labelled with ase's EMT calculator (effective-medium theory for Al, Ni, Cu, Pd, Ag, Pt, Au
and their alloys): no downloads. Any ase-readable file with energies and forces works too
(:func:`read`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..atoms import radius_edges
from ..graph import Graph


def neighbour_edges(atoms, cutoff: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Radius-graph edges of `atoms` from vesin: ``(senders, receivers, shifts)`` with an edge
    ``j -> i`` for every neighbour ``j`` of ``i`` within `cutoff` (Å), periodic images included,
    and integer cell shifts ``S`` so that the edge vector is ``pos[j] - pos[i] + S @ cell``
    (the convention of :func:`jequi.atoms.radius_edges`, which uses ase's slower list)."""
    from vesin import NeighborList

    if not cutoff > 0:
        raise ValueError(f"cutoff must be positive, got {cutoff!r}")
    pbc = np.asarray(atoms.pbc, bool)
    cell = np.asarray(atoms.cell.array, np.float64)
    if pbc.any() and np.linalg.matrix_rank(cell[pbc]) < pbc.sum():
        raise ValueError(f"periodic directions {pbc.tolist()} need a non-degenerate cell, got {cell.tolist()}")
    i, j, shifts = NeighborList(cutoff=float(cutoff), full_list=True).compute(
        points=np.asarray(atoms.positions, np.float64), box=cell, periodic=pbc.tolist(), quantities="ijS"
    )
    return j.astype(np.int32), i.astype(np.int32), shifts.astype(np.float64)


def bucket(n: int, minimum: int = 16, growth: float = 1.25) -> int:
    """The smallest size of the geometric sequence ``minimum, ceil(minimum * growth), ...`` that
    is at least `n`: arrays padded to it compile once per bucket, not once per size."""
    if growth <= 1:
        raise ValueError(f"growth must be > 1, got {growth!r}")
    size = max(1, int(minimum))
    while size < n:
        size = max(size + 1, math.ceil(size * growth))
    return size

EMT_METALS = ("Al", "Ni", "Cu", "Pd", "Ag", "Pt", "Au")


@dataclasses.dataclass(frozen=True)
class Structure:
    """One labelled structure (numpy arrays; ``energy`` in eV, ``forces`` in eV/Å)."""

    numbers: np.ndarray
    positions: np.ndarray
    cell: np.ndarray
    pbc: np.ndarray
    energy: float
    forces: np.ndarray

    def to_atoms(self):
        from ase import Atoms

        return Atoms(self.numbers, positions=self.positions, cell=self.cell, pbc=self.pbc)

    @classmethod
    def from_atoms(cls, atoms, energy=None, forces=None) -> Structure:
        """From ase ``Atoms``; labels from its calculator unless given."""
        if energy is None:
            energy = atoms.get_potential_energy()
        if forces is None:
            forces = atoms.get_forces()
        return cls(
            np.asarray(atoms.numbers), np.asarray(atoms.positions, float), np.asarray(atoms.cell.array, float),
            np.asarray(atoms.pbc), float(energy), np.asarray(forces, float),
        )  # fmt: skip


def _random_structure(rng: np.random.Generator, large: bool = False):
    from ase.build import bulk, fcc111
    from ase.cluster import Icosahedron
    from ase.data import atomic_numbers

    a, b = rng.choice(EMT_METALS, 2, replace=False)
    kind = rng.choice(["bulk", "bulk", "alloy", "vacancy", "surface", "cluster"])
    if kind == "cluster":
        atoms = Icosahedron(str(a), 3 if large else 2)
        atoms.center(vacuum=6.0)
    elif kind == "surface":
        atoms = fcc111(str(a), (3, 3, 4) if large else (2, 2, 3), vacuum=6.0)
    else:
        atoms = bulk(str(a), "fcc", cubic=True).repeat((3, 3, 3) if large else (2, 2, 2))
        atoms.set_cell(atoms.cell * (1 + rng.uniform(-0.04, 0.04)), scale_atoms=True)
        if kind == "vacancy":
            del atoms[int(rng.integers(len(atoms)))]
    if kind in ("alloy", "surface", "cluster"):
        mask = rng.random(len(atoms)) < rng.uniform(0.1, 0.5)
        atoms.numbers[mask] = atomic_numbers[str(b)]
    atoms.positions += rng.normal(0, rng.uniform(0.03, 0.15), atoms.positions.shape)
    return atoms


def _emt_label(atoms) -> Structure:
    from ase.calculators.emt import EMT

    atoms.calc = EMT()
    return Structure.from_atoms(atoms)


def emt_dataset(n: int, seed: int = 0, large: bool = False, workers: int = 1) -> list[Structure]:
    """`n` random perturbed metal structures (bulk, alloys, vacancies, (111) surfaces,
    icosahedral clusters; 12-32 atoms) labelled by ase's EMT calculator. ``large=True``: the
    same kinds in larger cells (3x3x3 cubic bulk cells, 108 atoms; 3x3x4 surface slabs; 55-atom
    icosahedra), to test a model on cells larger than those it was trained on. `workers` > 1
    labels in that many spawned processes (the structures, drawn in order, are the same)."""
    rng = np.random.default_rng(seed)
    structures = [_random_structure(rng, large) for _ in range(n)]
    if workers <= 1 or n < 2 * workers:
        return [_emt_label(a) for a in structures]
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_emt_label, structures, chunksize=max(1, n // (4 * workers))))


def read(path: str, index=":") -> list[Structure]:
    """Labelled structures from any ase-readable file (extxyz, ...)."""
    import ase.io

    images = ase.io.read(path, index=index)
    return [Structure.from_atoms(a) for a in (images if isinstance(images, list) else [images])]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """Structures padded into one graph (jraph style). Padding nodes have ``node_mask``
    False and no edges; padding edges are dropped by the convolution (out-of-range indices).
    Edge shifts are Cartesian (``cell`` is the identity), so structures with different
    cells share one graph."""

    species: jnp.ndarray  # (n_node,) indices into the model's species (0 for padding)
    positions: jnp.ndarray  # (n_node, 3)
    graph: Graph
    cell: jnp.ndarray  # identity
    node_graph: jnp.ndarray  # (n_node,) structure index (num_graphs for padding)
    node_mask: jnp.ndarray  # (n_node,)
    num_atoms: jnp.ndarray  # (num_graphs,)
    energy: jnp.ndarray  # (num_graphs,)
    forces: jnp.ndarray  # (n_node, 3)


def structure_edges(structures: list[Structure], cutoff: float) -> list[tuple]:
    """Each structure's radius-graph edges ``(senders, receivers, shifts)`` as host arrays:
    vesin's neighbour list (:func:`neighbour_edges`, ~50x faster on
    small cells), or ase's (:func:`jequi.atoms.radius_edges`, the same edges) where vesin is
    not installed (a GPU image without it)."""
    import importlib.util


    edges = neighbour_edges if importlib.util.find_spec("vesin") else radius_edges
    return [edges(s.to_atoms(), cutoff) for s in structures]


def batch(
    structures: list[Structure], config, n_node: int | None = None, n_edge: int | None = None, edges=None,
    n_graph: int | None = None,
) -> Batch:
    """Concatenate `structures` into one padded graph of `n_node` nodes and `n_edge` edges
    (default: exactly what they need), for a model with `config` (cutoff and species).
    `edges`: their :func:`structure_edges` at ``config.cutoff``, when already built.
    `n_graph`: structure slots (default: ``len(structures)``); the extra ones are padding
    structures with no atoms and zero energy, so a smaller batch keeps the shape of the others
    (the training step compiles once) and the loss skips them (``num_atoms == 0``)."""
    if edges is None:
        edges = structure_edges(structures, config.cutoff)
    senders, receivers, shifts, offset = [], [], [], 0
    for s, (snd, rcv, shift) in zip(structures, edges):
        senders.append(snd + offset)
        receivers.append(rcv + offset)
        shifts.append(shift @ s.cell)
        offset += len(s.numbers)
    senders, receivers, shifts = (np.concatenate(a) if a else np.zeros((0,)) for a in (senders, receivers, shifts))
    n_node = offset if n_node is None else n_node
    n_edge = len(senders) if n_edge is None else n_edge
    n_graph = len(structures) if n_graph is None else n_graph
    if offset > n_node or len(senders) > n_edge or len(structures) > n_graph:
        raise ValueError(
            f"the structures need {offset} nodes, {len(senders)} edges and {len(structures)} structure slots; "
            f"the batch has {n_node}, {n_edge}, {n_graph}"
        )
    pad_g = n_graph - len(structures)
    pad_e = n_edge - len(senders)
    senders = np.concatenate([senders, -np.ones(pad_e)]).astype(np.int32)
    receivers = np.concatenate([receivers, -np.ones(pad_e)]).astype(np.int32)
    shifts = np.concatenate([shifts.reshape(-1, 3), np.zeros((pad_e, 3))])
    pad_n = n_node - offset
    positions = np.concatenate([s.positions for s in structures] + [np.zeros((pad_n, 3))])
    species = np.concatenate([config.species_index(s.numbers) for s in structures] + [np.zeros(pad_n, np.int32)])
    # padding nodes belong to no structure: index n_graph is dropped by the per-structure sums
    node_graph = np.concatenate([np.full(len(s.numbers), i) for i, s in enumerate(structures)] + [np.full(pad_n, n_graph)])
    forces = np.concatenate([s.forces for s in structures] + [np.zeros((pad_n, 3))])
    return Batch(
        species=jnp.asarray(species),
        positions=jnp.asarray(positions),
        graph=Graph.build(senders, receivers, n_node, shifts=shifts),
        cell=jnp.eye(3),
        node_graph=jnp.asarray(node_graph, jnp.int32),
        node_mask=jnp.asarray(np.arange(n_node) < offset),
        num_atoms=jnp.asarray([len(s.numbers) for s in structures] + [0] * pad_g),
        energy=jnp.asarray([s.energy for s in structures] + [0.0] * pad_g),
        forces=jnp.asarray(forces),
    )
