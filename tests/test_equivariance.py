"""Rotating (and reflecting) the inputs rotates the output by the Wigner D matrices."""

import numpy as np
import pytest
import scipy.linalg
from conftest import assert_close, random_inputs

import jequi


def rotation(seed, parity=1):
    """A random rotation (times `parity`) in float64."""
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return parity * q * np.sign(np.linalg.det(q))


def wigner_d(irreps, R):
    """``irreps.D_from_matrix(R)``, each irrep's matrix computed once, not once per copy (e3nn-jax
    computes NequIP-LiPS's 960 output blocks one by one: 20 s)."""
    blocks = {ir: np.asarray(ir.D_from_matrix(R)) for _, ir in irreps}
    return scipy.linalg.block_diag(*(blocks[ir] for mul, ir in irreps for _ in range(mul)))


@pytest.mark.parametrize("parity", [1, -1])
@pytest.mark.parametrize(
    "make",
    [
        lambda: jequi.problems.get("nequip-lips"),
        lambda: jequi.fully_connected("3x0e+2x1o+2x2e+1x3o", "1x0e+1x1o+1x2e", "2x0o+3x1e+2x2o+2x3e+1x4e"),
        lambda: jequi.channelwise("2x5o+2x6e", "0e+1o+2e+3o+4e+5o+6e", "0e+1o+2e+3o+4e+5o+6e+6o"),
    ],
)
def test_equivariance(make, parity):
    tp = make()
    x, y, w = random_inputs(tp, 3)
    R = rotation(11, parity)
    D1, D2, Do = (wigner_d(i, R) for i in (tp.irreps_in1, tp.irreps_in2, tp.irreps_out))
    assert_close(tp(x @ D1.T, y @ D2.T, w), np.asarray(tp(x, y, w)) @ Do.T, 1e-11)


def test_conv_equivariance():
    tp = jequi.channelwise("4x0e+4x1o", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, tp.irreps_in1.dim))
    y = rng.normal(size=(15, tp.irreps_in2.dim))
    w = rng.normal(size=(15, tp.weight_numel))
    s, r = rng.integers(0, 6, 15), rng.integers(0, 6, 15)
    R = rotation(2)
    D1, D2, Do = (wigner_d(i, R) for i in (tp.irreps_in1, tp.irreps_in2, tp.irreps_out))
    assert_close(tp.conv(x @ D1.T, y @ D2.T, w, s, r), np.asarray(tp.conv(x, y, w, s, r)) @ Do.T, 1e-11)
