"""Neighbour attention: the fused Pallas kernels against the plain-JAX forms, one process, one GPU.

Methods (all jitted, float32, envelope ``[N, K]`` and eps = 1e-3 as E2Former-V2's released code):

* ``fused``: ``jequi.neighbor_attention(backend="pallas")`` (online softmax forward; backward with
  the deterministic pass over the transposed neighbour list);
* ``fused-atomic``: the same, the backward's ``dk``, ``dv`` added with atomics;
* ``gather``: the materialised reference (``jequi.attention.reference``): ``k[nbr]``, ``v[nbr]``,
  masked softmax, sum, as XLA fuses it;
* ``three-step``: the released code's shape: scores ``[N, K, H]`` written, softmax, then the
  aggregation, with optimisation barriers so each step's ``[N, K, H]`` result is materialised.

Per cell (N nodes, K slots with 10 % padding, (H, d, D_v)): forward and forward+backward (grad
of ``<out, c>`` in q, k, v) median time, TFLOPS (model FLOPs: forward ``2 E H (d + D_v)`` for E
valid edges, backward 2.5x that, FlashAttention's convention) and memory: XLA's footprint of
the executable (``memory_analysis``: arguments + outputs + temporaries) and the device's
``memory_stats`` peak (``--isolate``: each cell and method in a fresh process, so the peak is
that call's; otherwise the process's running high-water mark). A cell whose footprint exceeds
the device memory is reported as OOM without running.

``--profile``: for ``fused`` and ``fused-atomic`` also each stage of forward+backward timed
alone, jitted with its real inputs (median, blocked): the forward kernel, ``delta = <dO, out>``
(XLA), then the deterministic backward's transposed-list build (XLA sort), source pass and
query pass, or the atomic backward's target pass, and the whole ``kernels.backward`` (without
``delta``; its excess over its stages is XLA glue: casts, reshapes, slices); rows with mode
``stage``, the stage and its ratio to the forward kernel in the note.
``--configs``: with ``--profile``, the backward's main kernel (source pass, or atomic target
pass) timed again under each given launch configuration (``AttentionConfig`` fields), a
tuning sweep of the kernel that dominates the backward.

Writes ``<date>-<device>-attention.{json,md}`` into --out (and $OUT) after every cell.
``--smoke``: tiny sizes (CPU, Pallas in interpret mode), to check the script.

    python benchmarks/attention_benchmark.py [--sizes 1024,8192,32768,100000] [--slots 20,64] [--isolate] [--profile]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jequi  # noqa: E402
from jequi.attention import reference  # noqa: E402
from pallas_kernels import attention as kernels  # noqa: E402
from timing import median_ms, save  # noqa: E402

METHODS = ("fused", "fused-atomic", "gather", "three-step")
HEADS = ((128, 8, 58), (16, 32, 64))
EPS = 1e-3


def make_inputs(n: int, k: int, h: int, d: int, dv: int, seed: int = 0):
    """Random q, k, v, envelope and a local neighbour list (``j = i + offset mod N``, offsets in
    ``[-4K, 4K]``, like spatially sorted atoms) with 10 % padding slots (-1)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, h, d)).astype(np.float32)
    kk = rng.normal(size=(n, h, d)).astype(np.float32)
    v = rng.normal(size=(n, h, dv)).astype(np.float32)
    offsets = rng.integers(-4 * k, 4 * k + 1, size=(n, k))
    nbr = ((np.arange(n)[:, None] + offsets) % n).astype(np.int32)
    nbr[rng.random((n, k)) < 0.1] = -1
    env = rng.uniform(0.0, 1.0, size=(n, k)).astype(np.float32)
    c = rng.normal(size=(n, h, dv)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (q, kk, v, nbr, env, c))


def three_step(q, k, v, nbr, env, scale):
    """Scores ``[N, K, H]`` -> masked softmax -> aggregation, each result materialised."""
    n_src = k.shape[0]
    valid = reference.valid_slots(nbr, n_src)
    j = jnp.where(valid, nbr, 0)
    s = jnp.einsum("nhd,nkhd->nkh", q, k[j]) * scale
    s = jax.lax.optimization_barrier(s)
    s = jnp.where(valid[..., None], s, -jnp.inf)
    mu = jnp.max(s, axis=1, keepdims=True)
    mu = jax.lax.stop_gradient(jnp.where(jnp.isfinite(mu), mu, 0.0))
    a = jnp.where(valid[..., None], jnp.exp(jnp.where(valid[..., None], s, mu) - mu) * env[..., None], 0.0)
    p = a / (jnp.sum(a, axis=1, keepdims=True) + EPS)
    p = jax.lax.optimization_barrier(p)
    return jnp.einsum("nkh,nkhd->nhd", p, v[j])


