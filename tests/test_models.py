"""The NequIP-style model: symmetries, forces vs finite differences, training, frameworks,
backends, batching."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.build import bulk
from ase.cluster import Icosahedron
from conftest import assert_close
from scipy.spatial.transform import Rotation

import jequi
from jequi.models import NequIP, NequIPConfig, data, nequip_haiku
from jequi.models.loss import errors
from jequi.models.train import make_batches

CONFIG = NequIPConfig(hidden="4x0e+2x1o+2x2e", num_basis=4, radial_hidden=8, cutoff=3.8)


def crystal():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
    atoms.numbers[[1, 2]] = 79
    atoms.rattle(0.1, seed=1)
    return atoms


def cluster():
    atoms = Icosahedron("Ni", 2)
    atoms.numbers[:4] = 47
    atoms.rattle(0.05, seed=2)
    return atoms


@functools.lru_cache
def params(config=CONFIG):
    atoms = crystal()
    g = jequi.graph_from_atoms(atoms, config.cutoff)
    p = NequIP(config).init(jax.random.key(0), config.species_index(atoms.numbers), jnp.asarray(atoms.positions), g, jnp.asarray(atoms.cell.array))
    return jax.tree.map(lambda a: a + 0.1, p)  # nonzero shifts, nothing special about init


@functools.lru_cache
def _energy_and_grad(config):
    """The energy and its gradient, jitted once per model (and per graph shape)."""

    def energy(positions, p, species, g, cell):
        return NequIP(config).apply(p, species, positions, g, cell).sum()

    return jax.jit(jax.value_and_grad(energy))


def energy_forces(atoms, config=CONFIG, p=None):
    g = jequi.graph_from_atoms(atoms, config.cutoff)
    species, cell = config.species_index(atoms.numbers), jnp.asarray(atoms.cell.array)
    e, grad = _energy_and_grad(config)(jnp.asarray(atoms.positions), params() if p is None else p, species, g, cell)
    return float(e), -np.asarray(grad)


@pytest.mark.parametrize("make", [crystal, cluster])
def test_rotation_translation_permutation(make):
    atoms = make()
    e, f = energy_forces(atoms)
    rot = Rotation.random(random_state=3).as_matrix()
    moved = atoms.copy()
    moved.positions = atoms.positions @ rot.T + np.array([0.3, -1.1, 2.0])
    moved.set_cell(atoms.cell.array @ rot.T if atoms.pbc.any() else atoms.cell)
    e2, f2 = energy_forces(moved)
    assert abs(e2 - e) < 1e-9 * max(1, abs(e))
    assert_close(f2, f @ rot.T, 1e-9)
    perm = np.random.default_rng(4).permutation(len(atoms))
    e3, f3 = energy_forces(atoms[perm])
    assert abs(e3 - e) < 1e-9 * max(1, abs(e))
    assert_close(f3, f[perm], 1e-9)


def test_forces_equal_finite_differences():
    atoms = crystal()
    _, f = energy_forces(atoms)
    h = 1e-5
    for i, k in [(0, 0), (3, 2), (2, 1)]:
        plus, minus = atoms.copy(), atoms.copy()
        plus.positions[i, k] += h
        minus.positions[i, k] -= h
        fd = -(energy_forces(plus)[0] - energy_forces(minus)[0]) / (2 * h)
        assert abs(fd - f[i, k]) < 1e-6 * max(1.0, abs(f[i, k])), (fd, f[i, k])


def test_haiku_and_flax_give_the_same_energy():
    atoms = crystal()
    g = jequi.graph_from_atoms(atoms, CONFIG.cutoff)
    args = (CONFIG.species_index(atoms.numbers), jnp.asarray(atoms.positions), g, jnp.asarray(atoms.cell.array))
    model = nequip_haiku(CONFIG)
    hk_params = model.init(jax.random.key(0), *args)
    assert jax.tree.structure(hk_params["nequip"]) == jax.tree.structure(dict(params()["params"]))
    assert_close(model.apply({"nequip": params()["params"]}, *args), NequIP(CONFIG).apply(params(), *args), 0)


def test_pallas_forces_equal_xla_forces():
    # a narrower model than CONFIG (interpreted kernels compile per path: its convs have a few)
    atoms = crystal()
    narrow = dataclasses.replace(CONFIG, hidden="4x0e+2x1o", sh_lmax=1)
    e_x, f_x = energy_forces(atoms, dataclasses.replace(narrow, backend="xla"), params(narrow))
    e_p, f_p = energy_forces(atoms, dataclasses.replace(narrow, backend="pallas"), params(narrow))
    assert abs(e_x - e_p) < 1e-10
    assert_close(f_p, f_x, 1e-10)


def test_e3nn_baseline_convolution_gives_the_same_model():
    atoms = crystal()
    e_j, f_j = energy_forces(atoms)
    e_e, f_e = energy_forces(atoms, NequIPConfig(**{**CONFIG.__dict__, "conv": "e3nn"}))
    assert abs(e_j - e_e) < 1e-10
    assert_close(f_e, f_j, 1e-10)
    with pytest.raises(ValueError, match="conv must be"):
        energy_forces(atoms, NequIPConfig(**{**CONFIG.__dict__, "conv": "torch"}))


def test_batches_share_the_tightest_shape():
    """make_batches pads every batch to the most atoms and edges of any one batch (one shape),
    no more."""
    structures = data.emt_dataset(7, seed=8)
    batches = make_batches(structures, CONFIG, 3)
    edges = data.structure_edges(structures, CONFIG.cutoff)
    groups = [range(0, 3), range(3, 6), range(6, 7)]
    atoms = max(sum(len(structures[i].numbers) for i in g) for g in groups)
    n_edges = max(sum(len(edges[i][0]) for i in g) for g in groups)
    assert len(batches) == 3 and {(b.species.shape[0], b.graph.num_edges) for b in batches} == {(atoms, n_edges)}
    for b, g in zip(batches, groups):
        assert int(b.node_mask.sum()) == sum(len(structures[i].numbers) for i in g)


def test_padded_batch_and_vmap_match_single_structures():
    structures = data.emt_dataset(3, seed=6)
    apply = jax.jit(NequIP(CONFIG).apply)
    singles = []
    for s in structures:
        atoms = s.to_atoms()
        g = jequi.graph_from_atoms(atoms, CONFIG.cutoff)
        species, cell = CONFIG.species_index(atoms.numbers), jnp.asarray(atoms.cell.array)
        singles.append(float(apply(params(), species, jnp.asarray(atoms.positions), g, cell).sum()))
    b = data.batch(structures, CONFIG, n_node=120, n_edge=6000)
    per_atom = apply(params(), b.species, b.positions, b.graph, b.cell)
    energies = jax.ops.segment_sum(jnp.where(b.node_mask, per_atom, 0), b.node_graph, 4)[:3]
    assert_close(energies, np.array(singles), 1e-10)
    # vmap over equal-size (padded) structures
    one = [data.batch([s], CONFIG, n_node=40, n_edge=2000) for s in structures]
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *one)
    batched = jax.jit(jax.vmap(lambda b: NequIP(CONFIG).apply(params(), b.species, b.positions, b.graph, b.cell)))
    got = jnp.sum(jnp.where(stacked.node_mask, batched(stacked), 0), axis=1)
    assert_close(got, np.array(singles), 1e-10)


def test_unknown_element_is_a_clear_error():
    with pytest.raises(ValueError, match=r"elements \[8\] are not in the model's species"):
        CONFIG.species_index([29, 8])


def test_batches_compile_once():
    """Every batch of make_batches has one static structure and the same shapes, the smaller
    last batch included (a batch without padding edges in receiver order, or one with fewer
    structure slots, would otherwise be a second compilation of the training step)."""
    structures = data.emt_dataset(10, seed=1)
    batches = make_batches(structures, CONFIG, 4)
    assert len(batches) == 3 and len({jax.tree.structure(b) for b in batches}) == 1
    shapes = {tuple(a.shape for a in jax.tree.leaves(b)) for b in batches}
    assert len(shapes) == 1
    assert [int(jnp.sum(b.num_atoms > 0)) for b in batches] == [4, 4, 2]


def test_padding_structures_do_not_count_in_the_loss_and_a_training_step_lowers_it():
    """A batch padded with empty structures (make_batches' last batch) has the loss, metrics and
    gradients of the same structures unpadded; one optax step along those gradients lowers the
    loss (the same compiled loss and gradient)."""
    import optax

    structures = data.emt_dataset(2, seed=3)
    p = params()
    plain = data.batch(structures, CONFIG)
    padded = data.batch(structures, CONFIG, n_node=plain.species.shape[0] + 5, n_edge=plain.graph.num_edges + 7, n_graph=5)
    assert padded.num_atoms.shape == (5,) and int(padded.num_atoms[2:].sum()) == 0
    f = jax.jit(jax.value_and_grad(lambda p, b: errors(p, CONFIG, b), has_aux=True))
    (loss, metrics), grads = f(p, plain)
    (loss_p, metrics_p), grads_p = f(p, padded)
    assert_close(loss_p, loss, 1e-12)
    for k in ("energy_mae", "force_mae"):
        assert_close(metrics_p[k], metrics[k], 1e-12)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-10), grads_p, grads)
    opt = optax.sgd(1e-3)
    updates, _ = opt.update(grads_p, opt.init(p))
    assert float(f(optax.apply_updates(p, updates), padded)[0][0]) < float(loss_p)
    with pytest.raises(ValueError, match="structure slots"):
        data.batch(structures, CONFIG, n_graph=1)


def test_chunked_forces_keep_no_per_edge_weights_or_hidden_values():
    """Energy + forces of a model whose convs run in edge chunks: the compiled program's
    temporaries stay under 1,500 floats a edge (the program that kept every layer's radial hidden
    values and first chunk's weights until the backward needed nearly twice that:
    benchmarks/results/2026-11-27-cpu-model-memory.md), and the values equal the unchunked model's."""
    from jequi.models.calculator import _evaluate

    config = NequIPConfig(hidden="16x0e+8x1o+8x2e", num_layers=3, radial_hidden=32, cutoff=3.8, backend="xla", edge_chunks=4)
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(3)
    atoms.rattle(0.05, seed=1)
    g = jequi.graph_from_atoms(atoms, config.cutoff)
    species, positions, cell = config.species_index(atoms.numbers), jnp.asarray(atoms.positions), jnp.asarray(atoms.cell.array)
    p = NequIP(config).init(jax.random.key(0), species, positions, g, cell)
    args = (species, positions, cell, g.senders, g.receivers, jnp.zeros((g.num_edges, 3)), np.ones(len(atoms), bool))
    evaluate = jax.jit(_evaluate, static_argnums=0)
    f32 = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, (p, *args))
    compiled = evaluate.lower(config, *f32).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp / 4 / g.num_edges < 1500, f"{temp / 4 / g.num_edges:.0f} floats a edge"
    # the values of that compiled program (float32: the chunks change only the order of sums)
    chunked, whole = compiled(*f32), evaluate(dataclasses.replace(config, edge_chunks=1), *f32)
    for a, b in zip(chunked, whole):
        assert_close(a, b, 1e-5)


def test_every_architecture_meets_the_interface():
    """NequIP, MACE and Nequix meet the whole interface the calculator, MD, sharding and
    training call; E2Former all but ``energies`` on a radius graph (it runs on its own
    neighbour lists: training only)."""
    from jequi.models import E2FormerConfig, MACEConfig, NequIPConfig
    from jequi.models.architecture import Architecture
    from jequi.models.pretrained import load_any

    configs = [NequIPConfig(), MACEConfig(), load_any("nequix-oam-1")[1]]
    for config in configs:
        assert isinstance(config, Architecture), type(config).__name__
    e2former = E2FormerConfig()
    assert not isinstance(e2former, Architecture) and not hasattr(e2former, "energies")
    assert all(hasattr(e2former, m) for m in ("species_index", "module", "init_params", "with_species_energies", "prepare_batches"))
