"""Every GPU kernel family of jequi once, on hostile inputs, in one process: the program that
``benchmarks/sanitize_run.sh`` runs under compute-sanitizer (memcheck, racecheck, initcheck).

Each case runs its kernel backend under ``jit`` in float32 and compares it with the ``xla``
backend in float64 (the oracle), so a run is a value check too; the sanitizer reports the
accesses. A case fails where the kernel's relative error (of the largest value) exceeds 1e-4 and
twice the error of ``xla`` in float32 on the same machine (on a GPU XLA's float32 matmuls may run
in TF32, which sets what float32 can be asked for). Families and orders (the issue's list):

* the product: forward, backward, double backward (force training's), tangent (``jvp``);
* the conv in the same four, on ``pallas``, ``cuda`` and ``cuda-atomic``: receivers and senders
  -1, -2^31, N, 2^31-1, a hub of ``--hub`` edges into one node, an empty graph, zero nodes;
* ``radial_conv`` in 3 edge chunks, forward and backward;
* the product and the conv in bfloat16 too (half-precision storage, the kernels' widening loads
  and rounding stores), against xla in bfloat16;
* the EAAS product (``sh_tensor_product``, ``pallas``): forward, backward, tangent, with a zero
  vector and zero rows;
* neighbour attention (``pallas``, ``pallas-atomic``): forward, backward, tangent, neighbours
  -1, -2^31, N, 2^31-1 and a hub row;
* the symmetric contraction (``pallas``): forward, backward, double backward, species -1,
  -2^31, S, 2^31-1, and zero rows.

Prints one line per case (``ok``, the error, ``FAIL``) and exits non-zero on any failure.
``--kernels-only`` runs the kernel backends' calls alone (under the sanitizer, after a checked
run has filled the compilation cache). On a
CPU the Pallas kernels run in interpret mode (a check of this program): ``--small``.
"""

from __future__ import annotations

import argparse
import sys
import traceback

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np

import jequi

BAD = (-1, -(2**31), None, 2**31 - 1)  # None: N, one past the end
RESULTS: list[tuple[str, str]] = []
ORDERS = ("forward", "backward", "second", "tangent")
KERNELS_ONLY = False  # --kernels-only (the sanitized runs): the kernel backend's call alone, no oracle
RUNS = 1  # --runs: executions of each case under --kernels-only (reports of a first run alone point at loading)
ONLY: tuple[str, ...] = ()  # --only: run the cases whose label starts with one of these


def bad_indices(n: int) -> np.ndarray:
    return np.array([n if b is None else b for b in BAD], np.int64).astype(np.int32)


def _error(got, ref) -> float:
    worst = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.all(np.isfinite(a)):
            raise AssertionError(f"shape {a.shape} against {b.shape}, or a non-finite value")
        worst = max(worst, float(np.abs(a - b).max(initial=0.0) / max(np.abs(b).max(initial=0.0), 1e-30)))
    return worst


def _cast(args, dtype):
    return tuple(jnp.asarray(a, dtype) if np.issubdtype(np.asarray(a).dtype, np.floating) else jnp.asarray(a) for a in args)


def _order(fn, order: str, args, seed: int = 9):
    """`fn` (of the floating `args`; integer ones ride along) and its derivative of `order`:
    the gradient of <fn, g>, force training's double backward (the gradient in every floating
    input of |d<fn, g>/d(first input)|^2) or the tangent."""
    if order == "forward":
        return fn
    floats = [i for i, a in enumerate(args) if np.issubdtype(np.asarray(a).dtype, np.floating)]
    rng = np.random.default_rng(seed)
    g = rng.normal(size=jax.eval_shape(fn, *args).shape)
    tangents = [rng.normal(size=np.shape(args[i])) for i in floats]

    def split(fl, a):
        full = list(a)
        for i, v in zip(floats, fl):
            full[i] = v
        return full

    def inner(fl, a):
        return jnp.vdot(fn(*split(fl, a)), jnp.asarray(g, fl[0].dtype))

    if order == "backward":
        return lambda *a: jax.grad(inner)([a[i] for i in floats], a)
    if order == "second":
        first = lambda fl, a: jax.grad(lambda f0: inner([f0, *fl[1:]], a))(fl[0])  # noqa: E731
        return lambda *a: jax.grad(lambda fl: jnp.sum(first(fl, a) ** 2))([a[i] for i in floats])
    return lambda *a: jax.jvp(lambda *fl: fn(*split(fl, a)), tuple(a[i] for i in floats),
                              tuple(jnp.asarray(t, a[i].dtype) for t, i in zip(tangents, floats)))  # fmt: skip


