"""Forward values equal e3nn-jax's FunctionalTensorProduct.left_right, row by row."""

import jax
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp, random_inputs

import jequi

TOL = 1e-12


# The xla backend's forward is the same program in either dtype (its CG blocks cast to the
# inputs'): values in float64, where the tolerance is tight, and float32's output dtype from
# the traced shapes (nothing to compile). test_derivatives.py::test_float32_gradients runs it
# in float32.
@pytest.mark.parametrize("name", jequi.problems.names())
def test_catalogue_problem(name):
    tp = jequi.problems.get(name)
    x, y, w = random_inputs(tp, 3)
    z = jax.jit(tp)(x, y, w)
    assert z.dtype == np.float64
    assert_close(z, e3nn_tp(tp, x, y, w), TOL, name)
    f32 = (jax.ShapeDtypeStruct(a.shape, np.float32) for a in (x, y, w))
    assert jax.eval_shape(tp, *f32).dtype == np.float32


def test_baseline_dims():
    # dims = (in1, in2, out, weights) as listed in the project's BASELINES.md (outside this repository)
    expected = {
        "mace-large": (1152, 16, 9088, 2176),
        "mace-medium": (512, 16, 3328, 1024),
        "nequip-lips": (576, 9, 3264, 960),
        "nequip-benzene": (2048, 16, 19968, 4352),
    }
    for name, dims in expected.items():
        tp = jequi.problems.get(name)
        assert (*tp.descriptor.dims, tp.weight_numel) == dims, name


def _single(in1, in2, out, mode, has_weight=True, path_weight=None, **kw):
    ins = (0, 0, 0, mode, has_weight) + (() if path_weight is None else (path_weight,))
    return jequi.TensorProduct(in1, in2, out, [ins], **kw)


EDGE_CASES = {
    "l6": lambda: jequi.fully_connected("2x6e+1x3o", "1x6e+1x2o", "2x0e+1x5o+2x6e+1x4e"),
    "l6-channelwise": lambda: jequi.channelwise("4x4e+4x6o", "0e+1o+2e+3o+4e+5o+6e", "0e+1o+2e+3o+4e+5o+6e+6o"),
    "in2-mul-uvu": lambda: _single("5x1o", "3x2e", "5x3o", "uvu"),
    "in2-mul-uvw": lambda: jequi.fully_connected("3x0e+2x1o", "4x0e+3x1o", "5x0e+2x1o+3x1e"),
    "uvv": lambda: _single("3x1o", "4x1o", "4x2e", "uvv"),
    "uuw": lambda: _single("3x1o", "3x1e", "5x1o", "uuw"),
    "uuu": lambda: _single("3x2e", "3x1o", "3x3o", "uuu"),
    "uvuv": lambda: _single("3x1o", "2x1o", "6x0e", "uvuv"),
    "unweighted-uvu": lambda: _single("3x1o", "2x1o", "3x1e", "uvu", False),
    "unweighted-uvv": lambda: _single("3x1o", "2x1o", "2x2e", "uvv", False),
    "unweighted-uuu": lambda: _single("3x1o", "3x1o", "3x0e", "uuu", False),
    "unweighted-uuw": lambda: _single("3x1o", "3x1o", "1x1e", "uuw", False),
    "unweighted-uvuv": lambda: _single("3x1o", "2x2e", "6x3o", "uvuv", False),
    "path-weights": lambda: jequi.TensorProduct(
        "4x0e+3x1o", "0e+1o", "4x0e+4x1o",
        [(0, 0, 0, "uvu", True, 0.5), (1, 1, 0, "uvw", True, 2.0), (1, 0, 1, "uvw", True, 3.0), (0, 1, 1, "uvu", True)],
    ),
    "mixed-modes-one-output": lambda: jequi.TensorProduct(
        "3x0e+3x1o", "3x0e+1x1o", "3x1o+2x0e",
        [(0, 1, 0, "uvu", True), (1, 0, 0, "uuu", False), (1, 1, 1, "uvw", True), (1, 0, 0, "uvu", True)],
    ),
    "output-without-path": lambda: jequi.TensorProduct("2x0e", "0e", "2x1o+2x0e+3x2e", [(0, 0, 1, "uvu", True)]),
    "zero-multiplicity": lambda: jequi.fully_connected("0x0e+2x1o", "1x0e+0x1o", "2x1o+0x0e+1x1o"),
    "norm-element": lambda: jequi.channelwise("4x0e+4x1o+4x2e", "0e+1o+2e", "0e+1o+2e", irrep_normalization="norm"),
    "none-path": lambda: jequi.fully_connected(
        "4x0e+4x1o", "0e+1o+2e", "3x1o+2x2e", irrep_normalization="none", path_normalization="path"
    ),
    "component-path": lambda: jequi.fully_connected("4x0e+4x1o", "0e+1o+2e", "3x1o+2x2e", path_normalization="path"),
    "gradient-element": lambda: jequi.fully_connected(
        "4x0e+4x1o", "2x0e+1o", "3x1o+2x0e", gradient_normalization="element"
    ),
    "path-exponent": lambda: jequi.fully_connected("4x0e+4x1o", "0e+1o", "3x1o+2x0e", path_normalization=0.3),
}


