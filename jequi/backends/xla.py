"""The ``"xla"`` backend: pure JAX, any platform; the CPU default and the test oracle.

The paths of a descriptor are grouped by ``(mode, has_weight, input-1 block, input-2
multiplicity, output block)``. Within a group, every path has the same shape of computation
and adds into the same output block, so the whole group is two ``einsum`` calls on stacked
operands and a sum over its paths:

* ``X1[..., u, i]``: the group's one block of ``x``; ``X2[..., v, J]``: the distinct blocks
  of ``y`` it reads, concatenated (reshapes, never gathers: XLA fuses them, while static
  gathers are slow on CPU);
* ``C[i, J, p, k]``: the group's CG blocks (normalization folded in, zero elsewhere);
* ``T = X2 . C`` (small: no channel of ``x`` in it), then ``Z = sum_p X1 . T . W`` per mode;
* ``W[..., u, v, (w), p]``: the group's weights, stacked from the flat weight vector.

Keying groups on the ``x`` block keeps ``C`` dense along ``i`` (stacking several ``x`` blocks
would multiply the dominant ``X1 . T`` work by zeros).

``x``, ``y`` and ``w`` are cut into their blocks (and paths' weights) once per call, by one
split each (:func:`_pieces`), and each group's sum is added into its output block, the blocks
concatenated: no slice or scatter, whose transposes (a zero-padded copy of the whole operand
per use) made the double backward several times slower on CPU than e3nn-jax's
(benchmarks/results/2026-11-26-cpu-reference.md; docs/tuning.md#xla-operands-split-once).

``backward`` is ``jax.vjp`` of ``forward`` (in the needed inputs only) and the double
backward (:func:`second`) ``jax.vjp`` of ``backward``; convolutions are gather, tensor product
and ``segment_sum``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..autodiff import composed_second
from ..descriptor import Path, Segment, TensorProductDescriptor
from ..dtypes import compute_dtype
from ..sums import Sums

_HIGHEST = jax.lax.Precision.HIGHEST

# Per mode: subscripts of (X1, T, W) -> Z, without the leading batch "...".
# T is "vipk" (or "uipk" when both inputs share the channel index u).
_SPECS = {
    "uvw": ("ui", "vipk", "uvwp", "wpk"),
    "uvu": ("ui", "vipk", "uvp", "upk"),
    "uvv": ("ui", "vipk", "uvp", "vpk"),
    "uuw": ("ui", "uipk", "uwp", "wpk"),
    "uuu": ("ui", "uipk", "up", "upk"),
    "uvuv": ("ui", "vipk", "uvp", "uvpk"),
}


@dataclasses.dataclass(frozen=True, eq=False)
class _Group:
    mode: str
    has_weight: bool
    in1: Segment  # the block of x every path of the group reads
    in2: tuple[Segment, ...]  # distinct blocks of y, stacked along J
    cg: np.ndarray  # (d1, D2, P, k)
    paths: tuple[Path, ...]
    i_out: int  # the output segment every path of the group adds into


def _make_group(desc: TensorProductDescriptor, paths: list[Path]) -> _Group:
    used2 = sorted({p.i_in2 for p in paths})
    start2 = dict(zip(used2, np.cumsum([0] + [desc.in2[s].ir_dim for s in used2]).tolist()))
    total2 = sum(desc.in2[s].ir_dim for s in used2)
    p0 = paths[0]
    cg = np.zeros((p0.ir_in1.dim, total2, len(paths), p0.ir_out.dim))
    for n, p in enumerate(paths):
        cg[:, start2[p.i_in2] : start2[p.i_in2] + p.ir_in2.dim, n, :] = p.cg
    return _Group(p0.mode, p0.has_weight, desc.in1[p0.i_in1], tuple(desc.in2[s] for s in used2), cg, tuple(paths), p0.i_out)


@functools.lru_cache(maxsize=256)
def plan(desc: TensorProductDescriptor) -> tuple[_Group, ...]:
    """The descriptor's paths grouped by shape of computation (see module docstring)."""
    by_key: dict[tuple, list[Path]] = {}
    for p in desc.active_paths:
        key = (p.mode, p.has_weight, p.i_in1, p.mul_in2, p.i_out)
        by_key.setdefault(key, []).append(p)
    return tuple(_make_group(desc, paths) for paths in by_key.values())


