"""jequi.models.nequix against Nequix's own code (the ``nequix`` package, 0.4.5, on the same
``.nqx`` files): every shipped model's energy, forces, stress and Hessian on a periodic bulk, a
molecule in vacuum and a slab; the reader and writer against Nequix's ``load_model`` and
``save_model``; per-species skips and no layer norm on a model Nequix builds; the entry points
(calculator by name and path, DeviceMD, training); bad checkpoints.

Nequix builds its modules in JAX's default float dtype and refuses float32 files under x64, so
its models are built with x64 off (:func:`_nequix`) and cast to float64 for the comparisons.
Importing ``nequix`` sets ``jax_default_matmul_precision`` to "highest"; the test restores it.
"""

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import add_adsorbate, bulk, fcc111, molecule

from jequi.models import DeviceMD, JequiCalculator, NequixConfig, nequix, pretrained
from jequi.models.data import neighbour_edges

_precision = jax.config.jax_default_matmul_precision
import equinox as eqx  # noqa: E402
import jraph  # noqa: E402
import nequix.model as nequix_model  # noqa: E402
from nequix.pft.hessian import hessian_linearized  # noqa: E402

jax.config.update("jax_default_matmul_precision", _precision)

MODELS = sorted(pretrained.FOUNDATION)


@contextlib.contextmanager
def _float32_default():
    jax.config.update("jax_enable_x64", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", True)


def _nequix(path, dtype=jnp.float64):
    """Nequix's own model of a .nqx file (its load_model), cast to `dtype`."""
    with _float32_default():
        model, cfg = nequix_model.load_model(str(path))
    cast = lambda a: jnp.asarray(a, dtype) if eqx.is_inexact_array(a) else a  # noqa: E731
    return jax.tree.map(cast, model), cfg


def _structures():
    mgo = bulk("MgO", "rocksalt", a=4.21, cubic=True)
    mgo.rattle(0.05, seed=1)
    ethanol = molecule("CH3CH2OH")
    ethanol.rattle(0.02, seed=2)
    slab = fcc111("Cu", (2, 2, 3), vacuum=6.0, periodic=True)  # periodic with vacuum, as DFT slabs are
    add_adsorbate(slab, "O", 1.3, "fcc")
    slab.rattle(0.03, seed=3)
    return {"bulk MgO": mgo, "ethanol": ethanol, "Cu(111) + O": slab}


def _graph(atoms, species, cutoff, dtype):
    """Nequix's input graph of `atoms` (its edges' convention: senders j, receivers i, vector
    pos[j] - pos[i] + S @ cell), padded with one empty graph as its calculator pads."""
    s, r, shifts = neighbour_edges(atoms, cutoff)
    periodic = bool(np.all(atoms.pbc))
    index = np.array([species.index(z) for z in atoms.numbers], np.int32)
    g = jraph.GraphsTuple(
        n_node=np.array([len(atoms)]), n_edge=np.array([len(s)]),
        nodes={"species": index, "positions": jnp.asarray(atoms.positions, dtype), "forces": None},
        edges={"shifts": jnp.asarray(shifts, dtype)}, senders=s, receivers=r,
        globals={"cell": jnp.asarray(atoms.cell.array, dtype)[None] if periodic else None, "energy": None, "stress": None},
    )  # fmt: skip
    return jraph.pad_with_graphs(g, n_node=len(atoms) + 1, n_edge=len(s) + 1, n_graph=2)


def _nequix_outputs(model, cfg, atoms, dtype):
    g = _graph(atoms, sorted(cfg["atomic_numbers"]), cfg["cutoff"], dtype)
    energy, forces, stress = eqx.filter_jit(model)(g)
    out = {"energy": float(energy[0]), "forces": np.asarray(forces[: len(atoms)])}
    if stress is not None:
        out["stress"] = np.asarray(stress[0]).flat[[0, 4, 8, 5, 2, 1]]  # ase's Voigt order
    return out


def _relative(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _assert_equal(calc, atoms, ref, tol, stress_scale=0.0):
    """Energy, forces and stress equal `ref` to `tol` relative (the stress relative to its
    largest component or `stress_scale` eV/Å^3, whichever is larger)."""
    atoms = atoms.copy()
    atoms.calc = calc
    assert _relative(atoms.get_potential_energy(), ref["energy"]) < tol
    assert _relative(atoms.get_forces(), ref["forces"]) < tol
    assert np.abs(ref["forces"]).max() > 0.1  # real forces are compared, not zeros
    if "stress" in ref:
        stress = atoms.get_stress()
        assert np.abs(stress - ref["stress"]).max() < tol * max(np.abs(ref["stress"]).max(), stress_scale)
    else:
        assert not np.all(atoms.pbc)


# The Hessian (forward over reverse, the slowest check of the CPU suite) of one shipped model: the
# two run the same code on other weights.
@pytest.mark.parametrize("name", MODELS)
def test_shipped_model_equals_nequix_float64(name):
    """Energy, forces and stress on three structures, and (nequix-oam-1) the Hessian of the
    bulk, to 1e-10."""
    path = pretrained.WEIGHTS / f"{name}.nqx"
    model, cfg = _nequix(path)
    calc = JequiCalculator(name, dtype="float64")
    for label, atoms in _structures().items():
        _assert_equal(calc, atoms, _nequix_outputs(model, cfg, atoms, jnp.float64), 1e-10)
    if name != "nequix-oam-1":
        return
    atoms = _structures()["bulk MgO"]
    n = len(atoms)
    g = _graph(atoms, sorted(cfg["atomic_numbers"]), cfg["cutoff"], jnp.float64)
    ref = np.asarray(eqx.filter_jit(hessian_linearized)(model, g))[:n, :n]
    ours = calc.get_hessian(atoms)
    assert ours.shape == (n, n, 3, 3)
    assert _relative(ours, ref) < 1e-10
    assert _relative(ours, ours.transpose(1, 0, 3, 2)) < 1e-10  # symmetric
    assert np.abs(ours.sum(axis=1)).max() < 1e-8 * np.abs(ours).max()  # a rigid translation costs nothing


@pytest.mark.parametrize("name", MODELS)
def test_shipped_model_equals_nequix_float32(name):
    """The float32 model (as both ship) on the slab: energy and forces to 1e-5 relative. The
    slab's stress is small (3e-3 eV/Å^3) and both float32 codes miss the float64 value by 1-3e-5
    of it, so the stress is compared to 1e-5 of 0.01 eV/Å^3 (1.6 GPa)."""
    model, cfg = _nequix(pretrained.WEIGHTS / f"{name}.nqx", jnp.float32)
    atoms = _structures()["Cu(111) + O"]
    _assert_equal(JequiCalculator(name), atoms, _nequix_outputs(model, cfg, atoms, jnp.float32), 1e-5, stress_scale=0.01)


@pytest.mark.parametrize("name", MODELS)
def test_reader_reads_nequix_arrays_and_writer_round_trips(name, tmp_path):
    """read_nqx's arrays are load_model's leaves, in order; write_nqx writes a file load_model
    reads back to the same leaves (and read_nqx to the same params and header)."""
    path = pretrained.WEIGHTS / f"{name}.nqx"
    params, config, meta = nequix.read_nqx(path)
    model, _ = _nequix(path, jnp.float32)
    leaves = jax.tree.leaves(model)
    ours = list(params["params"].values())
    assert len(leaves) == len(ours) == len(nequix.parameter_shapes(config))
    for a, b in zip(leaves, ours):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert config.species == tuple(sorted(meta["atomic_numbers"])) and config.avg_num_neighbors == meta["avg_n_neighbors"]
    out = tmp_path / "copy.nqx"
    nequix.write_nqx(out, params, config, meta)
    back, _ = _nequix(out, jnp.float32)
    for a, b in zip(jax.tree.leaves(back), leaves):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    p2, c2, m2 = nequix.read_nqx(out)
    assert c2 == config and m2 == meta
    assert all(np.array_equal(p2["params"][k], v) for k, v in params["params"].items())


def test_model_card_is_generated_from_provenance():
    for name in MODELS:
        assert (pretrained.WEIGHTS / f"{name}.md").read_text() == pretrained.foundation_card(name)
        import hashlib

        assert hashlib.sha256((pretrained.WEIGHTS / f"{name}.nqx").read_bytes()).hexdigest() == pretrained.FOUNDATION[name]["sha256"]
    assert (pretrained.WEIGHTS / "LICENSE-nequix").read_text().startswith("MIT License")


def _built_by_nequix(tmp_path, **kwargs):
    """A small model that Nequix itself builds (random weights, atom energies set) and saves."""
    header = {"atomic_numbers": [8, 12], "cutoff": 4.0, "hidden_irreps": "6x0e+3x1o+2x2e", "lmax": 2, "n_layers": 2,
              "radial_basis_size": 6, "radial_mlp_size": 8, "radial_mlp_layers": 2, "radial_polynomial_p": 6.0,
              "mlp_init_scale": 4.0, "index_weights": True, "layer_norm": False, "shift": 0.3, "scale": 1.7,
              "avg_n_neighbors": 12.0, **kwargs}  # fmt: skip
    with _float32_default():
        model = nequix_model.Nequix(
            jax.random.key(1), n_species=2, lmax=header["lmax"], cutoff=header["cutoff"], hidden_irreps=header["hidden_irreps"],
            n_layers=header["n_layers"], radial_basis_size=header["radial_basis_size"], radial_mlp_size=header["radial_mlp_size"],
            radial_mlp_layers=header["radial_mlp_layers"], radial_polynomial_p=header["radial_polynomial_p"],
            index_weights=header["index_weights"], layer_norm=header["layer_norm"], shift=header["shift"], scale=header["scale"],
            avg_n_neighbors=header["avg_n_neighbors"], atom_energies=[-2.0, -1.5],
        )  # fmt: skip
        path = tmp_path / "small.nqx"
        nequix_model.save_model(str(path), model, header)
    return path


@pytest.mark.parametrize("options", [{"index_weights": True, "layer_norm": False}, {"index_weights": False, "layer_norm": True}])
def test_model_built_by_nequix(tmp_path, options):
    """Per-species skips (index_weights) and no layer norm, and the other way round, on a model
    Nequix builds and saves; the checkpoint loads from its path."""
    path = _built_by_nequix(tmp_path, **options)
    model, cfg = _nequix(path)
    atoms = bulk("MgO", "rocksalt", a=4.3, cubic=True)
    atoms.rattle(0.1, seed=4)
    _assert_equal(JequiCalculator(str(path), dtype="float64"), atoms, _nequix_outputs(model, cfg, atoms, jnp.float64), 1e-10)


def test_device_md_and_training_take_nequix(tmp_path):
    """DeviceMD conserves energy with a Nequix model and train fine-tunes one (the loss falls)."""
    from jequi.models.data import Structure
    from jequi.models.train import train

    config = NequixConfig(species=(8, 12), cutoff=3.0, hidden="4x0e+2x1o", sh_lmax=1, num_layers=2, radial_mlp_size=8,
                          avg_num_neighbors=10.0)  # fmt: skip
    params = config.init_params(jax.random.key(0))
    crystal = bulk("MgO", "rocksalt", a=4.21, cubic=True).repeat((3, 3, 3))
    crystal.rattle(0.02, seed=0)
    crystal.set_velocities(np.zeros((len(crystal), 3)))
    out = DeviceMD(crystal, (params, config), timestep_fs=0.5, rebuild_every=5).run(10)
    total = out["potential"] + out["kinetic"]
    assert np.abs(total - total[0]).max() < 1e-3 * len(crystal)

    rng = np.random.default_rng(0)
    structures = []
    for k in range(4):
        a = bulk("MgO", "rocksalt", a=4.2 + 0.02 * k, cubic=True)
        a.rattle(0.05, seed=k)
        structures.append(Structure(a.numbers, a.positions, a.cell.array, a.pbc, energy=float(rng.normal()) - 5.0 * len(a),
                                    forces=0.1 * rng.standard_normal((len(a), 3))))  # fmt: skip
    _, history = train(config, structures, steps=12, batch_size=2, learning_rate=1e-2, params=params, progress=False)
    assert np.mean(history.loss[-3:]) < np.mean(history.loss[:3])


def test_bad_checkpoints_are_clear_errors(tmp_path):
    good = (pretrained.WEIGHTS / "nequix-mp-1.nqx").read_bytes()
    header, _, arrays = good.partition(b"\n")
    cases = {
        "not_json.nqx": (b"PK\x03\x04 a zip file\n" + arrays, "not a Nequix .nqx checkpoint"),
        "truncated.nqx": (good[: len(good) // 2], "the arrays end before"),
        "missing_key.nqx": (json.dumps({k: v for k, v in json.loads(header).items() if k != "lmax"}).encode() + b"\n" + arrays, "lmax"),
        "other_model.nqx": (json.dumps({**json.loads(header), "hidden_irreps": "64x0e+32x1o"}).encode() + b"\n" + arrays, "has shape"),
    }
    for filename, (content, match) in cases.items():
        (tmp_path / filename).write_bytes(content)
        with pytest.raises(ValueError, match=match):
            nequix.read_nqx(tmp_path / filename)
    with pytest.raises(ValueError, match="unknown model"):
        JequiCalculator(str(tmp_path / "absent.nqx"))
    with pytest.raises(ValueError, match="not in the model's species"):
        atoms = molecule("H2O")
        atoms.numbers[0] = 100
        JequiCalculator("nequix-mp-1").get_potential_energy(atoms)
    with pytest.raises(ValueError, match="increasing order"):
        NequixConfig(species=(12, 8))
