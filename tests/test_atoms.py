"""graph_from_atoms against a brute-force periodic neighbour search; edge vectors."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import bulk, molecule

import jequi


def brute_force(atoms, cutoff):
    """Every (sender j, receiver i, shift S) with 0 < |pos_j - pos_i + S @ cell| < cutoff."""
    pos, cell = atoms.positions, atoms.cell.array
    reach = [range(-3, 4) if p else range(1) for p in atoms.pbc]
    out = set()
    for shift in itertools.product(*reach):
        d = pos[None, :, :] - pos[:, None, :] + np.array(shift) @ cell
        r = np.linalg.norm(d, axis=-1)
        for i, j in zip(*np.nonzero((r < cutoff) & (r > 1e-8))):
            out.add((int(j), int(i), shift))
    return out


@pytest.mark.parametrize("make, cutoff", [
    (lambda: bulk("Cu", "fcc", a=3.6), 5.0),  # primitive cell: many images of each atom
    (lambda: bulk("Si", "diamond", a=5.43, cubic=True), 4.0),
    (lambda: molecule("C6H6"), 2.0),  # no periodicity
])
def test_radius_graph_matches_brute_force(make, cutoff):
    atoms = make()
    atoms.rattle(0.02, seed=0)
    g = jequi.graph_from_atoms(atoms, cutoff)
    got = {(int(s), int(r), tuple(int(v) for v in sh)) for s, r, sh in zip(g.senders, g.receivers, np.asarray(g.shifts))}
    assert got == brute_force(atoms, cutoff)
    assert g.edges_sorted and g.num_nodes == len(atoms)
    vectors = np.asarray(jequi.edge_vectors(g, jnp.asarray(atoms.positions), jnp.asarray(atoms.cell.array)))
    assert np.all(np.linalg.norm(vectors, axis=1) < cutoff)


def test_bad_cutoff():
    with pytest.raises(ValueError, match="cutoff must be positive"):
        jequi.graph_from_atoms(molecule("H2O"), 0.0)
