"""EAAS (``jequi.sh_tensor_product``) and the SO(2) convolution (``jequi.so2_conv``) against
e3nn-jax's dense products: values, output irreps, the weight map both ways, roll invariance,
O(3) equivariance with parity, derivatives of order 2 (forward and reverse, on and near the
poles +-y), the layers and bad inputs (E2FORMER.md section 4)."""

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp

import jequi
from jequi import eaas, eaas_reference, so2

# on both poles, near them, on the switch between the two frame charts (r_y = 0), generic
VECTORS = np.array(
    [[0.0, 1.3, 0.0], [0.0, -0.7, 0.0], [1e-9, 1.0, -2e-9], [3e-9, -1.0, 1e-9], [0.3, 0.0, -0.5], [0.3, 1e-17, 0.5], [0.4, -0.8, 1.1]]
)


def _rng(seed=0):
    return np.random.default_rng(seed)


# ---- frames -------------------------------------------------------------------------------------


def test_edge_rotation_and_wigner_d():
    d = np.concatenate([VECTORS, _rng().normal(size=(5, 3))])
    d = d / np.linalg.norm(d, axis=-1, keepdims=True)
    rot = so2.edge_rotation(jnp.asarray(d))
    assert_close(rot @ np.array([0.0, 1.0, 0.0]), d, 1e-14, "R y = d")
    assert_close(np.swapaxes(rot, -1, -2) @ rot, np.broadcast_to(np.eye(3), rot.shape), 1e-14, "R^T R")
    assert np.allclose(np.linalg.det(rot), 1.0)
    # e3nn's D (through Euler angles) loses digits near the poles; Y^l(R v) = D_l(R) Y^l(v) does not
    v = _rng(1).normal(size=(4, 3))
    rotated = np.einsum("eij,vj->evi", rot, v)
    sh = jax.jit(lambda a: e3nn.spherical_harmonics("0e+1o+2e+3o+4e", a, False).array)
    y, y_rot = sh(v), sh(rotated)
    for l, dl in enumerate(so2.wigner_d(rot, 4)):
        s = slice(l * l, (l + 1) ** 2)
        assert_close(np.einsum("eij,vj->evi", dl, y[:, s]), y_rot[..., s], 1e-13, f"D_{l}")


def test_coupling_is_sparse_and_parity_symmetric():
    for li, lf, lo in [(1, 1, 1), (2, 2, 2), (3, 2, 3), (2, 3, 4), (1, 2, 2)]:
        c = so2.coupling(li, lf, lo)
        coef = np.array(c.coefficient)
        sign = 1 if c.even else -1
        assert np.allclose(coef, sign * coef[::-1])
    assert so2.coupling(3, 2, 3).coefficient[3 + 2] == 0.0  # an accidental zero (m = +-2)
    for normalization in ("component", "norm", "integral"):
        y = e3nn.spherical_harmonics([0, 1, 2, 3], e3nn.IrrepsArray("1o", np.array([0.0, 1.0, 0.0])), True, normalization).array
        assert_close([y[l * l + l] for l in range(4)], [so2.pole_value(l, normalization) for l in range(4)], 1e-14, normalization)
    with pytest.raises(ValueError, match="no Clebsch-Gordan path"):
        so2.coupling(1, 1, 3)


# ---- sh_tensor_product: the dense oracle ------------------------------------------------------

CASES = [
    ("3x0e+2x1o+2e", "0e+1o+2e", None, True),
    ("3x0e+2x1o+2e", "0e+1o+2e", None, False),
    ("2x1e+0o+2x2o+1o", "0e+1o+2e+3o", None, True),
    ("4x1o+2x2e+0e", "0e+1o+2e+3o", "0e+1o+2e", False),
    ("2x0e+1o+1e", "2x1o+0e+1x1o", [e3nn.Irrep("1e"), e3nn.Irrep("2o"), e3nn.Irrep("1o")], True),
]


