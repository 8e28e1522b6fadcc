"""The row-part fix-up both kernel packages' convolutions end with: the partial sums of the rows
walked in parts (:class:`jequi.graph.RowParts`) added to the rows' first parts, in part order.

It lives below ``pallas_kernels`` and ``ffi`` (both import it; neither imports the other): on
the GPU a Pallas kernel (:func:`add_extras_kernel`, launched by :mod:`jequi.pallas_launch`)
whatever backend ran the conv, on the CPU XLA's segment sum.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .pallas_launch import on_gpu, pallas_call

# Column pieces per fix-up program, and the most columns in a piece (a Triton vector's size is a
# power of two; pallas_kernels' row code cuts its channels with the same rule, :func:`pieces`).
FIXUP_PIECES = 8
PIECE = 128


def pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """``range(start, stop)`` as ``(start, size)`` pieces of power-of-two sizes, at most :data:`PIECE`."""
    out = []
    while start < stop:
        size = min(PIECE, 1 << ((stop - start).bit_length() - 1))
        out.append((start, size))
        start += size
    return out


def add_extras(out, extras, firsts):
    """``out`` ``(R, d)`` plus the extras of the rows split in parts: ``out[r] += extras[firsts[r]
    - r] + ... + extras[firsts[r + 1] - r - 2]``, in that order (bitwise reproducible; ``firsts``
    as :class:`jequi.graph.RowParts`): on the GPU a kernel that updates ``out`` in place
    (:func:`add_extras_kernel`), on the CPU XLA's segment sum, which adds in index order there
    (an interpreted kernel launch per conv cost seconds of every CPU test)."""
    num_rows, d = out.shape
    if on_gpu():
        return add_extras_kernel(out, extras, firsts)
    ends = firsts - jnp.arange(num_rows + 1, dtype=firsts.dtype)  # row r's extras: ends[r]:ends[r + 1]
    extras = extras.reshape(-1, d)
    k = jnp.arange(extras.shape[0])
    row, real = jnp.searchsorted(ends, k, side="right") - 1, k < ends[-1]
    total = jax.ops.segment_sum(jnp.where(real[:, None], extras, 0), jnp.where(real, row, num_rows), num_rows)
    return (out + total).astype(out.dtype)


def add_extras_kernel(out, extras, firsts):
    """:func:`add_extras` as a Pallas kernel: a program per row and block of columns, in place;
    rows of one part return at once. The sum runs in float32 or better (the dtype of ``out``
    promoted), stored in ``out``'s dtype."""
    num_rows, d = out.shape
    cut = pieces(0, d)
    blocks = [cut[i : i + FIXUP_PIECES] for i in range(0, len(cut), FIXUP_PIECES)]
    acc = jnp.promote_types(out.dtype, jnp.float32)

    def kernel(firsts_ref, out_ref, extras_ref, o_ref):
        r, block = pl.program_id(0), pl.program_id(1)
        lo, hi = firsts_ref[r] - r, firsts_ref[r + 1] - r - 1
        cols = lambda c0, cs: c0 + jnp.arange(cs, dtype=jnp.int32)  # noqa: E731
        for bi, piece in enumerate(blocks):

            @pl.when((block == bi) & (hi > lo))
            def _():
                def add(k, sums):
                    return [s + extras_ref[k * d + cols(c0, cs)].astype(acc) for s, (c0, cs) in zip(sums, piece)]

                init = [out_ref[r * d + cols(c0, cs)].astype(acc) for c0, cs in piece]
                for (c0, cs), value in zip(piece, jax.lax.fori_loop(lo, hi, add, init)):
                    o_ref[r * d + cols(c0, cs)] = value.astype(o_ref.dtype)

    out = pallas_call(
        kernel, jax.ShapeDtypeStruct((num_rows * d,), out.dtype), (num_rows, len(blocks)), 4, name="jequi_conv_parts",
        aliases={1: 0},
    )(firsts, out.reshape(-1), extras.reshape(-1))
    return out.reshape(num_rows, d)