def method_fn(method: str, scale: float):
    if method in ("fused", "fused-atomic"):
        backend = "pallas" if method == "fused" else "pallas-atomic"
        return lambda q, k, v, nbr, env: jequi.neighbor_attention(q, k, v, nbr, envelope=env, eps=EPS, backend=backend)
    if method == "gather":
        return lambda q, k, v, nbr, env: reference.neighbor_attention(q, k, v, nbr, envelope=env[..., None], scale=scale, eps=EPS)
    return lambda q, k, v, nbr, env: three_step(q, k, v, nbr, env, scale)


def memory_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
    except Exception:  # noqa: BLE001 (not every platform reports it)
        return None


def device_peak() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def device_limit() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def stage_fns(method: str, q, k, v, nbr, env, c, scale: float, configs=()):
    """``[(stage, jitted fn, args)]``: the stages of the fused forward+backward of
    :func:`method_fn` (gradients in q, k, v), each with the real inputs it gets there; and for
    each of `configs` (``AttentionConfig`` fields as dicts) the backward's main kernel again
    (the source pass, or the atomic target pass) launched with it."""
    n, h, d = q.shape
    p = kernels.Problem(h, d, v.shape[2], nbr.shape[1], (None, None, 1, None), scale, EPS)
    edges = (None, None, env[..., None], None)
    needs = (True, True, True, False)
    cfg = kernels.DEFAULT
    out, lse, amax = kernels.forward(q, k, v, nbr, edges, p=p, config=cfg)
    delta_fn = jax.jit(lambda dout, out: jnp.sum(dout * out, axis=-1))
    delta = delta_fn(c, out)
    stats = (lse, amax, c, delta)
    forward = jax.jit(lambda q, k, v, nbr, env: kernels.forward(q, k, v, nbr, (None, None, env, None), p=p, config=cfg))
    stages = [("forward", forward, (q, k, v, nbr, env[..., None])), ("delta", delta_fn, (c, out))]
    atomic = method == "fused-atomic"
    if atomic:
        targets = jax.jit(lambda q, k, v, nbr, env, *st: kernels.backward_targets(
            q, k, v, nbr, (None, None, env, None), *st, p=p, needs=needs, atomic=True, config=cfg))  # fmt: skip
        stages.append(("targets (atomic dk, dv)", targets, (q, k, v, nbr, env[..., None], *stats)))
        for fields in configs:
            alt = dataclasses.replace(cfg, **fields)
            fn = jax.jit(lambda q, k, v, nbr, env, *st, alt=alt: kernels.backward_targets(
                q, k, v, nbr, (None, None, env, None), *st, p=p, needs=needs, atomic=True, config=alt))  # fmt: skip
            stages.append((f"targets {config_label(fields)}", fn, (q, k, v, nbr, env[..., None], *stats)))
    else:
        transpose = jax.jit(lambda nbr: kernels.transposed_neighbors(nbr, n))
        order, offsets = transpose(nbr)
        sources = jax.jit(lambda q, k, v, nbr, env, *st: kernels.backward_sources(
            q, k, v, nbr, (None, None, env, None), *st, p=p, needs=needs, config=cfg))  # fmt: skip
        coef = sources(q, k, v, nbr, env[..., None], *stats, order, offsets)[2]
        queries = jax.jit(lambda k, nbr, coef: kernels.backward_queries(k, nbr, coef, p=p, config=cfg))
        stages += [
            ("transposed list", transpose, (nbr,)),
            ("sources (dk, dv, coef)", sources, (q, k, v, nbr, env[..., None], *stats, order, offsets)),
            ("queries (dq)", queries, (k, nbr, coef)),
        ]  # fmt: skip
        for fields in configs:
            alt = dataclasses.replace(cfg, **fields)
            fn = jax.jit(lambda q, k, v, nbr, env, *st, alt=alt: kernels.backward_sources(
                q, k, v, nbr, (None, None, env, None), *st, p=p, needs=needs, config=alt))  # fmt: skip
            stages.append((f"sources {config_label(fields)}", fn, (q, k, v, nbr, env[..., None], *stats, order, offsets)))
    whole = jax.jit(lambda q, k, v, nbr, env, *st: kernels.backward(
        q, k, v, nbr, (None, None, env, None), *st, p=p, needs=needs, atomic=atomic, config=cfg))  # fmt: skip
    stages.append(("backward (all)", whole, (q, k, v, nbr, env[..., None], *stats)))
    return stages