@pytest.mark.parametrize("irreps_x, irreps_sh, filter_ir_out, normalize", CASES)
def test_sh_tensor_product_matches_e3nn(irreps_x, irreps_sh, filter_ir_out, normalize):
    rng = _rng()
    x = e3nn.IrrepsArray(irreps_x, rng.normal(size=(2, len(VECTORS) + 1, e3nn.Irreps(irreps_x).dim)))
    r = np.concatenate([VECTORS, np.zeros((1, 3))])  # leading dims (2, 8) and (8,) broadcast; r = 0 too

    @jax.jit
    def dense(x, r):
        return e3nn.tensor_product(x, e3nn.spherical_harmonics(irreps_sh, r, normalize), filter_ir_out=filter_ir_out)

    ref = dense(x, r)
    out = jequi.sh_tensor_product(x, r, irreps_sh, filter_ir_out=filter_ir_out, normalize=normalize)
    assert out.irreps == ref.irreps
    assert_close(out.array, ref.array, 1e-13, "values")


def test_sh_tensor_product_int_degrees_pseudovector_and_zero_flags():
    rng = _rng(1)
    r = e3nn.IrrepsArray("1e", VECTORS)  # a pseudovector: odd harmonics are 1e, 3e
    a, b = rng.normal(size=(7, 2, 3)), rng.normal(size=(7, 1, 5))
    x = e3nn.from_chunks("2x1o+0e+2e", [a, None, b], (7,))

    flags = []

    @jax.jit  # zero flags do not cross jit's boundary: make x inside, keep the flags at trace time
    def dense(a, b, r):
        out = e3nn.tensor_product(e3nn.from_chunks("2x1o+0e+2e", [a, None, b], (7,)), e3nn.spherical_harmonics([0, 1, 3], r, True))
        flags.append(out.zero_flags)
        return out

    ref = dense(a, b, r)
    out = jequi.sh_tensor_product(x, r, [0, 1, 3])
    assert out.irreps == ref.irreps and out.zero_flags == flags[0] and any(flags[0])
    assert_close(out.array, ref.array, 1e-13, "values")
    empty = jequi.sh_tensor_product(x, r, 1, filter_ir_out="5e")
    assert empty.irreps == e3nn.Irreps("") and empty.shape == (7, 0)


@pytest.mark.parametrize("irrep_normalization, sh_normalization", [("norm", "integral"), ("none", "norm")])
def test_sh_tensor_product_follows_e3nn_config(irrep_normalization, sh_normalization):
    old = e3nn.config("irrep_normalization"), e3nn.config("spherical_harmonics_normalization")
    try:
        e3nn.config("irrep_normalization", irrep_normalization)
        e3nn.config("spherical_harmonics_normalization", sh_normalization)
        x = e3nn.IrrepsArray("0e+1o+2e", _rng(2).normal(size=(len(VECTORS), 9)))
        ref = jax.jit(lambda x, r: e3nn.tensor_product(x, e3nn.spherical_harmonics("0e+1o+2e", r, True)))(x, VECTORS)
        out = jequi.sh_tensor_product(x, VECTORS, "0e+1o+2e")
    finally:
        e3nn.config("irrep_normalization", old[0])
        e3nn.config("spherical_harmonics_normalization", old[1])
    assert_close(out.array, ref.array, 1e-13, "values")


def test_sh_tensor_product_roll_invariance():
    """The product does not depend on the roll about r: any frame R Ry(gamma) gives it."""
    x = e3nn.IrrepsArray("2x0e+1o+2x2e+3o", _rng(3).normal(size=(len(VECTORS), 22)))
    plan = eaas._plan(x.irreps, (False,) * 4, e3nn.Irreps("0e+1o+2e"), None, "component", "component")
    array = eaas._reorder(jnp.asarray(x.array), x.irreps, plan.order)
    rot = so2.edge_rotation(so2.unit(jnp.asarray(VECTORS)))
    ones = jnp.ones(len(VECTORS))
    product = jax.jit(lambda rot: eaas_reference.product(plan, array, so2.wigner_d(rot, plan.lmax), ones, (len(VECTORS),), jnp.float64))
    ref = product(rot)
    for gamma in (0.3, 2.0, -1.2):
        c, s = np.cos(gamma), np.sin(gamma)
        roll = np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])  # about y
        assert_close(product(rot @ roll), ref, 1e-13, f"roll {gamma}")


