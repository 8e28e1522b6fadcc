"""JAX's own index code under compute-sanitizer's initcheck, without jequi: the control for the
reports that ``benchmarks/sanitize_run.sh``'s initcheck gives in XLA fusions (not in a jequi
kernel). It runs the ops of ``jequi.graph.csr_offsets`` and ``row_parts`` in their order (the
counts' scatter-add, ``cumsum``, the parts' ``maximum``, ``cumsum``, ``searchsorted``) with plain jax.numpy, under ``jit``.

    compute-sanitizer --tool initcheck python3 benchmarks/initcheck_xla_probe.py [x64]

``x64`` turns on ``jax_enable_x64`` as the sanitizer harness does (its float64 oracle): the
counts and sums stay int32 (as jequi's), the search's loop counter becomes int64. Results:
benchmarks/results/2026-12-02-nvidia-h200-sanitizer.md.
"""

import sys

import jax
import jax.numpy as jnp

jax.config.update("jax_enable_x64", sys.argv[1:] == ["x64"])


@jax.jit
def bookkeeping(keys, p):
    # jequi.graph.csr_offsets: counts and their cumulative sum, int32 under x64 too
    counts = jnp.zeros(501, jnp.int32).at[keys].add(1, mode="drop")
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    # jequi.graph.row_parts: parts of at most 15 edges a row, their firsts, a row per part
    parts = jnp.maximum(1, -(-(offsets[1:] - offsets[:-1]) // 15))
    firsts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(parts, dtype=jnp.int32)])
    return jnp.clip(jnp.searchsorted(firsts, p, side="right") - 1, 0, 500)


keys = jnp.arange(60_000, dtype=jnp.int32) % 500
print("x64" if jax.config.jax_enable_x64 else "x32", int(bookkeeping(keys, jnp.arange(4_501, dtype=jnp.int32)).sum()), flush=True)
