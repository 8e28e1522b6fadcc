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
from jequi.models.data import neighbour_edges
from jequi.models.decomposition import Decomposition, choose_grid, regions, split

ROOT = pathlib.Path(__file__).resolve().parents[1]
F64 = 1e-12  # float64: the split changes only the order of sums


def multidevice_failures(r: dict) -> list[str]:
    """What in the results of tests/multidevice_checks.py is not as it must be."""
    bad = []

    def check(ok, what):
        if not ok:
            bad.append(what)

    check(r["devices"] == 4, f"4 host devices, got {r['devices']}")
    for case in ("periodic", "open", "planes"):
        for scheme in ("exchange", "halo"):
            c = r["structures"][f"{case}/{scheme}/4"]
            for what in ("energy", "energies", "forces", "virial"):  # float64: the split changes only the order of sums
                check(c[what] < F64, f"{case}/{scheme}: {what} deviates by {c[what]:.2e} from one device")
            check(c["max_force"] > 1e-3, f"{case}/{scheme}: no forces to compare")
            check(sum(c["owned"]) == c["atoms"] and max(c["ghosts"]) > 0, f"{case}/{scheme}: ownership {c}")
    s = r["structures"]
    planes = s["planes/exchange/4"]
    check(planes["owned"][0] == 0 and planes["ghosts"][0] == 0, f"planes: region 0 should hold nothing: {planes}")
    check(planes["atoms_on_cuts"] == planes["atoms"], f"planes: every atom should lie on a cut plane: {planes}")
    check(s["periodic/halo/4"]["ghosts"][0] > s["periodic/exchange/4"]["ghosts"][0], "halo ghosts should reach further")
    t = r["training"]
    check(t["loss"] < F64 and t["params"] < F64, f"data-parallel training differs from one device: {t}")
    check(t["moved"] > 1e-3 and len(t["losses"]) == 3, f"training did not run its 3 steps: {t}")
    c = r["calculator"]["calculator"]
    check(c["energy"] < 1e-5 and c["forces"] < 1e-5 and c["stress"] < 1e-5, f"float32 calculator on 2 devices: {c}")
    check(c["md_energy"] < 1e-6 and c["md_positions"] < 1e-6, f"MD on 2 devices (eV/atom, A after 4 steps): {c}")
    check(c["compilations"] == 1, f"MD should compile once (size buckets): {c}")
    check(c["shifts"] == [1], f"on 2 devices, left and right neighbour are one device: {c}")
    k = r["chunked_conv"]
    check(k["xla"] < F64 and k["pallas"] < F64, f"radial_conv in edge chunks inside shard_map differs from one device: {k}")
    for scheme, c in r["mace"].items():
        for what in ("energy", "energies", "forces", "virial"):
            check(c[what] < F64, f"MACE {scheme}: {what} deviates by {c[what]:.2e} from one device")
        check(c["max_force"] > 1e-3, f"MACE {scheme}: no forces to compare")
    for scheme in ("exchange", "halo"):
        c = r["nequix"][scheme]
        for what in ("energy", "energies", "forces", "virial"):
            check(c[what] < F64, f"Nequix {scheme}: {what} deviates by {c[what]:.2e} from one device")
        check(c["max_force"] > 1e-3, f"Nequix {scheme}: no forces to compare")
    m = r["calculator"]["main"]
    check(m["split_line"] and m["energy"] <= 1e-4 and m["forces"] <= 1e-4, f"python -m jequi --devices 2 (4 decimals): {m}")
    return bad


@pytest.mark.slow  # one subprocess of about 90 s of CPU: started first under pytest-xdist
def test_four_host_devices_give_the_one_device_results(tmp_path):
    """Both schemes against one device (periodic, open, atoms on region boundaries, an empty
    region), the sharded calculator and MD, python -m jequi --devices 2, data-parallel training:
    all in one subprocess (one test, so pytest-xdist starts it once)."""
    out = tmp_path / "checks.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(ROOT / "tests" / "multidevice_checks.py"), str(out)], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    failures = multidevice_failures(json.loads(out.read_text()))
    assert not failures, "\n".join(failures)


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
    from jequi.models.data import bucket

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

    from jequi.models.mesh import device_mesh

    with pytest.raises(ValueError, match=f"{len(jax.devices()) + 1} devices requested but JAX sees"):
        device_mesh(len(jax.devices()) + 1)
    with pytest.raises(ValueError, match="devices must be a positive int"):
        device_mesh(0)


def test_parameters_by_name_from_linen_or_haiku():
    from jequi.models.nequip import model_parameters

    names = {"embed": np.zeros(2)}
    assert model_parameters({"params": names}) is names and model_parameters({"nequip": names}) is names
    with pytest.raises(ValueError, match="linen model's"):
        model_parameters({"w": 1})


def test_scaling_benchmark_efficiencies_and_tables(tmp_path, monkeypatch):
    """benchmarks/scaling_benchmark.py's strong and weak efficiencies and its markdown, on made-up cells."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.delenv("OUT", raising=False)
    import scaling_benchmark as sb

    def cell(part, atoms, devices, ms, scheme="exchange", **extra):
        return {"part": part, "atoms": atoms, "devices": devices, "scheme": scheme, "ms": ms, "grid": [1, 1, devices],
                "real": {"owned": [atoms // devices], "ghosts": [10], "edges": [100]}, "padded": {"owned": 1, "ghosts": 1, "edges": 1},
                **extra}  # fmt: skip

    cells = [cell("strong", 4000, 1, 100.0), cell("strong", 4000, 4, 31.25), cell("strong", 4000, 4, 50.0, "halo"),
             cell("weak", 1000, 1, 30.0), cell("weak", 4000, 4, 40.0, breakdown=None),
             cell("strong", 4000, 2, 60.0, error="skipped: budget")]  # fmt: skip
    del cells[-1]["ms"]
    assert sb.efficiency(cells[1], cells) == pytest.approx(0.8)  # 100 / (4 x 31.25)
    assert sb.efficiency(cells[2], cells) == pytest.approx(0.5)
    assert sb.efficiency(cells[4], cells) == pytest.approx(0.75)  # (30 / 1000) / (40 x 4 / 4000)
    assert sb.efficiency(cells[5], cells) is None
    cells[1]["breakdown"] = {"compute_ms_max": 26.0, "compute_ms_mean": 25.0, "exchange_ms": 1.5, "exchange_mb_per_device": 12.0, "rest_ms": 3.75}
    result = {"date": "2026-11-27", "device": "Test GPU x4", "jax": "0", "model": "m", "nccl_nvls_enable": "0", "cells": cells,
              "config": {"hidden": "8x0e", "sh_lmax": 1, "num_layers": 2, "cutoff": 4.5, "backend": None}, "args": {"growth": 1.01},
              "largest": {"1": {"fits": 1000, "fails": 2000, "error": "RESOURCE_EXHAUSTED"}, "4": {"fits": 4000, "ratio": 4.0}}}  # fmt: skip
    sb.write(result, tmp_path)
    md = (tmp_path / "2026-11-27-test-gpu-x4-scaling.md").read_text()
    assert "| strong | 4000 | 4 | exchange | 1x1x4 | 31.2 | 80 % |" in md and "| weak | 4000 | 4 | exchange | 1x1x4 | 40.0 | 75 % |" in md
    assert "| 31.2 | 26.0 | 25.0 | 1.50 (12.0) | 3.8 |" in md  # where the time goes
    assert "- 4 device(s): 4000 atoms, 4.00x one device's (larger not tried)" in md and "skipped: budget" in md
