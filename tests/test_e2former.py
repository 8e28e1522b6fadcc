"""The E2Former-style model (jequi.models.e2former): the neighbour-list helper, the per-source
values against the direct per-edge computation, symmetries, forces, periodic cells, smoothness at
the cutoff, training, and the Pallas attention (interpret mode) against xla.

Tiny sizes, float64, xla on CPU. Every model structure has 8 atoms and the same padded
neighbour list shape (K, N_src), so the energy-and-forces function compiles once per backend.
"""

import dataclasses
import functools

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk
from scipy.spatial.transform import Rotation

from jequi.atoms import radius_edges
from jequi.models import E2FormerConfig, neighbor_list, neighbors_from_atoms
from jequi.models.e2former import E2Former, equivariant_attention, init_params, neighbor_sizes

CFG = E2FormerConfig(hidden="4x0e+2x1o+2x2e", heads=2, head_dim=4, num_basis=4, radial_hidden=8, qk_hidden=8, cutoff=3.0)
K, NSRC = 16, 128  # one padded shape for every structure below


def cu8(seed=0):
    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((2, 1, 1))
    atoms.numbers[[1, 6]] = (28, 79)  # Ni, Au: more than one species
    atoms.rattle(0.08, seed=seed)
    return atoms


def neighbors(atoms, **kwargs):
    return neighbors_from_atoms(atoms, CFG.cutoff, max_neighbors=K, num_sources=NSRC, **kwargs)


@functools.partial(jax.jit, static_argnames="config")
def energy_forces(params, species, positions, nb, cell, config=CFG):
    def total(p):
        e = E2Former(config).apply(params, species, p, nb, cell)
        return e.sum(), e

    (energy, per_atom), grad = jax.value_and_grad(total, has_aux=True)(positions)
    return energy, -grad, per_atom


def evaluate(params, atoms, nb=None, config=CFG):
    nb = neighbors(atoms) if nb is None else nb
    cell = jnp.asarray(atoms.cell.array) if atoms.pbc.any() else jnp.eye(3)
    return energy_forces(params, CFG.species_index(atoms.numbers), jnp.asarray(atoms.positions), nb, cell, config=config)


@pytest.fixture(scope="module")
def params():
    atoms = cu8()
    p = init_params(CFG, jax.random.key(0), CFG.species_index(atoms.numbers), jnp.asarray(atoms.positions), neighbors(atoms),
                    jnp.asarray(atoms.cell.array))  # fmt: skip
    shift = p["params"]["species_shift"]
    return {"params": {**p["params"], "species_shift": shift + 0.1 * jnp.arange(shift.shape[0])}}


# --- the neighbour list --------------------------------------------------------------------------
def test_neighbor_list_layout_ghosts_and_padding():
    #        edges: 1->0, 2->0, 1->0 (shift +x), 1->0 (shift +x again: one ghost), 0->2 (shift -x), pad
    senders = np.array([1, 2, 1, 1, 0, -1])
    receivers = np.array([0, 0, 0, 0, 2, -1])
    shifts = np.array([[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0], [-1, 0, 0], [0, 0, 0]], float)
    nb = neighbor_list(senders, receivers, 3, shifts, max_neighbors=5, num_sources=6)
    assert nb.neighbors.shape == (3, 5) and nb.num_sources == 6
    np.testing.assert_array_equal(nb.neighbors[0], [1, 2, 4, 4, 6])  # ghosts sorted: (0, -x) = 3, (1, +x) = 4
    np.testing.assert_array_equal(nb.neighbors[1], [6] * 5)
    np.testing.assert_array_equal(nb.neighbors[2], [3, 6, 6, 6, 6])
    np.testing.assert_array_equal(nb.source_node, [0, 1, 2, 0, 1, 0])
    np.testing.assert_array_equal(nb.source_shift[3:], [[-1, 0, 0], [1, 0, 0], [0, 0, 0]])
    assert neighbor_sizes(senders, receivers, 3, shifts) == (4, 5)
    with pytest.raises(ValueError, match="max_neighbors"):
        neighbor_list(senders, receivers, 3, shifts, max_neighbors=3)
    with pytest.raises(ValueError, match="num_sources"):
        neighbor_list(senders, receivers, 3, shifts, num_sources=4)
    tiles = neighbor_list(senders, receivers, 3, shifts, origin=[[0, 0, 0], [0, 0, 0], [5, 0, 0]], max_neighbors=5, num_sources=7)
    np.testing.assert_array_equal(tiles.neighbors[0], [1, 5, 4, 4, 7])  # node 2 seen from node 0's tile: ghost 5
    np.testing.assert_array_equal(tiles.source_node[3:6], [0, 1, 2])
    np.testing.assert_array_equal(tiles.source_origin[5], [0, 0, 0])
    np.testing.assert_array_equal(tiles.source_origin[3], [5, 0, 0])  # (0, -x) seen from node 2
    auto = neighbor_list(senders, receivers, 3, shifts)  # size buckets
    assert auto.neighbors.shape[1] >= 4 and auto.num_sources >= 5


