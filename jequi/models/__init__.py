"""Interatomic potentials built on jequi (see :mod:`jequi.models.nequip`)."""

from .nequip import NequIPConfig, atomic_energies, energy_and_forces, nequip_haiku

try:
    from .nequip import NequIP
except ImportError:  # pragma: no cover - flax not installed
    pass

__all__ = ["NequIP", "NequIPConfig", "atomic_energies", "energy_and_forces", "nequip_haiku"]
