"""An ASE calculator for the NequIP-style potential: energy, forces, stress, per-atom energies.

:class:`JequiCalculator` builds each structure's radius graph on the host with vesin's
neighbour list (the fastest of ase, matscipy and vesin on this project's CPU at 1k-100k atoms:
``benchmarks/results/2026-11-27-cpu-neighbour-lists.md``), pads atoms and edges up to
geometric size buckets, and evaluates energy, forces and the strain derivative in one jitted
call. Padding to buckets is what keeps molecular dynamics from recompiling at every step: the
neighbour count changes as atoms move, but a new compilation happens only when it leaves its
bucket (``growth`` apart, so a few times over a long run at most).

Stress is the strain derivative of the energy divided by the volume, ``sigma = (1/V) dE/d eps``
with positions and cell deformed by ``(1 + eps)`` (ase's convention and units, eV/Å^3, Voigt
order ``xx yy zz yz xz xy``); it exists for cells periodic in all three directions only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from ase.calculators.calculator import Calculator, PropertyNotImplementedError, all_changes

from ..atoms import exact_matmul
from ..graph import Graph
from .data import bucket, neighbour_edges
from .nequip import NequIPConfig
from .precision import with_precision


def load_model(model):
    """``(params, config)`` of `model`:

    - a shipped name: ``"nequip-emt"`` (jequi's EMT-trained NequIP), or ``"nequix-mp-1"`` /
      ``"nequix-oam-1"`` (the Nequix foundation models, ``jequi/models/weights/*.md``);
    - a Nequix checkpoint's path (``*.nqx``, :func:`jequi.models.nequix.read_nqx`);
    - a directory holding ``<name>.msgpack`` and ``<name>.json`` (``"path/to/dir"`` or
      ``"path/to/dir/name"``);
    - a ``(params, config)`` pair of any model with the ``config.energies`` interface.
    """
    from . import pretrained

    if isinstance(model, tuple) and len(model) == 2 and hasattr(model[1], "energies"):
        return model
    if isinstance(model, (str, pathlib.Path)):
        return pretrained.load_any(model)
    raise TypeError(f"model must be a shipped name, a path or a (params, config) pair (NequIPConfig, MACEConfig, NequixConfig), "
                    f"got {type(model).__name__}")  # fmt: skip


def _evaluate(config: NequIPConfig, params, species, positions, cell, senders, receivers, shifts, node_mask):
    """Total energy, per-atom energies, forces and ``dE/d eps`` (the strain derivative) of one
    padded structure; padding atoms (``node_mask`` False) and edges (index -1) add nothing."""
    graph = Graph.build(senders, receivers, positions.shape[0], shifts=shifts)

    def energy(positions, strain):
        deform = jnp.eye(3, dtype=positions.dtype) + 0.5 * (strain + strain.T)
        per_atom = config.energies(params, species, exact_matmul(positions, deform), graph, exact_matmul(cell, deform))
        per_atom = jnp.where(node_mask, per_atom, 0.0)
        return per_atom.sum(), per_atom

    (total, per_atom), (grad, virial) = jax.value_and_grad(energy, argnums=(0, 1), has_aux=True)(
        positions, jnp.zeros((3, 3), positions.dtype)
    )
    return total, per_atom, -grad, virial


def _hessian(config, params, species, positions, cell, senders, receivers, shifts, node_mask):
    """``(n, n, 3, 3)`` second derivatives of the energy in the positions of one padded
    structure: forward mode over the forces (``jax.linearize`` of the gradient, then one
    Hessian-vector product per Cartesian coordinate), as Nequix's ``hessian_linearized``."""
    graph = Graph.build(senders, receivers, positions.shape[0], shifts=shifts)

    def energy(positions):
        return jnp.where(node_mask, config.energies(params, species, positions, graph, cell), 0.0).sum()

    _, hvp = jax.linearize(jax.grad(energy), positions)
    n = positions.shape[0]
    basis = jnp.eye(3 * n, dtype=positions.dtype).reshape(3 * n, n, 3)
    return jax.lax.map(hvp, basis).reshape(n, 3, n, 3).swapaxes(1, 2)


class JequiCalculator(Calculator):
    """ASE calculator of a jequi potential (NequIP-style, MACE, Nequix).

    ``model``: ``"nequip-emt"`` (shipped, see ``jequi/models/weights/nequip-emt.md``), a saved
    model's path, or ``(params, config)`` of any model with the ``config.energies`` interface
    (:class:`~jequi.models.NequIPConfig`, :class:`~jequi.models.MACEConfig`, e.g. from
    :func:`~jequi.models.from_mace_torch`). ``backend``: jequi backend of the convolutions (None:
    the fastest available). ``dtype``: ``"float32"`` or ``"float64"`` (needs
    ``jax_enable_x64``). ``growth`` / ``min_atoms`` / ``min_edges``: the size buckets atoms and
    edges are padded to (:func:`bucket`). Properties: ``energy``, ``free_energy`` (the same:
    no electronic entropy), ``energies`` (per atom), ``forces``, ``stress`` (periodic cells);
    :meth:`get_hessian` for phonons.
    """

    implemented_properties = ["energy", "free_energy", "energies", "forces", "stress"]

    def __init__(self, model="nequip-emt", backend=None, dtype="float32", growth: float = 1.25,
                 min_atoms: int = 8, min_edges: int = 64, precision: str | None = None, **kwargs):  # fmt: skip
        super().__init__(**kwargs)
        self.params, self.config, self.dtype = calculator_model(model, backend, dtype, precision)
        config = self.config
        self.growth, self.min_atoms, self.min_edges = growth, min_atoms, min_edges
        # one jitted function per calculator: its cache holds one entry per (atom, edge) bucket
        self.compiled = jax.jit(functools.partial(_evaluate, config))
        self._hessian = None  # compiled on the first get_hessian

    @property
    def compilations(self) -> int:
        """How many shapes the evaluation has been compiled for (one per bucket visited)."""
        return self.compiled._cache_size()

    def padded_inputs(self, atoms):
        """The jitted function's arguments for `atoms`: species, positions, cell, senders,
        receivers, shifts and the node mask, padded to their buckets."""
        n = len(atoms)
        senders, receivers, shifts = neighbour_edges(atoms, self.config.cutoff)
        n_pad, e_pad = bucket(n, self.min_atoms, self.growth), bucket(len(senders), self.min_edges, self.growth)
        species = np.zeros(n_pad, np.int32)
        species[:n] = self.config.species_index(atoms.numbers)
        positions = np.zeros((n_pad, 3))
        positions[:n] = atoms.positions
        pad = e_pad - len(senders)
        senders = np.concatenate([senders, np.full(pad, -1, np.int32)])
        receivers = np.concatenate([receivers, np.full(pad, -1, np.int32)])
        shifts = np.concatenate([shifts, np.zeros((pad, 3))])
        dt = self.dtype
        return (
            jnp.asarray(species), jnp.asarray(positions, dt), jnp.asarray(atoms.cell.array, dt),
            jnp.asarray(senders), jnp.asarray(receivers), jnp.asarray(shifts, dt), jnp.asarray(np.arange(n_pad) < n),
        )  # fmt: skip

    def get_hessian(self, atoms=None) -> np.ndarray:
        """The Hessian ``d2E / dx_i dx_j`` of `atoms` (default: the last structure), shape
        ``(n, n, 3, 3)`` in eV/Å^2, for phonons (:func:`_hessian`: forward mode over the forces,
        one jitted call; the padding atoms' rows are computed and dropped)."""
        if atoms is None:
            if self.atoms is None:
                raise ValueError("get_hessian needs atoms: none given and none calculated yet")
            atoms = self.atoms
        if self._hessian is None:
            self._hessian = jax.jit(functools.partial(_hessian, self.config))
        n = len(atoms)
        return np.asarray(self._hessian(self.params, *self.padded_inputs(atoms))[:n, :n], np.float64)

    def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
        super().calculate(atoms, properties, system_changes)
        atoms = self.atoms
        check_stress_request(atoms, properties)
        n = len(atoms)
        total, per_atom, forces, virial = self.compiled(self.params, *self.padded_inputs(atoms))
        self.results = calculator_results(atoms, total, np.asarray(per_atom[:n]), np.asarray(forces[:n]), virial)


def calculator_model(model, backend, dtype, precision: str | None = None):
    """``(params, config, dtype)`` of a calculator: :func:`load_model`'s, the params cast to
    `dtype` (float32, or float64 under ``jax_enable_x64``), `backend` and the precision policy
    `precision` (:mod:`jequi.models.precision`) set on the config (None keeps the model's)."""
    params, config = load_model(model)
    config = with_precision(config, precision)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.float32, jnp.float64):
        raise ValueError(f"dtype must be float32 or float64, got {dtype!r}")
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("dtype float64 needs jax.config.update('jax_enable_x64', True) first")
    if dtype == jnp.float64 and getattr(config, "precision", "float32") != "float32":
        raise ValueError(f"precision={config.precision!r} trades float32's accuracy for speed; a float64 model runs precision='float32'")
    if backend is not None:
        config = dataclasses.replace(config, backend=backend)
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), params), config, dtype


def check_stress_request(atoms, properties) -> None:
    """A clear error where stress is asked of a structure not periodic in all three directions."""
    if "stress" in properties and not np.all(atoms.pbc):
        raise PropertyNotImplementedError(f"stress needs a cell periodic in all three directions; this structure has pbc={atoms.pbc.tolist()}")


def calculator_results(atoms, energy, per_atom, forces, virial) -> dict:
    """ASE's results of one evaluation (float64): energy, free energy (the same: no electronic
    entropy), per-atom energies, forces and, for periodic cells, the Voigt stress virial / volume."""
    energy = float(energy)
    results = {"energy": energy, "free_energy": energy, "energies": np.asarray(per_atom, np.float64), "forces": np.asarray(forces, np.float64)}
    if np.all(atoms.pbc):
        stress = np.asarray(virial, np.float64) / atoms.get_volume()
        results["stress"] = stress.flat[[0, 4, 8, 5, 2, 1]]
    return results