def test_neighbor_list_has_the_radius_graph_edge_vectors():
    atoms = cu8()
    nb = neighbors(atoms)
    cell = atoms.cell.array
    p_src = atoms.positions[np.asarray(nb.source_node)] + np.asarray(nb.source_shift) @ cell
    nbr = np.asarray(nb.neighbors)
    i, t = np.nonzero(nbr < nb.num_sources)
    got = np.sort(np.round(np.column_stack([i, p_src[nbr[i, t]] - atoms.positions[i]]), 9), axis=0)
    s, r, sh = radius_edges(atoms, CFG.cutoff)
    want = np.sort(np.round(np.column_stack([r, atoms.positions[s] - atoms.positions[r] + sh @ cell]), 9), axis=0)
    np.testing.assert_array_equal(got, want)


# --- per-source values = the per-edge computation --------------------------------------------------
@pytest.mark.parametrize("dtype,tile", [(np.float64, None), (np.float64, 2.0), (np.float32, None)])
def test_node_values_equal_direct_edge_values(dtype, tile):
    """sum_j alpha_ij EAAS(h_j, r_ij) from per-source values and the target-side term, against
    EAAS of every edge's own vector (periodic images included); local origin at the centroid or
    at the centres of 2 Å tiles (more ghosts)."""
    atoms = cu8()
    atoms.positions += 50.0  # far from 0: the local origin matters in float32
    nb = neighbors(atoms, tile=tile)
    if tile is not None:
        assert len(np.unique(np.asarray(nb.origin), axis=0)) > 1
    rng = np.random.default_rng(0)
    n, heads = len(atoms), 2
    irreps = e3nn.Irreps("4x0e+2x1o+2x2e")
    h = e3nn.IrrepsArray(irreps, jnp.asarray(rng.normal(size=(n, irreps.dim)), dtype))
    q, k = (jnp.asarray(rng.normal(size=(n, heads, 4)), dtype) for _ in range(2))
    bias, env, post = (jnp.asarray(rng.uniform(0.2, 1.0, size=(n, K, heads)), dtype) for _ in range(3))
    cell, pos = atoms.cell.array, atoms.positions
    p_src = (pos[np.asarray(nb.source_node)] + np.asarray(nb.source_shift) @ cell - np.asarray(nb.source_origin)) / CFG.cutoff
    p_dst = (pos - np.asarray(nb.origin)) / CFG.cutoff
    filter_irs = tuple(ir for _, ir in irreps)
    args = (q, k, h, nb.source_node, jnp.asarray(p_src, dtype), jnp.asarray(p_dst, dtype), nb.neighbors)
    kw = dict(heads=heads, filter_irs=filter_irs, logit_bias=bias, envelope=env, post_scale=post, backend="xla")
    with jax.default_matmul_precision("float32"):  # the cancellation, not a GPU's TF32 matmuls (~1e-4)
        node = equivariant_attention(*args, **kw, values="node")
        edge = equivariant_attention(*args, **kw, values="edge")
    assert node.irreps == edge.irreps
    assert node.irreps == e3nn.Irreps("2x0e+6x1o+2x2e+4x0e+2x1o+2x2e")  # EAAS per head: 0e->1o, 1o->0e+2e, 2e->1o; then h
    scale = np.abs(np.asarray(edge.array)).max()
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(np.asarray(node.array), np.asarray(edge.array), atol=tol * scale, rtol=0)