def _improper(seed):
    """A random rotation times the inversion (det -1)."""
    return -np.asarray(e3nn.rand_matrix(jax.random.PRNGKey(seed), ()))


@jax.jit
def _transform(x, q):
    """e3nn's action of the O(3) matrix `q` on an IrrepsArray (parity included)."""
    return x.transform_by_matrix(q)


def test_sh_tensor_product_equivariance_with_parity():
    q = _improper(4)
    x = e3nn.IrrepsArray("2x0e+1o+1e+2o", _rng(4).normal(size=(len(VECTORS), 13)))
    out = jequi.sh_tensor_product(x, VECTORS, "0e+1o+2e")
    moved = jequi.sh_tensor_product(_transform(x, q), VECTORS @ q.T, "0e+1o+2e")
    assert_close(moved.array, _transform(out, q).array, 1e-6, "g out")  # e3nn's D (Euler angles): ~1e-7


# ---- derivatives of order 2 --------------------------------------------------------------------


def _check_second_orders(dense, ours, x, vectors, pure_modes=True):
    """First and second derivatives of scalar losses ``f(x, r)`` in reverse, forward and mixed
    modes, at each of `vectors`, against the dense oracle's (one compiled function per loss)."""

    def derivatives(loss):
        modes = {"grad": jax.grad(loss, (0, 1)), "hessian": jax.hessian(loss, (0, 1))}  # fwd-over-rev
        if pure_modes:  # forward-over-forward and reverse-over-reverse in r (the product is linear in x)
            modes["rev_rev"] = jax.jacrev(jax.grad(loss, 1), 1)
            modes["fwd_fwd"] = jax.jacfwd(jax.jacfwd(loss, 1), 1)
        return jax.jit(jax.vmap(lambda x, r: {k: f(x, r) for k, f in modes.items()}, in_axes=(None, 0)))

    ref, out = derivatives(dense)(x, vectors), derivatives(ours)(x, vectors)
    for name in ref:
        for a, b in zip(jax.tree.leaves(out[name]), jax.tree.leaves(ref[name])):
            for k, r in enumerate(vectors):
                assert_close(a[k], b[k], 1e-11, f"{name} at r = {r}")


@pytest.mark.parametrize("normalize", [True, False])
def test_sh_tensor_product_derivatives_on_and_near_poles(normalize):
    irreps_x, irreps_sh = "1o", "1o+2e"
    rng = _rng(5)
    x = jnp.asarray(rng.normal(size=(3,)))
    g = rng.normal(size=(e3nn.tensor_product(irreps_x, irreps_sh).dim,))

    def dense(x, r):
        return jnp.vdot(g, e3nn.tensor_product(e3nn.IrrepsArray(irreps_x, x), e3nn.spherical_harmonics(irreps_sh, r, normalize)).array)

    def ours(x, r):
        return jnp.vdot(g, jequi.sh_tensor_product(e3nn.IrrepsArray(irreps_x, x), r, irreps_sh, normalize=normalize).array)

    _check_second_orders(dense, ours, x, jnp.asarray(VECTORS), pure_modes=normalize)


# ---- so2_conv and the weight map ---------------------------------------------------------------

SO2_CASES = [("2x0e+3x1o+2x2e", "0e+2x1o+2e"), ("2x1o+0e+2e+1e", "1e+2x0o+2o+1o+2x2e")]


def _path_oracle(irreps_in, irreps_out, x, r, w):
    """e3nn-jax's FunctionalTensorProduct of the path product with the harmonics of r / |r|."""
    tp = jequi.so2_path_product(irreps_in, irreps_out)
    oracle = jax.jit(lambda x, r, w: e3nn_tp(tp, x, e3nn.spherical_harmonics(tp.irreps_in2, r, True).array, w))
    return tp, oracle(x, r, w)


