"""Structures split over devices (jequi.models.decomposition, .distributed) and data-parallel
training (jequi.models.data_parallel): the same energies, forces, stress and training steps as
one device.

The multi-device cases run on 4 host CPU devices in a subprocess (tests/multidevice_checks.py),
since JAX takes its device count when it starts and this process's JAX has started; the
host-side splitting and the argument checks run here.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from ase.build import bulk

from jequi.models import NequIPConfig
from jequi.models.calculator import neighbour_edges
from jequi.models.decomposition import Decomposition, choose_grid, regions, split

ROOT = pathlib.Path(__file__).resolve().parents[1]
F64 = 1e-12  # float64: the split changes only the order of sums


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    out = tmp_path_factory.mktemp("multidevice") / "checks.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "multidevice_checks.py"), str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["periodic/exchange/4", "periodic/halo/4", "open/exchange/4", "open/halo/4", "planes/exchange/4", "planes/halo/4"])
def test_sharded_energy_forces_stress_equal_one_device(checks, case):
    assert checks["devices"] == 4
    c = checks["structures"][case]
    for what in ("energy", "energies", "forces", "virial"):
        assert c[what] < F64, (case, what, c)
    assert c["max_force"] > 1e-3  # forces that are there to compare
    assert 0 < max(c["ghosts"]) and sum(c["owned"]) == c["atoms"]


def test_cases_hold_what_they_claim(checks):
    s = checks["structures"]
    planes = s["planes/exchange/4"]
    assert planes["owned"][0] == 0 and planes["ghosts"][0] == 0, planes  # a region without atoms
    assert planes["atoms_on_cuts"] == planes["atoms"]  # every atom on a cut plane
    assert s["periodic/halo/4"]["ghosts"][0] > s["periodic/exchange/4"]["ghosts"][0]  # two cutoffs deep vs one
    assert checks["calculator"]["calculator"]["shifts"] == [1]  # on 2 devices, left and right neighbour are one device


def test_data_parallel_training_equals_one_device(checks):
    t = checks["training"]
    assert t["loss"] < F64 and t["params"] < F64, t
    assert t["moved"] > 1e-3  # the steps changed the parameters
    assert len(t["losses"]) == 3


def test_sharded_calculator_and_md_on_two_devices_in_float32(checks):
    c = checks["calculator"]["calculator"]
    assert c["energy"] < 1e-5 and c["forces"] < 1e-5 and c["stress"] < 1e-5, c
    assert c["md_energy"] < 1e-6 and c["md_positions"] < 1e-6, c  # eV/atom, Å after 4 steps
    assert c["compilations"] == 1, c  # moving atoms stay in their size buckets


def test_main_job_on_two_devices_prints_the_one_device_numbers(checks):
    m = checks["calculator"]["main"]
    assert m["split_line"]
    assert m["energy"] <= 1e-4 and m["forces"] <= 1e-4, m  # printed to 4 decimals


# --- host side: regions, ghosts, padding, errors -----------------------------------------------
CONFIG = NequIPConfig(num_layers=3)


def _alloy():
    atoms = bulk("Cu", "fcc", a=3.7, cubic=True).repeat((5, 4, 3))
    atoms.numbers[::4] = 79
    atoms.rattle(0.05, seed=0)
    return atoms


def _split(atoms, dec):
    s, r, sh = neighbour_edges(atoms, CONFIG.cutoff)
    return split(atoms.positions, atoms.cell.array, atoms.pbc, CONFIG.species_index(atoms.numbers), s, r, sh, dec, CONFIG.num_layers), (s, r, sh)


@pytest.mark.parametrize("scheme", ["exchange", "halo"])
def test_split_holds_every_atom_once_and_every_edge_a_device_needs(scheme):
    atoms = _alloy()
    shards, (s, r, sh) = _split(atoms, Decomposition(4, scheme))
    lay = shards.layout
    ids = shards.atom_ids[shards.atom_mask]
    assert sorted(ids.tolist()) == list(range(len(atoms)))  # each atom owned once
    assert shards.grid == (4, 1, 1)  # the longest axis (4 cells) cut into slabs
    edges = {(int(a), int(b), *np.asarray(c, int).tolist()) for a, b, c in zip(s, r, sh)}
    for d in range(lay.devices):
        # the structure's index of each local row: own rows, then ghost blocks from the senders
        local = np.full(lay.local, -1)
        local[: lay.owned] = shards.atom_ids[d]
        start = lay.owned
        for i, k in enumerate(lay.shifts):
            source = (d - k) % lay.devices
            rows = shards.sends[i][source]
            local[start : start + len(rows)] = shards.atom_ids[source][rows]
            start += lay.sends[i]
        real = shards.senders[d] >= 0
        got = {(int(local[a]), int(local[b]), *np.asarray(c, int).tolist())
               for a, b, c in zip(shards.senders[d][real], shards.receivers[d][real], shards.shifts[d][real])}  # fmt: skip
        assert got <= edges  # local edges are the structure's edges
        own = set(shards.atom_ids[d][shards.atom_mask[d]].tolist())
        assert {e for e in edges if e[1] in own} <= got  # every edge into an own atom is there
        if scheme == "exchange":
            assert all(e[1] in own for e in got)  # ... and nothing else: no edge computed twice
        assert np.all(np.diff(shards.receivers[d][real]) >= 0)  # receiver order
    assert lay.depth == (1 if scheme == "exchange" else CONFIG.num_layers)


def test_halo_reaches_num_layers_cutoffs_and_exchange_one():
    atoms = _alloy()
    (ex, _), (halo, _) = (_split(atoms, Decomposition(2, scheme)) for scheme in ("exchange", "halo"))
    assert ex.counts["edges"].sum() == len(neighbour_edges(atoms, CONFIG.cutoff)[0])  # edges split, not repeated
    assert np.all(halo.counts["ghosts"] > ex.counts["ghosts"]) and np.all(halo.counts["edges"] > ex.counts["edges"])


def test_padding_follows_buckets():
    from jequi.models.calculator import bucket

    atoms = _alloy()
    dec = Decomposition(3, "exchange", growth=1.5, min_atoms=4, min_edges=16)
    a, _ = _split(atoms, dec)
    lay, counts = a.layout, a.counts
    assert lay.owned == bucket(counts["owned"].max(), 4, 1.5) and lay.edges == bucket(counts["edges"].max(), 16, 1.5)
    assert lay.ghosts >= counts["ghosts"].max()
    assert a.senders.shape == (3, lay.edges) and a.species.shape == (3, lay.owned) and a.positions.shape == (3, lay.owned, 3)
    assert all(send.shape == (3, n) for send, n in zip(a.sends, lay.sends))


def test_regions_cut_at_quantiles_and_boundary_atoms_go_up():
    positions = np.array([[0.0, 0, z] for z in (0.0, 1.0, 1.0, 2.0, 3.0, 3.0, 3.0, 4.0)])
    owner, grid = regions(positions, np.zeros((3, 3)), False, 4, (1, 1, 4))
    assert grid == (1, 1, 4)
    # cuts at the coordinates of ranks 2, 4, 6: z = 1, 3, 3 (region 2 between two equal cuts is empty)
    assert owner.tolist() == [0, 1, 1, 1, 3, 3, 3, 3]


def test_grid_choice():
    assert choose_grid(4, [10.0, 10.0, 40.0], [True] * 3) == (1, 1, 4)  # slabs across the long axis
    assert choose_grid(8, [10.0, 10.0, 80.0], [True] * 3) == (1, 1, 8)
    assert choose_grid(4, [20.0, 20.0, 20.0], [True] * 3) == (1, 1, 4)  # 2 x 2 cuts as much area, on two axes
    assert choose_grid(2, [30.0, 20.0, 20.0], [False, True, True]) == (2, 1, 1)  # an open axis has one plane fewer
    assert choose_grid(1, [5.0, 5.0, 5.0], [True] * 3) == (1, 1, 1)


def test_gather_returns_the_structure_order():
    atoms = _alloy()
    shards, _ = _split(atoms, Decomposition(4))
    back = shards.gather(np.concatenate([shards.positions, shards.atom_ids[..., None]], axis=-1))
    np.testing.assert_array_equal(back[:, :3], atoms.positions)
    np.testing.assert_array_equal(back[:, 3], np.arange(len(atoms)))
    with pytest.raises(ValueError, match="per-device shape"):
        shards.gather(np.zeros((3, 5)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(devices=0), "devices must be a positive int"),
        (dict(devices=2.0), "devices must be a positive int"),
        (dict(devices=2, scheme="ring"), "scheme must be one of"),
        (dict(devices=4, grid=(2, 1, 1)), "grid .* has 2 regions but devices is 4"),
        (dict(devices=2, grid=(2, 1)), "grid must be three positive ints"),
        (dict(devices=2, growth=1.0), "growth must be > 1"),
        (dict(devices=2, min_edges=0), "min_atoms and min_edges"),
    ],
)
def test_bad_decompositions_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Decomposition(**kwargs)


def test_bad_split_inputs_are_clear_errors():
    atoms = _alloy()
    s, r, sh = neighbour_edges(atoms, CONFIG.cutoff)
    species = CONFIG.species_index(atoms.numbers)
    args = (atoms.positions, atoms.cell.array, atoms.pbc)
    with pytest.raises(ValueError, match="no atoms"):
        split(np.zeros((0, 3)), atoms.cell.array, atoms.pbc, species[:0], s[:0], r[:0], sh[:0], Decomposition(2), 2)
    with pytest.raises(ValueError, match="species must have shape"):
        split(*args, species[:-1], s, r, sh, Decomposition(2), 2)
    with pytest.raises(ValueError, match="edge indices must lie in"):
        split(*args, species, s + len(atoms), r, sh, Decomposition(2), 2)
    with pytest.raises(ValueError, match="must describe the same edges"):
        split(*args, species, s[:-1], r, sh, Decomposition(2), 2)
    with pytest.raises(ValueError, match="num_layers must be a positive int"):
        split(*args, species, s, r, sh, Decomposition(2), 0)


def test_more_devices_than_jax_has_is_a_clear_error():
    import jax

    from jequi.models.distributed import device_mesh

    with pytest.raises(ValueError, match=f"{len(jax.devices()) + 1} devices requested but JAX sees"):
        device_mesh(len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="devices must be a positive int"):
        device_mesh(0)
