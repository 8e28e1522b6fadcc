"""jequi against its peers on one GPU: batched tensor products and a fused convolution.

On the GPU machine, from the project root::

    source .peers/setup_peers.sh && python3 benchmarks/gpu_benchmark.py
    source .peers/setup_peers.sh && python3 benchmarks/gpu_benchmark.py --conv
    python3 benchmarks/gpu_benchmark.py --quick --problems nequip-lips --dtypes float32   # CPU smoke test

Every available jequi backend, e3nn-jax (``legacy.FunctionalTensorProduct`` under
``jax.vmap``), cuEquivariance-JAX (``segmented_polynomial``) and OpenEquivariance's JAX
extension run in this one process on the same random inputs, under ``jax.jit``. A peer that
cannot be imported or fails is reported as n/a with the reason. ``jequi-default`` is jequi on
the backend it picks itself (``backend=None``), ``jequi-<backend>`` on a named one. ``jequi-pallas-ir_mul`` is
jequi in cuEquivariance's ``ir_mul`` layout, on the same values stored so (``--no-ir-mul``
leaves it out; ``jequi-cuda-ir_mul`` likewise); the speedup table compares each peer with jequi in the peer's layout. Passes:

* ``fwd``: ``tp(x, y, w)``;
* ``bwd``: ``jax.grad`` of ``vdot(tp(x, y, w), g)`` w.r.t. (x, y, w);
* ``dbl``: ``jax.grad`` w.r.t. (x, y, w) of ``sum(gx**2) + sum(gy**2)``, (gx, gy, gw) that
  backward (batch ``--dbl-batch``);
* ``dblf`` (only where ``--passes`` names it): the double backward force training runs, where
  ``g`` is a later layer's cotangent and every gradient is used: ``jax.grad`` w.r.t. (x, y, w,
  g) of ``sum(gx**2) + sum(gy**2) + sum(gw**2)`` (the ``d/dg`` term is a forward pass of its own).

Each cell: compile, a warm-up call, then the median of ``--repeat`` (5) repetitions of
``--calls`` (10) calls, ended by ``block_until_ready`` (fewer calls when one call is slow).

HBM bound: bytes that must move at least once divided by the device-to-device bandwidth this
script measures (``a + 1`` on a ~2 GB float32 array, read + write). Per row, in elements:
fwd reads x, y, w, writes z; bwd reads x, y, w, g, writes gx, gy, gw; dbl (fully fused, gx
and gy kept on chip) also reads x, y, w, g and writes dx, dy, dw, the same bytes as bwd;
dblf reads x, y, w, g and writes dx, dy, dw, dg.
``dbl_2k`` (the markdown's "dbl 2-kernel %HBM") is the bound of any double backward that
``jax.grad`` runs (a first and a second derivative op), whose loss between the two derivative orders is user
code: a first backward reads x, y, w, g and writes gx, gy; the loss's XLA fusion reads them and
writes their cotangents; a second-order kernel reads x, y, w, g and those and writes dx, dy, dw
(2 x (in1 + in2 + w + out) + 5 x (in1 + in2) + w per row). Conv: fwd reads x once, y, w per edge, both index arrays,
writes out per node; fwd+bwd adds a backward that reads x, y, w, g, indices and writes gx,
gy, gw. ``fraction`` = bound / measured.

The full default run takes longer than one 10-minute device command: split it with
``--problems``/``--dtypes``/``--impls``; results are rewritten after every problem, so a run
cut short still leaves its finished rows, and ``--merge a.json,b.json --tag T`` writes the
parts as one table (speedups, geometric means, plot). Outputs ``<date>-<device>-tp[-<tag>].{json,md,png}`` (``-conv`` with ``--conv``) into ``--out``
(default benchmarks/results) and, when $OUT is set, into $OUT as well.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import shutil
import time
import traceback

import jax

jax.config.update("jax_enable_x64", True)  # for the float64 cells; every array below has an explicit dtype

import e3nn_jax as e3nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from e3nn_jax.legacy import FunctionalTensorProduct  # noqa: E402

import jequi  # noqa: E402
from jequi.descriptor import layout_positions  # noqa: E402
from timing import median_ms  # noqa: E402

TP_PROBLEMS = "mace-large,mace-medium,nequip-lips,nequip-benzene,nequip-oam-main,diffdock-l1,diffdock-l2,tetris-poly-1,tetris-poly-2"
PEERS = ("e3nn", "cuex", "oeq", "oeq-det")
# The layout of each peer's operands: cuEquivariance's channelwise and fully connected
# descriptors are ``ir_mul`` (segments ``iu``: a component's channels contiguous), e3nn-jax and
# OpenEquivariance take e3nn's ``mul_ir``. Speedups compare a peer with jequi in its layout.
PEER_LAYOUTS = {"e3nn": "mul_ir", "cuex": "ir_mul", "oeq": "mul_ir", "oeq-det": "mul_ir"}
IR_MUL = "-ir_mul"  # name suffix of the jequi implementations run in the ir_mul layout
# A/B pairs, each derivative order on the other backend's kernels (built and registered here)
MIXED = {jequi.backends.register(jequi.backends.mixed(a, b)) for a, b in (("pallas", "cuda"), ("cuda", "pallas"))}
KERNEL_BACKENDS = {"pallas", "cuda", "cuda-atomic", *MIXED}  # the jequi backends also run in the ir_mul layout
CONV_ONLY = {"cuda-atomic"}  # backends that differ from another only in the conv
BOUND_NAMES = {"dbl_2k": "dbl 2-kernel"}  # markdown names of the bounds that are not a pass's own
DEFAULT = "default"  # jequi-default: the backend jequi picks when the caller names none (backends.resolve)
CHECK_ROWS = 64
SLOW_CELL_S = 10.0  # fewer calls per repetition when a cell would take longer than this

_PEER_MODULES: dict[str, object] = {}


def peer(name):
    """The peer's modules, imported once; raises with the reason when it is missing."""
    if name not in _PEER_MODULES:
        try:
            if name == "cuex":
                import cuequivariance as cue
                import cuequivariance_jax as cuex

                _PEER_MODULES[name] = (cue, cuex)
            else:
                os.environ.setdefault("OEQ_NOTORCH", "1")
                import openequivariance.jax as oeqj
                from openequivariance.benchmark.problems import (
                    ChannelwiseTPP,
                    FullyConnectedTPProblem,
                )

                _PEER_MODULES[name] = (oeqj, ChannelwiseTPP, FullyConnectedTPProblem)
        except Exception as exc:  # noqa: BLE001
            _PEER_MODULES[name] = exc
    mods = _PEER_MODULES[name]
    if isinstance(mods, Exception):
        raise RuntimeError(f"not importable: {type(mods).__name__}: {mods}")
    return mods


