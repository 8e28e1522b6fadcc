"""Interatomic potentials built on jequi (see :mod:`jequi.models.nequip`)."""

from .calculator import JequiCalculator, bucket, neighbour_edges
from .distributed import ShardedCalculator
from .e2former import E2Former, E2FormerConfig, Neighbors, neighbor_list, neighbors_from_atoms, neighbors_from_graph
from .md import DeviceMD, ase_nve
from .nequip import (
    NequIP,
    NequIPConfig,
    atomic_energies,
    energy_and_forces,
    nequip_haiku,
)

__all__ = ["DeviceMD", "E2Former", "E2FormerConfig", "Neighbors", "neighbor_list", "neighbors_from_atoms", "neighbors_from_graph", "JequiCalculator", "NequIP", "ShardedCalculator", "ase_nve", "bucket", "neighbour_edges", "NequIPConfig", "atomic_energies", "energy_and_forces", "nequip_haiku"]
