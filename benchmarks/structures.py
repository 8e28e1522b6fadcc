"""The real structures the convolution benchmark runs on (built with ase, no downloads)."""

from __future__ import annotations

import numpy as np


def carbon_lattice(repeat: int = 6):
    """Diamond carbon, a cubic cell (8 atoms, a = 3.567 Å) repeated `repeat`^3 times
    (1,728 atoms for 6): MACE's own benchmark structure."""
    from ase.build import bulk

    return bulk("C", "diamond", a=3.567, cubic=True).repeat((repeat,) * 3)


def water_box(per_side: int = 12, seed: int = 0):
    """A periodic box of ``per_side``^3 randomly oriented water molecules on a cubic grid at
    liquid density (29.9 Å^3 per molecule; 5,184 atoms for 12)."""
    from ase import Atoms
    from ase.build import molecule
    from scipy.spatial.transform import Rotation

    spacing = 29.9 ** (1 / 3)
    h2o = molecule("H2O")
    h2o.positions -= h2o.get_center_of_mass()
    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(per_side)] * 3, indexing="ij"), -1).reshape(-1, 3) * spacing
    rotations = Rotation.random(len(grid), random_state=seed).as_matrix()
    positions = np.einsum("mij,aj->mai", rotations, h2o.positions) + grid[:, None, :] + rng.uniform(0, 0.2, (len(grid), 1, 3))
    symbols = list(h2o.get_chemical_symbols()) * len(grid)
    return Atoms(symbols, positions=positions.reshape(-1, 3), cell=[per_side * spacing] * 3, pbc=True)


def copper_crystal(repeat: int = 5):
    """fcc copper, a cubic cell (4 atoms, a = 3.615 Å) repeated `repeat`^3 times (500 atoms for
    5; at jequi.models' 4.5 Å cutoff about as many edges as the model benchmark's batch)."""
    from ase.build import bulk

    return bulk("Cu", "fcc", a=3.615, cubic=True).repeat((repeat,) * 3)


STRUCTURES = {"carbon": (carbon_lattice, 6.0), "water": (water_box, 5.0), "copper": (copper_crystal, 4.5)}


def radius_graph(name: str):
    """``(atoms, cutoff, graph)``: the named structure of :data:`STRUCTURES` and its
    :func:`jequi.graph_from_atoms` radius graph at the structure's cutoff."""
    import jequi

    build, cutoff = STRUCTURES[name]
    atoms = build()
    return atoms, cutoff, jequi.graph_from_atoms(atoms, cutoff)
