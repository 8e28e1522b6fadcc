"""The models' precision policies (jequi.models.precision: "float32", "tf32", "bf16-mixed")
through every entry point: JequiCalculator, ShardedCalculator, DeviceMD and train, on the
shipped "nequip-emt" model and on small NequIP, MACE and Nequix configs.

The oracle of the "float32" policy (the default: the pretrained models' own numbers) is the
float64 calculator; the oracle of the others is the "float32" policy:

* "tf32" equals float32 on the CPU, which has no TF32 (the policy multiplies in float32 there);
* "bf16-mixed" stores the convolutions' operands in bfloat16, so it is not float32's to the bit
  but within a few bfloat16 roundings of it (measured on the rattled Cu-Au cell below: force MAE
  1.6 meV/Å, energy 0.2 meV/atom). XLA's CPU ignores the BF16_BF16_F32 dot algorithm of the
  linear layers on float32 operands (jax.lax.dot_general's lowering says so), so with x64 off the
  CPU's difference is the convolutions' bfloat16 storage alone (under this suite's x64, the
  lowering also rounds the model's float64-promoted operands of those dots to bfloat16);
* structurally, the jaxpr of a "bf16-mixed" model holds ``jequi_trilinear`` calls on bfloat16
  operands, and a "float32" one none.

Errors: an unknown policy name (the choices named), an architecture without the policy
(E2Former: float32 only) and the e3nn baseline convolution under half precision.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import bulk
from jax.extend import core as jax_core

import jequi
from jequi.models import DeviceMD, E2FormerConfig, JequiCalculator, MACEConfig, NequIPConfig, NequixConfig, ShardedCalculator, data
from jequi.models.calculator import _evaluate, calculator_model, load_model
from jequi.models.data import neighbour_edges
from jequi.models.loss import errors
from jequi.models.md import thermalize
from jequi.models.precision import POLICIES, policy, with_precision
from jequi.models.train import make_batches, train

POLICY_NAMES = ["float32", "tf32", "bf16-mixed"]
CHOICES = r"precision must be one of 'float32', 'tf32', 'bf16-mixed', got 'fp8'"
ON_CPU = jax.default_backend() == "cpu"
# The energy bound (eV/atom) of a half-precision policy against float32 on a GPU. There the
# BF16_BF16_F32 linears round their operands to bfloat16 too (the CPU ignores that algorithm, so
# its bound, 1 meV/atom, covers the convolutions' storage alone): measured on the H200, 1.1 to
# 1.75 meV/atom on the shipped model, 3.5 on Nequix (benchmarks/results/2026-12-02-nvidia-h200-
# precision-nequix.md); the accuracy target is the force error, which keeps its bound.
GPU_ENERGY_BOUND = 5e-3


def cu_au():
    """A rattled 32-atom Cu-Au cell (periodic: stress too)."""
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.numbers[[1, 5, 9, 14, 22]] = 79
    atoms.rattle(0.1, seed=3)
    return atoms


@functools.lru_cache
def calculated(precision):
    """The shipped model's calculator with `precision` and its results on
    :func:`cu_au` (one compilation per policy, shared by the tests)."""
    calc = JequiCalculator("nequip-emt", precision=precision)
    atoms = cu_au()
    atoms.calc = calc
    out = {
        "energy": atoms.get_potential_energy(),
        "energies": atoms.get_potential_energies(),
        "forces": atoms.get_forces(),
        "stress": atoms.get_stress(),
    }
    return calc, out


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (jit, custom_jvp/vjp, scan, cond)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax_core.ClosedJaxpr):
                    yield from _equations(sub.jaxpr)
                elif isinstance(sub, jax_core.Jaxpr):
                    yield from _equations(sub)


def trilinear_operand_dtypes(fn, *args):
    """The floating operands' dtypes of each ``jequi_trilinear`` call in ``fn(*args)``'s jaxpr."""
    closed = jax.make_jaxpr(fn)(*args)
    return [
        {str(v.aval.dtype) for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)}
        for eqn in _equations(closed.jaxpr)
        if eqn.primitive.name == "jequi_trilinear"
    ]


# --- the calculators ---------------------------------------------------------------------------
def test_policies_are_the_three_named():
    assert list(POLICIES) == POLICY_NAMES
    assert policy("float32").conv_dtype is None and policy("tf32").conv_dtype is None
    assert policy("bf16-mixed").conv_dtype == jnp.bfloat16


def _check_results(out):
    """ase's results as a calculator returns them: finite float32-or-better numpy arrays."""
    assert np.isfinite(out["energy"])
    for key in ("energies", "forces", "stress"):
        a = out[key]
        assert isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float64), (key, type(a), getattr(a, "dtype", None))
        assert np.all(np.isfinite(a)), key


