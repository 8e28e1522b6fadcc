"""Molecular dynamics with the NequIP-style potential: through ase, and on the device.

* :func:`ase_nve`: ase's velocity Verlet with :class:`~jequi.models.JequiCalculator` (the
  neighbour list on the host at every step; what the main job runs).
* :class:`DeviceMD`: velocity Verlet in ``lax.scan`` that stays on the accelerator for a whole
  run. Every ``rebuild_every`` steps the neighbour list is rebuilt inside the scan from a cell
  list (cells at least ``cutoff + skin`` wide, at least 3 a side, so each atom's candidates are
  the 27 cells around it), kept to a fixed capacity per cell and per atom. Edges up to
  ``cutoff + skin`` are kept (the model's envelope is zero past the cutoff, so the extra ones
  add nothing). After the scan three flags are read: a cell or an atom over its capacity, or an
  atom that moved more than ``skin / 2`` between rebuilds; the run is then repeated from its
  start with larger capacities (or raises, for the skin: use a larger one).

Units are ase's (Å, eV, amu, ``ase.units.fs``), so both paths integrate the same equations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..atoms import exact_matmul
from ..graph import Graph
from .calculator import load_model
from .nequip import NequIPConfig
from .precision import with_precision


def thermalize(atoms, temperature_K: float, seed: int = 0):
    """Maxwell-Boltzmann velocities at `temperature_K` (seeded), total momentum removed."""
    from ase.md import velocitydistribution as vd

    rng = np.random.default_rng(seed)
    if hasattr(vd, "thermalize_momenta"):  # ase >= 3.29 (MaxwellBoltzmannDistribution deprecated)
        vd.thermalize_momenta(atoms, temperature_K, rng=rng)
    else:
        vd.MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=rng)
    vd.Stationary(atoms)


def ase_nve(atoms, calculator, steps: int, timestep_fs: float = 1.0, temperature_K: float | None = 300.0, seed: int = 0):
    """Run `steps` of ase's velocity Verlet on a copy of `atoms` with `calculator`; velocities
    from a Maxwell-Boltzmann distribution at `temperature_K` (None: keep the atoms' own).

    Returns a dict: ``total_energy`` (eV, per step, the first before any step), ``steps_per_s``
    (after the first step, which may compile), ``drift_meV_per_atom`` (last minus first total
    energy per atom), ``max_deviation_meV_per_atom`` and the final ``atoms``."""
    from ase import units
    from ase.md.verlet import VelocityVerlet

    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    atoms = atoms.copy()
    atoms.calc = calculator
    if temperature_K is not None:
        thermalize(atoms, temperature_K, seed)
    dyn = VelocityVerlet(atoms, timestep=timestep_fs * units.fs)
    energies = [atoms.get_potential_energy() + atoms.get_kinetic_energy()]
    dyn.run(1)
    energies.append(atoms.get_potential_energy() + atoms.get_kinetic_energy())
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        dyn.run(1)
        energies.append(atoms.get_potential_energy() + atoms.get_kinetic_energy())
    seconds = time.perf_counter() - t0
    e = np.asarray(energies)
    return {
        "total_energy": e,
        "steps_per_s": (steps - 1) / seconds if steps > 1 else float("nan"),
        "drift_meV_per_atom": 1e3 * (e[-1] - e[0]) / len(atoms),
        "max_deviation_meV_per_atom": 1e3 * np.abs(e - e[0]).max() / len(atoms),
        "atoms": atoms,
    }


# --- the on-device loop ----------------------------------------------------------------------
_OFFSETS = np.array([(a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1)], np.int32)


@dataclasses.dataclass(frozen=True)
class CellList:
    """Static shape of the on-device neighbour search: ``dims`` cells a side, at most
    ``cell_capacity`` atoms a cell and ``neighbour_capacity`` neighbours an atom within
    ``radius`` (= cutoff + skin, Å)."""

    dims: tuple[int, int, int]
    cell_capacity: int
    neighbour_capacity: int
    radius: float


def cell_list_for(positions, cell, radius: float, margin: float = 1.3) -> CellList:
    """A :class:`CellList` sized from the current positions, with `margin` to spare."""
    cell = np.asarray(cell, np.float64)
    volume = abs(np.linalg.det(cell))
    heights = volume / np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)
    dims = tuple(int(d) for d in np.floor(heights / radius))
    if min(dims) < 3:
        raise ValueError(
            f"the on-device cell list needs a cell at least 3 x (cutoff + skin) = {3 * radius:.2f} Å across in every "
            f"direction; this one is {np.round(heights, 2).tolist()} Å (repeat the structure, or use JequiCalculator)"
        )
    frac = np.asarray(positions) @ np.linalg.inv(cell)
    idx = np.clip(np.floor((frac - np.floor(frac)) * dims).astype(int), 0, np.array(dims) - 1)
    counts = np.bincount((idx[:, 0] * dims[1] + idx[:, 1]) * dims[2] + idx[:, 2], minlength=math.prod(dims))
    density = len(positions) / volume
    neighbours = 4 / 3 * math.pi * radius**3 * density
    return CellList(dims, int(math.ceil(counts.max() * margin)) + 2, int(math.ceil(neighbours * margin)) + 4, float(radius))


def neighbour_graph(positions, cell, cl: CellList):
    """Edges ``j -> i`` for every pair within ``cl.radius`` (periodic, minimum image), built
    on the device from a cell list: ``(graph, overflow)``; the graph has ``N *
    neighbour_capacity`` edge slots (unused ones dropped) and integer ``shifts``; `overflow` is
    True when a cell or an atom held more than its capacity (then pairs are missing)."""
    n = positions.shape[0]
    dims = jnp.asarray(cl.dims, jnp.int32)
    num_cells = math.prod(cl.dims)
    frac = exact_matmul(positions, jnp.linalg.inv(cell))
    cell_idx = jnp.clip(jnp.floor((frac - jnp.floor(frac)) * dims).astype(jnp.int32), 0, dims - 1)
    flat = lambda c: (c[..., 0] * cl.dims[1] + c[..., 1]) * cl.dims[2] + c[..., 2]  # noqa: E731
    cid = flat(cell_idx)
    order = jnp.argsort(cid).astype(jnp.int32)
    sorted_cid = cid[order]
    counts = jnp.bincount(cid, length=num_cells)
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(n, dtype=jnp.int32) - starts[sorted_cid]
    table = jnp.full((num_cells, cl.cell_capacity), -1, jnp.int32).at[sorted_cid, rank].set(order, mode="drop")
    around = flat((cell_idx[:, None, :] + jnp.asarray(_OFFSETS)[None]) % dims)  # (N, 27), distinct when dims >= 3
    cand = table[around].reshape(n, -1)  # (N, 27 * cell_capacity), -1 for empty slots
    ds = frac[jnp.maximum(cand, 0)] - frac[:, None, :]
    shift = -jnp.round(ds)  # unique image: |ds + shift| <= radius / height <= 1/3 per direction
    d = exact_matmul(ds + shift, cell)
    ok = (cand >= 0) & (cand != jnp.arange(n)[:, None]) & (jnp.sum(d * d, axis=-1) < cl.radius**2)
    count = ok.sum(axis=1)
    _, pick = jax.lax.top_k(ok.astype(jnp.int32), cl.neighbour_capacity)
    keep = jnp.take_along_axis(ok, pick, axis=1)
    senders = jnp.where(keep, jnp.take_along_axis(cand, pick, axis=1), -1).reshape(-1)
    receivers = jnp.where(keep, jnp.arange(n, dtype=jnp.int32)[:, None], -1).reshape(-1)
    shifts = jnp.take_along_axis(shift, pick[..., None], axis=1).reshape(-1, 3)
    overflow = (counts.max() > cl.cell_capacity) | (count.max() > cl.neighbour_capacity)
    return Graph.build(senders, receivers, n, shifts=shifts), overflow


def _run(config: NequIPConfig, cl: CellList, masses, dt: float, rebuild_every: int, chunks: int, params, species, cell, state):
    """`chunks` x `rebuild_every` velocity-Verlet steps from ``state = (positions, velocities,
    forces)``; returns the final state, per-step potential and kinetic energies, and the flags
    ``(capacity_overflow, moved_past_half_skin)``."""
    inv_m = (1.0 / masses)[:, None]
    skin = cl.radius - config.cutoff

    def energy_forces(positions, graph):
        e, grad = jax.value_and_grad(lambda p: config.energies(params, species, p, graph, cell).sum())(positions)
        return e, -grad

    def chunk(carry, _):
        positions, velocities, forces, flags = carry
        graph, overflow = neighbour_graph(positions, cell, cl)
        start = positions

        def step(c, _):
            x, v, f = c
            v = v + 0.5 * dt * f * inv_m
            x = x + dt * v
            e, f = energy_forces(x, graph)
            v = v + 0.5 * dt * f * inv_m
            moved = jnp.max(jnp.sum((x - start) ** 2, axis=-1))
            return (x, v, f), (e, 0.5 * jnp.sum(v * v / inv_m), moved)

        (positions, velocities, forces), (pot, kin, moved) = jax.lax.scan(step, (positions, velocities, forces), None, rebuild_every)
        moved = jnp.max(moved) > (0.5 * skin) ** 2
        return (positions, velocities, forces, flags | jnp.stack([overflow, moved])), (pot, kin)

    positions, velocities, forces = state
    flags = jnp.zeros(2, bool)
    (positions, velocities, forces, flags), (pot, kin) = jax.lax.scan(chunk, (positions, velocities, forces, flags), None, chunks)
    return (positions, velocities, forces), pot.reshape(-1), kin.reshape(-1), flags


class DeviceMD:
    """NVE molecular dynamics (velocity Verlet) that stays on the device for a whole run.

    ``atoms``: a periodic structure at least ``3 (cutoff + skin)`` across (velocities from
    ``atoms.get_velocities()``, ase units); ``model``: as :class:`JequiCalculator`'s;
    ``timestep_fs``; ``skin`` (Å); ``rebuild_every``: steps between neighbour-list rebuilds.
    :meth:`run` advances the state and returns per-step energies."""

    def __init__(self, atoms, model="nequip-emt", *, timestep_fs: float = 1.0, skin: float = 0.5, rebuild_every: int = 10,
                 backend=None, dtype="float32", precision: str | None = None):  # fmt: skip
        from ase import units

        if not np.all(atoms.pbc):
            raise ValueError(f"DeviceMD needs a cell periodic in all three directions, got pbc={atoms.pbc.tolist()}")
        if rebuild_every < 1 or skin <= 0:
            raise ValueError(f"rebuild_every must be >= 1 and skin > 0, got {rebuild_every}, {skin}")
        params, config = load_model(model)
        config = with_precision(config, precision)
        if backend is not None:
            config = dataclasses.replace(config, backend=backend)
        dtype = jnp.dtype(dtype)
        self.config, self.dtype, self.rebuild_every = config, dtype, rebuild_every
        self.params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
        self.species = jnp.asarray(config.species_index(atoms.numbers))
        self.cell = jnp.asarray(atoms.cell.array, dtype)
        self.masses = jnp.asarray(atoms.get_masses(), dtype)
        self.dt = float(timestep_fs * units.fs)
        self.cells = cell_list_for(atoms.positions, atoms.cell.array, config.cutoff + skin)
        self.natoms = len(atoms)
        self.regrown = 0  # how many times a run was repeated with larger capacities
        positions = jnp.asarray(atoms.positions, dtype)
        graph, _ = jax.jit(neighbour_graph, static_argnums=2)(positions, self.cell, self.cells)
        # the graph is an argument, not a closed-over constant: XLA would constant-fold its sort
        grad = jax.jit(jax.grad(lambda p, g: config.energies(self.params, self.species, p, g, self.cell).sum()))
        self.state = (positions, jnp.asarray(atoms.get_velocities(), dtype), -grad(positions, graph))

    @functools.cached_property
    def _compiled(self):
        return jax.jit(_run, static_argnums=(0, 1, 3, 4, 5))

    def run(self, steps: int) -> dict:
        """Advance ``ceil(steps / rebuild_every) * rebuild_every`` steps; returns
        ``potential`` and ``kinetic`` energies per step (eV, host arrays) and ``steps``."""
        chunks = max(1, -(-steps // self.rebuild_every))
        while True:
            out = self._compiled(self.config, self.cells, self.masses, self.dt, self.rebuild_every, chunks,
                                 self.params, self.species, self.cell, self.state)  # fmt: skip
            state, pot, kin, flags = out
            overflow, moved = (bool(x) for x in np.asarray(flags))
            if moved:
                raise RuntimeError(
                    f"an atom moved more than skin/2 = {0.5 * (self.cells.radius - self.config.cutoff):.3f} Å between "
                    f"neighbour-list rebuilds: use a larger skin or a smaller rebuild_every ({self.rebuild_every})"
                )
            if not overflow:
                break
            c = self.cells  # pairs were missed: grow the capacities and redo this run from its start
            self.cells = CellList(c.dims, math.ceil(1.5 * c.cell_capacity), math.ceil(1.5 * c.neighbour_capacity), c.radius)
            self.regrown += 1
        self.state = state
        return {"potential": np.asarray(pot, np.float64), "kinetic": np.asarray(kin, np.float64), "steps": chunks * self.rebuild_every}

    @property
    def positions(self) -> np.ndarray:
        return np.asarray(self.state[0])

    @property
    def velocities(self) -> np.ndarray:
        return np.asarray(self.state[1])