def case(name: str, f, args, orders=ORDERS, tol: float = 1e-4, dtype=jnp.float32):
    """``f(backend, *args)``: each order on the kernel backend (in `dtype`, float32 unless a
    half-precision case) against xla in float64, with xla in `dtype` beside it; records ok / FAIL."""
    backend = name.split("/")[1]
    for order in orders:
        label = f"{name}/{order}"
        if ONLY and not label.startswith(ONLY):
            continue
        try:
            compiled = lambda be: jax.jit(_order(lambda *a: f(be, *a), order, args))  # noqa: E731
            run = lambda be, dtype: compiled(be)(*_cast(args, dtype))  # noqa: E731
            if KERNELS_ONLY:  # copied to the host: initcheck checks every byte of the results as a memcpy source
                fn = compiled(backend)  # one trace for all the runs
                for i in range(RUNS):
                    jax.device_get(fn(*_cast(args, dtype)))
                    print(f"{label}{f' (run {i + 1})' if RUNS > 1 else ''}: ran", flush=True)
                RESULTS.append((label, "ran"))
                continue
            oracle = run("xla", jnp.float64)
            err, xla_err = _error(run(backend, dtype), oracle), _error(run("xla", dtype), oracle)
            dname = jnp.dtype(dtype).name
            if err > max(tol, 2 * xla_err):
                raise AssertionError(f"relative error {err:.2e} (xla {dname}: {xla_err:.2e})")
            RESULTS.append((label, f"ok ({err:.1e}; xla {dname} {xla_err:.1e})"))
        except Exception as exc:  # noqa: BLE001  (every case runs; the exit code says what failed)
            RESULTS.append((label, f"FAIL {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"))
            traceback.print_exc()
        print(f"{label}: {RESULTS[-1][1]}", flush=True)


def products(backends, rows):
    tp = jequi.channelwise("8x0e+8x1o+4x2e", "0e+1o+2e", "0e+1o+2e")
    rng = np.random.default_rng(0)
    x, y, w = (rng.normal(size=(rows, d)) for d in (tp.irreps_in1.dim, tp.irreps_in2.dim, tp.weight_numel))
    for b in backends:
        if b == "cuda-atomic":
            continue  # the same product kernels as cuda; atomics are in the conv backward only
        case(f"tp/{b}", lambda be, x, y, w: tp(x, y, w, backend=be), (x, y, w))
        case(f"tp/{b}/zero-rows", lambda be, x, y, w: tp(x, y, w, backend=be), (x[:0], y[:0], w[:0]), ("forward", "backward"))
        case(f"tp/{b}/bfloat16", lambda be, x, y, w: tp(x, y, w, backend=be), (x, y, w), dtype=jnp.bfloat16)
    return tp


def graph(n, e, hub, rng):
    """Senders and receivers over n nodes: `hub` edges into node 0, the others random, and the
    hostile indices at both ends of the first edges."""
    s = rng.integers(0, n, e).astype(np.int32)
    r = rng.integers(0, n, e).astype(np.int32)
    r[: min(hub, e)] = 0
    bad = bad_indices(n)
    s[: len(bad)], r[len(bad) : 2 * len(bad)] = bad, bad
    return s, r


def convs(tp, backends, n, e, hub):
    rng = np.random.default_rng(1)
    s, r = graph(n, e, hub, rng)
    x = rng.normal(size=(n, tp.irreps_in1.dim))
    y, w = (rng.normal(size=(e, d)) for d in (tp.irreps_in2.dim, tp.weight_numel))
    hidden, kernel = rng.normal(size=(e, 8)), rng.normal(size=(8, tp.weight_numel)) / 3
    none = np.zeros(0, np.int32)
    conv = lambda be, x, y, w, s, r: tp.conv(x, y, w, s, r, n, backend=be)  # noqa: E731
    for b in backends:
        case(f"conv/{b}", conv, (x, y, w, s, r))
        case(f"conv/{b}/bfloat16", conv, (x, y, w, s, r), dtype=jnp.bfloat16)
        case(f"radial_conv/{b}/3-chunks", lambda be, x, y, k, h, s, r: tp.radial_conv(x, y, h, k, s, r, n, edge_chunks=3, backend=be),
             (x, y, kernel, hidden, s, r), ("forward", "backward", "tangent"))  # fmt: skip
        case(f"conv/{b}/empty-graph", conv, (x, y[:0], w[:0], none, none), ("forward", "backward"))
        case(f"conv/{b}/zero-nodes", lambda be, x, y, w, s, r: tp.conv(x, y, w, s, r, 0, backend=be),
             (x, y[:3], w[:3], s[:3] * 0, r[:3] * 0), ("forward",))  # fmt: skip


