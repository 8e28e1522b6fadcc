"""The descriptor: e3nn's weight layout and normalization, and each path's nonzero CG entries."""

import numpy as np
import pytest
from conftest import e3nn_functional
from test_forward_e3nn import EDGE_CASES

import jequi
from jequi.descriptor import CG_ZERO


@pytest.mark.parametrize("name", ["path-weights", "gradient-element", "none-path", "mixed-modes-one-output", "uvuv"])
def test_matches_e3nn_instructions(name):
    tp = EDGE_CASES[name]()
    f = e3nn_functional(tp)
    assert tp.weight_numel == sum(int(np.prod(i.path_shape)) for i in f.instructions if i.has_weight)
    for p, ins in zip(tp.descriptor.paths, f.instructions):
        assert p.weight_shape == (ins.path_shape if ins.has_weight else ())
        assert np.isclose(p.path_weight, ins.path_weight)
        assert not ins.has_weight or np.isclose(p.weight_std, ins.weight_std)
    std = np.concatenate([np.full(int(np.prod(i.path_shape)), i.weight_std) for i in f.instructions if i.has_weight])
    np.testing.assert_allclose(tp.weight_std, std)


def test_nonzeros_rebuild_every_cg_block():
    """Each path's nonzero entries (what the kernel generators unroll), ordered by output
    component, give back its CG block but for e3nn's numerical noise."""
    for p in jequi.problems.get("nequip-oam-main").descriptor.paths:
        i, j, k, coeff = p.nonzeros()
        dense = np.zeros_like(p.cg)
        dense[i, j, k] = coeff
        np.testing.assert_array_equal(dense, np.where(np.abs(p.cg) > CG_ZERO, p.cg, 0))
        assert np.all(np.diff(k) >= 0)


def test_trilinear_view_weights_every_path():
    d = EDGE_CASES["mixed-modes-one-output"]().descriptor
    t = d.trilinear
    assert all(p.has_weight for p in t.paths)
    assert t.weight_numel == d.weight_numel + 3  # the unweighted uuu path of multiplicity 3
    assert t != d and hash(t) != hash(d)
    assert jequi.channelwise("2x0e", "0e", "0e").descriptor.trilinear is not None


def test_equal_arguments_give_equal_descriptors():
    a = jequi.problems.get("mace-medium").descriptor
    b = jequi.problems.get("mace-medium").descriptor
    assert a == b and hash(a) == hash(b)
    assert a != jequi.problems.get("mace-medium", layout="ir_mul").descriptor


def test_layout_positions_map_mul_ir_to_ir_mul():
    a = jequi.channelwise("3x0e+4x1o+2x2e", "0e+1o", "3x0e+4x1o+2x2e").descriptor
    b = jequi.channelwise("3x0e+4x1o+2x2e", "0e+1o", "3x0e+4x1o+2x2e", layout="ir_mul").descriptor
    positions = jequi.descriptor.layout_positions(a.in1, "ir_mul")
    for sa, sb in zip(a.in1, b.in1):  # element (u, m) moves from sa.index() to sb.index()
        assert np.array_equal(positions[sa.index()], sb.index())
    assert np.array_equal(jequi.descriptor.layout_positions(b.in1, "ir_mul"), np.arange(a.dims[0]))
    back = jequi.descriptor.layout_positions(b.in1, "mul_ir")
    assert np.array_equal(back[positions], np.arange(a.dims[0]))
    with pytest.raises(ValueError, match="layout must be one of"):
        jequi.descriptor.layout_positions(a.in1, "ir-mul")