@pytest.mark.parametrize("irreps_in, irreps_out", SO2_CASES)
def test_so2_conv_equals_path_weighted_product_and_weight_map(irreps_in, irreps_out):
    rng = _rng(6)
    n = len(VECTORS)
    tp = jequi.so2_path_product(irreps_in, irreps_out)
    x = rng.normal(size=(n, e3nn.Irreps(irreps_in).dim))
    w = rng.normal(size=(n, tp.weight_numel))
    _, ref = _path_oracle(irreps_in, irreps_out, x, VECTORS, w)
    weights = jequi.so2_weights_from_path_weights(w, irreps_in, irreps_out)
    assert weights.shape == (n, jequi.so2_layout(irreps_in, irreps_out).weight_numel)
    out = jequi.so2_conv(e3nn.IrrepsArray(irreps_in, x), VECTORS, weights, irreps_out)  # per-edge weights
    assert out.irreps == e3nn.Irreps(irreps_out)
    assert_close(out.array, ref, 1e-13, "per-edge weights")
    _, ref_shared = _path_oracle(irreps_in, irreps_out, x, VECTORS, np.broadcast_to(w[0], w.shape))
    shared = jequi.so2_conv(x, VECTORS, weights[0], irreps_out, irreps_in=irreps_in)  # plain array in, out
    assert_close(shared, ref_shared, 1e-13, "shared weights")
    # the map both ways
    assert_close(jequi.path_weights_from_so2_weights(weights, irreps_in, irreps_out), w, 1e-12, "path -> so2 -> path")
    s = rng.normal(size=(weights.shape[-1],))
    s_back = jequi.so2_weights_from_path_weights(jequi.path_weights_from_so2_weights(s, irreps_in, irreps_out), irreps_in, irreps_out)
    assert_close(s_back, s, 1e-12, "so2 -> path -> so2")


def test_weight_map_is_invertible_up_to_l6():
    """Every pair of degrees <= 6, both kinds (real: 6e -> 6e, imag: 6e -> 6o)."""
    from jequi.so2_conv import _pair_maps

    irreps = e3nn.Irreps("0e+1o+2e+3o+4e+5o+6e")
    for irreps_out in (irreps, e3nn.Irreps("0o+1e+2o+3e+4o+5e+6o")):
        for pm in _pair_maps(irreps, irreps_out):
            assert pm.matrix.shape[0] == pm.matrix.shape[1] == len(pm.orders)
            assert np.linalg.cond(pm.matrix) < 1e3, (pm.i_in, pm.i_out)


def test_so2_conv_m_max_is_the_full_conv_with_zero_orders():
    rng = _rng(8)
    irreps_in, irreps_out = "2x0e+2x1o+2x2e+3o", "0e+1o+1e+2x2e"
    truncated = jequi.so2_layout(irreps_in, irreps_out, m_max=1)
    assert truncated.m_max == 1 and all(b.m <= 1 for b in truncated.blocks)
    s = rng.normal(size=(truncated.weight_numel,))
    x = e3nn.IrrepsArray(irreps_in, rng.normal(size=(len(VECTORS), e3nn.Irreps(irreps_in).dim)))
    out = jequi.so2_conv(x, VECTORS, s, irreps_out, m_max=1)
    full = jequi.so2_weights_from_path_weights(jequi.path_weights_from_so2_weights(s, irreps_in, irreps_out, m_max=1), irreps_in, irreps_out)
    assert_close(jequi.so2_conv(x, VECTORS, full, irreps_out).array, out.array, 1e-12, "m_max=1")


def test_so2_conv_equivariance_with_parity():
    """Imag blocks give pseudo-tensors (1o x Y^1 -> 1e): the output labels must be right under inversion."""
    rng = _rng(9)
    irreps_in, irreps_out = "2x0e+2x1o+2e", "0o+2x1e+1o+2o+2e"
    layout = jequi.so2_layout(irreps_in, irreps_out)
    assert {b.kind for b in layout.blocks} == {"real", "imag"}
    q = _improper(9)
    x = e3nn.IrrepsArray(irreps_in, rng.normal(size=(len(VECTORS), e3nn.Irreps(irreps_in).dim)))
    w = rng.normal(size=(layout.weight_numel,))
    out = jequi.so2_conv(x, VECTORS, w, irreps_out)
    moved = jequi.so2_conv(_transform(x, q), VECTORS @ q.T, w, irreps_out)
    assert_close(moved.array, _transform(out, q).array, 1e-6, "g out")


