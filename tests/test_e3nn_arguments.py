"""jequi.TensorProduct takes e3nn's FunctionalTensorProduct arguments as e3nn takes them: the
per-irrep variances, None for a normalization (e3nn.config), defaults that follow
e3nn.config; and its IrrepsArray outputs flag the blocks no path reaches as zero, as e3nn's do."""

import contextlib

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp, random_inputs
from e3nn_jax.legacy import FunctionalTensorProduct

import jequi

IRREPS = ("2x0e+3x1o", "0e+1o", "3x0e+2x1o+1x1e+3x2e")
INSTRUCTIONS = [(0, 0, 0, "uvw", True), (1, 1, 0, "uvw", True), (1, 0, 1, "uvw", True), (0, 1, 1, "uvw", True, 0.5),
                (1, 1, 2, "uvw", True), (1, 1, 3, "uvu", False)]  # fmt: skip


@contextlib.contextmanager
def e3nn_config(**values):
    old = {k: e3nn.config(k) for k in values}
    for k, v in values.items():
        e3nn.config(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            e3nn.config(k, v)


def _e3nn(x, y, w, **kwargs):
    f = FunctionalTensorProduct(*map(e3nn.Irreps, IRREPS), INSTRUCTIONS, **kwargs)
    return jax.vmap(lambda w_, x_, y_: f.left_right(w_, e3nn.IrrepsArray(IRREPS[0], x_), e3nn.IrrepsArray(IRREPS[1], y_)).array)(w, x, y)


@pytest.mark.parametrize("path_normalization", ["element", "path"])
def test_variances_scale_the_paths_as_e3nn(path_normalization):
    variances = {"in1_var": [0.5, 2.0], "in2_var": [1.5, 0.25], "out_var": [3.0, 0.5, 0.0, 1.0]}
    tp = jequi.TensorProduct(*IRREPS, INSTRUCTIONS, path_normalization=path_normalization, **variances)
    assert tp.descriptor.in1_var == (0.5, 2.0) and tp.descriptor.out_var == (3.0, 0.5, 0.0, 1.0)
    x, y, w = random_inputs(tp, 7)
    ref = _e3nn(x, y, w, path_normalization=path_normalization, **variances)
    assert_close(tp(x, y, w), ref, 1e-12, "variances")
    assert_close(tp(x, y, w), e3nn_tp(tp, x, y, w), 1e-12, "conftest oracle")
    assert np.abs(np.asarray(tp(x, y, w))[:, 9:12]).max() == 0.0  # out_var 0: that block is zero
    plain = jequi.TensorProduct(*IRREPS, INSTRUCTIONS, path_normalization=path_normalization)
    assert tp.descriptor != plain.descriptor  # the variances are part of the product's identity


def test_none_and_the_defaults_read_e3nn_config():
    with e3nn_config(irrep_normalization="norm", path_normalization="path", gradient_normalization="element"):
        defaults = jequi.TensorProduct(*IRREPS, INSTRUCTIONS)
        nones = jequi.TensorProduct(*IRREPS, INSTRUCTIONS, irrep_normalization=None, path_normalization=None, gradient_normalization=None)
        x, y, w = random_inputs(defaults, 5)
        ref = _e3nn(x, y, w)  # e3nn's defaults under the same config
    assert defaults.descriptor == nones.descriptor
    assert (defaults.descriptor.irrep_normalization, defaults.descriptor.path_normalization) == ("norm", "path")
    assert_close(defaults(x, y, w), ref, 1e-12, "config")
    # built under the config, the product keeps it once the config changes back
    assert_close(defaults(x, y, w), ref, 1e-12, "after")
    assert jequi.TensorProduct(*IRREPS, INSTRUCTIONS).descriptor != defaults.descriptor


def test_outputs_flag_unreached_blocks_zero_as_e3nn():
    tp = jequi.TensorProduct("2x0e+1x1o", "0e", "2x0e+1x1o+1x2e", [(0, 0, 0, "uvw", True), (1, 0, 1, "uvu", True)])
    x, y, w = random_inputs(tp, 3)
    z = tp(e3nn.IrrepsArray(tp.irreps_in1, jnp.asarray(x)), e3nn.IrrepsArray(tp.irreps_in2, jnp.asarray(y)), w)
    f = FunctionalTensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, list(tp.instructions))
    ref = f.left_right(w[0], e3nn.IrrepsArray(tp.irreps_in1, x[0]), e3nn.IrrepsArray(tp.irreps_in2, y[0]))
    assert z.zero_flags == ref.zero_flags == (False, False, True)
    assert z.chunks[2] is None


@pytest.mark.parametrize("kwargs, match", [({"in1_var": [1.0]}, "in1_var must be 2"), ({"out_var": [1, 1, -1, 1]}, "out_var must be 4"),
                                           ({"in2_var": "ab"}, "in2_var must be")])  # fmt: skip
def test_bad_variances_are_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jequi.TensorProduct(*IRREPS, INSTRUCTIONS, **kwargs)
