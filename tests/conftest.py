"""Shared helpers: the e3nn-jax oracle and random inputs. Tests run in float64 unless noted."""

import importlib.util
import os
import tempfile

# Tests write only to temporary folders: the CUDA kernels' build cache too (one folder per
# test session, shared by pytest-xdist's workers, which inherit the environment).
os.environ.setdefault("JEQUI_CACHE_DIR", tempfile.mkdtemp(prefix="jequi-test-cache-"))

# On CPU, XLA's backend (LLVM) optimisation off for the tests and the processes they start: the suite's time
# is mostly compiling small programs run once; a GPU run (a CUDA plugin installed) or a level set in XLA_FLAGS stays.
_gpu = any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
if not _gpu and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import e3nn_jax as e3nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from e3nn_jax.legacy import FunctionalTensorProduct  # noqa: E402

from jequi.backends import xla  # noqa: E402

jax.config.update("jax_enable_x64", True)


def e3nn_functional(tp):
    """e3nn-jax's FunctionalTensorProduct with the same arguments as a jequi TensorProduct."""
    d = tp.descriptor
    return FunctionalTensorProduct(
        d.irreps_in1,
        d.irreps_in2,
        d.irreps_out,
        list(d.instructions),
        in1_var=list(d.in1_var),
        in2_var=list(d.in2_var),
        out_var=list(d.out_var),
        irrep_normalization=d.irrep_normalization,
        path_normalization=d.path_normalization,
        gradient_normalization=d.gradient_normalization,
    )


def e3nn_tp(tp, x, y, w):
    """Row-wise e3nn-jax reference for flat arrays x (B, d1), y (B, d2), w (B, nw) or (nw,),
    always computed in float64: in float32 e3nn-jax's einsums run at the platform's default
    matmul precision, TF32 on a GPU (relative errors ~5e-4, seen on the H200)."""
    x, y, w = (jnp.asarray(a).astype(jnp.float64) for a in (x, y, w))
    f = e3nn_functional(tp)
    one = lambda w_, x_, y_: f.left_right(  # noqa: E731
        w_, e3nn.IrrepsArray(tp.irreps_in1, x_), e3nn.IrrepsArray(tp.irreps_in2, y_)
    ).array
    return jax.vmap(one, in_axes=(None if w.ndim == 1 else 0, 0, 0))(w, x, y)


def five_path_channelwise(layout: str = "mul_ir"):
    """A channelwise product of 5 paths, for tests about how a product is run (splits, calls,
    transforms) rather than the product: interpreted Pallas kernels compile per path."""
    import jequi

    return jequi.channelwise("3x0e+5x1o", "0e+1o", "0e+1o+1e", layout=layout)


def random_inputs(tp, batch, dtype=np.float64, seed=0, shared=False):
    rng = np.random.default_rng(seed)
    d1, d2, _ = tp.descriptor.dims
    x = rng.normal(size=(batch, d1)).astype(dtype)
    y = rng.normal(size=(batch, d2)).astype(dtype)
    w = rng.normal(size=(tp.weight_numel,) if shared else (batch, tp.weight_numel)).astype(dtype)
    return x, y, w


def assert_close(a, b, rtol, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    scale = max(np.abs(b).max(initial=0.0), 1e-30)
    err = np.abs(a - b).max(initial=0.0) / scale
    assert err <= rtol, f"{what}: max error {err:.3g} relative to max |ref| (tolerance {rtol})"


def check_batched(tp, backend: str, batch: int, dtype, shared: bool, tol: float):
    """`tp` on `backend`: the forward and the (x, y, w) gradients of ``<tp(x, y, w), g>``
    against the pure-JAX reference on random inputs."""
    x, y, w = random_inputs(tp, batch, dtype, shared=shared)
    ref = lambda *a: xla.forward(tp.descriptor, *a)  # noqa: E731
    ours = lambda *a: tp(*a, backend=backend)  # noqa: E731
    # jitted: eager dispatch of interpret-mode kernels and their gradients is several times slower
    assert_close(jax.jit(ours)(x, y, w), jax.jit(ref)(x, y, w), tol, "forward")
    g = np.random.default_rng(2).normal(size=(batch, tp.irreps_out.dim)).astype(dtype)
    grads = lambda f: jax.jit(jax.grad(lambda *a: jnp.vdot(f(*a), g), argnums=(0, 1, 2)))(x, y, w)  # noqa: E731
    for a, b, what in zip(grads(ours), grads(ref), "xyw"):
        assert_close(a, b, tol, f"d/d{what}")


# modules of quick host-side tests: dealt out last, they fill the other worker's time while one finishes a long test
QUICK_LAST = ("test_atoms.py", "test_descriptor.py", "test_errors.py", "test_equivariance.py")


def pytest_collection_modifyitems(items):
    """Tests marked ``slow`` first: under pytest-xdist (the GPU runs, benchmarks/cuda_run.sh)
    they then start at once beside the others instead of last and alone (on a fresh GPU
    machine the conv's split-kernel tests, dealt out last, ran past a device command's limit).
    The modules of :data:`QUICK_LAST` last, so that a run does not end on one long test."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, item.path.name in QUICK_LAST))


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def pallas_backend(**knobs) -> str:
    """The name of the ``pallas`` backend whose kernels take these :class:`pallas_kernels.Config`
    knobs (registered once per config)."""
    import pallas_kernels
    from jequi import backends

    return backends.register(backends.configured("pallas", pallas_kernels.Config(**knobs)))


@pytest.fixture
def fresh_kernels():
    """Caches cleared on both sides: kernels traced with a test's module settings (jequi.graph's
    part sizes) are neither reused from nor left to other tests."""
    jax.clear_caches()
    yield
    jax.clear_caches()