def test_so2_conv_derivatives_on_and_near_poles():
    irreps_in, irreps_out = "0e+1o", "1o+1e+2e"
    rng = _rng(10)
    tp = jequi.so2_path_product(irreps_in, irreps_out)
    w = rng.normal(size=(tp.weight_numel,))
    s = jequi.so2_weights_from_path_weights(w, irreps_in, irreps_out)
    x = rng.normal(size=(4,))
    g = rng.normal(size=(e3nn.Irreps(irreps_out).dim,))

    def dense(x, r):
        sh = e3nn.spherical_harmonics(tp.irreps_in2, r, True).array
        return jnp.vdot(g, tp(x, sh, w, backend="xla"))

    def ours(x, r):
        return jnp.vdot(g, jequi.so2_conv(x, r, s, irreps_out, irreps_in=irreps_in))

    _check_second_orders(dense, ours, jnp.asarray(x), jnp.asarray(VECTORS), pure_modes=False)  # pure modes: the EAAS test


def test_so2_conv_float32_jit_and_weight_gradient():
    irreps_in, irreps_out = "4x0e+4x1o+4x2e", "4x0e+4x1o+4x2e"
    layout = jequi.so2_layout(irreps_in, irreps_out, m_max=2)
    rng = _rng(11)
    x = jnp.asarray(rng.normal(size=(5, 36)), jnp.float32)
    r = jnp.asarray(VECTORS[:5], jnp.float32)
    w = layout.init_weights(jax.random.PRNGKey(0))
    f = jax.jit(lambda w: jnp.sum(jequi.so2_conv(x, r, w, irreps_out, irreps_in=irreps_in) ** 2))
    assert f(w).dtype == jnp.float32
    ref = jax.grad(lambda w: jnp.sum(jequi.so2_conv(x.astype(jnp.float64), r.astype(jnp.float64), w, irreps_out, irreps_in=irreps_in) ** 2))(w.astype(jnp.float64))
    with jax.default_matmul_precision("float32"):  # a GPU's default float32 matmuls are TF32 (~3e-4 here)
        grad = jax.grad(f)(w)
    assert_close(grad, ref, 1e-4, "float32 weight gradient")


# ---- layers --------------------------------------------------------------------------------------


def _layer_inputs():
    irreps_in, irreps_out = "2x0e+2x1o", "0e+1o+1e"
    rng = _rng(12)
    x = e3nn.IrrepsArray(irreps_in, rng.normal(size=(4, 8)))
    return irreps_in, irreps_out, x, jnp.asarray(VECTORS[:4]), jequi.so2_layout(irreps_in, irreps_out)


def test_so2_layers():
    import flax.linen
    import haiku as hk
    from flax import nnx

    from jequi.nn import equinox, haiku, linen
    from jequi.nn import nnx as jnnx

    irreps_in, irreps_out, x, r, layout = _layer_inputs()
    per_edge = jnp.asarray(_rng(13).normal(size=(4, layout.weight_numel)))
    expect = jequi.so2_conv(x, r, per_edge, irreps_out)

    module = linen.SO2Conv(irreps_in, irreps_out)
    params = module.init(jax.random.PRNGKey(0), x, r)
    w = params["params"]["weights"]
    assert w.shape == (layout.weight_numel,)
    assert_close(module.apply(params, x, r).array, jequi.so2_conv(x, r, w, irreps_out).array, 1e-13, "linen")
    assert_close(flax.linen.Module.apply(module, {}, x, r, per_edge).array, expect.array, 1e-13, "linen per edge")

    f = hk.transform(lambda x, r, w=None: haiku.SO2Conv(irreps_in, irreps_out)(x, r, w))
    params = f.init(jax.random.PRNGKey(0), x, r)
    (w,) = jax.tree.leaves(params)
    assert_close(f.apply(params, None, x, r).array, jequi.so2_conv(x, r, w, irreps_out).array, 1e-13, "haiku")
    assert_close(f.apply({}, None, x, r, per_edge).array, expect.array, 1e-13, "haiku per edge")

    layer = equinox.SO2Conv(irreps_in, irreps_out, key=jax.random.PRNGKey(0))
    assert_close(layer(x, r).array, jequi.so2_conv(x, r, layer.weights, irreps_out).array, 1e-13, "equinox")
    assert_close(equinox.SO2Conv(irreps_in, irreps_out, key=None)(x, r, per_edge).array, expect.array, 1e-13, "equinox per edge")
    with pytest.raises(TypeError, match="pass weights="):
        equinox.SO2Conv(irreps_in, irreps_out, key=None)(x, r)

    layer = jnnx.SO2Conv(irreps_in, irreps_out, rngs=nnx.Rngs(0))
    assert_close(layer(x, r).array, jequi.so2_conv(x, r, layer.weights[...], irreps_out).array, 1e-13, "nnx")
    assert_close(jnnx.SO2Conv(irreps_in, irreps_out, internal_weights=False)(x, r, per_edge).array, expect.array, 1e-13, "nnx per edge")