def test_float32_is_the_default_and_multiplies_in_full_precision():
    """The default calculator is the float32 one (the same config, so the same jitted program),
    and its numbers are float64's to float32 rounding (measured: forces 5e-6 eV/Å; a TF32 or
    bfloat16 multiply would be 1e-3 or more off)."""
    default = JequiCalculator("nequip-emt")
    calc, got = calculated("float32")
    assert default.config == calc.config and default.config.precision == "float32"
    _check_results(got)
    atoms = cu_au()
    atoms.calc = JequiCalculator("nequip-emt", dtype="float64")
    assert abs(got["energy"] - atoms.get_potential_energy()) < 1e-4
    np.testing.assert_allclose(got["forces"], atoms.get_forces(), rtol=0, atol=1e-4)
    np.testing.assert_allclose(got["energies"], atoms.get_potential_energies(), rtol=0, atol=2e-5)
    np.testing.assert_allclose(got["stress"], atoms.get_stress(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["tf32", "bf16-mixed"])
def test_calculator_policy_against_float32(precision):
    """Energy, per-atom energies, forces and stress of ``JequiCalculator(precision=p)`` against
    the float32 (default) calculator's."""
    calc, got = calculated(precision)
    assert calc.config.precision == precision
    want = calculated("float32")[1]
    _check_results(got)
    n = len(cu_au())
    if precision == "tf32" and ON_CPU:
        # the CPU has no TF32: the policy multiplies in float32 there, the same program as
        # float32's, so the same numbers (a TF32 multiply would be ~1e-3 off)
        assert abs(got["energy"] - want["energy"]) <= 1e-6 * abs(want["energy"])
        for key in ("energies", "forces", "stress"):
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-6 * np.abs(want[key]).max(), err_msg=key)
        return
    # bf16-mixed (and tf32 on a GPU): not float32's numbers (the policy is applied) but close
    force_err = np.abs(got["forces"] - want["forces"])
    assert force_err.max() > 1e-4, f"forces within {force_err.max():.2g} eV/Å of float32's: the policy was not applied"
    assert force_err.mean() < 5e-3, f"force MAE {1e3 * force_err.mean():.2f} meV/Å"
    energy_bound = 1e-3 if ON_CPU else GPU_ENERGY_BOUND
    assert abs(got["energy"] - want["energy"]) / n < energy_bound, f"{1e3 * abs(got['energy'] - want['energy']) / n:.2f} meV/atom"
    assert np.abs(got["energies"] - want["energies"]).max() < 1.5e-2  # eV (measured 4 meV)
    assert np.abs(got["stress"] - want["stress"]).max() < 2e-3  # eV/Å^3 (measured 2e-4; the stress itself ~0.1)
    assert abs(got["energy"] - got["energies"].sum()) < 1e-4