def bookkeeping(n, e, hub):
    """The conv's index bookkeeping alone, no kernel (``Graph.build`` and the row parts of the
    pallas and cuda kernels, under ``jit``): separates a report in XLA's index code from one in a
    kernel's output."""
    from jequi.graph import row_parts

    s, r = graph(n, e, hub, np.random.default_rng(1))

    def prepare(s, r):
        g = jequi.Graph.build(s, r, n)
        return g, row_parts(g.receiver_offsets, e, 256)

    label = "graph/bookkeeping/forward"
    if not ONLY or label.startswith(ONLY):
        jax.block_until_ready(jax.jit(prepare)(jnp.asarray(s), jnp.asarray(r)))
        RESULTS.append((label, "ran"))
        print(f"{label}: ran", flush=True)


def eaas(rows):
    rng = np.random.default_rng(2)
    irreps = e3nn.Irreps("8x0e+8x1o")
    x, v = rng.normal(size=(rows, irreps.dim)), rng.normal(size=(rows, 3))
    f = lambda be, x, v: jequi.sh_tensor_product(e3nn.IrrepsArray(irreps, x), v, [0, 1, 2], backend=be).array  # noqa: E731
    case("eaas/pallas", f, (x, v), ("forward", "backward", "tangent"))
    case("eaas/pallas/zero-vector", f, (x[:4], np.concatenate([np.zeros((1, 3)), v[1:4]])), ("forward",))
    case("eaas/pallas/zero-rows", f, (x[:0], v[:0]), ("forward",))


def attention(n, k):
    rng = np.random.default_rng(3)
    heads, d, dv = 4, 8, 24
    q, kk, v = (rng.normal(size=(n, heads, c)) for c in (d, d, dv))
    nbr = rng.integers(0, n, size=(n, k)).astype(np.int32)
    nbr[:, 0] = 3  # a source hub: every target's first slot is node 3 (the backward's dk, dv sum n rows into it)
    bad = bad_indices(n)
    nbr[1, : len(bad)] = bad
    nbr[2, :] = -1  # no valid neighbour
    b, e = rng.normal(size=(n, k, heads)), rng.uniform(0.2, 1, (n, k))
    f = lambda be, q, kk, v, b, e, nbr: jequi.neighbor_attention(q, kk, v, nbr, logit_bias=b, envelope=e, eps=1e-3, backend=be)  # noqa: E731
    for backend in ("pallas", "pallas-atomic"):
        case(f"attention/{backend}", f, (q, kk, v, b, e, nbr), ("forward", "backward", "tangent"))


def symmetric(rows):
    sc = jequi.SymmetricContraction("16x0e+16x1o+16x2e", "16x0e+16x1o", 3, 4)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(rows, sc.descriptor.irreps_in.dim)) / 2
    s = rng.integers(0, 4, rows).astype(np.int64)
    s[:4] = [-1, -(2**31), 4, 2**31 - 1]  # traced (an argument under jit): these rows give zero
    s = s.astype(np.int32)
    names = sorted(sc.weight_shapes)
    ws = tuple(np.asarray(sc.init_weights(jax.random.key(0))[k], np.float64) for k in names)
    f = lambda be, x, s, *w: sc(x, s, dict(zip(names, w)), backend=be)  # noqa: E731
    case("symmetric/pallas", f, (x, s, *ws), ("forward", "backward", "second"))
    case("symmetric/pallas/zero-rows", f, (x[:0], s[:0], *ws), ("forward", "backward"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="CPU sizes (interpret mode)")
    ap.add_argument("--families", default="tp,conv,eaas,attention,symmetric", help="also: graph (the conv's index bookkeeping, no kernel)")
    ap.add_argument("--only", default="", help="comma-separated label prefixes: run only those cases (e.g. conv/pallas/forward)")
    ap.add_argument("--kernels-only", action="store_true", help="run the kernel backends alone (values unchecked): the sanitized runs")
    ap.add_argument("--runs", type=int, default=1, help="with --kernels-only (ignored without it): executions of each case (one compile)")
    a = ap.parse_args()
    global KERNELS_ONLY, ONLY, RUNS
    KERNELS_ONLY, ONLY, RUNS = a.kernels_only, tuple(p for p in a.only.split(",") if p), a.runs
    jax.config.update("jax_enable_x64", True)  # the float64 oracle
    rows, n, e, hub, k = (24, 9, 40, 20, 6) if a.small else (2000, 500, 60_000, 50_000, 40)
    kernel_backends = ["pallas"] + [b for b in ("cuda", "cuda-atomic") if b in jequi.available_backends()]
    print("jax", jax.__version__, jax.devices(), "kernel backends", kernel_backends, flush=True)
    families = a.families.split(",")
    if "graph" in families:
        bookkeeping(n, e, hub)
    tp = products(kernel_backends if "tp" in families else [], rows)
    if "conv" in families:
        convs(tp, kernel_backends, n, e, hub)
    if "eaas" in families:
        eaas(rows)
    if "attention" in families:
        attention(n, k)
    if "symmetric" in families:
        symmetric(rows)
    failed = [name for name, res in RESULTS if res.startswith("FAIL")]
    print(f"{len(RESULTS)} cases, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
