"""Bad input raises ValueError/TypeError naming the problem, before any kernel runs."""

import e3nn_jax as e3nn
import numpy as np
import pytest

import jequi


def make(instructions, in1="2x0e+2x1o", in2="0e+1o", out="2x0e+2x1o+3x1e", **kw):
    return jequi.TensorProduct(in1, in2, out, instructions, **kw)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(instructions=[(0, 0, 0, "uvu", True)], in1="2x0q"), "irreps_in1"),
        (dict(instructions=[(0, 0, 0, "uvu", True)], out="x1e"), "irreps_out"),
        (dict(instructions=[(2, 0, 0, "uvu", True)]), "i_in1=2 is out of range"),
        (dict(instructions=[(0, 5, 0, "uvu", True)]), "i_in2=5 is out of range"),
        (dict(instructions=[(0, 0, -1, "uvu", True)]), "i_out=-1 is out of range"),
        (dict(instructions=[(0.0, 0, 0, "uvu", True)]), "not an integer"),
        (dict(instructions=[(0, 0, 0, "uvx", True)]), "unknown mode 'uvx'"),
        (dict(instructions=[(0, 0, 0, "uvu")]), "expected"),
        (dict(instructions=[(0, 0, 0, "uvu", "yes")]), "has_weight"),
        (dict(instructions=[(0, 0, 0, "uvu", True, -1.0)]), "path_weight"),
        (dict(instructions=[(0, 0, 1, "uvu", True)]), "selection rules"),  # 0e x 0e -> 1o: l
        (dict(instructions=[(1, 1, 2, "uvu", True)], out="2x0e+2x1o+2x1o"), "selection rules"),  # parity
        (dict(instructions=[(1, 1, 2, "uvu", True)]), "mul_in1 == mul_out"),
        (dict(instructions=[(0, 0, 2, "uvv", True)], out="2x0e+2x1o+3x0e"), "mul_in2 == mul_out"),
        (dict(instructions=[(0, 0, 0, "uuu", True)], in2="3x0e"), "mul_in1 == mul_in2 == mul_out"),
        (dict(instructions=[(0, 0, 0, "uuw", True)], in2="3x0e"), "mul_in1 == mul_in2"),
        (dict(instructions=[(0, 0, 2, "uvuv", True)], out="2x0e+2x1o+3x0e"), "mul_in1 \\* mul_in2"),
        (dict(instructions=[(0, 0, 0, "uvw", False)]), "needs weights"),
        (dict(instructions=[(0, 0, 0, "uuw", False)], in2="2x0e"), "mul_out == 1"),
        (dict(instructions="uvu"), "list of tuples"),
        (dict(instructions=[(0, 0, 0, "uvu", True)], irrep_normalization="unit"), "irrep_normalization"),
        (dict(instructions=[(0, 0, 0, "uvu", True)], path_normalization="paths"), "path_normalization"),
        (dict(instructions=[(0, 0, 0, "uvu", True)], layout="mul_first"), "layout"),
    ],
)
def test_bad_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


@pytest.fixture(scope="module")
def tp():
    return jequi.channelwise("2x0e+2x1o", "0e+1o", "0e+1o")


def arrays(tp, n=3, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(n, tp.irreps_in1.dim)).astype(dtype),
        rng.normal(size=(n, tp.irreps_in2.dim)).astype(dtype),
        rng.normal(size=(n, tp.weight_numel)).astype(dtype),
    )


def test_bad_call_shapes(tp):
    x, y, w = arrays(tp)
    with pytest.raises(ValueError, match="x has shape"):
        tp(x[:, :-1], y, w)
    with pytest.raises(ValueError, match="y has shape"):
        tp(x, y[:, :3], w)
    with pytest.raises(ValueError, match="weight_numel"):
        tp(x, y, w[:, 1:])
    with pytest.raises(ValueError, match="do not broadcast"):
        tp(x, y[:2], w)
    with pytest.raises(ValueError, match="x has shape"):
        tp(np.float32(1.0), y, w)
    with pytest.raises(TypeError, match="w is required"):
        tp(x, y)
    shared = jequi.TensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, tp.instructions, shared_weights=True)
    with pytest.raises(ValueError, match="shared_weights=True"):
        shared(x, y, w)


def test_bad_dtypes(tp):
    x, y, w = arrays(tp)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        tp(x.astype(np.int32), y, w)
    with pytest.raises(TypeError, match="w must be a floating-point"):
        tp(x, y, w.astype(np.complex64))


def test_bad_irreps_array(tp):
    x, y, w = arrays(tp)
    with pytest.raises(ValueError, match="x has irreps"):
        tp(e3nn.IrrepsArray("2x0e+1x1o+3x0e", x), y, w)


def test_bad_backend(tp):
    x, y, w = arrays(tp)
    with pytest.raises(ValueError, match="unknown backend 'cudnn'"):
        tp(x, y, w, backend="cudnn")


def test_bad_graph_indices(tp):
    x, y, w = arrays(tp, 4)
    s = r = np.array([0, 1, 2, 3])
    with pytest.raises(TypeError, match="senders must be an integer"):
        tp.conv(x, y, w, s.astype(np.float32), r, 4)
    with pytest.raises(TypeError, match="receivers must be an integer"):
        tp.conv(x, y, w, s, r.astype(bool), 4)
    with pytest.raises(ValueError, match="receivers has 3 entries"):
        tp.conv(x, y, w, s, r[:3], 4)
    with pytest.raises(ValueError, match="senders must be 1-D"):
        tp.conv(x, y, w, s[None], r, 4)
    with pytest.raises(ValueError, match="num_nodes"):
        tp.conv(x, y, w, s, r, 4.0)
    with pytest.raises(ValueError, match="num_nodes"):
        tp.conv(x, y, w, s, r, -1)
    with pytest.raises(ValueError, match="w has 3 rows"):
        tp.conv(x, y, w[:3], s, r, 4)
    with pytest.raises(ValueError, match="conv takes"):
        tp.conv(x[None], y, w, s, r, 4)