def test_sharded_calculator_takes_the_policy():
    """``ShardedCalculator(precision="bf16-mixed")`` on one device gives JequiCalculator's
    bf16-mixed numbers (not its float32 ones)."""
    calc = ShardedCalculator("nequip-emt", devices=1, precision="bf16-mixed")
    assert calc.config.precision == "bf16-mixed"
    atoms = cu_au()
    atoms.calc = calc
    forces, energy, stress = atoms.get_forces(), atoms.get_potential_energy(), atoms.get_stress()
    _, bf16 = calculated("bf16-mixed")
    _, f32 = calculated("float32")
    assert abs(energy - bf16["energy"]) < 1e-4
    np.testing.assert_allclose(forces, bf16["forces"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(stress, bf16["stress"], rtol=0, atol=1e-6)
    assert np.abs(forces - f32["forces"]).max() > 1e-4


# --- the compiled programs ---------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_the_calculators_convolutions_run_on_the_policys_dtype(precision):
    """The calculator's program (energy, forces, strain derivative) of the shipped model: under
    bf16-mixed every ``jequi_trilinear`` (the convolutions forward and backward) takes bfloat16
    node features, harmonics and radial weights; under float32 none does. The results stay
    float32 under both."""
    calc, _ = calculated(precision)
    args = (calc.params, *calc.padded_inputs(cu_au()))
    calls = trilinear_operand_dtypes(calc.compiled, *args)
    assert len(calls) >= 2 * NequIPConfig().num_layers  # each layer's conv and its backward
    if precision == "bf16-mixed":
        assert all(dtypes == {"bfloat16"} for dtypes in calls), calls
    else:
        assert not any("bfloat16" in dtypes for dtypes in calls), calls
    total, per_atom, forces, virial = jax.eval_shape(calc.compiled, *args)
    assert forces.dtype == virial.dtype == jnp.float32, (forces.dtype, virial.dtype)
    # the energies: float32, or float64 under this suite's jax_enable_x64 (float64 constants of the
    # model promote them; the same under both policies), never bfloat16
    assert total.dtype == per_atom.dtype and total.dtype in (jnp.float32, jnp.float64), (total.dtype, per_atom.dtype)


def _small_graph_inputs(config):
    atoms = cu_au()
    graph = jequi.graph_from_atoms(atoms, config.cutoff)
    species = jnp.asarray(config.species_index(atoms.numbers))
    return species, jnp.asarray(atoms.positions, jnp.float32), graph, jnp.asarray(atoms.cell.array, jnp.float32)


SMALL_CONFIGS = {
    "nequip": NequIPConfig(hidden="8x0e+4x1o+2x2e", num_basis=4, radial_hidden=8, cutoff=3.8),
    "mace": MACEConfig(species=(29, 79), hidden="8x0e+8x1o", sh_lmax=2, correlation=2, radial_mlp=(8,), cutoff=3.8, avg_num_neighbors=12.0),
    "nequix": NequixConfig(species=(29, 79), hidden="8x0e+4x1o+2x2e", sh_lmax=2, num_layers=2, radial_mlp_size=8, cutoff=3.8),
}


@pytest.mark.parametrize("name", sorted(SMALL_CONFIGS))
def test_every_architecture_stores_its_convolutions_in_bfloat16(name):
    """NequIP, MACE and Nequix: ``energies`` of a ``with_precision(config, "bf16-mixed")``
    config traces its ``jequi_trilinear`` calls on bfloat16 operands, the float32 config's on
    none (a trace on abstract parameters: nothing is compiled)."""
    config = SMALL_CONFIGS[name]
    species, positions, graph, cell = _small_graph_inputs(config)
    params = jax.eval_shape(lambda: config.init_params(jax.random.key(0), species, positions, graph, cell))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), params)
    for precision in ("float32", "bf16-mixed"):
        cfg = with_precision(config, precision)
        assert cfg.precision == precision and dataclasses.replace(cfg, precision=config.precision) == config
        calls = trilinear_operand_dtypes(lambda p, x: cfg.energies(p, species, x, graph, cell).sum(), params, positions)
        assert calls, f"{name}: no jequi_trilinear call"
        if precision == "bf16-mixed":
            assert all(dtypes == {"bfloat16"} for dtypes in calls), (name, calls)
        else:
            assert not any("bfloat16" in dtypes for dtypes in calls), (name, calls)


# --- errors ------------------------------------------------------------------------------------
def test_an_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match=CHOICES):
        policy("fp8")
    with pytest.raises(ValueError, match=CHOICES):
        with_precision(NequIPConfig(), "fp8")
    with pytest.raises(ValueError, match=CHOICES):
        JequiCalculator("nequip-emt", precision="fp8")
    with pytest.raises(ValueError, match=CHOICES):
        ShardedCalculator("nequip-emt", devices=1, precision="fp8")
    with pytest.raises(ValueError, match=CHOICES):
        DeviceMD(bulk("Cu", "fcc", a=3.6, cubic=True).repeat(5), "nequip-emt", precision="fp8")
    with pytest.raises(ValueError, match=CHOICES):
        train(NequIPConfig(), data.emt_dataset(1, seed=0), steps=1, progress=False, precision="fp8")
    assert with_precision(NequIPConfig(), None) == NequIPConfig()  # None: the config's own


