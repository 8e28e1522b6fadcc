"""Interatomic potentials built on jequi (see :mod:`jequi.models.nequip`)."""

from .calculator import JequiCalculator, bucket, neighbour_edges
from .distributed import ShardedCalculator
from .md import DeviceMD, ase_nve
from .nequip import (
    NequIP,
    NequIPConfig,
    atomic_energies,
    energy_and_forces,
    nequip_haiku,
)

__all__ = ["DeviceMD", "JequiCalculator", "NequIP", "ShardedCalculator", "ase_nve", "bucket", "neighbour_edges", "NequIPConfig", "atomic_energies", "energy_and_forces", "nequip_haiku"]
