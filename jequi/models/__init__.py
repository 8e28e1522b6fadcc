"""Interatomic potentials built on jequi (see :mod:`jequi.models.nequip`)."""

from .nequip import (
    NequIP,
    NequIPConfig,
    atomic_energies,
    energy_and_forces,
    nequip_haiku,
)

__all__ = ["NequIP", "NequIPConfig", "atomic_energies", "energy_and_forces", "nequip_haiku"]
