"""The interface every architecture's config meets, so that training, the calculator, MD and
sharding take any model without knowing which it is (:class:`Architecture`), and the defaults
the radius-graph models share (:class:`RadiusGraphModel`).

An architecture is a frozen config dataclass with ``species``, ``cutoff`` and ``backend``
fields and the methods of :class:`Architecture`; its parameters are a pytree its methods
read. tests/test_models.py checks that every shipped architecture meets it."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import jax.numpy as jnp
import numpy as np


@runtime_checkable
class Architecture(Protocol):
    species: tuple
    cutoff: float
    backend: str | None

    def species_index(self, numbers) -> np.ndarray:
        """Atomic numbers -> indices into ``species`` (ValueError for unknown elements)."""

    def module(self):
        """The Flax module whose ``apply(params, species, positions, graph, cell)`` gives per-atom
        energies: what training differentiates."""

    def init_params(self, key, species, positions, graph, cell=None):
        """Fresh parameters (the shapes from one batch's arrays where the model needs them)."""

    def with_species_energies(self, params, energies):
        """`params` with the per-species reference energies set (``(len(species),)``; the
        least-squares fit training starts from)."""

    def prepare_batches(self, batches):
        """Training batches in the model's own graph form (the identity for a radius graph)."""

    def energies(self, params, species, positions, graph, cell=None, exchange=None):
        """Per-atom energies on a :class:`jequi.Graph` (and a halo ``exchange`` where sharded):
        what the calculator, MD and sharding call."""


class RadiusGraphModel:
    """The defaults of the models that run on a radius :class:`jequi.Graph`."""

    def prepare_batches(self, batches):
        return batches


def with_species_shift(params, energies):
    """Linen ``{"params": ...}`` with its ``species_shift`` parameter set to `energies`, in that
    parameter's dtype (NequIP's and E2Former's per-species energies)."""
    shift = jnp.asarray(energies, params["params"]["species_shift"].dtype)
    return {"params": {**params["params"], "species_shift": shift}}