def test_a_model_without_the_policy_runs_float32_only():
    """E2Former has no ``precision`` field: float32 (and None) return its config unchanged,
    the other policies are a clear error."""
    config = E2FormerConfig()
    assert not any(f.name == "precision" for f in dataclasses.fields(config))
    assert with_precision(config, "float32") is config
    assert with_precision(config, None) is config
    for name in ("bf16-mixed", "tf32"):
        with pytest.raises(ValueError, match=f"E2FormerConfig has no precision policy but float32; got '{name}'"):
            with_precision(config, name)
    with pytest.raises(ValueError, match=CHOICES):
        with_precision(config, "fp8")


def test_the_e3nn_baseline_convolution_refuses_half_precision():
    """``conv="e3nn"`` (gather, e3nn-jax product, segment_sum) has no bfloat16 storage: under
    bf16-mixed the energy is a clear error, in the calculator too; float32 and tf32 trace."""
    params, config = load_model("nequip-emt")
    e3nn_conv = dataclasses.replace(config, conv="e3nn")
    species, positions, graph, cell = _small_graph_inputs(config)
    for precision in ("float32", "tf32"):
        cfg = with_precision(e3nn_conv, precision)
        jax.make_jaxpr(lambda x: cfg.energies(params, species, x, graph, cell))(positions)
    cfg = with_precision(e3nn_conv, "bf16-mixed")
    with pytest.raises(ValueError, match=r"precision='bf16-mixed' stores the convolutions in half precision: it needs conv='jequi'"):
        jax.make_jaxpr(lambda x: cfg.energies(params, species, x, graph, cell))(positions)
    atoms = cu_au()
    atoms.calc = JequiCalculator((params, e3nn_conv), precision="bf16-mixed")  # the config is checked when evaluated
    with pytest.raises(ValueError, match=r"it needs conv='jequi'"):
        atoms.get_potential_energy()


# --- training and MD ---------------------------------------------------------------------------
TRAIN_CONFIG = NequIPConfig(hidden="4x0e+2x1o+2x2e", num_basis=4, radial_hidden=8, cutoff=3.8)


def test_training_under_bf16_mixed(monkeypatch):
    """``train(precision="bf16-mixed")``: two Adam steps on two EMT structures differentiate the
    loss of the bf16-mixed model (the config its step traces) and give finite losses and finite
    float32 parameters that moved. Run with x64 off: under it the batches' positions are
    float64, and XLA's CPU runtime has no bfloat16 x bfloat16 -> float32 dot for the float64
    model the BF16_BF16_F32 algorithm then rounds."""
    import jequi.models.train as train_module

    traced = []

    def recording_errors(params, config, *args, **kwargs):
        traced.append(config.precision)
        return errors(params, config, *args, **kwargs)

    monkeypatch.setattr(train_module, "errors", recording_errors)
    with jax.enable_x64(False):  # float32 batches: under x64 they are float64, a float64 model
        structures = data.emt_dataset(2, seed=3)
        b = make_batches(structures, TRAIN_CONFIG, 2)[0]
        # seeded unit-normal parameters of the model's shapes (its init traced, not run: cheaper)
        shapes = jax.eval_shape(TRAIN_CONFIG.init_params, jax.random.key(0), b.species, b.positions, b.graph, b.cell)
        rng = np.random.default_rng(5)
        p0 = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), jnp.float32), shapes)
        params, history = train(TRAIN_CONFIG, structures, steps=2, batch_size=2, learning_rate=1e-2, params=p0,
                                progress=False, precision="bf16-mixed")  # fmt: skip
    assert traced and set(traced) == {"bf16-mixed"}, traced
    assert TRAIN_CONFIG.precision == "float32"  # the caller's config is left as it was
    assert len(history.loss) == 2 and np.all(np.isfinite(history.loss)), history.loss
    leaves, leaves0 = jax.tree.leaves(params), jax.tree.leaves(p0)
    assert all(a.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(a))) for a in leaves)
    assert any(not np.array_equal(np.asarray(a), np.asarray(a0)) for a, a0 in zip(leaves, leaves0))


