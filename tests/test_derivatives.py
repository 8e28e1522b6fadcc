"""First, second and third reverse-mode derivatives through the jequi_trilinear primitive (the seven-op identity)
equal jax autodiff through the pure-JAX reference and through e3nn-jax (float64)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, e3nn_tp, five_path_channelwise, random_inputs

import jequi
from jequi import backends
from jequi.backends import xla
from jequi.sums import GGW, GGY, W, X, Y, Sums

# the cuda backends run on a GPU only (tests/test_cuda.py covers them further)
ON_CUDA = pytest.mark.skipif("cuda" not in jequi.available_backends(), reason="needs a CUDA GPU and nvcc")
# each derivative order on the other backend's kernels (an A/B pair, registered here only)
MIXED = [backends.register(backends.mixed(a, b)) for a, b in (("pallas", "cuda"), ("cuda", "pallas"))]
BACKENDS = ["xla", "pallas", *(pytest.param(b, marks=ON_CUDA) for b in ("cuda", *MIXED))]
CONV_BACKENDS = [*BACKENDS, pytest.param("cuda-atomic", marks=ON_CUDA)]  # differs from cuda in the conv only

PROBLEMS = {
    "channelwise": lambda: jequi.channelwise("4x0e+3x1o+2x2e", "0e+1o+2e", "0e+1o+2e+3o"),
    "fully-connected": lambda: jequi.fully_connected("3x0e+2x1o", "2x0e+1o", "2x0e+3x1o+1x1e"),
    "mixed": lambda: jequi.TensorProduct(
        "3x0e+3x1o", "3x0e+1x1o", "3x1o+2x0e",
        [(0, 1, 0, "uvu", True), (1, 0, 0, "uuu", False), (1, 1, 1, "uvw", True), (1, 0, 0, "uvv", True, 0.7)],
    ),
}


def first(f, g):
    """(x, y, w) -> gradient of <f(x, y, w), g>."""
    return jax.grad(lambda x, y, w: jnp.vdot(f(x, y, w), g), argnums=(0, 1, 2))


def second(f, g):
    """(x, y, w) -> gradient of a nonlinear function of the first gradient (force-training shape)."""

    def scalar(x, y, w):
        gx, gy, gw = first(f, g)(x, y, w)
        return jnp.sum(jnp.sin(gx)) + jnp.sum(gy**2) + jnp.sum(gw * jnp.cos(gw))

    return jax.grad(scalar, argnums=(0, 1, 2))


def third(f, g):
    def scalar(x, y, w):
        hx, hy, hw = second(f, g)(x, y, w)
        return jnp.sum(jnp.tanh(hx)) + jnp.sum(hy**3) + jnp.sum(hw**2)

    return jax.grad(scalar, argnums=(0, 1, 2))


def _functions(tp):
    return {
        "jequi": tp,
        "reference": functools.partial(xla.forward, tp.descriptor),
        "e3nn": functools.partial(e3nn_tp, tp),
    }


# On CPU every product runs the xla backend, whose code is per mode (its einsums) and the same at
# every order (the third differentiates the rule's calls of it): there "mixed", which has the
# modes of the other two, runs shared weights and the third order.
DERIVATIVE_CASES = [
    (name, order, shared)
    for name in PROBLEMS
    for order in (first, second, third)
    for shared in (False, True)
    if name == "mixed" or (not shared and order is not third) or jequi.default_backend() != "xla"
]


@pytest.mark.parametrize("name, order, shared", DERIVATIVE_CASES)
def test_derivatives(name, order, shared):
    tp = PROBLEMS[name]()
    x, y, w = random_inputs(tp, 3, shared=shared)
    g = np.random.default_rng(7).normal(size=(3, tp.irreps_out.dim))
    fs = _functions(tp)
    ours = jax.jit(order(fs["jequi"], g))(x, y, w)
    for oracle in ("reference", "e3nn"):
        expected = jax.jit(order(fs[oracle], g))(x, y, w)  # jit: eager third order takes 12 s
        for a, b, what in zip(ours, expected, "xyw"):
            assert_close(a, b, 1e-10, f"{order.__name__} d/d{what} vs {oracle}")


@pytest.mark.parametrize("name", ["fully-connected"])
def test_third_order_through_the_fused_second_order(name):
    """The pallas backend's fused double backward is differentiated through the composed rule
    (restricted to its perturbed inputs and nonzero cotangents): third order as the reference."""
    tp = PROBLEMS[name]()
    x, y, w = random_inputs(tp, 2)
    g = np.random.default_rng(4).normal(size=(2, tp.irreps_out.dim))
    ours = jax.jit(third(functools.partial(tp, backend="pallas"), g))(x, y, w)
    expected = jax.jit(third(functools.partial(xla.forward, tp.descriptor), g))(x, y, w)
    for a, b, what in zip(ours, expected, "xyw"):
        assert_close(a, b, 1e-10, f"third d/d{what}")


def test_second_order_with_symbolic_zero_cotangents():
    # Only gy is used: the seven-op rule sees zero cotangents for gx and gw and skips them.
    tp = PROBLEMS["channelwise"]()
    x, y, w = random_inputs(tp, 3)
    g = np.random.default_rng(3).normal(size=(3, tp.irreps_out.dim))

    def scalar(f):
        return lambda x, y, w: jnp.sum(first(f, g)(x, y, w)[1] ** 2)

    ours = jax.jit(jax.grad(scalar(tp), argnums=(0, 1, 2)))(x, y, w)
    ref = jax.jit(jax.grad(scalar(functools.partial(xla.forward, tp.descriptor)), argnums=(0, 1, 2)))(x, y, w)
    for a, b in zip(ours, ref):
        assert_close(a, b, 1e-10)


# Interpreted Pallas (the CPU) runs the third order only: its program holds the conv's first- and
# second-order kernels too, whose values test_pallas.py checks (test_conv, the conv cases of
# test_fused_second_order), and the rule's lower orders are the same on every backend (xla's cases)
CONV_DERIVATIVE_CASES = [
    pytest.param(order, *b.values, marks=b.marks, id=f"{order.__name__}-{b.values[0]}")
    for order in (first, second, third)
    for b in map(lambda name: pytest.param(name) if isinstance(name, str) else name, CONV_BACKENDS)
    if not (b.values[0] == "pallas" and order is not third and jax.default_backend() == "cpu")
]


@pytest.mark.parametrize("order, backend", CONV_DERIVATIVE_CASES)
def test_conv_derivatives(order, backend):
    # channelwise with fewer paths than PROBLEMS' (7, not 13: interpreted kernels compile per
    # path, and the third order's Pallas program was most of this file's time)
    tp = jequi.channelwise("3x0e+2x1o+1x2e", "0e+1o", "0e+1o+2e")
    rng = np.random.default_rng(5)
    n, e = 5, 12
    x = rng.normal(size=(n, tp.irreps_in1.dim))
    y = rng.normal(size=(e, tp.irreps_in2.dim))
    w = rng.normal(size=(e, tp.weight_numel))
    s, r = rng.integers(0, n, e), rng.integers(0, n, e)
    g = rng.normal(size=(n, tp.irreps_out.dim))

    def reference(x, y, w):
        return jax.ops.segment_sum(e3nn_tp(tp, x[s], y, w), r, num_segments=n)

    ours = jax.jit(order(lambda x, y, w: tp.conv(x, y, w, s, r, n, backend=backend), g))(x, y, w)
    expected = jax.jit(order(reference, g))(x, y, w)
    for a, b, what in zip(ours, expected, "xyw"):
        assert_close(a, b, 1e-10, f"{order.__name__} d/d{what}")


def test_float32_gradients():
    tp = PROBLEMS["fully-connected"]()
    x, y, w = random_inputs(tp, 4, np.float32)
    g = np.random.default_rng(1).normal(size=(4, tp.irreps_out.dim)).astype(np.float32)
    ours = jax.jit(second(tp, g))(x, y, w)
    ref = jax.jit(second(functools.partial(e3nn_tp, tp), g))(x.astype(np.float64), y.astype(np.float64), w.astype(np.float64))
    for a, b in zip(ours, ref):
        assert a.dtype == np.float32
        assert_close(a, b, 1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_calls_compute_only_needed_gradients(backend, monkeypatch):
    """Force-training shape: x depends on the parameters only, y on the positions only, w on
    both. The forces' backward needs no gx; the loss gradient's double backward needs no gy
    and no gz-cotangent (composed: two backward calls, the ggw one without gw; fused: the
    spec's dx and dw sums only). The gradient still equals plain autodiff of the reference."""
    tp = five_path_channelwise()
    calls, seconds = [], []
    b = backends.BACKENDS[backend]

    def recording(desc, *args, needs):
        calls.append(needs)
        return b.backward(desc, *args, needs=needs)

    def recording_second(desc, spec, arrays):
        seconds.append(spec)
        return b.second(desc, spec, arrays)

    replaced = dataclasses.replace(b, backward=recording, second=recording_second if b.second else None)
    monkeypatch.setitem(backends.BACKENDS, backend, replaced)
    jequi.products._tp_kernels.cache_clear()
    rng = np.random.default_rng(11)
    d1, d2, _ = tp.descriptor.dims
    px, pw = rng.normal(size=(3, d1)), rng.normal(size=(3, tp.weight_numel))
    pos = rng.normal(size=(3, d2))
    g = rng.normal(size=(3, tp.irreps_out.dim))

    def loss(f):
        def energy(pos, px, pw):
            return jnp.vdot(f(jnp.sin(px), pos**2, pw * jnp.sum(pos**2, axis=1, keepdims=True)), g)

        return lambda px, pw: jnp.sum(jax.grad(energy)(pos, px, pw) ** 2)

    try:  # jitted, as the reference (eagerly each op of a double backward compiles alone): the kernels are asked for the same
        ours = jax.jit(jax.grad(loss(functools.partial(tp, backend=backend)), argnums=(0, 1)))(px, pw)
    finally:
        jequi.products._tp_kernels.cache_clear()
    expected = jax.jit(jax.grad(loss(functools.partial(xla.forward, tp.descriptor)), argnums=(0, 1)))(px, pw)
    for a, e in zip(ours, expected):
        assert_close(a, e, 1e-10)
    assert calls[0] == (False, True, True)
    if b.second is None:
        assert sorted(calls[1:]) == [(True, False, False), (True, False, True)]
    else:
        assert calls[1:] == []
        assert seconds == [Sums(dx=((GGY, W), (Y, GGW)), dw=((X, GGY),))]


# the pruning is the same primitive for every backend: Pallas' interpret mode (minutes here) is
# left to the GPU, where it compiles
@pytest.mark.parametrize("backend", [*(b for b in BACKENDS if b != "pallas"), pytest.param("pallas", marks=ON_CUDA)])
def test_unused_gradients_are_not_computed(backend, monkeypatch):
    """A loss of the backward's ``gx`` and ``gy`` only (the benchmark's double backward):
    the first backward's ``gw`` is pruned from the program (jequi.autodiff's dead-code rule), so the
    lowered kernel is asked for ``gx`` and ``gy`` only, also under ``vmap``; the result
    still equals autodiff of the reference."""
    tp = PROBLEMS["channelwise"]()
    calls = []
    b = backends.BACKENDS[backend]

    def recording(desc, *args, needs):
        calls.append(needs)
        return b.backward(desc, *args, needs=needs)

    monkeypatch.setitem(backends.BACKENDS, backend, dataclasses.replace(b, backward=recording))
    jequi.products._tp_kernels.cache_clear()
    x, y, w = random_inputs(tp, 4)
    g = np.random.default_rng(5).normal(size=(4, tp.irreps_out.dim))

    def loss(f):
        def scalar(x, y, w):
            gx, gy, _ = first(f, g)(x, y, w)
            return jnp.sum(gx**2) + jnp.sum(jnp.sin(gy))

        return jax.grad(scalar, argnums=(0, 1, 2))

    stacked = (np.stack([x, 2 * x]), np.stack([y, -y]), w)  # a vmapped batch of two, w shared
    try:
        for transform, args in ((lambda f: f, (x, y, w)), (lambda f: jax.vmap(f, (0, 0, None)), stacked)):
            traced = jax.jit(transform(loss(functools.partial(tp, backend=backend)))).trace(*args)
            calls.clear()
            compiled = traced.lower().compile()
            assert calls and (True, True, True) not in calls and (True, True, False) in calls, calls
            expected = jax.jit(transform(loss(functools.partial(xla.forward, tp.descriptor))))(*args)
            for a, e in zip(compiled(*args), expected):
                assert_close(a, e, 1e-10)
    finally:
        jequi.products._tp_kernels.cache_clear()


def test_pruned_gradients_keep_types_under_shard_map_and_nested_vmap():
    """The pruned backward's gradients carry their primals' types: the double backward runs
    under ``shard_map`` (varying axes) and under nested ``vmap`` with batch axes not first and
    an unbatched primal, and equals the reference."""
    tp = PROBLEMS["channelwise"]()
    x, y, w = random_inputs(tp, 4)
    g = np.random.default_rng(5).normal(size=(4, tp.irreps_out.dim))

    def dbl(f):
        def loss(x, y, w, g):
            gx, gy, _ = jax.grad(lambda x, y, w: jnp.vdot(f(x, y, w), g), argnums=(0, 1, 2))(x, y, w)
            return jnp.sum(gx**2) + jnp.sum(jnp.sin(gy))

        return jax.grad(loss, argnums=(0, 1, 2))

    ours, ref = dbl(functools.partial(tp, backend="xla")), dbl(functools.partial(xla.forward, tp.descriptor))
    mesh = jax.make_mesh((1,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("i")
    sharded = jax.jit(jax.shard_map(ours, mesh=mesh, in_specs=(spec,) * 4, out_specs=spec))
    for a, e in zip(sharded(x, y, w, g), jax.jit(ref)(x, y, w, g)):
        assert_close(a, e, 1e-10)
    xs, ys = np.stack([x, 2 * x], axis=1), np.stack([y, -y, y], axis=1)  # (4, 2, .), (4, 3, .)
    inner = lambda f: jax.vmap(f, in_axes=(None, 1, None, None))  # noqa: E731
    nested = lambda f: jax.vmap(inner(f), in_axes=(1, None, None, None))  # noqa: E731
    for a, e in zip(jax.jit(nested(ours))(xs, ys, w, g), jax.jit(nested(ref))(xs, ys, w, g)):
        assert_close(a, e, 1e-10)
