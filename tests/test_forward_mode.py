"""Forward-mode autodiff (jvp, linearize, jacfwd, hessian, jvp of grad) of products and convs
on every backend, against the pure-JAX reference's autodiff and finite differences (float64),
and which kernels the primitive's terms run in (jequi.autodiff)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.interpreters import partial_eval as pe
from conftest import assert_close, five_path_channelwise, random_inputs

import jequi
from jequi import autodiff, backends
from jequi.backends import xla
from jequi.sums import GGW, GGX, GGY, W, X, Y, Sums

ON_CUDA = pytest.mark.skipif("cuda" not in jequi.available_backends(), reason="needs a CUDA GPU and nvcc")
BACKENDS = ["xla", "pallas", pytest.param("cuda", marks=ON_CUDA)]
CONV_BACKENDS = [*BACKENDS, pytest.param("cuda-atomic", marks=ON_CUDA)]


def _tp():
    """A channelwise product of 5 paths (not 11: these tests are about the primitive's rules,
    and interpreted Pallas kernels compile per path; test_pallas.py runs the wider products)."""
    return five_path_channelwise()


def _mixed():
    return jequi.TensorProduct(
        "3x0e+3x1o", "3x0e+1x1o", "3x1o+2x0e",
        [(0, 1, 0, "uvu", True), (1, 0, 0, "uuu", False), (1, 1, 1, "uvw", True), (1, 0, 0, "uvv", True, 0.7)],
    )  # fmt: skip


# The (backend, problem) pairs a backend refuses by design, with what its error names: the
# Pallas kernels do not run uvv paths, the CUDA kernels run channelwise products only.
REFUSED = {("pallas", "_mixed"): "uvv", ("cuda", "_mixed"): "cuda backend runs mode"}


def _graph(num_nodes=5):
    # a hub (node 3), a self-loop, a node with no edges in (4 receives nothing but 0 -> 4) and a
    # padding edge (receiver out of range)
    senders = np.array([0, 1, 2, 3, 4, 0, 2, 1, 3, 0])
    receivers = np.array([1, 2, 3, 3, 0, 3, 3, 3, 4, num_nodes])
    return jequi.Graph.build(senders, receivers, num_nodes)


def _tangents(arrays, seed=7):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=np.shape(a)) for a in arrays)


def _conv_inputs(tp, graph, seed=3):
    rng = np.random.default_rng(seed)
    d1, d2, _ = tp.descriptor.dims
    return rng.normal(size=(graph.num_senders, d1)), rng.normal(size=(graph.num_edges, d2)), rng.normal(size=(graph.num_edges, tp.weight_numel))


@pytest.mark.parametrize("problem", [_tp, _mixed], ids=["channelwise", "mixed"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_is_the_sum_of_three_products(backend, problem):
    """``jvp`` of ``tp`` at ``(x, y, w)`` along ``(tx, ty, tw)`` equals the reference's, and for
    a product whose paths are all weighted (trilinear) it is ``tp(tx, y, w) + tp(x, ty, w) +
    tp(x, y, tw)``; per-row and shared weights; ``jax.linearize`` gives the same."""
    tp = problem()
    refused = REFUSED.get((backend, problem.__name__))
    if refused is not None:  # refused by design: the refusal is what is checked, and nothing else may be refused
        with pytest.raises(ValueError, match=refused):
            backends.resolve(backend, tp.descriptor.trilinear)
        pytest.skip(f"{backend} refuses the {problem.__name__} product by design ({refused})")
    f = functools.partial(tp, backend=backend)
    ref = functools.partial(xla.forward, tp.descriptor)
    trilinear = all(p.has_weight for p in tp.descriptor.paths)

    # one program per function: the jvp, jax.linearize's tangent, the tangent along y alone (a
    # zero tangent is no term) and the three products (the reference's); the reference jitted
    # too: eagerly each of its ops compiles alone
    @jax.jit
    def tangents(x, y, w, tx, ty, tw):
        out = {"jvp": jax.jvp(f, (x, y, w), (tx, ty, tw)), "dy": jax.jvp(lambda y: f(x, y, w), (y,), (ty,))[1]}
        out["linearize"] = jax.linearize(f, x, y, w)[1](tx, ty, tw)
        return out

    @jax.jit
    def reference(x, y, w, tx, ty, tw):
        out = {"jvp": jax.jvp(ref, (x, y, w), (tx, ty, tw)), "dy": jax.jvp(lambda y: ref(x, y, w), (y,), (ty,))[1]}
        if trilinear:
            out["three"] = ref(tx, y, w) + ref(x, ty, w) + ref(x, y, tw)
        return out

    for shared in (False, True):
        x, y, w = random_inputs(tp, 6, shared=shared)
        tx, ty, tw = _tangents((x, y, w))
        got, expected = tangents(x, y, w, tx, ty, tw), reference(x, y, w, tx, ty, tw)
        (z, dz), (z_ref, dz_ref) = got["jvp"], expected["jvp"]
        assert_close(z, z_ref, 1e-12, "primal")
        assert_close(dz, dz_ref, 1e-12, f"tangent shared={shared}")
        if trilinear:
            assert_close(dz, expected["three"], 1e-12, "three products")
        assert_close(got["linearize"], dz, 1e-12, "linearize")
        assert_close(got["dy"], expected["dy"], 1e-12, "y only")


@pytest.mark.parametrize("backend", CONV_BACKENDS)
def test_conv_jvp_and_hvp_of_forces(backend):
    """The conv's ``jvp`` against the reference's, and the Hessian-vector product of its
    "forces" (``jvp`` of ``grad`` in y and w, what phonons and Hessian fine-tuning take)
    against reverse-over-reverse, with a hub and a padding edge."""
    tp, graph = _tp(), _graph()
    x, y, w = _conv_inputs(tp, graph)
    tx, ty, tw = _tangents((x, y, w))
    ours = lambda x, y, w: tp.conv(x, y, w, graph, backend=backend)  # noqa: E731
    ref = lambda x, y, w: xla.conv_forward(tp.descriptor, x, y, w, graph)  # noqa: E731

    def energy(f):
        return lambda x, y, w: jnp.sum(jnp.sin(f(x, y, w)))

    # one program each (the jvp's tangent and the HVP's tangent of the conv are one kernel)
    @jax.jit
    def forward(x, y, w, tx, ty, tw, zero_x):  # the jvp, and forward over reverse
        return jax.jvp(ours, (x, y, w), (tx, ty, tw))[1], jax.jvp(jax.grad(energy(ours), argnums=(1, 2)), (x, y, w), (zero_x, ty, tw))[1]

    @jax.jit
    def reference(x, y, w, tx, ty, tw):  # the jvp, and reverse over reverse: grad of <grad, t>
        def inner(x, y, w, ty, tw):
            gy, gw = jax.grad(energy(ref), argnums=(1, 2))(x, y, w)
            return jnp.vdot(gy, ty) + jnp.vdot(gw, tw)

        return jax.jvp(ref, (x, y, w), (tx, ty, tw))[1], jax.grad(inner, argnums=(1, 2))(x, y, w, ty, tw)

    (got, hvp), (expected, hvp_ref) = forward(x, y, w, tx, ty, tw, np.zeros_like(tx)), reference(x, y, w, tx, ty, tw)
    assert_close(got, expected, 1e-12, "conv jvp")
    for a, b, what in zip(hvp, hvp_ref, ("y", "w")):
        assert_close(a, b, 1e-11, f"hvp d{what}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_jacfwd_equals_jacrev_and_hessian_matches_finite_differences(backend):
    tp = _tp()
    x, y, w = random_inputs(tp, 2)
    f = functools.partial(tp, backend=backend)
    jf = jax.jit(jax.jacfwd(f, argnums=(0, 1, 2)))(x, y, w)
    jr = jax.jit(jax.jacrev(f, argnums=(0, 1, 2)))(x, y, w)
    for a, b in zip(jf, jr):
        assert_close(a, b, 1e-12, "jacfwd vs jacrev")

    def energy(y):
        return jnp.sum(jnp.tanh(f(x, y, w)))

    hessian = jax.jit(jax.hessian(energy))(y)
    grad = jax.jit(jax.grad(energy))
    eps, rng = 1e-5, np.random.default_rng(0)
    for _ in range(3):
        v = rng.normal(size=y.shape)
        fd = (grad(y + eps * v) - grad(y - eps * v)) / (2 * eps)
        assert_close(jnp.einsum("abcd,cd->ab", hessian, v), fd, 1e-6, "hessian vs finite differences")


def test_mixed_modes_to_third_order():
    """Any mix of forward and reverse mode up to third order equals the reference's:
    ``jvp(grad(grad))``, ``grad(jvp)``, ``jacfwd(jacrev)`` and ``jvp`` of ``jvp``."""
    tp = _mixed()
    x, y, w = random_inputs(tp, 2)
    tx, ty, tw = _tangents((x, y, w))
    ours, ref = functools.partial(tp, backend="xla"), functools.partial(xla.forward, tp.descriptor)

    def cases(f):
        s = lambda x, y, w: jnp.sum(jnp.sin(f(x, y, w)))  # noqa: E731
        g2 = jax.grad(lambda x, y, w: jnp.sum(jax.grad(s, argnums=(0, 1, 2))(x, y, w)[1] ** 2), argnums=(0, 1, 2))
        return [
            jax.jvp(g2, (x, y, w), (tx, ty, tw))[1],
            jax.grad(lambda x, y, w: jnp.sum(jax.jvp(f, (x, y, w), (tx, ty, tw))[1] ** 3), argnums=(0, 1, 2))(x, y, w),
            jax.jacfwd(jax.jacrev(s, argnums=2), argnums=1)(x, y, w),
            jax.jvp(lambda x: jax.jvp(lambda x: jnp.sin(f(x, y, w)), (x,), (tx,))[1], (x,), (2 * tx,))[1],
        ]

    # the reference jitted too: eagerly each of its ops compiles alone
    for a, b in zip(jax.tree.leaves(jax.jit(lambda: cases(ours))()), jax.tree.leaves(jax.jit(lambda: cases(ref))())):
        assert_close(a, b, 1e-11)


def test_vmap_of_jvp_and_jvp_of_vmap_with_unbatched_weights():
    """``vmap`` over rows and over graphs of a ``jvp``, and ``jvp`` of a ``vmap``, with weights
    shared across the batch (their tangent unbatched)."""
    tp, graph = _tp(), _graph()
    x, y, w = _conv_inputs(tp, graph)
    tx, ty, tw = _tangents((x, y, w))
    xs, txs = np.stack([x, -x, 2 * x]), np.stack([tx, tx, -tx])

    def run(conv):
        one = lambda x, tx: jax.jvp(lambda x, w: conv(x, y, w), (x, w), (tx, tw))[1]  # noqa: E731
        inner = jax.vmap(lambda x, w: conv(x, y, w), in_axes=(0, None))
        return jax.vmap(one)(xs, txs), jax.jvp(inner, (xs, w), (txs, tw))[1]

    ours = run(lambda x, y, w: jequi.TensorProduct.conv(tp, x, y, w, graph, backend="xla"))
    ref = run(lambda x, y, w: xla.conv_forward(tp.descriptor, x, y, w, graph))
    for a, b in zip(ours, ref):
        assert_close(a, b, 1e-12)


def _recording(backend, monkeypatch):
    """The backend with its ``forward``, ``backward`` and ``second`` recording their calls."""
    b = backends.BACKENDS[backend]
    calls = []

    def record(kind, fn):
        def wrapped(desc, *args, **kwargs):
            calls.append((kind, kwargs.get("needs", args[0] if kind == "second" else None)))
            return fn(desc, *args, **kwargs)

        return wrapped

    replaced = dataclasses.replace(
        b, forward=record("forward", b.forward), backward=record("backward", b.backward), second=record("second", b.second)
    )
    monkeypatch.setitem(backends.BACKENDS, backend, replaced)
    jequi.products._tp_kernels.cache_clear()
    return calls


def test_a_tangent_of_three_products_runs_as_one_fused_forward_sum(monkeypatch):
    """``jvp`` along ``(tx, ty, tw)`` is one ``second`` call with the three products as its
    ``dgz`` triples (one fused forward sum on the GPU backends), and the primal one forward;
    ``jvp`` of ``grad`` (an HVP) runs the forward's tangent as that same call, then two
    backward-like calls: the tangents' pairs against ``gz`` (one fused call) and the plain
    backward against the tangent of ``gz``."""
    tp = _tp()
    calls = _recording("xla", monkeypatch)
    x, y, w = random_inputs(tp, 3)
    tx, ty, tw = _tangents((x, y, w))
    try:
        jax.jit(lambda *p: jax.jvp(functools.partial(tp, backend="xla"), p[:3], p[3:]))(x, y, w, tx, ty, tw)
        assert calls == [("forward", None), ("second", Sums(out=((GGX, Y, W), (X, GGY, W), (X, Y, GGW))))]
        calls.clear()
        g = np.ones((3, tp.irreps_out.dim))
        grad = jax.grad(lambda x, y, w: jnp.vdot(jnp.sin(tp(x, y, w, backend="xla")), g), argnums=(0, 1, 2))
        jax.jit(lambda *p: jax.jvp(grad, p[:3], p[3:]))(x, y, w, tx, ty, tw)
        seconds = [c[1] for c in calls if c[0] == "second"]
        assert seconds == [
            Sums(out=((GGX, Y, W), (X, GGY, W), (X, Y, GGW))),  # the tangent of z, for sin's
            Sums(dx=((GGY, W), (Y, GGW)), dy=((GGX, W), (X, GGW)), dw=((GGX, Y), (X, GGY))),
        ], calls
        assert ("backward", (True, True, True)) in calls
    finally:
        jequi.products._tp_kernels.cache_clear()


def test_xla_second_sums_a_partial_spec_term_by_term():
    """A spec that is not the identity of its arrays (forward mode's and higher orders' partial
    sums, e.g. ``dx`` from ``ggy`` alone while ``ggw`` feeds ``dw``) is summed term by term."""
    tp = _tp()
    desc = tp.descriptor.trilinear
    x, y, w = random_inputs(tp, 4)
    w = np.concatenate([w, np.ones((4, desc.weight_numel - w.shape[1]))], axis=1)
    rng = np.random.default_rng(1)
    gz, ggx, ggy, ggw = (rng.normal(size=s) for s in ((4, desc.dims[2]), x.shape, y.shape, w.shape))
    spec = Sums(out=((X, GGY, W),), dx=((GGY, W),), dw=((GGX, Y),))
    dx, dy, dw, dgz = xla.second(desc, spec, (x, y, w, gz, ggx, ggy, ggw))
    assert dy is None
    assert_close(dx, xla.backward(desc, x, ggy, w, gz, needs=(True, False, False))[0], 1e-13, "dx")
    assert_close(dw, xla.backward(desc, ggx, y, w, gz, needs=(False, False, True))[2], 1e-13, "dw")
    assert_close(dgz, xla.forward(desc, x, ggy, w), 1e-13, "dgz")


def test_unused_outputs_of_a_tangent_are_pruned():
    """Under ``jit``, outputs of the primitive nobody reads are dropped with their terms: the
    jvp's primal is not computed when only the tangent is returned."""
    tp = _tp()
    x, y, w = random_inputs(tp, 3)
    tx = _tangents((x,))[0]
    f = lambda x, tx: jax.jvp(lambda x: tp(x, y, w, backend="xla"), (x,), (tx,))[1]  # noqa: E731
    jaxpr = jax.make_jaxpr(f)(x, tx).jaxpr
    assert sum(e.primitive is autodiff.trilinear_p for e in jaxpr.eqns) == 2
    pruned, _ = pe.dce_jaxpr(jaxpr, [True])
    (eqn,) = [e for e in pruned.eqns if e.primitive is autodiff.trilinear_p]
    assert eqn.params["outputs"] == ((autodiff.Z, (autodiff.Term(3, 1, 2, None),)),)