# --- the model -------------------------------------------------------------------------------------
def test_rotation_translation_permutation(params):
    atoms = cu8()
    energy, forces, per_atom = evaluate(params, atoms)
    rot = Rotation.random(random_state=3).as_matrix()
    moved = atoms.copy()
    moved.set_cell(atoms.cell.array @ rot.T)
    moved.positions = atoms.positions @ rot.T + np.array([0.3, -1.2, 2.5])
    perm = np.random.default_rng(1).permutation(len(atoms))
    moved = moved[perm]
    e2, f2, pa2 = evaluate(params, moved)
    np.testing.assert_allclose(e2, energy, rtol=1e-10)
    np.testing.assert_allclose(pa2, np.asarray(per_atom)[perm], rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(f2, np.asarray(forces)[perm] @ rot.T, atol=1e-9)
    assert np.abs(forces).max() > 1e-3  # not trivially zero


def test_forces_equal_finite_differences(params):
    atoms = cu8()
    nb = neighbors(atoms)
    _, forces, _ = evaluate(params, atoms, nb)
    delta = 1e-5
    for atom, axis in [(0, 0), (3, 1), (6, 2)]:
        es = []
        for sign in (1, -1):
            a = atoms.copy()
            a.positions[atom, axis] += sign * delta
            es.append(float(evaluate(params, a, nb)[0]))
        np.testing.assert_allclose(-(es[0] - es[1]) / (2 * delta), forces[atom, axis], rtol=1e-6, atol=1e-8)


def test_periodic_cell_is_a_supercell_of_its_unit_cell(params):
    """The 2x1x1 supercell of a rattled 4-atom cell against two copies of the 4-atom cell in one
    graph (Cartesian shifts, identity cell, as data.batch does): the same per-atom energies.
    In the 4-atom cell every neighbour is an image (many ghosts)."""
    unit = bulk("Cu", "fcc", a=3.61, cubic=True)
    unit.numbers[1] = 79
    unit.rattle(0.08, seed=2)
    sup = unit.repeat((2, 1, 1))
    _, f_sup, e_sup = evaluate(params, sup)
    s, r, sh = radius_edges(unit, CFG.cutoff)
    sh = sh @ unit.cell.array
    nb = neighbor_list(np.concatenate([s, s + 4]), np.concatenate([r, r + 4]), 8, np.concatenate([sh, sh]),
                       origin=unit.positions.mean(0), max_neighbors=K, num_sources=NSRC)  # fmt: skip
    two = Atoms(np.concatenate([unit.numbers] * 2), positions=np.concatenate([unit.positions] * 2))
    _, f_two, e_two = evaluate(params, two, nb)
    np.testing.assert_allclose(e_sup, e_two, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f_sup, f_two, atol=1e-9)


def test_energy_and_forces_continuous_across_the_cutoff(params):
    """Atom 7 leaves its only neighbour's cutoff sphere: no jump in energy or forces (the
    envelope is on the softmax weights and on the post-scale; a node losing its last neighbour
    goes to zero smoothly)."""
    rc = CFG.cutoff
    cluster = bulk("Cu", "fcc", a=3.61, cubic=True).repeat((1, 1, 1)).positions  # 4 atoms
    base = np.concatenate([cluster, cluster[:3] + [0.0, 0.0, 2.2]])  # 7 atoms, < rc apart
    results = []
    for d in (rc - 1e-4, rc + 1e-4):
        far = base[np.argmax(base[:, 0])] + [d, 0.0, 0.0]
        atoms = Atoms("Cu8", positions=np.concatenate([base, far[None]]))
        nb = neighbors(atoms)
        results.append(evaluate(params, atoms, nb) + (int((np.asarray(nb.neighbors)[7] < NSRC).sum()),))
    (e_in, f_in, _, deg_in), (e_out, f_out, _, deg_out) = results
    assert (deg_in, deg_out) == (1, 0)
    assert abs(float(e_in - e_out)) < 1e-9
    np.testing.assert_allclose(f_in, f_out, atol=1e-6)


def test_pallas_attention_interpret_mode_equals_xla(params):
    atoms = cu8()
    nb = neighbors(atoms)
    e_x, f_x, _ = evaluate(params, atoms, nb)
    e_p, f_p, _ = evaluate(params, atoms, nb, config=dataclasses.replace(CFG, backend="pallas"))
    np.testing.assert_allclose(e_p, e_x, rtol=1e-10)
    np.testing.assert_allclose(f_p, f_x, atol=1e-9)


def test_training_steps_reduce_the_loss():
    from jequi.models.data import emt_dataset
    from jequi.models.train import train

    data = emt_dataset(3, seed=1)  # one batch: every step sees the same structures
    config = dataclasses.replace(CFG, num_layers=1)  # half the compile time
    _, history = train(config, data, steps=4, batch_size=3, learning_rate=2e-2, progress=False)
    assert np.all(np.isfinite(history.loss))
    assert np.all(np.diff(history.loss) < 0) and history.loss[-1] < 0.9 * history.loss[0], history.loss
