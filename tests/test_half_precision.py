"""Half-precision storage (bfloat16, float16) with float32 math (jequi.dtypes), on every op.

The oracle is float64 on the same rounded inputs (e3nn-jax for products, jequi's pure-JAX
references for the rest): a kernel that computes in float32 and rounds its result once is
within about one half-precision rounding of it (``TOL`` units of the dtype's epsilon, relative
to the largest value). Sums in the half dtype itself (a hub of 300 edges) would miss that by
several units. Derivatives of first order take a given cotangent (one rounding); the double
backward and forward mode store intermediate results, each rounded once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jequi
from jequi.backends import BACKENDS, default_backend

from conftest import e3nn_tp

HALF = [jnp.bfloat16, jnp.float16]
# The backends that run the products and convs: xla and pallas everywhere, the CUDA kernels on a GPU.
CUDA = ["cuda", "cuda-atomic"] if "cuda" in jequi.available_backends() else []
TP_BACKENDS = ["xla", "pallas", *CUDA]
TOL = 0.6  # in units of the dtype's epsilon, relative to the largest reference value: one rounding is 0.5


def _eps(dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def _rounded(rng, shape, dtype, scale=1.0):
    """A random half-precision array and the same values in float64."""
    a = jnp.asarray(rng.normal(size=shape) * scale, dtype)
    return a, np.asarray(a, np.float64)


def assert_within(got, want, dtype, units=TOL):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got - want).max() / scale
    assert err <= units * _eps(dtype), f"error {err:.3g} = {err / _eps(dtype):.2f} eps > {units} eps"


PRODUCTS = {
    "channelwise": lambda: jequi.channelwise("8x0e+8x1o+4x2e", "0e+1o+2e", "0e+1o+2e"),  # per_row kernels
    "channelwise-ir_mul": lambda: jequi.channelwise("8x0e+8x1o+4x2e", "0e+1o+2e", "0e+1o+2e", layout="ir_mul"),
    "one-channel-uvw": lambda: jequi.fully_connected("0e+1o", "0e+1o", "16x0e+8x1o"),  # row_blocks kernels
}


@pytest.mark.parametrize("backend", TP_BACKENDS)
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(PRODUCTS))
@pytest.mark.parametrize("shared", [False, True], ids=["per-row", "shared"])
def test_product_and_its_gradients(name, dtype, backend, shared):
    """Output and cotangents stay in the half dtype; each is float64's on the rounded inputs to
    one rounding."""
    tp = PRODUCTS[name]()
    if backend in CUDA and BACKENDS[backend].package.unsupported_reason(tp.descriptor.trilinear):
        pytest.skip(f"{backend} does not run {name}")
    rng = np.random.default_rng(0)
    n = 24
    x, x64 = _rounded(rng, (n, tp.irreps_in1.dim), dtype)
    y, y64 = _rounded(rng, (n, tp.irreps_in2.dim), dtype)
    w, w64 = _rounded(rng, (tp.weight_numel,) if shared else (n, tp.weight_numel), dtype)
    g, g64 = _rounded(rng, (n, tp.irreps_out.dim), dtype)
    z, vjp = jax.vjp(lambda *a: tp(*a, backend=backend), x, y, w)
    assert z.dtype == dtype
    # e3nn-jax's arrays are mul_ir; in ir_mul the pure-JAX reference (checked against it in
    # test_forward_e3nn.py) is the oracle
    oracle = e3nn_tp(tp, x64, y64, w64) if tp.descriptor.layout == "mul_ir" else tp(x64, y64, w64, backend="xla")
    assert_within(z, oracle, dtype)
    grads = vjp(g)
    want = jax.vjp(lambda *a: tp(*a, backend="xla"), x64, y64, w64)[1](g64)
    for got, ref, primal in zip(grads, want, (x, y, w)):
        assert got.dtype == primal.dtype
        assert_within(got, ref, dtype)


def _hub_graph(rng, num_nodes: int, hub_edges: int, other_edges: int):
    """Edges into node 0 (a hub, which the conv kernels split in parts) and random others."""
    receivers = np.concatenate([np.zeros(hub_edges, int), rng.integers(0, num_nodes, other_edges)])
    senders = rng.integers(0, num_nodes, receivers.size)
    return senders, receivers


@pytest.mark.parametrize("backend", TP_BACKENDS)
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
@pytest.mark.parametrize("shared", [False, True], ids=["per-edge", "shared"])
def test_conv_sums_in_float32(dtype, backend, shared):
    """A 300-edge hub's sum, and the backward's per-sender sums (and a shared weight's gradient,
    summed over every edge), to one rounding: the sums run in float32 (in the half dtype they
    would be several roundings off)."""
    tp = jequi.channelwise("8x0e+8x1o", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(1)
    n = 10
    s, r = _hub_graph(rng, n, 300, 40)
    e = s.size
    x, x64 = _rounded(rng, (n, tp.irreps_in1.dim), dtype)
    y, y64 = _rounded(rng, (e, tp.irreps_in2.dim), dtype)
    w, w64 = _rounded(rng, (tp.weight_numel,) if shared else (e, tp.weight_numel), dtype)
    g, g64 = _rounded(rng, (n, tp.irreps_out.dim), dtype)
    graph = jequi.Graph.build(s, r, n)
    out, vjp = jax.vjp(lambda *a: tp.conv(*a, graph, backend=backend), x, y, w)
    assert out.dtype == dtype
    want, want_vjp = jax.vjp(lambda *a: tp.conv(*a, graph, backend="xla"), x64, y64, w64)
    assert_within(out, want, dtype)
    for got, ref, primal in zip(vjp(g), want_vjp(g64), (x, y, w)):
        assert got.dtype == primal.dtype
        assert_within(got, ref, dtype)


@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_force_training_and_forward_mode_in_bfloat16(backend):
    """The double backward (a force loss's parameter gradient) and a forward-mode tangent of
    the conv in bfloat16: each stored intermediate is rounded once, so they stay within a few
    roundings of float64's."""
    dtype = jnp.bfloat16
    tp = jequi.channelwise("8x0e+8x1o", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(2)
    n = 8
    s, r = _hub_graph(rng, n, 60, 30)
    graph = jequi.Graph.build(s, r, n)
    x, x64 = _rounded(rng, (n, tp.irreps_in1.dim), dtype)
    y, y64 = _rounded(rng, (s.size, tp.irreps_in2.dim), dtype)
    w, w64 = _rounded(rng, (s.size, tp.weight_numel), dtype)

    def force_loss(backend):
        def energy(y, x, w):
            return tp.conv(x, y, w, graph, backend=backend).astype(jnp.float32 if backend != "ref" else jnp.float64).sum()

        def loss(w, x, y):
            f = jax.grad(energy)(y, x, w)
            return (f.astype(jnp.float64 if f.dtype == jnp.float64 else jnp.float32) ** 2).sum()

        return loss

    def ref_energy(y, x, w):
        return tp.conv(x, y, w, graph, backend="xla").sum()

    def ref_loss(w, x, y):
        return (jax.grad(ref_energy)(y, x, w) ** 2).sum()

    gw = jax.grad(force_loss(backend))(w, x, y)
    assert gw.dtype == dtype
    assert_within(gw, jax.grad(ref_loss)(w64, x64, y64), dtype, units=3)
    t, t64 = _rounded(rng, x.shape, dtype)
    _, tangent = jax.jvp(lambda x: tp.conv(x, y, w, graph, backend=backend), (x,), (t,))
    _, want = jax.jvp(lambda x: tp.conv(x, y64, w64, graph, backend="xla"), (x64,), (t64,))
    assert tangent.dtype == dtype
    assert_within(tangent, want, dtype)


@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_float16_products_do_not_overflow_inside(backend):
    """float16 holds at most 65504: factors of 300 whose products (9e4) would overflow in
    float16 math give the right, finite result in float32 math."""
    dtype = jnp.float16
    tp = jequi.channelwise("4x0e", "0e", "4x0e")
    n = 8
    x = jnp.full((n, 4), 300.0, dtype)
    y = jnp.full((n, 1), 300.0, dtype)
    w = jnp.full((n, tp.weight_numel), 0.01, dtype)
    z = tp(x, y, w, backend=backend)
    assert np.all(np.isfinite(np.asarray(z, np.float64)))
    assert_within(z, e3nn_tp(tp, *(np.asarray(a, np.float64) for a in (x, y, w))), dtype)
    s = np.zeros(40, int)  # 40 edges into one node: 40 * 900 = 36,000, below 65,504
    out = tp.conv(x[:1], y[:1].repeat(40, 0), w[:1].repeat(40, 0), jequi.Graph.build(s, s, 1), backend=backend)
    assert np.all(np.isfinite(np.asarray(out, np.float64)))


@pytest.mark.parametrize("edge_chunks", [1, 3])
def test_radial_conv_stores_its_weights_in_the_dtype(edge_chunks):
    """``radial_conv(dtype=bfloat16)``: the radial MLP's weights rounded as they are made, the
    conv's operands and output in bfloat16, in one chunk or several."""
    dtype = jnp.bfloat16
    tp = jequi.channelwise("8x0e+8x1o", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(3)
    n, e = 10, 70
    s, r = rng.integers(0, n, e), rng.integers(0, n, e)
    graph = jequi.Graph.build(s, r, n)
    x = rng.normal(size=(n, tp.irreps_in1.dim)).astype(np.float32)
    y = rng.normal(size=(e, tp.irreps_in2.dim)).astype(np.float32)
    hidden = rng.normal(size=(e, 6)).astype(np.float32)
    kernel = rng.normal(size=(6, tp.weight_numel)).astype(np.float32) / 3
    out = tp.radial_conv(x, y, hidden, kernel, graph, edge_chunks=edge_chunks, dtype=dtype, backend="pallas")
    assert out.dtype == dtype
    w64 = np.asarray(jnp.asarray(hidden.astype(np.float64) @ kernel.astype(np.float64), dtype), np.float64)
    x64, y64 = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (x, y))
    assert_within(out, tp.conv(x64, y64, w64, graph, backend="xla"), dtype)
    with pytest.raises(TypeError, match="floating dtype"):
        tp.radial_conv(x, y, hidden, kernel, graph, dtype=jnp.int32)


def _other_ops():
    """Each op with half-precision inputs: ``(name, call(inputs, backend), inputs in bfloat16)``."""
    rng = np.random.default_rng(4)
    sc = jequi.SymmetricContraction("4x0e+4x1o", "4x0e+4x1o", 3, 2)
    species = rng.integers(0, 2, 20)
    sc_weights = {k: rng.normal(size=shape) / shape[1] for k, shape in sc.weight_shapes.items()}
    lin = jequi.IndexedLinear("4x0e+4x1o", "8x0e+2x1o", 2)
    import e3nn_jax as e3nn

    def irreps_array(irreps):
        return lambda a: e3nn.IrrepsArray(irreps, a)

    n, k, h, d = 12, 5, 2, 8
    nbr = rng.integers(0, n, (n, k))
    layout = jequi.so2_layout("4x0e+4x1o", "4x0e+4x1o")
    return [
        ("symmetric", lambda a, b, **kw: sc(a[0], species, dict(zip(sc_weights, a[1:])), backend=b, **kw),
         [rng.normal(size=(20, 16)), *sc_weights.values()], ["xla", "pallas"]),
        ("indexed_linear", lambda a, b, **kw: lin(a[0], species, a[1], **kw), [rng.normal(size=(20, 16)), rng.normal(size=lin.weight_numel)], ["xla"]),
        ("sh_tensor_product", lambda a, b, **kw: jequi.sh_tensor_product(irreps_array("8x0e+8x1o")(a[0]), a[1], "0e+1o+2e", backend=b, **kw).array,
         [rng.normal(size=(20, 32)), rng.normal(size=(20, 3))], ["xla", "pallas"]),
        ("neighbor_attention", lambda a, b, **kw: jequi.neighbor_attention(a[0], a[1], a[2], nbr, backend=b, **kw),
         [rng.normal(size=(n, h, d)) for _ in range(3)], ["xla", "pallas"]),
        ("so2_conv", lambda a, b, **kw: jequi.so2_conv(a[0], a[1], a[2], "4x0e+4x1o", irreps_in="4x0e+4x1o", **kw),
         [rng.normal(size=(6, 16)), rng.normal(size=(6, 3)), rng.normal(size=(6, layout.weight_numel))], ["xla"]),
    ]


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_the_other_ops_compute_in_float32(dtype):
    """The symmetric contraction, species-indexed linear, EAAS product and neighbour attention
    take half-precision inputs, compute in float32 and round their output once; their
    gradients come back in the inputs' dtype."""
    for name, call, inputs, backends in _other_ops():
        rounded = [jnp.asarray(a, dtype) for a in inputs]
        want = call([np.asarray(a, np.float64) for a in rounded], "xla")
        for backend in backends:
            got = call(rounded, backend)
            assert got.dtype == dtype, name
            assert_within(got, want, dtype)
            g = jax.grad(lambda a: call([a, *rounded[1:]], backend).astype(jnp.float32).sum())(rounded[0])
            assert g.dtype == dtype, name


def test_every_backend_takes_half_precision_and_refuses_other_dtypes():
    """Every backend stores bfloat16 and float16 (the CUDA kernels too: they widen as they
    load); another dtype is a clear error before any kernel runs, and the default backend picks
    for half precision what it picks for float32."""
    for name in ("xla", "pallas", "cuda", "cuda-atomic"):
        for dtype in HALF:
            BACKENDS[name].check_dtype(dtype)
        with pytest.raises(ValueError, match="operands, not int32"):
            BACKENDS[name].check_dtype(jnp.int32)
    for name in ("nequip-water", "nequix-main", "mace-large"):
        desc = jequi.problems.get(name).descriptor.trilinear
        for conv in (False, True):
            assert default_backend(desc, conv=conv, dtype=jnp.bfloat16) == default_backend(desc, conv=conv, dtype=jnp.float32)


# --- out_dtype= and math_dtype= (jequi.dtypes.plan) ------------------------------------------


def _tp_and_conv(backend, **kw):
    """``(name, call)`` for the product and the hub conv, each ``call(x, y, w)``."""
    tp = jequi.channelwise("8x0e+8x1o", "0e+1o+2e", "0e+1o+2e")
    s, r = _hub_graph(np.random.default_rng(1), 10, 300, 40)
    graph = jequi.Graph.build(s, r, 10)
    return tp, [
        ("tp", lambda x, y, w: tp(x, y, w, backend=backend, **kw), 24),
        ("conv", lambda x, y, w: tp.conv(x, y, w, graph, backend=backend, **kw), s.size),
    ]


def _operands(tp, rows, edges, dtype, seed=6):
    rng = np.random.default_rng(seed)
    nodes = rows if edges == rows else 10
    return [jnp.asarray(rng.normal(size=shape), dtype) for shape in ((nodes, tp.irreps_in1.dim), (edges, tp.irreps_in2.dim), (edges, tp.weight_numel))]


def _two_programs(backend) -> bool:
    """Whether two calls of the same math may differ in the last bits: XLA on a GPU compiles
    each as its own program, free to fuse the widening into its matmuls and to order their sums
    differently (measured: it did). The kernels, and XLA on the CPU, give the same bits."""
    return backend == "xla" and jax.default_backend() == "gpu"


@pytest.mark.parametrize("backend", TP_BACKENDS)
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_out_dtype_float32_from_half_precision_is_the_same_math_unrounded(dtype, backend):
    """``out_dtype=float32`` on half-precision operands: exactly the float32 call on the widened
    operands (widening is exact), so within float32's accuracy of float64, not a half-precision
    rounding; cotangents still follow their primals."""
    tp, calls = _tp_and_conv(backend, out_dtype=jnp.float32)
    for name, call, edges in calls:
        half = _operands(tp, 24, edges, dtype) if name == "tp" else _operands(tp, 10, edges, dtype)
        got = call(*half)
        assert got.dtype == jnp.float32, name
        plain = _tp_and_conv(backend)[1][0 if name == "tp" else 1][1]
        same = plain(*(a.astype(jnp.float32) for a in half))
        if _two_programs(backend):
            assert_within(got, same, jnp.float32, units=64)
        else:
            np.testing.assert_array_equal(got, same, err_msg=name)
        want = plain(*(a.astype(jnp.float64) for a in half))
        assert_within(got, want, jnp.float32, units=64)  # float32 sums of up to 300 terms
        assert np.abs(np.asarray(got, np.float64) - want).max() < 0.1 * _eps(dtype) * np.abs(want).max(), name
        grads = jax.grad(lambda *a: call(*a).sum(), argnums=(0, 1, 2))(*half)
        assert all(g.dtype == dtype for g in grads), name


@pytest.mark.parametrize("backend", TP_BACKENDS)
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_out_dtype_half_from_float32_rounds_once(dtype, backend):
    tp, calls = _tp_and_conv(backend, out_dtype=dtype)
    for (name, call, edges), (_, plain, _) in zip(calls, _tp_and_conv(backend)[1]):
        ops = _operands(tp, 24, edges, jnp.float32) if name == "tp" else _operands(tp, 10, edges, jnp.float32)
        got = call(*ops)
        assert got.dtype == dtype, name
        if _two_programs(backend):  # a float32 value a few bits apart may round to the next half-precision value
            assert_within(got, plain(*ops).astype(dtype), dtype, units=1.0)
        else:
            np.testing.assert_array_equal(got, plain(*ops).astype(dtype), err_msg=name)
        assert_within(got, plain(*(a.astype(jnp.float64) for a in ops)), dtype)


@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_math_dtype_float64_rounds_float32_results_once(backend):
    """``math_dtype=float64`` on float32 operands: the 300-edge hub's sum within one float32
    rounding of float64 (0.6 eps), where float32 math is not."""
    tp, calls = _tp_and_conv(backend, math_dtype=jnp.float64)
    name, call, edges = calls[1]
    ops = _operands(tp, 10, edges, jnp.float32)
    got = call(*ops)
    assert got.dtype == jnp.float32
    plain = _tp_and_conv(backend)[1][1][1]
    want = plain(*(a.astype(jnp.float64) for a in ops))
    assert_within(got, want, jnp.float32)
    with pytest.raises(AssertionError):  # the check above can fail: float32 math misses it
        assert_within(plain(*ops), want, jnp.float32)
    grads = jax.grad(lambda *a: call(*a).sum(), argnums=(0, 1, 2))(*ops)
    assert all(g.dtype == jnp.float32 for g in grads)


def test_math_dtype_float32_on_float64_operands():
    """cuEquivariance's meaning: the operands rounded to float32, computed there, the result
    returned in the operands' dtype (or ``out_dtype``)."""
    tp, calls = _tp_and_conv("pallas", math_dtype=jnp.float32)
    for (name, call, edges), (_, plain, _) in zip(calls, _tp_and_conv("pallas")[1]):
        ops = _operands(tp, 24, edges, jnp.float64) if name == "tp" else _operands(tp, 10, edges, jnp.float64)
        got = call(*ops)
        assert got.dtype == jnp.float64, name
        np.testing.assert_array_equal(got, plain(*(a.astype(jnp.float32) for a in ops)).astype(jnp.float64), err_msg=name)


@pytest.mark.parametrize("edge_chunks", [1, 3])
def test_radial_conv_out_dtype_sums_its_chunks_in_float32(edge_chunks):
    """bfloat16 storage (``dtype=``) with ``out_dtype=float32``, in one chunk or several: the
    chunks' results are summed in float32 and not rounded to bfloat16."""
    tp = jequi.channelwise("8x0e+8x1o", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(3)
    n, e = 10, 70
    graph = jequi.Graph.build(rng.integers(0, n, e), rng.integers(0, n, e), n)
    x, y = (rng.normal(size=shape).astype(np.float32) for shape in ((n, tp.irreps_in1.dim), (e, tp.irreps_in2.dim)))
    hidden = rng.normal(size=(e, 6)).astype(np.float32)
    kernel = rng.normal(size=(6, tp.weight_numel)).astype(np.float32) / 3
    with jax.default_matmul_precision("float32"):  # the radial matmul as the oracle's (a GPU's default is TF32)
        out = tp.radial_conv(x, y, hidden, kernel, graph, edge_chunks=edge_chunks, dtype=jnp.bfloat16, out_dtype=jnp.float32,
                             backend="pallas")  # fmt: skip
    assert out.dtype == jnp.float32
    w64 = np.asarray(jnp.asarray(hidden.astype(np.float64) @ kernel.astype(np.float64), jnp.bfloat16), np.float64)
    x64, y64 = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (x, y))
    want = tp.conv(x64, y64, w64, graph, backend="xla")
    assert_within(out, want, jnp.float32, units=64)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.__name__)
def test_the_other_ops_take_out_dtype_and_math_dtype(dtype):
    """Each op that widens at the op: ``out_dtype=float32`` is its float32 call on the widened
    inputs, to the bit; ``math_dtype=float64`` is its float64 call rounded once."""
    for name, call, inputs, backends in _other_ops():
        rounded = [jnp.asarray(a, dtype) for a in inputs]
        for backend in backends:
            got = call(rounded, backend, out_dtype=jnp.float32)
            assert got.dtype == jnp.float32, name
            np.testing.assert_array_equal(got, call([a.astype(jnp.float32) for a in rounded], backend), err_msg=f"{name} {backend}")
            got = call(rounded, backend, math_dtype=jnp.float64)
            assert got.dtype == dtype, name
            want = call([a.astype(jnp.float64) for a in rounded], backend)
            np.testing.assert_array_equal(got, want.astype(dtype), err_msg=f"{name} {backend}")


def test_out_dtype_and_math_dtype_errors():
    tp = jequi.channelwise("4x0e", "0e", "4x0e")
    x, y, w = (jnp.ones(shape, jnp.float32) for shape in ((3, 4), (3, 1), (3, tp.weight_numel)))
    with pytest.raises(ValueError, match="half-precision math is not offered"):
        tp(x, y, w, math_dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="out_dtype must be one of bfloat16, float16, float32, float64, got int32"):
        tp(x, y, w, out_dtype=jnp.int32)
    with pytest.raises(TypeError, match="math_dtype must be a floating dtype"):
        tp(x, y, w, math_dtype="not a dtype")
    jax.config.update("jax_enable_x64", False)
    try:
        with pytest.raises(ValueError, match="math_dtype=float64 needs jax_enable_x64"):
            tp(x, y, w, math_dtype=jnp.float64)
    finally:
        jax.config.update("jax_enable_x64", True)


@pytest.mark.parametrize("backend", TP_BACKENDS)
def test_vmap_of_half_precision_calls_is_each_call(backend):
    """``jax.vmap`` over a batch of two bfloat16 products and hub convs (the kernels' batch grid
    rows): each element equals its own call, bitwise."""
    dtype = jnp.bfloat16
    tp, calls = _tp_and_conv(backend)
    for name, call, edges in calls:
        nodes = 24 if name == "tp" else 10
        batch = [_operands(tp, nodes, edges, dtype, seed) for seed in (7, 8)]
        stacked = [jnp.stack(a) for a in zip(*batch)]
        got = jax.vmap(call)(*stacked)
        assert got.dtype == dtype, name
        for b, ops in enumerate(batch):
            np.testing.assert_array_equal(np.asarray(got[b], np.float32), np.asarray(call(*ops), np.float32), err_msg=name)