# ---- bad inputs ------------------------------------------------------------------------------------


def test_bad_inputs():
    x = e3nn.IrrepsArray("0e+1o", np.ones((3, 4)))
    r = np.ones((3, 3))
    with pytest.raises(ValueError, match=r"vectors: expected shape \(\.\.\., 3\)"):
        jequi.sh_tensor_product(x, np.ones((3, 2)), "0e+1o")
    with pytest.raises(ValueError, match="parity of the vectors"):
        jequi.sh_tensor_product(x, e3nn.IrrepsArray("1o", r), "0e+1e")
    with pytest.raises(ValueError, match="even degree"):
        jequi.sh_tensor_product(x, r, "0e+2o")
    with pytest.raises(ValueError, match="share one parity"):
        jequi.sh_tensor_product(x, r, "1o+3e")
    with pytest.raises(ValueError, match="single vector"):
        jequi.sh_tensor_product(x, e3nn.IrrepsArray("2x1o", np.ones((3, 6))), "0e")
    with pytest.raises(ValueError, match="do not broadcast"):
        jequi.sh_tensor_product(x, np.ones((4, 3)), "0e+1o")
    with pytest.raises(ValueError, match="filter_ir_out"):
        jequi.sh_tensor_product(x, r, "0e", filter_ir_out="not irreps")
    with pytest.raises(ValueError, match="irreps_sh"):
        jequi.sh_tensor_product(x, r, "nonsense")

    layout = jequi.so2_layout("0e+1o", "0e+1o")
    w = np.ones(layout.weight_numel)
    with pytest.raises(ValueError, match="weight_numel"):
        jequi.so2_conv(x, r, np.ones(layout.weight_numel + 1), "0e+1o")
    with pytest.raises(TypeError, match="irreps_in="):
        jequi.so2_conv(np.ones((3, 4)), r, w, "0e+1o")
    with pytest.raises(ValueError, match="does not match irreps_in"):
        jequi.so2_conv(np.ones((3, 5)), r, w, "0e+1o", irreps_in="0e+1o")
    with pytest.raises(ValueError, match="differs from x.irreps"):
        jequi.so2_conv(x, r, w, "0e+1o", irreps_in="0e+1e")
    with pytest.raises(ValueError, match="m_max"):
        jequi.so2_conv(x, r, w, "0e+1o", m_max=-1)
    with pytest.raises(ValueError, match="1x1o"):
        jequi.so2_conv(x, e3nn.IrrepsArray("1e", r), w, "0e+1o")
    with pytest.raises(ValueError, match="irreps_out"):
        jequi.so2_conv(x, r, w, "bad irreps")
    with pytest.raises(ValueError, match="do not broadcast"):
        jequi.so2_conv(x, r, np.ones((4, layout.weight_numel)), "0e+1o")
    with pytest.raises(ValueError, match="path_weights"):
        jequi.so2_weights_from_path_weights(np.ones(3), "0e+1o", "0e+1o")
    with pytest.raises(ValueError, match="weights"):
        jequi.path_weights_from_so2_weights(np.ones(layout.weight_numel + 2), "0e+1o", "0e+1o")