def config_label(fields: dict) -> str:
    """``[block_edges=8 num_warps=8]``: a launch configuration in a stage's name."""
    return "[" + " ".join(f"{k}={v}" for k, v in sorted(fields.items())) + "]"


def parse_configs(text: str | None) -> list[dict]:
    """``--configs``: ``AttentionConfig`` fields, one configuration per ``;``-separated item
    (``block_edges=8,num_warps=8;block_heads=8``)."""
    names = {f.name for f in dataclasses.fields(kernels.AttentionConfig)}
    configs = []
    for item in filter(None, (text or "").split(";")):
        fields = {}
        for pair in item.split(","):
            key, _, value = pair.partition("=")
            if key.strip() not in names or not value.strip().isdigit():
                raise SystemExit(f"--configs: {pair!r} is not <AttentionConfig field>=<int> (fields: {sorted(names)})")
            fields[key.strip()] = int(value)
        configs.append(fields)
    return configs


def profile(method: str, inputs, scale: float, repeat: int, configs=()) -> dict:
    """Each stage of :func:`stage_fns` timed alone: ``{stage: {ms, footprint_bytes}}``."""
    result = {}
    for stage, fn, args in stage_fns(method, *inputs, scale, configs):
        entry = {}
        try:
            compiled = fn.lower(*args).compile()
            entry["footprint_bytes"] = memory_bytes(compiled)
            jax.block_until_ready(compiled(*args))
            entry["ms"] = median_ms(compiled, args, repeat=repeat, calls=3)
        except Exception as err:  # noqa: BLE001 (recorded, as in measure)
            entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        result[stage] = entry
    return result