# --- implementations: name -> list of (note, fn) candidates, tried in order --------------------
def backend_arg(name):
    """The ``backend=`` argument of jequi implementation ``jequi-<name>`` (None: jequi's own choice)."""
    return None if name == DEFAULT else name


def e3nn_fn(tp, conv_nodes=None):
    f = FunctionalTensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, list(tp.instructions))
    one = lambda w, x, y: f.left_right(w, e3nn.IrrepsArray(tp.irreps_in1, x), e3nn.IrrepsArray(tp.irreps_in2, y)).array  # noqa: E731
    if conv_nodes is None:
        return lambda x, y, w: jax.vmap(one)(w, x, y)
    return lambda x, y, w, s, r, graph: jax.ops.segment_sum(
        jax.vmap(one)(w, x[s], y), r, num_segments=conv_nodes, indices_are_sorted=True
    )


def cuex_candidates(tp, spec, conv_nodes=None):
    cue, cuex = peer("cuex")
    kind, in1, in2, out = spec
    _, _, dout = tp.descriptor.dims
    irreps1 = cue.Irreps("O3", in1)
    build = cue.descriptors.channelwise_tensor_product if kind == "uvu" else cue.descriptors.fully_connected_tensor_product
    poly = build(irreps1, cue.Irreps("O3", in2), cue.Irreps("O3", out)).polynomial
    sizes = [op.size for op in poly.inputs] + [poly.outputs[0].size]
    want = [tp.weight_numel, *tp.descriptor.dims]
    print(f"    cuex check: operand sizes (w, x, y, z) {sizes}, jequi {want}", flush=True)
    if sizes != want:
        raise ValueError(f"cuex operand sizes {sizes} differ from jequi's {want}")
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    cands = []
    if gpu:
        cands.append(("uniform_1d", poly))
        muls = {mul for mul, _ in irreps1}
        if kind == "uvu" and len(muls) > 1:
            # uniform_1d needs one channel extent: cut in1 into gcd-sized blocks (same sizes, more paths).
            g = math.gcd(*muls)
            chunked = cue.Irreps("O3", "+".join("+".join([f"{g}x{ir}"] * (mul // g)) for mul, ir in irreps1))
            chunked_poly = build(chunked, cue.Irreps("O3", in2), cue.Irreps("O3", out)).polynomial
            cands.append((f"uniform_1d, in1 in {g}-channel blocks", chunked_poly))
    cands.append(("naive" if gpu else "naive (no GPU)", poly))

    def make(method, p):
        if conv_nodes is None:
            return lambda x, y, w: cuex.segmented_polynomial(
                p, [w, x, y], [jax.ShapeDtypeStruct((x.shape[0], dout), x.dtype)], method=method
            )[0]
        return lambda x, y, w, s, r, graph: cuex.segmented_polynomial(
            p, [w, x, y], [jax.ShapeDtypeStruct((conv_nodes, dout), x.dtype)],
            indices=[None, s, None, r], method=method,
        )[0]

    return [(note, make(note.split(",")[0].split(" ")[0], p)) for note, p in cands]


def oeq_problem(tp, spec, dtype):
    oeqj, ChannelwiseTPP, FullyConnectedTPProblem = peer("oeq")
    kind, in1, in2, out = spec
    np_dtype = np.float64 if dtype == "float64" else np.float32
    if kind == "uvu":
        problem = ChannelwiseTPP(in1, in2, out, irrep_dtype=np_dtype, weight_dtype=np_dtype)
    else:  # shared_weights defaults to True in TPProblem
        problem = FullyConnectedTPProblem(
            in1, in2, out, shared_weights=False, internal_weights=False, irrep_dtype=np_dtype, weight_dtype=np_dtype
        )
    return oeqj, problem


def oeq_check(op, tp):
    got, want = (op.weight_numel, op.L3_dim), (tp.weight_numel, tp.descriptor.dims[2])
    print(f"    oeq check: (weight_numel, out dim) {got}, jequi {want}", flush=True)
    if got != want:
        raise ValueError(f"OEQ (weight_numel, out dim) {got} differ from jequi's {want}")


def tp_impls(tp, tp_ir, spec, dtype):
    """`tp_ir`: the same product in the ir_mul layout (None: not run)."""
    batched = [b for b in jequi.available_backends() if b not in CONV_ONLY]
    impls = {f"jequi-{b}": lambda b=b: [("", lambda x, y, w: tp(x, y, w, backend=backend_arg(b)))] for b in [DEFAULT, *batched]}
    for b in [DEFAULT, *(KERNEL_BACKENDS & set(batched))] if tp_ir is not None else ():
        impls[f"jequi-{b}" + IR_MUL] = lambda b=b: [("ir_mul", lambda x, y, w: tp_ir(x, y, w, backend=backend_arg(b)))]
    impls["e3nn"] = lambda: [("vmap(FunctionalTensorProduct)", e3nn_fn(tp))]
    impls["cuex"] = lambda: cuex_candidates(tp, spec)

    def oeq():
        oeqj, problem = oeq_problem(tp, spec, dtype)
        op = oeqj.TensorProduct(problem)
        oeq_check(op, tp)
        return [("TensorProduct", lambda x, y, w: op(x, y, w))]

    impls["oeq"] = oeq
    return impls


def conv_impls(tp, tp_ir, spec, dtype, num_nodes, sender_perm):
    """jequi runs on the prebuilt :class:`jequi.Graph` (built once per structure, reused by
    every layer of a model); the peers on the receiver-sorted index arrays. `tp_ir`: the same
    product in the ir_mul layout (None: not run)."""
    impls = {
        f"jequi-{b}": lambda b=b: [("Graph", lambda x, y, w, s, r, graph: tp.conv(x, y, w, graph, backend=backend_arg(b)))]
        for b in [DEFAULT, *jequi.available_backends()]
    }
    for b in [DEFAULT, *(KERNEL_BACKENDS & set(jequi.available_backends()))] if tp_ir is not None else ():
        impls[f"jequi-{b}" + IR_MUL] = lambda b=b: [
            ("Graph, ir_mul", lambda x, y, w, s, r, graph: tp_ir.conv(x, y, w, graph, backend=backend_arg(b)))
        ]
    if dtype == "float32" and "pallas" in jequi.available_backends():
        impls["jequi-pallas-kahan"] = lambda: [
            ("Graph, kahan", lambda x, y, w, s, r, graph: tp.conv(x, y, w, graph, backend="pallas", kahan=True))
        ]
    impls["e3nn"] = lambda: [("gather, vmap(tp), segment_sum(sorted)", e3nn_fn(tp, num_nodes))]
    impls["cuex"] = lambda: cuex_candidates(tp, spec, num_nodes)

    def oeq(deterministic):
        oeqj, problem = oeq_problem(tp, spec, dtype)
        op = oeqj.TensorProductConv(problem, deterministic=deterministic)
        oeq_check(op, tp)
        if deterministic:  # rows = receivers (output), cols = senders (gathered)
            return [("deterministic", lambda x, y, w, s, r, graph: op(x, y, w, r, s, sender_perm))]
        return [("atomic", lambda x, y, w, s, r, graph: op(x, y, w, r, s))]

    impls["oeq"] = lambda: oeq(False)
    impls["oeq-det"] = lambda: oeq(True)
    return impls


# --- timing ------------------------------------------------------------------------------------
def measure(fn, args, repeat, calls, keep_rows=0):
    """Compile, warm up, time. Returns (stats, first rows of the warm-up output or None)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    out = jax.block_until_ready(compiled(*args))
    stats = {"compile_s": time.perf_counter() - t0}
    try:
        m = compiled.memory_analysis()
        stats["temp_bytes"] = int(m.temp_size_in_bytes)
        stats["output_bytes"] = int(m.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every platform reports it
        pass
    try:  # process-wide and never reset: only its growth across cells says anything
        stats["process_peak_bytes"] = int(jax.devices()[0].memory_stats()["peak_bytes_in_use"])
    except Exception:  # noqa: BLE001 - CPU gives no memory_stats
        pass
    kept = np.asarray(out[:keep_rows]) if keep_rows else None
    del out
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    once = time.perf_counter() - t0
    calls = max(1, min(calls, int(SLOW_CELL_S / max(once * repeat, 1e-9))))
    stats.update(ms=median_ms(compiled, args, repeat, calls), calls=calls, repeat=repeat)
    return stats, kept


def run_impl(build, passes, args_of, repeat, calls, keep=None):
    """Time every pass of one implementation; candidates that fail to compile are skipped."""
    try:
        cands = build()
    except Exception as exc:  # noqa: BLE001
        reason = f"n/a: {describe(exc)}"
        print(f"    {reason}", flush=True)
        return {p: {"error": reason} for p in passes}, None
    cells, kept = {}, None
    for pname, make_pass in passes.items():
        errors = []
        for note, f in cands:
            try:
                stats, rows = measure(make_pass(f), args_of[pname], repeat, calls, keep_rows=CHECK_ROWS if pname == keep else 0)
            except Exception as exc:  # noqa: BLE001 - OOM, unsupported method, ...
                errors.append(f"[{note or 'default'}] {describe(exc)}")
                continue
            cells[pname] = {**stats, "note": note, **({"skipped": errors} if errors else {})}
            kept = rows if rows is not None else kept
            break
        else:
            cells[pname] = {"error": "; ".join(errors)}
        c = cells[pname]
        said = f"{c['ms']:.3f} ms (compile {c['compile_s']:.1f} s) {c['note']}" if "ms" in c else c["error"][:200]
        print(f"    {pname}: {said}", flush=True)
    return cells, kept


def describe(exc):
    """One line: type, first line of the message, and where it was raised when it says nothing."""
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    if not text and exc.__traceback__ is not None:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        text = f"raised at {frame.filename}:{frame.lineno}"
    return f"{type(exc).__name__}: {text}"


def tp_passes():
    def bwd(f):
        return jax.grad(lambda x, y, w, g: jnp.vdot(f(x, y, w), g), argnums=(0, 1, 2))

    def dbl(f):
        def loss(x, y, w, g):
            gx, gy, _ = bwd(f)(x, y, w, g)
            return jnp.sum(gx**2) + jnp.sum(gy**2)

        return jax.grad(loss, argnums=(0, 1, 2))

    def dblf(f):
        def loss(x, y, w, g):
            return sum(jnp.sum(d**2) for d in bwd(f)(x, y, w, g))

        return jax.grad(loss, argnums=(0, 1, 2, 3))

    return {"fwd": lambda f: f, "bwd": bwd, "dbl": dbl, "dblf": dblf}


OPTIONAL_PASSES = {"dblf"}  # run only where --passes names them


def conv_passes():
    def fwd_bwd(f):
        return jax.value_and_grad(lambda x, y, w, s, r, graph, g: jnp.vdot(f(x, y, w, s, r, graph), g), argnums=(0, 1, 2))

    return {"fwd": lambda f: (lambda x, y, w, s, r, graph, g: f(x, y, w, s, r, graph)), "fwd+bwd": fwd_bwd}


def conv_graph(kind, nodes, edges):
    """(senders, receivers, num_nodes, description): a real structure's radius graph or a
    random graph; edges sorted by (receiver, sender), as the peers' fused calls want."""
    if kind == "random":
        rng = np.random.default_rng(0)
        s, r, n, text = rng.integers(0, nodes, edges), rng.integers(0, nodes, edges), nodes, "random"
    else:
        import structures

        atoms, cutoff, g = structures.radius_graph(kind)
        s, r, n = np.asarray(g.senders), np.asarray(g.receivers), len(atoms)
        text = f"{kind} {atoms.get_chemical_formula()}, {cutoff} A"
    order = np.lexsort((s, r))
    return s[order].astype(np.int32), r[order].astype(np.int32), n, text


def conv_checks(impls, chosen, args_of, dtype):
    """Bitwise determinism of the `chosen` jequi kernel convs (3 runs of fwd and fwd+bwd, on
    their arguments ``args_of(name)``) and, in f32, the error of the plain and Kahan sums
    against the same inputs in f64 (the ``jequi-xla`` reference of `impls`)."""
    checks = {}
    for name in (f"jequi-{b}{sfx}" for b in sorted(KERNEL_BACKENDS) for sfx in ("", IR_MUL)):
        if name not in chosen:
            continue
        f = impls[name]()[0][1]
        for pname, make in conv_passes().items():
            fn = jax.jit(make(f))
            runs = [jax.tree.leaves(jax.block_until_ready(fn(*args_of(name)))) for _ in range(3)]
            same = all(all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(runs[0], run)) for run in runs[1:])
            checks[f"{name} {pname} bitwise identical over 3 runs"] = str(same)
    plain = [n for n in ("jequi-pallas", "jequi-pallas-kahan", "jequi-cuda") if n in chosen]
    if dtype == "float32" and plain and "jequi-xla" in impls:
        x, y, w, s, r, graph, _ = args_of(plain[0])
        hi = [a.astype(jnp.float64) for a in (x, y, w)]
        try:  # the reference holds |E| x out.dim float64 values (NequIP-benzene on carbon: 43 GB)
            exact = np.asarray(jax.jit(lambda x, y, w: impls["jequi-xla"]()[0][1](x, y, w, s, r, graph))(*hi))
        except jax.errors.JaxRuntimeError as exc:
            if "RESOURCE_EXHAUSTED" not in str(exc):
                raise
            checks["fwd vs float64"] = "n/a: the float64 xla reference ran out of GPU memory"
            return checks
        for name in plain:
            got = np.asarray(jax.jit(impls[name]()[0][1])(x, y, w, s, r, graph), np.float64)
            err = np.abs(got - exact).max() / np.abs(exact).max()
            checks[f"{name} fwd vs float64, max|diff|/max|out|"] = f"{err:.2e}"
    return checks


def copy_bandwidth(nbytes, repeat, calls):
    a = jnp.ones((nbytes // 4,), jnp.float32)
    stats, _ = measure(lambda a: a + 1.0, (a,), repeat, calls)
    return 2 * a.size * 4 / (stats["ms"] * 1e-3)


def random_arrays(key, dtype, shapes):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, dtype) for k, s in zip(keys, shapes)]


# --- reporting ---------------------------------------------------------------------------------
def versions():
    v = {"python": platform.python_version(), "jax": jax.__version__, "jequi": jequi.__version__, "e3nn_jax": e3nn.__version__}
    dists = ("jaxlib", "cuequivariance", "cuequivariance_jax", "cuequivariance_ops_jax_cu13")
    for dist in dists + ("openequivariance", "openequivariance_extjax"):
        try:
            v[dist] = importlib.metadata.version(dist)
        except Exception:  # noqa: BLE001
            v[dist] = None
    mods = _PEER_MODULES.get("oeq")
    if v["openequivariance"] is None and mods is not None and not isinstance(mods, Exception):
        import openequivariance  # the sdist on PYTHONPATH has no dist-info: read the version off its path

        m = re.search(r"openequivariance-([0-9][0-9.]*[0-9])", openequivariance.__file__)
        v["openequivariance"] = m.group(1) if m else "unknown"
    return v


def result_stem(meta, tag) -> str:
    """``<date>-<device>-<mode>[-<tag>]``: the result files' name."""
    return f"{meta['date']}-{device_slug(meta['device'])}-{meta['mode']}" + (f"-{tag}" if tag else "")


def device_slug(kind):
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", kind)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "device"


def best_jequi(impls, pname, layout=None):
    """``(ms, name)`` of the fastest jequi implementation of a pass (with `layout`, of those
    run in that layout); ``(None, None)`` when there is none."""
    cands = [(c[pname]["ms"], n) for n, c in impls.items() if n.startswith("jequi-") and "ms" in c.get(pname, {})]
    if layout is not None:
        cands = [c for c in cands if c[1].endswith(IR_MUL) == (layout == "ir_mul")]
    return min(cands) if cands else (None, None)


def speedups(row, peers, pname) -> dict:
    """``{peer: (peer ms / jequi ms, same layout)}`` for one pass of a result row: jequi in the
    peer's layout (:data:`PEER_LAYOUTS`), or, where none ran in it, in any layout."""
    out = {}
    for q in peers:
        cell = row["impls"].get(q, {}).get(pname, {})
        mine, _ = best_jequi(row["impls"], pname, PEER_LAYOUTS[q])
        same = mine is not None
        mine = mine if same else best_jequi(row["impls"], pname)[0]
        if mine and "ms" in cell:
            out[q] = (cell["ms"] / mine, same)
    return out


def in_layout(desc, a, role, back=False):
    """Array `a` (e3nn's ``mul_ir``) in ``ir_mul``, or back with `back`; `role` names its
    irreps (``"in1"``, ``"in2"``, ``"out"``)."""
    positions = layout_positions(getattr(desc, role), "ir_mul")  # a_ir[..., positions] = a
    return a[..., positions] if back else a[..., np.argsort(positions)]


def fmt_ms(cell):
    return f"{cell['ms']:.3f}" if "ms" in cell else ("n/a" if cell.get("error", "").startswith("n/a") else "err")


def geomeans(rows, passes, peers) -> list[str]:
    """Markdown lines: the geometric mean of jequi's speedup over each peer (:func:`speedups`)
    over every cell, the channelwise and the ``uvw`` ones, and per dtype; and the cells where
    a peer is faster."""
    groups = {"all": lambda r: True, "channelwise (uvu)": lambda r: r.get("kind") == "uvu",
              "uvw": lambda r: r.get("kind") == "uvw"}  # fmt: skip
    groups.update({d: (lambda r, d=d: r["dtype"] == d) for d in sorted({r["dtype"] for r in rows})})
    ratios = [(r, p, speedups(r, peers, p)) for r in rows for p in passes]
    out = ["| cells | " + " | ".join(f"vs {q}" for q in peers) + " |", "|" + "---|" * (1 + len(peers))]
    for label, member in groups.items():
        cells = []
        for q in peers:
            xs = [sp[q][0] for r, _, sp in ratios if member(r) and q in sp]
            cells.append(f"{math.exp(sum(map(math.log, xs)) / len(xs)):.2f}x ({len(xs)})" if xs else "n/a")
        if any(c != "n/a" for c in cells):
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    slower = [f"{r['problem']} {r['dtype']} {p} vs {q} {sp[q][0]:.2f}x" for r, p, sp in ratios for q in peers if q in sp and sp[q][0] < 1]
    out += ["", "Cells where a peer is faster: " + ("; ".join(slower) if slower else "none") + "."]
    return out


def markdown(result, passes):
    meta, rows = result["meta"], result["rows"]
    # each pass's bound, then the other bounds of a pass (dbl_2k after dbl)
    bounds = [b for p in passes for b in sorted({k for r in rows for k in r["bound_ms"] if k.split("_")[0] == p}, key=len)]
    mode = "fused convolution" if meta["mode"] == "conv" else "batched tensor products"
    out = [
        f"# jequi vs peers, {mode}: {meta['device']} ({meta['date']})",
        "",
        f"Copy bandwidth {meta['copy_bandwidth_GBps']:.0f} GB/s; " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v),
        f"Median of {meta['repeat']} x {meta['calls']} jitted calls (fewer calls when slow). "
        "%HBM = HBM bound / measured time (see the script's docstring for the bytes counted).",
        *([f"Rows merged from {', '.join(meta['merged_from'])} (a later file's row replaces an earlier one of its problem "
           f"and dtype); their copy bandwidths {', '.join(f'{b:.0f}' for b in meta['copy_bandwidths_GBps'])} GB/s."]
          if meta.get("merged_from") else []),
        "",
        "| problem | dtype | sizes | impl | " + " | ".join(f"{p} ms" for p in passes) + " | "
        + " | ".join(f"{BOUND_NAMES.get(b, b)} %HBM" for b in bounds) + " | compile s | temp MB |",
        "|" + "---|" * (5 + len(passes) + len(bounds) + 1),
    ]
    notes = []
    for r in rows:
        sizes = r["sizes"]
        bound = " | ".join(f"{r['bound_ms'][p]:.3f}" for p in passes)
        out.append(f"| {r['problem']} | {r['dtype']} | {sizes} | HBM bound | {bound} |" + " |" * (len(bounds) + 2))
        for name, cells in r["impls"].items():
            c = [cells.get(p, {}) for p in passes]
            frac = [f"{100 * r['bound_ms'][b] / x['ms']:.0f}%" if "ms" in x and b in r["bound_ms"] else ""
                    for b, x in ((b, cells.get(b.split("_")[0], {})) for b in bounds)]
            comp = "/".join(f"{x['compile_s']:.1f}" for x in c if "compile_s" in x)
            temp = "/".join(f"{x['temp_bytes'] / 2**20:.0f}" for x in c if "temp_bytes" in x)
            times = " | ".join(fmt_ms(x) for x in c)
            out.append(f"| | | | {name} | {times} | " + " | ".join(frac) + f" | {comp} | {temp} |")
            said = {}  # message -> passes, so that one reason for all passes is written once
            for p, x in zip(passes, c):
                for msg in [x.get("error") or x.get("note")] + x.get("skipped", []):
                    if msg:
                        said.setdefault(msg, []).append(p)
            notes += [f"{r['problem']} {r['dtype']} {name} {'/'.join(ps)}: {msg}" for msg, ps in said.items()]
        for k, v in r.get("checks", {}).items():
            notes.append(f"{r['problem']} {r['dtype']} check {k}: {v}")
    peers = [p for p in PEERS if any(p in r["impls"] for r in rows)]
    layouts = "".join(f"; {p} {PEER_LAYOUTS[p]}" for p in peers)
    out += ["", "Speedup of jequi's best backend in each peer's layout over the peer (peer ms / jequi ms, > 1: "
            f"jequi faster{layouts}; *: no jequi ran in that layout, the other's), " + " / ".join(passes) + ":", ""]
    out += ["| problem | dtype | jequi best | " + " | ".join(f"vs {p}" for p in peers) + " |", "|" + "---|" * (3 + len(peers))]
    for r in rows:
        best = {p: best_jequi(r["impls"], p) for p in passes}
        ratios = {p: speedups(r, peers, p) for p in passes}
        cells = [
            " / ".join(f"{ratios[p][q][0]:.2f}x" + ("" if ratios[p][q][1] else "*") if q in ratios[p] else "n/a" for p in passes)
            for q in peers
        ]
        label = " / ".join(f"{best[p][1][6:]} {best[p][0]:.3f}" if best[p][0] else "n/a" for p in passes)
        out.append(f"| {r['problem']} | {r['dtype']} | {label} | " + " | ".join(cells) + " |")
    out += ["", "Geometric means of those speedups (cells):", ""] + geomeans(rows, passes, peers)
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def plot(result, passes, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        print(f"no plot: matplotlib unavailable ({exc})")
        return False
    peers = [p for p in PEERS if any(p in r["impls"] for r in result["rows"])]
    groups = []
    for r in result["rows"]:
        for p in passes:
            sp = {q: ratio for q, (ratio, _) in speedups(r, peers, p).items()}
            if sp:
                groups.append((f"{r['problem']}\n{r['dtype'][5:]} {p}", sp))
    peers = [q for q in peers if any(q in sp for _, sp in groups)]
    if not groups:
        print("no plot: no peer was measured")
        return False
    fig, ax = plt.subplots(figsize=(min(40, max(6, 0.25 * len(groups) * (len(peers) + 1))), 4.5))
    width = 0.8 / len(peers)
    for i, q in enumerate(peers):
        xs = [j + (i - (len(peers) - 1) / 2) * width for j, (_, sp) in enumerate(groups) if q in sp]
        ax.bar(xs, [sp[q] for _, sp in groups if q in sp], width, label=f"vs {q}", color=f"C{PEERS.index(q)}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)), [g for g, _ in groups], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("speedup of jequi (peer ms / jequi ms)")
    ax.set_title(f"jequi vs peers, {result['meta']['mode']}: {result['meta']['device']} ({result['meta']['date']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def write(result, passes, out_dir, stem, final):
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    files[0].write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result, passes)
    files[1].write_text(md)
    if final and plot(result, passes, out_dir / f"{stem}.png"):
        files.append(out_dir / f"{stem}.png")
    env_out = os.environ.get("OUT")
    if env_out and pathlib.Path(env_out).resolve() != out_dir.resolve():
        pathlib.Path(env_out).mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy(f, env_out)
    return md, files


def _replace_passes(old: dict, new: dict) -> dict:
    """Row `old` with the passes `new` ran taken from `new`, for every implementation."""
    ran = {p for cells in new["impls"].values() for p in cells}
    impls = {i: {p: c for p, c in cells.items() if p not in ran} for i, cells in old["impls"].items()}
    for i, cells in new["impls"].items():
        impls[i] = {**impls.get(i, {}), **cells}
    merged = {k: {**old.get(k, {}), **v} if isinstance(v, dict) else v for k, v in new.items() if k != "impls"}  # bounds, checks
    return dict(old, **merged, impls={i: c for i, c in impls.items() if c})


def merge(files, out_dir, tag):
    """Write the rows of several result files (runs split to fit the device's per-command
    limit, or a later run of some rows) as one table, speedups and geometric means; the first
    file's meta, with the copy bandwidth each run measured. A later file's row replaces an
    earlier one of the same problem and dtype, in its place, in the passes it ran: every
    implementation's cells of those passes (so a pass's speedups compare one run's cells)."""
    results = [json.loads(f.read_text()) for f in files]
    same = ("device", "mode", "batch", "dbl_batch", "repeat", "calls")
    if len({tuple(r["meta"].get(k) for k in same) for r in results}) > 1:
        raise SystemExit(f"merge: the files differ in one of {', '.join(same)}")
    meta = dict(results[0]["meta"], merged_from=[f.name for f in files],
                copy_bandwidths_GBps=[r["meta"]["copy_bandwidth_GBps"] for r in results])  # fmt: skip
    rows = {}
    for row in (row for r in results for row in r["rows"]):
        key = (row["problem"], row["dtype"])
        rows[key] = _replace_passes(rows[key], row) if key in rows else row
    rows = list(rows.values())
    order = list(conv_passes() if meta["mode"] == "conv" else tp_passes())
    passes = [p for p in order if any(p in c for r in rows for c in r["impls"].values())]
    md, written = write({"meta": meta, "rows": rows}, passes, out_dir, result_stem(meta, tag), final=True)
    print("wrote " + ", ".join(str(f) for f in written) + "\n")
    print(md)


# --- main ------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--problems", help=f"comma list (default: {TP_PROBLEMS}; with --conv: mace-large)")
    ap.add_argument("--dtypes", help="comma list (default float32,float64; with --conv: float32)")
    ap.add_argument("--batch", type=int, default=None, help="rows for fwd/bwd (default 50000)")
    ap.add_argument("--dbl-batch", type=int, default=None, help="rows for dbl (default 20000)")
    ap.add_argument("--repeat", type=int, default=None, help="repetitions, median taken (default 5)")
    ap.add_argument("--calls", type=int, default=None, help="calls per repetition (default 10)")
    ap.add_argument("--impls", help="comma list of implementations to run (jequi-<backend>, jequi-<backend>-ir_mul, e3nn, cuex, oeq, oeq-det)")
    ap.add_argument("--ir-mul", action=argparse.BooleanOptionalAction, default=True,
                    help="also run jequi-pallas-ir_mul and jequi-cuda-ir_mul (jequi in cuEquivariance's layout)")
    ap.add_argument("--passes", help="comma list of passes to run (default fwd,bwd,dbl, dblf only if named; with --conv fwd,fwd+bwd)")
    ap.add_argument("--conv", action="store_true", help="fused convolution on real structures' graphs instead")
    ap.add_argument("--graphs", default="carbon,water", help="--conv: comma list of carbon, water, random")
    ap.add_argument("--nodes", type=int, default=None, help="--conv random graph: nodes (default 4096)")
    ap.add_argument("--edges", type=int, default=None, help="--conv random graph: edges (default 131072)")
    ap.add_argument("--bw-mb", type=int, default=None, help="array size for the bandwidth measurement (default 2048)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a CPU smoke test")
    ap.add_argument("--tag", default="", help="appended to the result files' names (a partial re-run beside a full one)")
    ap.add_argument("--merge", help="comma list of result JSONs (one device, one session) to write as one table (--tag names it)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    if a.merge:
        merge([pathlib.Path(f) for f in a.merge.split(",")], pathlib.Path(a.out), a.tag)
        return
    q = a.quick
    batch, dbl_batch = a.batch or (256 if q else 50_000), a.dbl_batch or (128 if q else 20_000)
    repeat, calls = a.repeat or (3 if q else 5), a.calls or (2 if q else 10)
    nodes, edges = a.nodes or (256 if q else 4096), a.edges or (2048 if q else 131_072)
    problems = (a.problems or ("mace-large,nequip-benzene" if a.conv else TP_PROBLEMS)).split(",")
    dtypes = (a.dtypes or "float32,float64").split(",")
    wanted = set(a.impls.split(",")) if a.impls else None

    dev = jax.devices()[0]
    bw = copy_bandwidth((a.bw_mb or (64 if q else 2048)) << 20, repeat, calls)
    date = datetime.date.today().isoformat()
    meta = {
        "date": date, "mode": "conv" if a.conv else "tp", "device": dev.device_kind, "platform": dev.platform,
        "copy_bandwidth_GBps": bw / 1e9, "repeat": repeat, "calls": calls, "batch": batch, "dbl_batch": dbl_batch,
        "argv": vars(a), "versions": versions(),
    }
    print(f"{dev.device_kind} ({dev.platform}); copy bandwidth {bw / 1e9:.0f} GB/s; "
          f"jequi backends {jequi.available_backends()}", flush=True)
    stem = result_stem(meta, a.tag)
    passes = conv_passes() if a.conv else tp_passes()
    if a.passes:
        unknown = set(a.passes.split(",")) - set(passes)
        if unknown:
            ap.error(f"unknown passes {sorted(unknown)}; known: {', '.join(passes)}")
        passes = {p: make for p, make in passes.items() if p in a.passes.split(",")}
    else:
        passes = {p: make for p, make in passes.items() if p not in OPTIONAL_PASSES}
    result = {"meta": meta, "rows": []}
    key = jax.random.key(0)

    cases = [(g, name) for g in a.graphs.split(",") for name in problems] if a.conv else [(None, n) for n in problems]
    graphs = {}
    for graph_kind, name in cases:
        if a.conv and graph_kind not in graphs:
            s, r, n_nodes, text = conv_graph(graph_kind, nodes, edges)
            sender_perm = jnp.asarray(np.lexsort((r, s)).astype(np.int32))  # OEQ deterministic: column-major nonzeros
            senders, receivers = jnp.asarray(s), jnp.asarray(r)
            build = jax.jit(jequi.Graph.build, static_argnums=2)  # on device, as inside a jitted model step
            jax.block_until_ready(build(senders, receivers, n_nodes))
            t0 = time.perf_counter()
            jax.block_until_ready(build(senders, receivers, n_nodes))
            graph_ms = 1e3 * (time.perf_counter() - t0)
            graph = jequi.Graph.build(senders, receivers, n_nodes)  # eager: edges_sorted is known
            graphs[graph_kind] = (senders, receivers, n_nodes, text, sender_perm, graph)
            meta.setdefault("graphs", {})[graph_kind] = {
                "description": text, "nodes": n_nodes, "edges": len(s), "jequi_graph_build_ms": graph_ms,
            }
            print(f"\ngraph {text}: {n_nodes} nodes, {len(s)} edges; jequi.Graph.build {graph_ms:.2f} ms", flush=True)
        if a.conv:
            senders, receivers, nodes, text, sender_perm, graph = graphs[graph_kind]
            edges = senders.shape[0]
        spec = jequi.problems.CATALOGUE[name]
        tp = jequi.problems.get(name)
        tp_ir = jequi.problems.get(name, layout="ir_mul") if a.ir_mul else None
        d1, d2, do = tp.descriptor.dims
        nw = tp.weight_numel
        for dtype in dtypes:
            item = jnp.dtype(dtype).itemsize
            print(f"\n{name} {dtype}: dims {d1}, {d2}, {do}, weights {nw}", flush=True)
            if a.conv:
                x, y, w, g = random_arrays(key, dtype, [(nodes, d1), (edges, d2), (edges, nw), (nodes, do)])
                args = (x, y, w, senders, receivers, graph, g)
                args_of = {"fwd": args, "fwd+bwd": args}
                fwd_bytes = item * (nodes * (d1 + do) + edges * (d2 + nw)) + 8 * edges
                bwd_bytes = item * (nodes * (2 * d1 + do) + 2 * edges * (d2 + nw)) + 8 * edges
                bound_bytes = {"fwd": fwd_bytes, "fwd+bwd": fwd_bytes + bwd_bytes}
                impls = conv_impls(tp, tp_ir, spec, dtype, nodes, sender_perm)
                roles = {p: ("in1", "in2", None, None, None, None, "out") for p in args_of}
                sizes = f"{text}: {nodes} nodes, {edges} edges"
            else:
                x, y, w, g = random_arrays(key, dtype, [(batch, d1), (batch, d2), (batch, nw), (batch, do)])
                n = dbl_batch
                args_of = {"fwd": (x, y, w), "bwd": (x, y, w, g), "dbl": (x[:n], y[:n], w[:n], g[:n])}
                args_of["dblf"] = args_of["dbl"]
                per_row = {"fwd": d1 + d2 + nw + do, "bwd": 2 * (d1 + d2 + nw) + do, "dblf": 2 * (d1 + d2 + nw + do)}
                per_row["dbl"], per_row["dbl_2k"] = per_row["bwd"], 2 * (d1 + d2 + nw + do) + 5 * (d1 + d2) + nw
                bound_bytes = {p: item * (n if p.startswith("dbl") else batch) * v for p, v in per_row.items()}
                impls = tp_impls(tp, tp_ir, spec, dtype)
                roles = {p: ("in1", "in2", None, "out")[: len(v)] for p, v in args_of.items()}
                sizes = f"B={batch} (dbl {n}); {d1}, {d2}, {do}, w {nw}"
            row = {
                "problem": f"{name} @ {graph_kind}" if a.conv else name, "dtype": dtype, "kind": spec[0], "dims": [d1, d2, do], "weight_numel": nw,
                "sizes": sizes, "bound_bytes": bound_bytes, "bound_ms": {p: 1e3 * b / bw for p, b in bound_bytes.items()},
                "impls": {}, "checks": {},
            }
            chosen = [n for n in impls if not wanted or n in wanted]
            ir_args = None
            if any(n.endswith(IR_MUL) for n in chosen):  # the same values stored in ir_mul, each array once
                converted = {}
                ir_args = {
                    p: tuple(a if role is None else converted.setdefault(id(a), in_layout(tp.descriptor, a, role))
                             for a, role in zip(v, roles[p]))
                    for p, v in args_of.items()
                }  # fmt: skip
            kept = {}
            for impl_name in chosen:
                print(f"  {impl_name}", flush=True)
                ir_mul = impl_name.endswith(IR_MUL)
                row["impls"][impl_name], z = run_impl(impls[impl_name], passes, ir_args if ir_mul else args_of, repeat, calls, keep="fwd")
                kept[impl_name] = in_layout(tp.descriptor, z, "out", back=True) if ir_mul and z is not None else z
            # e3nn-jax is the reference; without it, jequi's xla backend, then its mul_ir Pallas kernels
            ref_name = next((n for n in ("e3nn", "jequi-xla", "jequi-pallas", "jequi-cuda") if kept.get(n) is not None), None)
            for impl_name, z in kept.items():
                if impl_name.startswith("jequi-") and impl_name != ref_name and z is not None and ref_name:
                    ref = kept[ref_name]
                    err = float(np.max(np.abs(z - ref)) / max(np.max(np.abs(ref)), 1e-30))
                    row["checks"][f"{impl_name} vs {ref_name} fwd, first {CHECK_ROWS} rows, max|diff|/max|z|"] = f"{err:.1e}"
            if a.conv:
                args_for = {n: ir_args["fwd"] if n.endswith(IR_MUL) else args for n in chosen}
                row["checks"].update(conv_checks(impls, chosen, args_for.get, dtype))
                del args_for
                print(f"  checks {row['checks']}", flush=True)
            result["rows"].append(row)
            del x, y, w, g, args_of, ir_args, kept
            args = None
            write(result, list(passes), pathlib.Path(a.out), stem, final=False)  # partial results survive a timeout

    md, files = write(result, list(passes), pathlib.Path(a.out), stem, final=True)
    print("\nwrote " + ", ".join(str(f) for f in files) + "\n")
    print(md)


if __name__ == "__main__":
    main()
