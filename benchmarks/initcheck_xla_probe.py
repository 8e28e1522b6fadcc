"""JAX's own index code under compute-sanitizer's initcheck, without jequi: the control for the
reports that ``benchmarks/sanitize_run.sh``'s initcheck gives in XLA fusions (not in a jequi
kernel). It runs the ops of ``jequi.graph.csr_offsets`` and ``row_parts`` in their order (the
counts' scatter-add, ``cumsum``, the parts' ``maximum``, ``cumsum``, ``searchsorted``) with plain jax.numpy, under ``jit``.

    compute-sanitizer --tool initcheck python3 benchmarks/initcheck_xla_probe.py [x64] [scan]

``x64`` turns on ``jax_enable_x64`` as the sanitizer harness does (its float64 oracle): the
counts and sums stay int32 (as jequi's), the search's loop counter becomes int64. ``scan`` runs
the same ops in the structure of ``radial_conv``'s chunks instead, where initcheck reported
``loop_maximum_fusion`` (the parts' ``maximum`` read offsets that came through the loop's
state): offsets built per chunk under ``vmap``, a ``scan`` over the chunks whose ``checkpoint``ed
body uses them, differentiated, so the backward's transposed loop recomputes them.
``chunks=N`` (default 3) sets the number of chunks, ``order=forward|backward|tangent`` what is
computed (default the gradient); ``keep`` turns XLA's while-loop unrolling
off. XLA may unroll a loop of two trips, and then no kernel reads its counter; jequi's program
keeps its loop (its body holds the kernels' custom calls), whose s64 counter the body's fusions
read. Results:
benchmarks/results/2026-12-02-nvidia-h200-sanitizer.md.
"""

import os
import sys

if "keep" in sys.argv[1:]:  # before jax reads XLA_FLAGS
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL"

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", "x64" in sys.argv[1:])


@jax.jit
def bookkeeping(keys, p):
    # jequi.graph.csr_offsets: counts and their cumulative sum, int32 under x64 too
    counts = jnp.zeros(501, jnp.int32).at[keys].add(1, mode="drop")
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    # jequi.graph.row_parts: parts of at most 15 edges a row, their firsts, a row per part
    parts = jnp.maximum(1, -(-(offsets[1:] - offsets[:-1]) // 15))
    firsts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(parts, dtype=jnp.int32)])
    return jnp.clip(jnp.searchsorted(firsts, p, side="right") - 1, 0, 500)


def offsets_of(keys):
    counts = jnp.zeros(501, jnp.int32).at[keys].add(1, mode="drop")
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


CHUNKS = next((int(a.split("=")[1]) for a in sys.argv[1:] if a.startswith("chunks=")), 3)
# order=forward | backward (default) | tangent: the sum itself, its gradient (the transposed loop)
# or its jvp; radial_conv's initcheck reports came in its forward and tangent, not its backward
ORDER = next((a.split("=")[1] for a in sys.argv[1:] if a.startswith("order=")), "backward")


@jax.jit
def chunked(keys, x):
    """A sum over CHUNKS chunks of the edges, each chunk's parts from its offsets, in ORDER."""
    offsets = jax.vmap(offsets_of)(keys.reshape(CHUNKS, -1))

    @jax.checkpoint
    def part(x, o):
        parts = jnp.maximum(1, -(-(o[1:] - o[:-1]) // 15))
        return (x[:501] * parts.astype(x.dtype)).sum()

    def loss(x):
        first = part(x, offsets[0])
        total, _ = jax.lax.scan(lambda c, o: (c + part(x, o), None), first, offsets[1:])
        return total

    if ORDER == "forward":
        return loss(x)
    if ORDER == "tangent":
        return jax.jvp(loss, (x,), (jnp.ones_like(x),))[1]
    return jax.grad(loss)(x)


keys = jnp.arange(60_000, dtype=jnp.int32) % 500
mode = ("x64" if jax.config.jax_enable_x64 else "x32") + (f" scan of {CHUNKS} chunks, {ORDER}" if "scan" in sys.argv[1:] else "") + (" (loop kept)" if "keep" in sys.argv[1:] else "")
if "scan" in sys.argv[1:]:
    print(mode, float(chunked(keys, jnp.ones(600, jnp.float32)).sum()), flush=True)
else:
    print(mode, int(bookkeeping(keys, jnp.arange(4_501, dtype=jnp.int32)).sum()), flush=True)
