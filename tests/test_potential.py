"""The potential as users run it: the ASE calculator (stress against finite differences of the
energy, symmetries, agreement with ``predict`` on batches, no recompilation inside size
buckets), vesin's neighbour list against ase's, and molecular dynamics (NVE energy
conservation; the on-device loop against ase's velocity Verlet step for step). Float64, a
small model with random parameters and a short cutoff, so that everything stays fast on a CPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import bulk, fcc111
from ase.calculators.calculator import PropertyNotImplementedError
from ase.cluster import Icosahedron
from conftest import assert_close
from scipy.spatial.transform import Rotation

import jequi
from jequi.atoms import radius_edges
from jequi.models import DeviceMD, JequiCalculator, NequIP, NequIPConfig, ase_nve, bucket, data, neighbour_edges
from jequi.models.md import CellList, thermalize
from jequi.models.loss import predict

CONFIG = NequIPConfig(hidden="4x0e+2x1o+2x2e", num_basis=4, radial_hidden=8, cutoff=3.0)


def crystal(repeat=(2, 2, 2), seed=1):
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(repeat)
    atoms.numbers[::5] = 79
    atoms.rattle(0.05, seed=seed)
    return atoms


@functools.lru_cache
def params():
    atoms = crystal()
    g = jequi.graph_from_atoms(atoms, CONFIG.cutoff)
    args = (CONFIG.species_index(atoms.numbers), jnp.asarray(atoms.positions), g, jnp.asarray(atoms.cell.array))
    p = NequIP(CONFIG).init(jax.random.key(0), *args)
    shift = jnp.linspace(-3.0, -2.0, len(CONFIG.species))  # nonzero per-species energies
    return {"params": {**p["params"], "species_shift": shift}}


@functools.lru_cache
def calculator():
    """One calculator for the module's tests: they share its compilations."""
    return JequiCalculator((params(), CONFIG), dtype="float64")


def evaluate(atoms):
    atoms = atoms.copy()
    atoms.calc = calculator()
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress(voigt=False) if atoms.pbc.all() else None


def test_stress_equals_finite_differences_of_the_strained_energy():
    atoms = crystal()
    _, _, stress = evaluate(atoms)
    assert np.abs(stress).max() > 1e-4  # a rattled alloy with random parameters is not at rest
    h = 1e-5
    for i, j in [(0, 0), (1, 1), (2, 2), (1, 2), (0, 2), (0, 1)]:
        sym = np.zeros((3, 3))
        sym[i, j] += 0.5
        sym[j, i] += 0.5
        energies = []
        for sign in (1, -1):
            strained = atoms.copy()
            strained.set_cell(atoms.cell.array @ (np.eye(3) + sign * h * sym), scale_atoms=True)
            energies.append(evaluate(strained)[0])
        fd = (energies[0] - energies[1]) / (2 * h) / atoms.get_volume()
        assert abs(fd - stress[i, j]) < 1e-6 * max(1e-2, abs(stress[i, j])) + 1e-9, (i, j, fd, stress[i, j])


def test_non_periodic_structures_have_no_stress():
    cluster = Icosahedron("Ni", 2)
    cluster.rattle(0.05, seed=2)
    cluster.calc = calculator()
    assert np.isfinite(cluster.get_potential_energy()) and cluster.get_forces().shape == (13, 3)
    with pytest.raises(PropertyNotImplementedError, match="periodic in all three directions"):
        cluster.get_stress()


def test_energy_invariant_forces_and_stress_equivariant_under_rotation():
    atoms = crystal()
    e, f, s = evaluate(atoms)
    rot = Rotation.random(random_state=3).as_matrix()
    moved = atoms.copy()
    moved.set_cell(atoms.cell.array @ rot.T)
    moved.positions = atoms.positions @ rot.T + np.array([0.3, -1.1, 2.0])
    e2, f2, s2 = evaluate(moved)
    assert abs(e2 - e) < 1e-9 * abs(e)
    assert_close(f2, f @ rot.T, 1e-9, "forces")
    assert_close(s2, rot @ s @ rot.T, 1e-9, "stress")


def test_calculator_equals_predict_on_a_batch():
    structures = data.emt_dataset(3, seed=6)
    b = data.batch(structures, CONFIG, n_node=120, n_edge=6000)
    energies, forces = jax.jit(predict, static_argnums=1)(params(), CONFIG, b)
    offset = 0
    for k, s in enumerate(structures):
        e, f, _ = evaluate(s.to_atoms())
        n = len(s.numbers)
        assert abs(e - float(energies[k])) < 1e-9 * abs(e)
        assert_close(f, forces[offset : offset + n], 1e-9, f"forces of structure {k}")
        offset += n


