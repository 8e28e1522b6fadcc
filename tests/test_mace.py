"""jequi.models.MACE against mace-torch's own ScaleShiftMACE (a fixture from mace-torch 0.3.16:
tests/fixtures/make_mace_torch_model_fixture.py), finite differences, rotation invariance,
training, and the calculator / MD / sharded calculator equal to one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jequi.graph import Graph
from jequi.models import mace

FIXTURE = "tests/fixtures/mace_torch_model.npz"


def _torch_model(**overrides):
    f = np.load(FIXTURE)
    state = {k[len("state/") :]: f[k] for k in f.files if k.startswith("state/")}
    return mace.from_mace_torch(state, float(f["config/avg_num_neighbors"]), first_residual=bool(f["config/first_residual"]),
                                backend="xla", contraction_backend="xla", **overrides), f  # fmt: skip


def _graph(senders, receivers, n, shifts=None):
    return Graph.build(jnp.asarray(senders, jnp.int32), jnp.asarray(receivers, jnp.int32), n,
                       shifts=None if shifts is None else jnp.asarray(shifts))  # fmt: skip


def _energy_forces(config, params, species, positions, graph, cell=None):
    def total(p):
        e = config.energies(params, species, p, graph, cell)
        return e.sum(), e

    (e, per_atom), grad = jax.value_and_grad(total, has_aux=True)(positions)
    return e, per_atom, -grad


@pytest.mark.parametrize("structure", ["A", "B"])
def test_equals_mace_torch(structure):
    """Energies, per-atom energies and forces of mace-torch's model (float64), loaded by
    from_mace_torch with no change of numbers; B has pairs beyond r_max."""
    (params, config), f = _torch_model()
    o = {k.split("__")[1]: f[k] for k in f.files if k.startswith(f"outputs/{structure}__")}
    species = jnp.asarray(config.species_index(o["Z"]))
    graph = _graph(o["edge_index"][0], o["edge_index"][1], len(o["Z"]))
    e, per_atom, forces = _energy_forces(config, params, species, jnp.asarray(o["positions"]), graph)
    assert abs(float(e) - float(o["energy"][0])) < 1e-9
    np.testing.assert_allclose(per_atom, o["node_energy"], atol=1e-10)
    np.testing.assert_allclose(forces, o["forces"], atol=1e-11)
    assert np.abs(o["forces"]).max() > 1e-2  # the comparison is not of zeros


def test_config_from_state_dict():
    (params, config), _ = _torch_model()
    assert (config.species, config.cutoff, config.hidden, config.correlation, config.num_layers) == ((1, 6, 8), 5.0, "8x0e+8x1o", 3, 2)
    assert (config.sh_lmax, config.radial_mlp, config.readout_mlp, config.scale, config.shift) == (3, (64, 64, 64), 16, 1.3, 0.1)
    assert set(params["params"]) == set(mace.parameter_shapes(config))


def test_medium_parameter_count():
    """MACE-MP-0 medium's 4,688,497 parameters (mace-jax's count of its nnx Params: E0s, scale and
    shift included, and 6 silu constants that jequi keeps in the config)."""
    shapes = mace.parameter_shapes(mace.MACEConfig())
    assert sum(int(np.prod(s)) for s in shapes.values()) + 6 == 4_688_497


def _periodic(seed=0, n=12):
    rng = np.random.default_rng(seed)
    cell = np.diag([6.0, 6.5, 7.0]) + 0.2 * rng.standard_normal((3, 3))
    positions = rng.uniform(size=(n, 3)) @ cell
    from ase import Atoms

    return Atoms(rng.choice([1, 6, 8], n), positions=positions, cell=cell, pbc=True)


def _small_config(**kw):
    return mace.MACEConfig(species=(1, 6, 8), atomic_energies=(-1.0, -5.0, -7.0), cutoff=3.5, hidden="4x0e+4x1o",
                           radial_mlp=(8,), avg_num_neighbors=6.0, backend="xla", contraction_backend="xla", **kw)  # fmt: skip


def _inputs(config, atoms, dtype=jnp.float64):
    from jequi.models import neighbour_edges

    s, r, shifts = neighbour_edges(atoms, config.cutoff)
    return (jnp.asarray(config.species_index(atoms.numbers)), jnp.asarray(atoms.positions, dtype),
            _graph(s, r, len(atoms), shifts), jnp.asarray(atoms.cell.array, dtype))  # fmt: skip


def test_forces_finite_differences_and_rotation():
    config = _small_config(first_residual=False)
    params = config.init_params(jax.random.key(0))
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params)
    species, positions, graph, cell = _inputs(config, _periodic())
    e, _, forces = _energy_forces(config, params, species, positions, graph, cell)
    rng = np.random.default_rng(1)
    for _ in range(3):
        d = jnp.asarray(rng.standard_normal(positions.shape))
        h = 1e-5
        fd = (config.energies(params, species, positions + h * d, graph, cell).sum()
              - config.energies(params, species, positions - h * d, graph, cell).sum()) / (2 * h)  # fmt: skip
        assert abs(float(fd) + float(jnp.sum(forces * d))) < 1e-6 * max(1.0, float(jnp.abs(forces).max()))
    q, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    q = jnp.asarray(q * np.sign(np.linalg.det(q)))  # a rotation
    e2, _, f2 = _energy_forces(config, params, species, positions @ q.T, graph, cell @ q.T)
    assert abs(float(e2 - e)) < 1e-10 * abs(float(e))
    np.testing.assert_allclose(f2, forces @ q.T, atol=1e-10)
    assert float(jnp.abs(forces).max()) > 1e-3


def test_pallas_equals_xla():
    """The default kernels (Pallas contraction in interpret mode on the CPU) give the XLA path's numbers."""
    config = _small_config()
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), config.init_params(jax.random.key(2)))
    args = _inputs(config, _periodic(3, 8))
    ref = _energy_forces(config, params, *args)
    got = _energy_forces(dataclasses.replace(config, contraction_backend="pallas", backend="pallas"), params, *args)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_linen_module_matches_config():
    config = _small_config()
    atoms = _periodic(4, 8)
    species, positions, graph, cell = _inputs(config, atoms, jnp.float32)
    module = mace.MACE(config)
    params = module.init(jax.random.key(0), species, positions, graph, cell)
    assert set(params["params"]) == set(mace.parameter_shapes(config))
    np.testing.assert_allclose(module.apply(params, species, positions, graph, cell),
                               config.energies(params, species, positions, graph, cell), rtol=1e-6)  # fmt: skip


