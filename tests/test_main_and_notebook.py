"""The README's main job (``python -m jequi``) and the quickstart notebook run end to end."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

import jequi.__main__ as main_job
from jequi.models import NequIPConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_main_job_runs_the_foundation_model_on_mgo(capsys):
    """The default job: nequix-oam-1 and its provenance, energy, forces and stress of rattled MgO
    (a real compound, near its equilibrium: a few GPa, about -5.9 eV/atom), a short MD."""
    main_job.main(["--md", "3"])
    out = capsys.readouterr().out
    for text in ("model: nequix-oam-1: Nequix", "trained on OMat24", "labels: DFT", "arXiv", "MIT licence", "Mg32O32, 64 atoms",
                 "stress (GPa", "timing:", "MD: 3 steps", "energy drift"):  # fmt: skip
        assert text in out, out
    per_atom = float(out.split("eV (")[1].split()[0])
    assert -6.5 < per_atom < -5.5, out
    stress = [float(v) for v in out.split("stress (GPa, xx yy zz yz xz xy): ")[1].split()[:6]]
    assert max(abs(v) for v in stress) < 20.0, out
    assert "EMT reference" not in out


def test_main_job_prints_energy_forces_timing_and_md(capsys):
    main_job.main(["--model", "nequip-emt", "--md", "8"])
    out = capsys.readouterr().out
    for text in ("energy:", "forces (eV/A)", "EMT reference", "timing:", "jequi backend", "MD: 8 steps", "steps/s", "energy drift"):
        assert text in out, out
    drift = float(out.split("energy drift ")[1].split()[0])
    assert abs(drift) < 1.0, out  # meV/atom over 8 fs: a force inconsistent with the energy would show


def test_main_job_trains_and_reads_structure_files(tmp_path, capsys):
    import ase.io

    path = tmp_path / "cluster.xyz"
    from ase.cluster import Icosahedron

    ase.io.write(path, Icosahedron("Pt", 2))
    # a narrow one-layer model: the test checks the job's steps, and the default model's training step compiles for minutes
    small = NequIPConfig(hidden="4x0e+2x1o", sh_lmax=1, num_layers=1, num_basis=4, radial_hidden=8)
    main_job.main(["--train", "--steps", "4", "--structure", str(path), "--md", "3"], train_config=small)
    out = capsys.readouterr().out
    assert "trained in" in out and "Pt13" in out and "MD: 3 steps" in out
    assert "1 layers, hidden 4x0e+2x1o" in out, out  # the job ran the model it trained


def test_unknown_elements_are_reported(tmp_path):
    import ase.io
    from ase.build import molecule

    path = tmp_path / "water.xyz"
    ase.io.write(path, molecule("H2O"))
    with pytest.raises(ValueError, match="not in the model's species"):
        main_job.main(["--model", "nequip-emt", "--structure", str(path)])


@pytest.mark.slow  # a kernel process of its own that trains a model: started first under pytest-xdist
def test_quickstart_notebook_executes():
    """Every cell runs, with the training shortened (150 -> 20 steps: the same code, compiled
    once, and a CPU-suite's worth of time less) on a narrower model (the same code again, and its
    training step compiles in a fraction of the time)."""
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    model = 'NequIPConfig(hidden="16x0e+8x1o+4x2e")'
    training = [c for c in nb.cells if "steps=150, eval_every=50" in c.source and model in c.source]
    assert len(training) == 1, "the notebook's model or training call changed: update this test"
    training[0].source = training[0].source.replace("steps=150, eval_every=50", "steps=20, eval_every=10").replace(
        model, 'NequIPConfig(hidden="4x0e+2x1o", sh_lmax=1, num_layers=1, num_basis=4, radial_hidden=8)'
    )
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "force MAE on held-out structures" in outputs


def test_check_reports_platform_versions_and_backends(capsys):
    """``python -m jequi --check``: exit 0 on this machine, every backend listed with a reason
    where it is not available, pallas self-tested against xla."""
    with pytest.raises(SystemExit) as done:
        main_job.main(["--check"])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    for text in ("platform: ", "versions: jax ", "jaxlib ", "kernel cache: ", "backend xla: available", "backend pallas: available",
                 "self-test against xla passed", "backend cuda", "check: everything that should work works"):  # fmt: skip
        assert text in out, out
    import jax

    if jax.default_backend() != "gpu":
        assert "backend cuda: not available: needs a CUDA GPU" in out


def test_check_fails_when_a_backend_fails_its_self_test(monkeypatch, capsys):
    from jequi import check

    monkeypatch.setattr(check, "self_test", lambda name: 1.0)
    assert check.run() == 1
    assert "self-test against xla FAILED" in capsys.readouterr().out