@pytest.mark.parametrize("make", [lambda: crystal(seed=4), lambda: fcc111("Pt", (2, 2, 3), vacuum=4.0), lambda: Icosahedron("Au", 2)])
def test_vesin_edges_equal_ase_edges(make):
    atoms = make()
    key = lambda e: sorted(zip(e[0].tolist(), e[1].tolist(), map(tuple, e[2].round().astype(int).tolist())))  # noqa: E731
    assert key(neighbour_edges(atoms, 4.5)) == key(radius_edges(atoms, 4.5))


def test_buckets():
    assert [bucket(n, 16, 1.25) for n in (0, 16, 17, 20, 21)] == [16, 16, 20, 20, 25]
    for n in range(1, 3000, 7):
        b = bucket(n, 16, 1.25)
        assert n <= b < max(17, 1.25 * n + 2)
    with pytest.raises(ValueError, match="growth"):
        bucket(10, growth=1.0)


def test_no_recompilation_inside_size_buckets():
    """A fresh calculator on rattled copies whose edge counts differ: one compilation per
    (atoms, edges) bucket visited, not per edge count."""
    calc = JequiCalculator((params(), CONFIG), dtype="float64")
    edge_counts, buckets = set(), set()
    for seed in range(8):
        atoms = crystal(seed=seed)
        atoms.rattle(0.25, seed=seed)
        n_edges = len(neighbour_edges(atoms, CONFIG.cutoff)[0])
        edge_counts.add(n_edges)
        buckets.add((bucket(len(atoms), calc.min_atoms, calc.growth), bucket(n_edges, calc.min_edges, calc.growth)))
        atoms.calc = calc
        atoms.get_forces()
    assert len(edge_counts) > len(buckets)  # the edge count changed inside a bucket
    assert calc.compilations == len(buckets)


def test_nve_conserves_energy():
    atoms = crystal()
    run = ase_nve(atoms, calculator(), 40, timestep_fs=1.0, temperature_K=600.0, seed=1)
    total = run["total_energy"]
    kinetic_scale = 1.5 * len(atoms) * 600 * 8.617e-5  # ~ the kinetic energy the run starts with
    assert np.abs(total - total[0]).max() < 1e-3 * kinetic_scale, total - total[0]
    assert run["atoms"].get_temperature() > 50  # the atoms moved


def test_device_md_follows_ase_velocity_verlet():
    """The on-device loop (cell list rebuilt every 5 steps inside lax.scan) gives ase's
    trajectory; starting with too small capacities, it detects the overflow and re-runs."""
    atoms = crystal((3, 3, 3))
    thermalize(atoms, 600.0, seed=2)
    ref = ase_nve(atoms, calculator(), 10, timestep_fs=1.0, temperature_K=None)
    md = DeviceMD(atoms, (params(), CONFIG), timestep_fs=1.0, skin=0.4, rebuild_every=5, dtype="float64")
    c = md.cells
    md.cells = CellList(c.dims, 2, 4, c.radius)  # far too small: pairs are missed, then found
    out = md.run(10)
    assert md.regrown > 0 and out["steps"] == 10
    assert_close(md.positions, ref["atoms"].positions, 1e-10, "positions")
    assert_close(md.velocities, ref["atoms"].get_velocities(), 1e-8, "velocities")
    total = out["potential"] + out["kinetic"]
    assert abs(total[-1] - ref["total_energy"][-1]) < 1e-8 * abs(total[-1])


def test_device_md_rejects_cells_too_small_for_its_cell_list():
    with pytest.raises(ValueError, match="at least 3 x"):
        DeviceMD(crystal((2, 2, 2)), (params(), CONFIG))
    with pytest.raises(ValueError, match="periodic"):
        DeviceMD(Icosahedron("Au", 2), (params(), CONFIG))


def test_calculator_input_errors():
    with pytest.raises(ValueError, match="unknown model"):
        JequiCalculator("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        JequiCalculator((params(), CONFIG), dtype="int32")
    atoms = crystal()
    atoms.numbers[0] = 8
    atoms.calc = calculator()
    with pytest.raises(ValueError, match="not in the model's species"):
        atoms.get_potential_energy()
