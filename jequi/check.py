"""``python -m jequi --check``: what this machine runs, and a short self-test of it.

It prints:

- the platform and devices;
- the jax, jaxlib and jequi versions;
- each backend: available or not, and why not;
- the kernel cache folder;
- a self-test of each available backend against ``xla`` on a small channelwise conv: forward,
  gradient and forward mode.

:func:`run` returns the exit status: 1 if a backend that is available fails its self-test,
or if on a GPU the ``cuda`` backend is not available (a toolchain is missing: the default
model convs would then run slower without it being asked for).
"""

from __future__ import annotations

import importlib.metadata
import time

import jax
import jax.numpy as jnp
import numpy as np


def _why_not(name: str) -> str:
    from ffi import build

    if name.startswith("cuda"):
        if jax.default_backend() != "gpu":
            return f"needs a CUDA GPU (JAX platform: {jax.default_backend()})"
        return build.toolchain_missing() or "unknown"
    return "unknown"


def self_test(backend: str, tol: float = 1e-4) -> float:
    """Largest relative deviation of `backend` from ``xla`` on a small channelwise conv
    (forward, the gradient in every input, a forward-mode derivative), float32."""
    import jequi

    tp = jequi.channelwise("32x0e+32x1o", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(0)
    n, e = 40, 200
    x = jnp.asarray(rng.normal(size=(n, tp.irreps_in1.dim)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(e, tp.irreps_in2.dim)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(e, tp.weight_numel)), jnp.float32)
    graph = jequi.Graph.build(jnp.asarray(rng.integers(0, n, e)), jnp.asarray(np.sort(rng.integers(0, n, e))), n)

    def outputs(name):
        f = lambda x, y, w: tp.conv(x, y, w, graph, backend=name)  # noqa: E731
        z = f(x, y, w)
        grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(x, y, w)
        _, tangent = jax.jvp(f, (x, y, w), (x, y, w))
        return [z, *grads, tangent]

    ref = jax.jit(lambda: outputs("xla"))()
    got = jax.jit(lambda: outputs(backend))()
    return max(float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30)) for a, b in zip(got, ref))


def run(print_=print) -> int:
    """Print the report; the exit status (0: everything that should work works)."""
    import jequi
    from ffi import build
    from jequi.backends import BACKENDS, available_backends

    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    print_(f"platform: {jax.default_backend()}; devices: {', '.join(f'{d.platform}:{d.id} {d.device_kind}' for d in jax.devices())}")
    print_(f"versions: jax {jax.__version__}, jaxlib {version('jaxlib')}, jequi {jequi.__version__}")
    print_(f"kernel cache: {build.CACHE_DIR} (JEQUI_CACHE_DIR sets it)")
    available = available_backends()
    status = 0
    for name in BACKENDS:
        if name not in available:
            print_(f"backend {name}: not available: {_why_not(name)}")
            if jax.default_backend() == "gpu" and name == "cuda":
                status = 1
            continue
        if name == "xla":
            print_("backend xla: available (the reference)")
            continue
        note = " (interpreted on this platform: slow, for tests)" if name == "pallas" and jax.default_backend() != "gpu" else ""
        t0 = time.perf_counter()
        try:
            dev = self_test(name)
            ok = dev < 1e-4
            result = f"self-test against xla {'passed' if ok else 'FAILED'}: largest relative deviation {dev:.1e}"
        except Exception as exc:  # noqa: BLE001  (a backend that fails is what the check reports)
            ok, result = False, f"self-test FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        print_(f"backend {name}: available{note}; {result} ({time.perf_counter() - t0:.1f} s, compile included)")
        status |= 0 if ok else 1
    oam = jequi.channelwise("128x0e+64x1o+32x2e+32x3o", "0e+1o+2e+3o", "128x0e+64x1o+32x2e+32x3o")
    print_(f"default backend here of NequIP-OAM-L's conv: {jequi.default_backend(oam.descriptor, conv=True)}")
    print_("check: " + ("everything that should work works" if status == 0 else "FAILED (see above)"))
    return status