def test_device_md_under_bf16_mixed_follows_float32():
    """``DeviceMD(precision=...)`` with the shipped model's weights (its cutoff cut to 3 Å, so that
    a 108-atom cell is 3 cell-list cells across): 5 NVE steps at 300 K; the bf16-mixed total
    energy is finite, not float32's to the bit, within the policy's energy bound of the float32
    run's (which conserves it to 0.01 meV/atom: 0.5 meV/atom on the CPU, GPU_ENERGY_BOUND on a
    GPU), and conserved to 0.5 meV/atom itself."""
    params, config = load_model("nequip-emt")
    model = (params, dataclasses.replace(config, cutoff=3.0))
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.numbers[::9] = 79
    atoms.rattle(0.05, seed=1)
    thermalize(atoms, 300.0, seed=2)
    totals = {}
    for precision in ("float32", "bf16-mixed"):
        md = DeviceMD(atoms, model, precision=precision, skin=0.2, rebuild_every=5)
        assert md.config.precision == precision
        out = md.run(5)
        assert out["steps"] == 5 and np.all(np.isfinite(out["potential"])) and np.all(np.isfinite(out["kinetic"]))
        assert np.all(np.isfinite(md.positions))
        totals[precision] = (out["potential"] + out["kinetic"]) / len(atoms)
    f32, bf16 = totals["float32"], totals["bf16-mixed"]
    assert np.abs(f32 - f32[0]).max() < 1e-5, f32 - f32[0]
    diff = np.abs(bf16 - f32)
    assert diff.max() > 1e-7, "bf16-mixed gave float32's energies: the policy was not applied"
    assert diff.max() < (5e-4 if ON_CPU else GPU_ENERGY_BOUND), f"{1e3 * diff.max():.3f} meV/atom"
    # the offset from float32 is the energy error above; conservation is the policy's own
    assert np.abs(bf16 - bf16[0]).max() < 5e-4, f"{1e3 * np.abs(bf16 - bf16[0]).max():.3f} meV/atom"


def test_training_refuses_a_half_precision_policy_on_float64_batches():
    """Under jax_enable_x64 the batches are float64: a half-precision policy is refused by name
    (XLA's CPU runtime would fail on the float64 model's bfloat16 dots with an obscure error)."""
    structures = data.emt_dataset(2, seed=3)
    with pytest.raises(ValueError, match="batches are float64"):
        train(TRAIN_CONFIG, structures, steps=1, batch_size=2, progress=False, precision="bf16-mixed")


def _dots(jaxpr):
    """Every ``dot_general`` of `jaxpr`, sub-jaxprs included: ``(precision, operand shapes)``."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.append((eqn.params["precision"], [tuple(v.aval.shape) for v in eqn.invars]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _dots(inner)
    return out


@pytest.mark.parametrize("precision", ["float32", "bf16-mixed"])
def test_no_matmul_runs_at_the_platforms_default_precision(precision):
    """Every matmul of the calculator's evaluation names its precision: none is left to the
    platform's default, which on a GPU is TF32 for float32 (the strain applied to the positions
    ran so, rounding them by about 1e-3 relative). The geometry's (positions and edge vectors
    against the cell, ``(rows, 3) x (3, 3)``) is full float32 under every policy."""
    params, config, _ = calculator_model("nequip-emt", None, "float32", precision)
    atoms = cu_au()
    s, r, shifts = neighbour_edges(atoms, config.cutoff)
    n = len(atoms)
    args = (params, jnp.asarray(config.species_index(atoms.numbers)), jnp.asarray(atoms.positions, jnp.float32),
            jnp.asarray(atoms.cell.array, jnp.float32), jnp.asarray(s), jnp.asarray(r), jnp.asarray(shifts, jnp.float32),
            jnp.ones(n, bool))  # fmt: skip
    dots = _dots(jax.make_jaxpr(functools.partial(_evaluate, config))(*args).jaxpr)
    assert len(dots) > 10
    assert all(p is not None for p, _ in dots), [shapes for p, shapes in dots if p is None]
    highest = (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST)
    geometry = [p for p, shapes in dots if shapes[1] == (3, 3)]
    assert geometry and all(p == highest for p in geometry), geometry
