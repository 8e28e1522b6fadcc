"""The ``"xla"`` backend: pure JAX, any platform; the CPU default and the test oracle.

The paths of a descriptor are grouped by ``(mode, has_weight, input-1 block, multiplicities,
output irrep dimension)``. Within a group, every path has the same shape of computation, so
the whole group is two ``einsum`` calls on stacked operands:

* ``X1[..., u, i]``: the group's one block of ``x``; ``X2[..., v, J]``: the distinct blocks
  of ``y`` it reads, concatenated (slices and reshapes, never gathers: XLA fuses them,
  while static gathers are slow on CPU);
* ``C[i, J, p, k]``: the group's CG blocks (normalization folded in, zero elsewhere);
* ``T = X2 . C`` (small: no channel of ``x`` in it), then ``Z = X1 . T . W`` per mode;
* ``W[..., u, v, (w), p]``: the group's weights, sliced from the flat weight vector.

Keying groups on the ``x`` block keeps ``C`` dense along ``i`` (stacking several ``x`` blocks
would multiply the dominant ``X1 . T`` work by zeros).

Each path's output block is added into its output segment and the segments concatenated
(no scatter). A problem has a handful of groups (one per output ``l`` for channelwise
products), not one einsum per path.

``backward`` is ``jax.vjp`` of ``forward`` (in the needed inputs only); convolutions are
gather, tensor product and ``segment_sum``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..descriptor import Path, Segment, TensorProductDescriptor

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


def _make_group(desc: TensorProductDescriptor, paths: list[Path]) -> _Group:
    used2 = sorted({p.i_in2 for p in paths})
    start2 = dict(zip(used2, np.cumsum([0] + [desc.in2[s].ir_dim for s in used2]).tolist()))
    total2 = sum(desc.in2[s].ir_dim for s in used2)
    p0 = paths[0]
    cg = np.zeros((p0.ir_in1.dim, total2, len(paths), p0.ir_out.dim))
    for n, p in enumerate(paths):
        cg[:, start2[p.i_in2] : start2[p.i_in2] + p.ir_in2.dim, n, :] = p.cg
    return _Group(p0.mode, p0.has_weight, desc.in1[p0.i_in1], tuple(desc.in2[s] for s in used2), cg, tuple(paths))


@functools.lru_cache(maxsize=256)
def plan(desc: TensorProductDescriptor) -> tuple[_Group, ...]:
    """The descriptor's paths grouped by shape of computation (see module docstring)."""
    by_key: dict[tuple, list[Path]] = {}
    for p in desc.active_paths:
        key = (p.mode, p.has_weight, p.i_in1, p.mul_in2, p.mul_out, p.ir_out.dim)
        by_key.setdefault(key, []).append(p)
    return tuple(_make_group(desc, paths) for paths in by_key.values())


def _block(a, s: Segment):
    """The ``(..., mul, ir_dim)`` view of block `s` of the flat array `a` (slices, no gather)."""
    flat = a[..., s.offset : s.offset + s.size]
    if s.layout == "mul_ir":
        return flat.reshape(*a.shape[:-1], s.mul, s.ir_dim)
    return jnp.swapaxes(flat.reshape(*a.shape[:-1], s.ir_dim, s.mul), -1, -2)


def _unblock(b, s: Segment):
    """Inverse of :func:`_block`: ``(..., mul, ir_dim)`` to the flat layout of `s`."""
    if s.layout == "ir_mul":
        b = jnp.swapaxes(b, -1, -2)
    return b.reshape(*b.shape[:-2], s.size)


def _group_forward(g: _Group, x, y, w, dtype):
    """``(..., mul_out, P, k)``: the outputs of the group's paths."""
    x1 = _block(x, g.in1)
    x2 = jnp.concatenate([_block(y, s) for s in g.in2], axis=-1)
    s1, st, sw, so = _SPECS[g.mode]
    t = jnp.einsum(f"...{st[0]}j,ij{st[2:]}->...{st}", x2, jnp.asarray(g.cg, dtype), precision=_HIGHEST)
    if g.has_weight:
        wg = jnp.stack(
            [w[..., p.weight_offset : p.weight_offset + p.weight_numel].reshape(*w.shape[:-1], *p.weight_shape) for p in g.paths],
            axis=-1,
        )
        wsub = ("..." if w.ndim > 1 else "") + sw
        z = jnp.einsum(f"...{s1},...{st},{wsub}->...{so}", x1, t, wg, precision=_HIGHEST)
    else:
        # Unweighted: the weight index is summed (uvu, uvv) or absent; uuw gives mul_out 1.
        so = so.replace("w", "") if g.mode == "uuw" else so
        z = jnp.einsum(f"...{s1},...{st}->...{so}", x1, t, precision=_HIGHEST)
        if g.mode == "uuw":
            z = z[..., None, :, :]
    if g.mode == "uvuv":
        z = z.reshape(*z.shape[:-4], -1, *z.shape[-2:])
    return z


def forward(desc: TensorProductDescriptor, x, y, w):
    """``z = tp(x, y, w)`` for arrays with any (broadcastable) leading dims; ``w`` may be 1-D."""
    dtype = x.dtype
    batch = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1], w.shape[:-1])
    blocks: list[list] = [[] for _ in desc.out]
    for g in plan(desc):
        z = _group_forward(g, x, y, w, dtype)
        for n, p in enumerate(g.paths):
            blocks[p.i_out].append(z[..., n, :])
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