def _pieces(a, ranges: list[tuple[int, int]]) -> list:
    """``a[..., start:stop]`` for each of the disjoint `ranges`, from one split of the last axis.

    The transpose of a split is one concatenate; each slice's would pad a zero copy of the whole
    array, and a double backward transposes every one of them again (NequIP-LiPS: 210 pads)."""
    cuts = sorted({c for r in ranges for c in r} | {0, a.shape[-1]})
    parts = dict(zip(zip(cuts, cuts[1:]), jnp.split(a, cuts[1:-1], axis=-1)))
    return [parts[r] if r[1] > r[0] else a[..., r[0] : r[1]] for r in ranges]


def _block(flat, s: Segment):
    """The ``(..., mul, ir_dim)`` view of block `s`, given its ``(..., s.size)`` values."""
    if s.layout == "mul_ir":
        return flat.reshape(*flat.shape[:-1], s.mul, s.ir_dim)
    return jnp.swapaxes(flat.reshape(*flat.shape[:-1], s.ir_dim, s.mul), -1, -2)


def _blocks(a, segments) -> dict:
    """Segment -> its :func:`_block` of the flat array `a`: each block made once, so that
    autodiff sums its cotangents from every group before one transpose."""
    pieces = _pieces(a, [(s.offset, s.offset + s.size) for s in segments])
    return {s: _block(piece, s) for s, piece in zip(segments, pieces)}


def _unblock(b, s: Segment):
    """Inverse of :func:`_block`: ``(..., mul, ir_dim)`` to the flat layout of `s`."""
    if s.layout == "ir_mul":
        b = jnp.swapaxes(b, -1, -2)
    return b.reshape(*b.shape[:-2], s.size)


def _group_forward(g: _Group, x1, x2, weights, dtype):
    """``(..., mul_out, k)``: the sum of the outputs of the group's paths, from its ``x``
    block `x1`, its ``y`` blocks `x2` and its paths' `weights` (flat, None if unweighted)."""
    x2 = jnp.concatenate(x2, axis=-1)
    s1, st, sw, so = _SPECS[g.mode]
    t = jnp.einsum(f"...{st[0]}j,ij{st[2:]}->...{st}", x2, jnp.asarray(g.cg, dtype), precision=_HIGHEST)
    if g.has_weight:
        wg = jnp.stack([wp.reshape(*wp.shape[:-1], *p.weight_shape) for wp, p in zip(weights, g.paths)], axis=-1)
        wsub = ("..." if wg.ndim > len(sw) else "") + sw
        z = jnp.einsum(f"...{s1},...{st},{wsub}->...{so}", x1, t, wg, precision=_HIGHEST)
    else:
        # Unweighted: the weight index is summed (uvu, uvv) or absent; uuw gives mul_out 1.
        so = so.replace("w", "") if g.mode == "uuw" else so
        z = jnp.einsum(f"...{s1},...{st}->...{so}", x1, t, precision=_HIGHEST)
        if g.mode == "uuw":
            z = z[..., None, :, :]
    if g.mode == "uvuv":
        z = z.reshape(*z.shape[:-4], -1, *z.shape[-2:])
    return z.sum(axis=-2)


def _widened(f):
    """`f` (of arrays ``x, y, w, *rest`` of one dtype) computed in :func:`jequi.dtypes.compute_dtype`
    of their dtype, its result stored back in it: half-precision operands are widened to float32
    and the result rounded once, as the kernels do."""

    @functools.wraps(f)
    def widened(desc, x, y, w, *rest):
        stored, math = x.dtype, compute_dtype(x.dtype)
        if math == stored:
            return f(desc, x, y, w, *rest)
        return f(desc, x.astype(math), y.astype(math), w.astype(math), *rest).astype(stored)

    return widened


@_widened
def forward(desc: TensorProductDescriptor, x, y, w):
    """``z = tp(x, y, w)`` for arrays with any (broadcastable) leading dims; ``w`` may be 1-D."""
    dtype = x.dtype
    batch = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1], w.shape[:-1])
    groups = plan(desc)
    xb, yb = _blocks(x, desc.in1), _blocks(y, desc.in2)
    weighted = [p for g in groups if g.has_weight for p in g.paths]
    wp = dict(zip(map(id, weighted), _pieces(w, [(p.weight_offset, p.weight_offset + p.weight_numel) for p in weighted])))
    blocks: list[list] = [[] for _ in desc.out]
    for g in groups:
        weights = [wp[id(p)] for p in g.paths] if g.has_weight else None
        blocks[g.i_out].append(_group_forward(g, xb[g.in1], [yb[s] for s in g.in2], weights, dtype))
    out = [
        jnp.broadcast_to(_unblock(sum(b[1:], b[0]), s), (*batch, s.size)) if b else jnp.zeros((*batch, s.size), dtype)
        for b, s in zip(blocks, desc.out)
    ]
    return jnp.concatenate(out, axis=-1) if out else jnp.zeros((*batch, 0), dtype)


