"""Interatomic potentials built on jequi: :mod:`jequi.models.nequip`, :mod:`jequi.models.mace`,
:mod:`jequi.models.nequix`, :mod:`jequi.models.e2former`."""

from .calculator import JequiCalculator
from .data import bucket, neighbour_edges
from .distributed import ShardedCalculator
from .e2former import E2Former, E2FormerConfig, Neighbors, neighbor_list, neighbors_from_atoms, neighbors_from_graph
from .mace import MACE, MACEConfig, from_mace_jax, from_mace_torch
from .md import DeviceMD, ase_nve
from .nequix import Nequix, NequixConfig, read_nqx, write_nqx
from .nequip import (
    NequIP,
    NequIPConfig,
    atomic_energies,
    energy_and_forces,
    nequip_haiku,
)

__all__ = ["DeviceMD", "E2Former", "E2FormerConfig", "Neighbors", "neighbor_list", "neighbors_from_atoms", "neighbors_from_graph", "JequiCalculator", "MACE", "MACEConfig", "NequIP", "ShardedCalculator", "ase_nve", "bucket", "neighbour_edges", "NequIPConfig", "atomic_energies", "energy_and_forces", "nequip_haiku", "from_mace_jax", "from_mace_torch", "Nequix", "NequixConfig", "read_nqx", "write_nqx"]
