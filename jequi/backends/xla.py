"""The ``"xla"`` backend: pure JAX, any platform; the CPU default and the test oracle.

The paths of a descriptor are grouped by ``(mode, has_weight, multiplicities, output irrep
dimension)``. Within a group, every path has the same shape of computation, so the whole
group is two ``einsum`` calls on stacked operands:

* ``X1[..., u, I]`` and ``X2[..., v, J]``: the distinct input blocks the group reads,
  gathered from the flat inputs with static index arrays (so both layouts cost the same);
* ``C[I, J, p, k]``: the group's CG blocks (normalization folded in, zero elsewhere);
* ``T = X2 . C`` (small: no channel of ``x`` in it), then ``Z = X1 . T . W`` per mode;
* ``W[..., u, v, (w), p]``: the group's weights gathered from the flat weight vector.

Group outputs are concatenated and placed into the output by static gathers (one per
path that shares an output block), so no scatter is needed. A problem has a handful of
groups (one per output ``l`` for channelwise products), not one einsum per path.

``backward`` is ``jax.vjp`` of ``forward``; convolutions are gather, tensor product and
``segment_sum``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..descriptor import Path, TensorProductDescriptor

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
    idx1: np.ndarray  # (mul1, D1) flat positions in x
    idx2: np.ndarray  # (mul2, D2) flat positions in y
    cg: np.ndarray  # (D1, D2, P, k)
    widx: np.ndarray | None  # (*weight_shape, P) flat positions in w
    out_pos: np.ndarray  # (mul_out, P, k) flat positions in z


def _stack_blocks(segments, paths, which):
    """Distinct input blocks of `paths` (attribute `which`), their gather index and offsets."""
    used = sorted({getattr(p, which) for p in paths})
    index = np.concatenate([segments[s].index() for s in used], axis=1)
    starts = np.cumsum([0] + [segments[s].ir_dim for s in used])
    return index, {s: int(starts[n]) for n, s in enumerate(used)}


def _make_group(desc: TensorProductDescriptor, paths: list[Path]) -> _Group:
    p0 = paths[0]
    idx1, start1 = _stack_blocks(desc.in1, paths, "i_in1")
    idx2, start2 = _stack_blocks(desc.in2, paths, "i_in2")
    k = p0.ir_out.dim
    cg = np.zeros((idx1.shape[1], idx2.shape[1], len(paths), k))
    for n, p in enumerate(paths):
        a, b = start1[p.i_in1], start2[p.i_in2]
        cg[a : a + p.ir_in1.dim, b : b + p.ir_in2.dim, n, :] = p.cg
    widx = None
    if p0.has_weight:
        widx = np.stack(
            [p.weight_offset + np.arange(p.weight_numel).reshape(p.weight_shape) for p in paths], axis=-1
        )
    out_pos = np.stack([desc.out[p.i_out].index() for p in paths], axis=1)
    return _Group(p0.mode, p0.has_weight, idx1, idx2, cg, widx, out_pos)


@dataclasses.dataclass(frozen=True, eq=False)
class XlaPlan:
    """Static gather indices and CG stacks for one descriptor (see module docstring)."""

    desc: TensorProductDescriptor
    groups: tuple[_Group, ...]
    placement: np.ndarray  # (R, out_dim): index into concat(group outputs, [0])

    @classmethod
    def build(cls, desc: TensorProductDescriptor) -> "XlaPlan":
        by_key: dict[tuple, list[Path]] = {}
        for p in desc.active_paths:
            key = (p.mode, p.has_weight, p.mul_in1, p.mul_in2, p.mul_out, p.ir_out.dim)
            by_key.setdefault(key, []).append(p)
        groups = tuple(_make_group(desc, paths) for paths in by_key.values())
        sources = [[] for _ in range(desc.irreps_out.dim)]
        offset = 0
        for g in groups:
            for n, pos in enumerate(g.out_pos.reshape(-1)):
                sources[pos].append(offset + n)
            offset += g.out_pos.size
        depth = max((len(s) for s in sources), default=0)
        placement = np.full((depth, desc.irreps_out.dim), offset, dtype=np.int64)
        for pos, src in enumerate(sources):
            placement[: len(src), pos] = src
        return cls(desc, groups, placement)


@functools.lru_cache(maxsize=256)
def plan(desc: TensorProductDescriptor) -> XlaPlan:
    return XlaPlan.build(desc)


def _group_forward(g: _Group, x, y, w, dtype):
    x1 = x[..., g.idx1]
    x2 = y[..., g.idx2]
    s1, st, sw, so = _SPECS[g.mode]
    t = jnp.einsum(f"...{st[0]}j,ij{st[2:]}->...{st}", x2, jnp.asarray(g.cg, dtype), precision=_HIGHEST)
    if g.has_weight:
        wg = w[..., g.widx]
        wsub = ("..." if w.ndim > 1 else "") + sw
        z = jnp.einsum(f"...{s1},...{st},{wsub}->...{so}", x1, t, wg, precision=_HIGHEST)
    else:
        # Unweighted: the weight index is summed (uvu, uvv) or absent; uuw gives mul_out 1.
        so = so.replace("w", "") if g.mode == "uuw" else so
        z = jnp.einsum(f"...{s1},...{st}->...{so}", x1, t, precision=_HIGHEST)
    return z.reshape(*z.shape[: z.ndim - len(so)], -1)


def forward(desc: TensorProductDescriptor, x, y, w):
    """``z = tp(x, y, w)`` for arrays with any (broadcastable) leading dims; ``w`` may be 1-D."""
    p = plan(desc)
    dtype = x.dtype
    batch = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1], w.shape[:-1])
    if not p.groups:
        return jnp.zeros((*batch, desc.irreps_out.dim), dtype)
    flat = [_group_forward(g, x, y, w, dtype) for g in p.groups]
    flat = [jnp.broadcast_to(z, (*batch, z.shape[-1])) for z in flat]
    flat.append(jnp.zeros((*batch, 1), dtype))
    cat = jnp.concatenate(flat, axis=-1)
    out = cat[..., p.placement[0]]
    for row in p.placement[1:]:
        out = out + cat[..., row]
    return out


def backward(desc: TensorProductDescriptor, x, y, w, gz):
    """``(gx, gy, gw)``: the VJP of :func:`forward` (jax autodiff)."""
    _, vjp = jax.vjp(functools.partial(forward, desc), x, y, w)
    return vjp(gz)


def conv_forward(desc: TensorProductDescriptor, x, y, w, senders, receivers, num_nodes: int):
    """``out[r] = sum_{e: receivers[e] == r} tp(x[senders[e]], y[e], w[e])``.

    Indices are already sanitized (see :mod:`jequi.graph`): ``senders`` in range, and
    ``receivers == num_nodes`` marks an edge to drop.
    """
    z = forward(desc, x[senders], y, w)
    return jax.ops.segment_sum(z, receivers, num_segments=num_nodes)


def conv_backward(desc: TensorProductDescriptor, x, y, w, gout, senders, receivers, num_nodes: int):
    """``(gx, gy, gw)``: the VJP of :func:`conv_forward` (jax autodiff)."""
    f = functools.partial(conv_forward, desc, senders=senders, receivers=receivers, num_nodes=num_nodes)
    _, vjp = jax.vjp(f, x, y, w)
    return vjp(gout)