def _vjp(f, args, g, needs):
    """The gradients of ``<g, f(*args)>`` with respect to the args flagged in `needs`, None
    for the others (jax autodiff of `f` in the needed args only)."""
    chosen = [n for n, need in enumerate(needs) if need]

    def of_chosen(*values):
        full = list(args)
        for n, v in zip(chosen, values):
            full[n] = v
        return f(*full)

    _, vjp = jax.vjp(of_chosen, *(args[n] for n in chosen))
    grads = dict(zip(chosen, vjp(g)))
    return tuple(grads.get(n) for n in range(len(args)))


def backward(desc: TensorProductDescriptor, x, y, w, gz, needs=(True, True, True)):
    """``(gx, gy, gw)``: the VJP of :func:`forward` (jax autodiff); None where `needs` is False."""
    return _vjp(functools.partial(forward, desc), (x, y, w), gz, needs)


def _second(fwd, bwd, sums: Sums, arrays):
    """``(dx, dy, dw, dgz)``: the :class:`~jequi.sums.Sums` `sums` over ``arrays = (x, y, w,
    gz, ggx, ggy, ggw)``; None where a sum is empty.

    Where `sums` is the double backward's identity for its arrays (every term of the nonzero
    cotangents ``ggx, ggy, ggw`` in each wanted result), the VJP of ``bwd(x, y, w, gz, needs)
    -> (gx, gy, gw)`` against them; else (forward mode's and higher orders' partial sums) term by term
    (:func:`jequi.autodiff.composed_second`)."""
    x, y, w, gz, *cts = arrays
    nonzero = tuple(ct is not None for ct in cts)
    wanted = (*sums.needs, bool(sums.out))
    if sums == Sums.of(wanted, nonzero):

        def grads(x, y, w, gz):
            return [g for g in bwd(x, y, w, gz, needs=nonzero) if g is not None]

        return _vjp(grads, (x, y, w, gz), [ct for ct in cts if ct is not None], wanted)

    return composed_second(fwd, bwd)(sums, arrays)


def second(desc: TensorProductDescriptor, sums: Sums, arrays):
    """The double backward by autodiff of :func:`backward`, instead of the identity's forward
    and backward calls (:mod:`jequi.autodiff`), which recompute the ``T`` tables and the
    conv's gathers per call: faster on CPU, or equal (docs/tuning.md#xla-second)."""
    return _second(functools.partial(forward, desc), functools.partial(backward, desc), sums, arrays)


def conv_second(desc: TensorProductDescriptor, sums: Sums, arrays, graph):
    """:func:`second` of the conv: autodiff of :func:`conv_backward`."""
    return _second(
        lambda x, y, w: conv_forward(desc, x, y, w, graph),
        lambda x, y, w, gz, needs: conv_backward(desc, x, y, w, gz, graph, needs),
        sums,
        arrays,
    )


@_widened
def conv_forward(desc: TensorProductDescriptor, x, y, w, graph):
    """``out[r] = sum_{e: receivers[e] == r} tp(x[senders[e]], y[e], w[e])``: a gather of
    sender rows, the product per edge and a segment sum (a ``|E| x out.dim`` buffer).

    ``graph`` is a :class:`jequi.Graph` (``receivers == num_nodes`` marks a dropped edge).
    """
    z = forward(desc, x[graph.senders], y, w)
    return jax.ops.segment_sum(z, graph.receivers, num_segments=graph.num_nodes)


def conv_backward(desc: TensorProductDescriptor, x, y, w, gout, graph, needs=(True, True, True)):
    """``(gx, gy, gw)``: the VJP of :func:`conv_forward` (jax autodiff); None where `needs` is False."""
    return _vjp(lambda x, y, w: conv_forward(desc, x, y, w, graph), (x, y, w), gout, needs)
