"""Physical invariants of every shipped model (float64, through JequiCalculator): energy
invariant under translations, rotations, permutations of the atoms and the choice of cell;
forces and stress covariant; forces minus the energy's gradient (a symmetric Hessian with the
acoustic sum rule; nequix-oam-1's in tests/test_nequix.py); stress the strain derivative (finite
differences); NVE energy conserved over 100 steps."""

import numpy as np
import pytest
from ase.build import bulk
from scipy.spatial.transform import Rotation

from jequi.models import JequiCalculator, ase_nve, pretrained


def _structure(name):
    if name == pretrained.NAME:  # the EMT model's metals
        atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((2, 1, 1))
        atoms.numbers[::3] = 79
    else:
        atoms = bulk("MgO", "rocksalt", a=4.25, cubic=True)
    atoms.rattle(0.05, seed=5)
    return atoms


def _efs(calc, atoms):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress(voigt=False)


# tests/test_nequix.py checks this model's float64 Hessian against nequix's own, with its symmetry
# and the acoustic sum rule: the suite's slowest computation, run once
HESSIAN_IN_TEST_NEQUIX = ("nequix-oam-1",)


@pytest.mark.parametrize("name", pretrained.shipped())
def test_invariants(name):
    calc = JequiCalculator(name, dtype="float64")
    atoms = _structure(name)
    e, f, s = _efs(calc, atoms)
    scale = np.abs(f).max()
    assert scale > 0.05

    moved = atoms.copy()
    moved.positions += np.array([0.31, -1.7, 2.2])
    e2, f2, _ = _efs(calc, moved)
    assert abs(e2 - e) < 1e-9 * abs(e) + 1e-10 and np.abs(f2 - f).max() < 1e-9 * scale

    rot = Rotation.random(random_state=3).as_matrix()
    turned = atoms.copy()
    turned.set_cell(atoms.cell.array @ rot.T, scale_atoms=False)
    turned.positions = atoms.positions @ rot.T
    e2, f2, s2 = _efs(calc, turned)
    assert abs(e2 - e) < 1e-9 * abs(e)
    assert np.abs(f2 - f @ rot.T).max() < 1e-9 * scale
    assert np.abs(s2 - rot @ s @ rot.T).max() < 1e-9 * max(np.abs(s).max(), 1e-3)

    perm = np.random.default_rng(1).permutation(len(atoms))
    e2, f2, _ = _efs(calc, atoms[perm])
    assert abs(e2 - e) < 1e-9 * abs(e) and np.abs(f2 - f[perm]).max() < 1e-9 * scale

    other_cell = atoms.copy()  # the same lattice, another cell: a3 + a1, and the atoms wrapped into it
    c = atoms.cell.array
    other_cell.set_cell([c[0], c[1], c[2] + c[0]], scale_atoms=False)
    other_cell.wrap()
    e2, f2, s2 = _efs(calc, other_cell)
    assert abs(e2 - e) < 1e-9 * abs(e) and np.abs(f2 - f).max() < 1e-9 * scale and np.abs(s2 - s).max() < 1e-8

    # stress is the strain derivative of the energy over the volume (central differences)
    h, volume = 1e-5, atoms.get_volume()
    for i, j in ((0, 0), (1, 2)):
        energies = []
        for sign in (1, -1):
            eps = np.zeros((3, 3))
            eps[i, j] = eps[j, i] = sign * h / (1 if i == j else 2)
            strained = atoms.copy()
            strained.set_cell(atoms.cell.array @ (np.eye(3) + eps), scale_atoms=True)
            energies.append(_efs(calc, strained)[0])
        fd = (energies[0] - energies[1]) / (2 * h) / volume
        assert abs(fd - s[i, j]) < 1e-5 * max(np.abs(s).max(), 1e-2), (i, j, fd, s[i, j])

    if name not in HESSIAN_IN_TEST_NEQUIX:
        _check_hessian(calc, atoms)

    md = ase_nve(atoms, calc, 100, timestep_fs=1.0, temperature_K=300.0, seed=2)
    assert abs(md["drift_meV_per_atom"]) < 0.5 and md["max_deviation_meV_per_atom"] < 2.0, md


def _check_hessian(calc, atoms):
    """The Hessian is symmetric, a rigid translation costs nothing, and it is minus the
    forces' derivative (central differences of one coordinate)."""
    hessian = calc.get_hessian(atoms)
    n = len(atoms)
    flat = hessian.transpose(0, 2, 1, 3).reshape(3 * n, 3 * n)
    assert np.abs(flat - flat.T).max() < 1e-9 * np.abs(flat).max()
    assert np.abs(hessian.sum(axis=1)).max() < 1e-8 * np.abs(flat).max()  # a rigid translation costs nothing
    k, h = 1, 1e-5
    shifted = [atoms.copy(), atoms.copy()]
    shifted[0].positions[k, 0] += h
    shifted[1].positions[k, 0] -= h
    column = -(_efs(calc, shifted[0])[1] - _efs(calc, shifted[1])[1]) / (2 * h)
    assert np.abs(column - hessian[:, k, :, 0]).max() < 1e-5 * np.abs(flat).max()