def _without_empty_paths(tp):
    # e3nn-jax 0.21 misaligns outputs after a path with a zero multiplicity (it skips the
    # path without a placeholder); such paths contribute nothing, so the oracle drops them.
    d = tp.descriptor
    keep = [ins for ins, p in zip(d.instructions, d.paths) if not p.is_empty]
    return jequi.TensorProduct(
        d.irreps_in1, d.irreps_in2, d.irreps_out, keep,
        irrep_normalization=d.irrep_normalization,
        path_normalization=d.path_normalization,
        gradient_normalization=d.gradient_normalization,
    )


# float64 only: in float32 the xla backend runs the same program (test_catalogue_problem)
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_case(name):
    tp = EDGE_CASES[name]()
    x, y, w = random_inputs(tp, 4)
    assert_close(tp(x, y, w), e3nn_tp(_without_empty_paths(tp), x, y, w), TOL, name)


@pytest.mark.parametrize("name", ["in2-mul-uvw", "path-weights", "uuu"])
def test_shared_weights(name):
    tp = EDGE_CASES[name]()
    x, y, w = random_inputs(tp, 5, shared=True)
    assert w.ndim == 1
    assert_close(tp(x, y, w), e3nn_tp(tp, x, y, w), 1e-12, name)
    shared = jequi.TensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, tp.instructions, shared_weights=True)
    assert_close(shared(x, y, w), e3nn_tp(tp, x, y, w), 1e-12, name)


def test_ir_mul_layout():
    kw = dict(irrep_normalization="component")
    a = jequi.channelwise("3x0e+4x1o+2x2e", "0e+1o+2e", "0e+1o+2e", **kw)
    b = jequi.channelwise("3x0e+4x1o+2x2e", "0e+1o+2e", "0e+1o+2e", layout="ir_mul", **kw)
    x, y, w = random_inputs(a, 4)

    def to_ir_mul(arr, segments):
        return np.concatenate([arr[:, s.offset : s.offset + s.size].reshape(-1, s.mul, s.ir_dim).transpose(0, 2, 1).reshape(len(arr), -1) for s in segments], axis=1)

    d = a.descriptor
    zb = b(to_ir_mul(x, d.in1), to_ir_mul(y, d.in2), w)
    assert_close(zb, to_ir_mul(np.asarray(a(x, y, w)), d.out), 1e-12)


def test_unweighted_product_needs_no_w():
    tp = EDGE_CASES["unweighted-uuu"]()
    x, y, _ = random_inputs(tp, 2)
    assert tp.weight_numel == 0
    assert_close(tp(x, y), e3nn_tp(tp, x, y, np.zeros(0)), 1e-12)