def measure(method: str, n: int, k: int, h: int, d: int, dv: int, repeat: int, stages: bool = False, configs=()) -> dict:
    """Forward and forward+backward of one method on one cell (with `stages`, and for the
    fused methods, also :func:`profile`)."""
    q, kk, v, nbr, env, c = make_inputs(n, k, h, d, dv)
    edges = int(jnp.sum(reference.valid_slots(nbr, n)))
    flops = 2.0 * edges * h * (d + dv)
    f = method_fn(method, 1.0 / math.sqrt(d))
    fwd = jax.jit(f)
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v, nbr, env: jnp.sum(f(q, k, v, nbr, env) * c), argnums=(0, 1, 2)))
    args = (q, kk, v, nbr, env)
    limit = device_limit()
    result = {"edges": edges}
    for mode, fn, model_flops in (("fwd", fwd, flops), ("fwd+bwd", fwd_bwd, 3.5 * flops)):
        entry = {}
        try:
            t0 = time.perf_counter()
            compiled = fn.lower(*args).compile()
            entry["compile_s"] = time.perf_counter() - t0
            entry["footprint_bytes"] = memory_bytes(compiled)
            if limit and entry["footprint_bytes"] and entry["footprint_bytes"] > limit:
                entry["error"] = f"OOM (footprint {entry['footprint_bytes'] / 2**30:.1f} GiB)"
            else:
                jax.block_until_ready(compiled(*args))
                ms = median_ms(compiled, args, repeat=repeat, calls=3)
                entry.update(ms=ms, tflops=model_flops / (ms * 1e-3) / 1e12, peak_bytes=device_peak())
        except Exception as err:  # noqa: BLE001 (an OOM at run time, a lowering failure: recorded)
            entry["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
        result[mode] = entry
    if stages and method in ("fused", "fused-atomic"):
        result["stages"] = profile(method, (q, kk, v, nbr, env, c), 1.0 / math.sqrt(d), repeat, configs)
    return result


def isolated(method: str, cell: tuple, repeat: int, stages: bool, configs=()) -> dict:
    """:func:`measure` in a fresh process (its memory_stats peak is that call's)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--single", json.dumps([method, *cell, repeat, stages, list(configs)])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": f"subprocess failed: {proc.stderr.strip().splitlines()[-1:]}"}
    return json.loads(lines[-1][len("RESULT ") :])


def _gib(b):
    return "-" if b is None else f"{b / 2**30:.2f}"


def markdown(result: dict) -> str:
    lines = [
        f"# Neighbour attention on {result['device']} ({result['date']})", "",
        f"jax {result['jax']}; float32; K slots with 10 % padding, local random neighbours; envelope and eps = "
        f"{EPS}. Model FLOPs: forward 2 E H (d + D_v), forward+backward 3.5x. Memory: XLA's footprint "
        f"(arguments + outputs + temporaries) and the device's memory_stats peak "
        f"({'per cell, fresh process' if result['isolate'] else 'running high-water mark of the process'}), GiB. "
        "`python benchmarks/attention_benchmark.py`.", "",
        "| N | K | H, d, D_v | mode | method | ms | TFLOPS | footprint | peak | speed-up vs gather | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for cell in result["cells"]:
        for mode in ("fwd", "fwd+bwd"):
            base = cell["methods"].get("gather", {}).get(mode, {}).get("ms")
            for method, entry in cell["methods"].items():
                e = entry.get(mode, {})
                ms = e.get("ms")
                speedup = f"{base / ms:.1f}x" if ms and base else "-"
                lines.append(
                    f"| {cell['n']} | {cell['k']} | {cell['h']}, {cell['d']}, {cell['dv']} | {mode} | {method} | "
                    f"{'-' if ms is None else f'{ms:.3f}'} | {'-' if ms is None else f'{e['tflops']:.2f}'} | "
                    f"{_gib(e.get('footprint_bytes'))} | {_gib(e.get('peak_bytes'))} | {speedup} | "
                    f"{e.get('error', entry.get('error', ''))} |"
                )  # fmt: skip
        for method, entry in cell["methods"].items():
            stages = entry.get("stages", {})
            fwd = stages.get("forward", {}).get("ms")
            for stage, e in stages.items():
                ms = e.get("ms")
                ratio = f"{stage}: {ms / fwd:.2f}x the forward kernel" if ms and fwd else stage
                lines.append(
                    f"| {cell['n']} | {cell['k']} | {cell['h']}, {cell['d']}, {cell['dv']} | stage | {method} | "
                    f"{'-' if ms is None else f'{ms:.3f}'} | - | {_gib(e.get('footprint_bytes'))} | - | - | "
                    f"{ratio}{' ' + e['error'] if 'error' in e else ''} |"
                )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1024,8192,32768,100000", help="N values")
    ap.add_argument("--slots", default="20,32,64", help="K values")
    ap.add_argument("--heads", default="128x8x58,16x32x64", help="H x d x D_v triples")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--isolate", action="store_true", help="each cell and method in a fresh process (exact peaks)")
    ap.add_argument("--profile", action="store_true", help="also time each forward/backward stage of the fused methods")
    ap.add_argument("--configs", help="with --profile: the backward's main kernel also timed with each of these launch "
                    "configurations (AttentionConfig fields, e.g. 'block_edges=8,num_warps=8;block_heads=8')")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CPU check of the script)")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--kind", default="attention")
    ap.add_argument("--single", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.single:
        method, n, k, h, d, dv, repeat, stages, configs = json.loads(a.single)
        print("RESULT " + json.dumps(measure(method, n, k, h, d, dv, repeat, stages, configs)), flush=True)
        return
    configs = parse_configs(a.configs)
    if configs and not a.profile:
        raise SystemExit("--configs needs --profile")
    if a.smoke:
        a.sizes, a.slots, a.heads, a.repeat = "48", "5", "4x8x58,2x4x16", 1
    sizes = [int(s) for s in a.sizes.split(",")]
    slots = [int(s) for s in a.slots.split(",")]
    heads = [tuple(int(x) for x in t.split("x")) for t in a.heads.split(",")]
    methods = a.methods.split(",")
    dev = jax.devices()[0]
    result = {
        "date": datetime.date.today().isoformat(), "device": dev.device_kind, "platform": dev.platform,
        "jax": jax.__version__, "isolate": a.isolate, "profile": a.profile, "smoke": a.smoke, "cells": [],
    }  # fmt: skip
    for h, d, dv in heads:
        for k in slots:
            for n in sizes:
                cell = {"n": n, "k": k, "h": h, "d": d, "dv": dv, "methods": {}}
                for method in methods:
                    t0 = time.perf_counter()
                    if a.isolate:
                        entry = isolated(method, (n, k, h, d, dv), a.repeat, a.profile, configs)
                    else:
                        entry = measure(method, n, k, h, d, dv, a.repeat, a.profile, configs)
                    cell["methods"][method] = entry
                    summary = {m: entry.get(m, {}).get("ms", entry.get(m, {}).get("error")) for m in ("fwd", "fwd+bwd")}
                    for stage, e in entry.get("stages", {}).items():
                        summary[stage] = e.get("ms", e.get("error"))
                    print(f"N={n} K={k} H,d,Dv={h},{d},{dv} {method}: {summary} ({time.perf_counter() - t0:.1f} s)", flush=True)
                result["cells"].append(cell)
                save(result, a.kind, markdown(result), a.out)


if __name__ == "__main__":
    main()