def test_bad_inputs():
    with pytest.raises(ValueError, match="one multiplicity"):
        mace.MACEConfig(hidden="4x0e+2x1o")
    with pytest.raises(ValueError, match="atomic_energies"):
        mace.MACEConfig(species=(1, 6), atomic_energies=(0.0,))
    with pytest.raises(ValueError, match="not in the model's species"):
        _small_config().species_index([1, 79])
    with pytest.raises(ValueError, match="avg_num_neighbors"):
        mace.from_mace_torch({"r_max": np.asarray(5.0)})


def test_calculator_md_and_training():
    """The shared machinery takes a (params, MACEConfig) pair: the calculator's forces are minus
    its energy's gradient and its stress the strain derivative; DeviceMD conserves energy; a short
    training lowers the loss."""
    from ase.build import bulk

    from jequi.models import DeviceMD, JequiCalculator
    from jequi.models.data import Structure
    from jequi.models.train import train

    config = _small_config()
    params = config.init_params(jax.random.key(0))
    atoms = _periodic(5, 10)
    calc = JequiCalculator((params, config))
    atoms.calc = calc
    f = atoms.get_forces()
    a2 = atoms.copy()
    a2.calc = calc
    h, i = 1e-3, 3
    a2.positions[i, 0] += h
    ep = a2.get_potential_energy()
    a2.positions[i, 0] -= 2 * h
    em = a2.get_potential_energy()
    assert abs((ep - em) / (2 * h) + f[i, 0]) < 2e-3 * max(1.0, np.abs(f).max())
    assert atoms.get_stress().shape == (6,)

    crystal = bulk("C", "diamond", a=3.57, cubic=True).repeat((3, 3, 3))
    crystal.rattle(0.02, seed=0)
    crystal.set_velocities(np.zeros((len(crystal), 3)))
    md = DeviceMD(crystal, (params, dataclasses.replace(config, cutoff=3.0)), timestep_fs=0.25, rebuild_every=5)
    out = md.run(10)
    total = out["potential"] + out["kinetic"]
    assert np.abs(total - total[0]).max() < 1e-3 * len(crystal)

    rng = np.random.default_rng(0)
    structures = []
    for k in range(4):
        a = _periodic(10 + k, 8)
        structures.append(Structure(a.numbers, a.positions, a.cell.array, a.pbc, energy=float(rng.normal()) - 5.0 * len(a),
                                    forces=0.1 * rng.standard_normal((len(a), 3))))  # fmt: skip
    _, history = train(config, structures, steps=12, batch_size=2, learning_rate=1e-2, progress=False)
    assert np.mean(history.loss[-3:]) < np.mean(history.loss[:3])

# The sharded calculator with MACE: tests/multidevice_checks.py (check_split_model), run by tests/test_distributed.py.
