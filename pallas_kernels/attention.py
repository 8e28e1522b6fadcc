"""Pallas kernels for node-centric attention over a padded neighbour list (E2Former-V2).

For target ``i``, its valid neighbours ``j = nbr[i, t]`` and each head (``jequi.neighbor_attention``
has the definition; ``../shared/E2FORMER.md`` section 2)::

    s_it = scale * g_it * <q_i, k_j> + b_it;   a_it = exp(s_it - mu_i) * e_it;   Z_i = sum_t a_it + eps
    out_i = sum_t (a_it / Z_i) * u_it * v_j

Kernels (one program per node and block of heads, gathers inside the kernel; nothing of size
``N x K x D_v`` is ever written):

* :func:`forward`: an online softmax over the neighbour slots in blocks (running max, sum and
  accumulator), writes ``out``, ``lse = mu + log Z`` and the slot of the (first) maximum,
  which the eps term of the derivatives needs.
* :func:`backward`: FlashAttention-2's backward, ``P = exp(s - lse) * e`` recomputed. ``dk``
  and ``dv`` are sums over the edges into each source. Deterministically (bitwise
  reproducible), a pass over sources walks the transposed neighbour list (a CSR built from
  ``nbr``), computes ``dk``, ``dv`` and the per-edge gradients and leaves each edge's
  ``ds g scale`` ``[N, K, H]``, from which a light pass over targets sums ``dq`` gathering only
  keys: the values (``D_v`` wide) are gathered once. With ``atomic=True`` (or when neither
  ``dk`` nor ``dv`` is needed) one pass over targets computes everything, adding ``dk`` and
  ``dv`` with atomics (one neighbour slot per step, so duplicate neighbours never collide
  within one atomic).
* :func:`tangent`: the forward-mode derivative (a JVP) in one pass over targets.

Layouts: ``q [N, H, d]``, ``k [N_src, H, d]``, ``v [N_src, H, D_v]``, ``nbr [N, K]`` int32
(an index outside ``[0, N_src)`` is a padding slot), per-edge scalars ``[N, K, 1]`` (shared by
the heads) or ``[N, K, H]``. ``d`` and ``D_v`` need not be powers of two: blocks are padded to
the next power of two with masked loads, and outputs are stored at their real width (masked
stores). Flat indices are
int32: every array must have fewer than 2**31 elements.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jequi.graph import csr

from .lowering import masked_load, masked_store, pallas_call

# The optional per-edge scalars, in the order the kernels take them.
EDGE_NAMES = ("logit_bias", "logit_gate", "envelope", "post_scale")
B, G, E, U = range(4)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of the attention kernels (None: the rule of :func:`blocks`).

    * ``block_heads``: heads per program (a power of two dividing ``H``).
    * ``block_neighbors``: neighbour slots per loop step of the forward, tangent and backward
      target and query passes (the atomic target pass takes one slot a step; the query pass,
      which gathers only keys, by default as many as fit ``tile_elements``).
    * ``block_edges``: incoming edges per loop step of the backward's source pass.
    * ``tile_elements``: the rules' budget for a step's gathered value tile
      (``block_neighbors x block_heads x D_v`` padded).
    * ``num_warps``: warps per program.
    """

    block_heads: int | None = None
    block_neighbors: int | None = None
    block_edges: int | None = None
    tile_elements: int = 8192
    num_warps: int = 4


DEFAULT = AttentionConfig()


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static facts of one call: head count, widths, neighbour slots, which per-edge scalars
    exist (``edge_heads[n]`` is None, 1 or ``heads`` for ``EDGE_NAMES[n]``), scale and eps."""

    heads: int
    d: int
    dv: int
    slots: int
    edge_heads: tuple
    scale: float
    eps: float

    @property
    def dp(self) -> int:
        return _pow2(self.d)

    @property
    def dvp(self) -> int:
        return _pow2(self.dv)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def blocks(p: Problem, config: AttentionConfig = DEFAULT) -> tuple[int, int, int]:
    """``(block_heads, block_neighbors, block_edges)``: the largest power of two dividing ``H``
    up to 16 heads; then as many neighbour slots (edges) as fit ``tile_elements`` values, up
    to 16 and the padded ``K``."""
    bh = config.block_heads
    if bh is None:
        bh = 1
        while bh < 16 and p.heads % (2 * bh) == 0:
            bh *= 2
    if p.heads % bh or bh & (bh - 1):
        raise ValueError(f"block_heads={bh} must be a power of two dividing the {p.heads} heads")
    fit = max(1, config.tile_elements // (bh * max(p.dvp, p.dp)))
    fit = 1 << (fit.bit_length() - 1)
    bk = config.block_neighbors or min(16, fit, _pow2(p.slots))
    be = config.block_edges or min(16, fit)
    for name, value in (("block_neighbors", bk), ("block_edges", be)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two")
    return bh, bk, be


# --- in-kernel helpers ---------------------------------------------------------------------------


def _store_rows(ref, row, heads, num_heads: int, width: int, padded: int, value):
    """``ref[row, heads, :width] = value[:, :width]`` of a flat ``[rows, num_heads, width]``
    array (`value` ``[BH, padded]``): outputs are written at their real width, so no padded
    copy is sliced afterwards."""
    c = jnp.arange(padded, dtype=jnp.int32)
    idx = (row * num_heads + heads[:, None]) * width + c[None, :]
    masked_store(ref, idx, value, (c < width)[None, :])


def _slot_block(p, nbr_ref, i, t, bk: int, n_src: int):
    """Step `t` of target row `i`'s neighbour slots, `bk` at a time: ``(slot, in_row, edge, j,
    valid)``, where `edge` indexes the flat ``[N * K]`` per-edge arrays (clamped into the row),
    `valid` marks slots in the row whose neighbour is a source, and `j` is that source (0 where
    not valid, so every gather stays in bounds)."""
    slot = t * bk + jnp.arange(bk, dtype=jnp.int32)
    in_row = slot < p.slots
    edge = i * p.slots + jnp.minimum(slot, p.slots - 1)
    j = nbr_ref[edge]
    valid = in_row & (j >= 0) & (j < n_src)
    return slot, in_row, edge, jnp.where(valid, j, 0), valid


def _recomputed_edges(p, k_ref, v_ref, edge_refs, qi, lse_i, j, edge, heads, h: int, valid, acc):
    """A backward or tangent kernel's step: the gathered ``k_j``, ``v_j``, the edges' scalars,
    ``q_i . k_j``, the logits and ``P0 = exp(s - lse)`` (0 on invalid slots), recomputed from
    the forward's ``lse`` rather than stored."""
    kj = _row_block(k_ref, j, heads, h, p.d, p.dp, valid, acc)
    vj = _row_block(v_ref, j, heads, h, p.dv, p.dvp, valid, acc)
    ev = _edge_block(edge_refs, p, edge, heads, valid, acc)
    qk = jnp.sum(qi[None] * kj, axis=2)
    s = _logits(p, qk, ev)
    vmask = valid[:, None]
    P0 = jnp.where(vmask, jnp.exp(jnp.where(vmask, s, 0.0) - lse_i[None, :]), 0.0)
    return kj, vj, ev, qk, s, P0


def _row_block(ref, row, heads, num_heads: int, width: int, padded: int, valid, dtype):
    """``ref[row, heads, :width]`` of a flat ``[rows, num_heads, width]`` array, as an array of
    shape ``row.shape + (BH, padded)`` in `dtype`, zero past `width` and where not `valid`."""
    c = jnp.arange(padded, dtype=jnp.int32)
    r = jnp.asarray(row, jnp.int32)[..., None, None]
    idx = (r * num_heads + heads[:, None]) * width + jnp.minimum(c, width - 1)[None, :]
    mask = jnp.asarray(valid)[..., None, None] & (c < width)[None, :]
    idx, mask = jnp.broadcast_arrays(idx, mask)
    return masked_load(ref, idx, mask).astype(dtype)


def _edge_block(refs, p: Problem, edge, heads, valid, dtype):
    """The per-edge scalars of flat edges `edge` ``[BE]`` (``i * K + t``) for `heads`: a list
    in :data:`EDGE_NAMES` order of ``[BE, BH]`` (per head) or ``[BE, 1]`` (shared) arrays,
    None where absent; zero where not `valid`."""
    values = []
    for ref, hb in zip(refs, p.edge_heads):
        if hb is None:
            values.append(None)
            continue
        cols = heads[None, :] if hb > 1 else jnp.zeros((1, 1), jnp.int32)
        idx = edge[:, None] * hb + cols
        mask = valid[:, None] & jnp.ones(cols.shape, bool)
        idx, mask = jnp.broadcast_arrays(idx, mask)
        values.append(masked_load(ref, idx, mask).astype(dtype))
    return values


def _logits(p: Problem, qk, ev):
    """``s = scale * g * qk + b`` (``qk [BE, BH]``)."""
    s = qk * p.scale if ev[G] is None else qk * (p.scale * ev[G])
    return s if ev[B] is None else s + ev[B]


def _times(x, y):
    return x if y is None else x * y


def _edge_refs(p: Problem, refs):
    """Split `refs` into the present edge scalars' refs (None for absent ones) and the rest."""
    refs = list(refs)
    out = []
    for hb in p.edge_heads:
        out.append(None if hb is None else refs.pop(0))
    return out, refs


def _edge_arrays(p: Problem, edges):
    return [a.reshape(-1) for a, hb in zip(edges, p.edge_heads) if hb is not None]


def _acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


# --- forward --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("p", "config"))
def forward(q, k, v, nbr, edges, *, p: Problem, config: AttentionConfig = DEFAULT):
    """``(out [N, H, D_v], lse [N, H], amax [N, H] int32)``: the attention output, ``mu + log Z``
    (``+inf`` where ``Z = 0``) and the slot of each row's first maximal logit (-1 where a row
    has no valid neighbour). `edges`: the four per-edge arrays in :data:`EDGE_NAMES` order,
    None where absent."""
    n, h, _ = q.shape
    n_src = k.shape[0]
    bh, bk, _ = blocks(p, config)
    steps = -(-p.slots // bk)
    acc = _acc_dtype(q.dtype)
    neg_inf = float("-inf")

    def kernel(q_ref, k_ref, v_ref, nbr_ref, *refs):
        edge_refs, (out_ref, lse_ref, amax_ref) = _edge_refs(p, refs)
        i, hblock = pl.program_id(0), pl.program_id(1)
        heads = hblock * bh + jnp.arange(bh, dtype=jnp.int32)
        qi = _row_block(q_ref, i, heads, h, p.d, p.dp, True, acc)  # [BH, dp]

        def step(t, carry):
            m, z, a, amax = carry
            slot, in_row, edge, j, valid = _slot_block(p, nbr_ref, i, t, bk, n_src)
            kj = _row_block(k_ref, j, heads, h, p.d, p.dp, valid, acc)  # [BK, BH, dp]
            ev = _edge_block(edge_refs, p, edge, heads, valid, acc)
            s = jnp.where(valid[:, None], _logits(p, jnp.sum(qi[None] * kj, axis=2), ev), neg_inf)
            m_blk = jnp.max(s, axis=0)
            first = jnp.min(jnp.where(s == m_blk[None, :], slot[:, None], p.slots), axis=0)
            amax = jnp.where(m_blk > m, first, amax)
            m_new = jnp.maximum(m, m_blk)
            m_safe = jnp.where(m_new == neg_inf, 0.0, m_new)
            c = jnp.exp(m - m_safe)
            w = _times(jnp.exp(s - m_safe), ev[E])  # [BK, BH]
            vj = _row_block(v_ref, j, heads, h, p.dv, p.dvp, valid, acc)  # [BK, BH, dvp]
            a = a * c[:, None] + jnp.sum(_times(w, ev[U])[:, :, None] * vj, axis=0)
            return m_new, z * c + jnp.sum(w, axis=0), a, amax

        init = (
            jnp.full((bh,), neg_inf, acc), jnp.zeros((bh,), acc), jnp.zeros((bh, p.dvp), acc),
            jnp.full((bh,), -1, jnp.int32),
        )  # fmt: skip
        m, z, a, amax = jax.lax.fori_loop(0, steps, step, init)
        zt = z + p.eps
        ok = zt > 0
        out = a / jnp.where(ok, zt, 1.0)[:, None]
        m_safe = jnp.where(m == neg_inf, 0.0, m)
        lse = jnp.where(ok, m_safe + jnp.log(jnp.where(ok, zt, 1.0)), float("inf"))
        base = i * h + heads
        _store_rows(out_ref, i, heads, h, p.dv, p.dvp, out)
        lse_ref[base] = lse
        amax_ref[base] = amax

    out, lse, amax = pallas_call(
        kernel,
        [
            jax.ShapeDtypeStruct((n * h * p.dv,), q.dtype),
            jax.ShapeDtypeStruct((n * h,), acc),
            jax.ShapeDtypeStruct((n * h,), jnp.int32),
        ],
        (n, h // bh), config.num_warps, name="jequi_attention_fwd",
    )(q.reshape(-1), k.reshape(-1), v.reshape(-1), nbr.reshape(-1), *_edge_arrays(p, edges))  # fmt: skip
    return out.reshape(n, h, p.dv), lse.reshape(n, h), amax.reshape(n, h)


# --- backward -------------------------------------------------------------------------------------


def _edge_step(p: Problem, s, qk, ev, P0, dpu, D, slot, amax):
    """The backward's algebra for a block of edges (``[BE, BH]`` arrays; ``P0 = exp(s - lse)``,
    0 where invalid; ``dPu = <dO_i, v_j>``; ``D = <dO_i, out_i>``): ``(P, ds, (db, dg, de, du))``
    with ``P = P0 e``, ``ds = P (u dPu - D)`` plus, at each row's argmax slot, the eps term
    ``-(eps / Z) D`` (``eps / Z = eps * P0`` there), ``db = ds``, ``dg = ds * scale * qk``,
    ``de = P0 (u dPu - D)`` (``ds / e`` without the division: envelopes may be 0) and
    ``du = P dPu`` (None for absent inputs)."""
    P = _times(P0, ev[E])
    de = P0 * (_times(dpu, ev[U]) - D)
    ds = _times(de, ev[E])
    if p.eps:
        ds = ds + jnp.where(slot == amax, -p.eps * P0 * D, 0.0)
    present = [hb is not None for hb in p.edge_heads]
    grads = (ds, ds * (p.scale * qk), de, P * dpu)
    return P, ds, tuple(g if has else None for g, has in zip(grads, present))


def _needs(p: Problem, needs: tuple):
    """``(need_q, need_k, need_v, need_edge)`` with `need_edge` over all four
    :data:`EDGE_NAMES` slots, from `needs` over ``(q, k, v, *present edge arrays)``."""
    need_edge = [False] * 4
    for flag, i in zip(needs[3:], [i for i, hb in enumerate(p.edge_heads) if hb is not None]):
        need_edge[i] = flag
    return needs[0], needs[1], needs[2], need_edge


def _edge_grad_width(p: Problem, i: int, h: int, bh: int) -> int:
    """Columns per edge of edge scalar `i`'s gradient as the kernels write it: one per head, or
    for a scalar shared by the heads one partial sum per head block (summed by
    :func:`_edge_grads`, so the result does not depend on the scheduling)."""
    return h if p.edge_heads[i] > 1 else h // bh


def _edge_grads(p: Problem, flat, need_edge, n: int, h: int, bh: int) -> list:
    """The per-edge gradients ``[N, K, H or 1]`` from the kernels' flat outputs."""
    grads = [None] * 4
    for i, g in zip([i for i in range(4) if need_edge[i]], flat):
        g = g.reshape(n, p.slots, _edge_grad_width(p, i, h, bh))
        grads[i] = g if p.edge_heads[i] > 1 else g.sum(axis=2, keepdims=True)
    return grads


def _store_edge_grads(refs, p: Problem, eg, need_edge, edge, heads, hblock, valid, h: int):
    """Store the per-edge gradients `eg` (``[BE, BH]`` each) of flat edges `edge` where
    `valid`, at their :func:`_edge_grad_width` columns."""
    refs = iter(refs)
    nhb = h // heads.shape[0]
    for i, g in enumerate(eg):
        if not need_edge[i]:
            continue
        ref = next(refs)
        if p.edge_heads[i] > 1:
            masked_store(ref, edge[:, None] * h + heads[None, :], g, valid[:, None])
        else:
            masked_store(ref, edge * nhb + hblock, jnp.sum(g, axis=1), valid)


@functools.partial(jax.jit, static_argnames=("p", "needs", "atomic", "config"))
def backward(q, k, v, nbr, edges, lse, amax, dout, delta, *, p: Problem, needs: tuple, atomic: bool = False,
             config: AttentionConfig = DEFAULT):  # fmt: skip
    """The gradients of ``<dout, out>`` for ``(q, k, v, *present edge arrays)`` flagged in
    `needs` (a bool each, in that order), None for the others. ``lse``, ``amax`` from
    :func:`forward`; ``delta = <dout, out>`` per row and head ``[N, H]``. Per-edge gradients
    have their input's shape (``[N, K, 1]`` summed over heads).

    Where ``dk`` or ``dv`` is needed and ``atomic`` is False: :func:`backward_sources` (a pass
    over sources along :func:`transposed_neighbors`; bitwise reproducible) computes ``dk``,
    ``dv``, the per-edge gradients and, if ``dq`` is needed, each edge's ``ds g scale``, from
    which :func:`backward_queries` sums ``dq`` gathering only keys, so the values are gathered
    by one pass, not two. Otherwise :func:`backward_targets`, one pass over targets (with
    ``atomic``, ``dk`` and ``dv`` added by atomics: not bitwise reproducible)."""
    need_q, need_k, need_v, _ = _needs(p, needs)
    if (need_k or need_v) and not atomic:
        order, offsets = transposed_neighbors(nbr, k.shape[0])
        dk, dv, coef, grads_edge = backward_sources(q, k, v, nbr, edges, lse, amax, dout, delta, order, offsets, p=p,
                                                    needs=needs, config=config)  # fmt: skip
        dq = backward_queries(k, nbr, coef, p=p, config=config) if need_q else None
    else:
        dq, dk, dv, grads_edge = backward_targets(q, k, v, nbr, edges, lse, amax, dout, delta, p=p, needs=needs,
                                                  atomic=atomic, config=config)  # fmt: skip
    cast = lambda x, like: None if x is None else x.astype(like.dtype)  # noqa: E731
    grads = [cast(dq, q), cast(dk, k), cast(dv, v)]
    for flag, i in zip(needs[3:], [i for i, hb in enumerate(p.edge_heads) if hb is not None]):
        grads.append(cast(grads_edge[i], edges[i]) if flag else None)
    return tuple(grads)


def _backward_args(q, k, v, nbr, edges, lse, amax, dout, delta, p: Problem):
    return (q.reshape(-1), k.reshape(-1), v.reshape(-1), nbr.reshape(-1), *_edge_arrays(p, edges), lse.reshape(-1),
            amax.reshape(-1), dout.reshape(-1), delta.reshape(-1))  # fmt: skip


@functools.partial(jax.jit, static_argnames=("p", "needs", "atomic", "config"))
def backward_targets(q, k, v, nbr, edges, lse, amax, dout, delta, *, p: Problem, needs: tuple, atomic: bool,
                     config: AttentionConfig = DEFAULT):  # fmt: skip
    """``(dq, dk, dv, per-edge gradients over the four slots)`` of the flagged inputs (None
    for the others) by one pass over targets: each program walks its row's slots, recomputes
    ``P`` and ``ds`` and sums ``dq``; with ``atomic``, it adds ``dk`` and ``dv`` by atomics,
    one slot a step (so duplicate neighbours never collide within one atomic); without it
    ``dk`` and ``dv`` are not computed here."""
    n, h, _ = q.shape
    n_src = k.shape[0]
    need_q, need_k, need_v, need_edge = _needs(p, needs)
    acc = _acc_dtype(q.dtype)
    bh, bk, _ = blocks(p, config)
    target_scatter = atomic and (need_k or need_v)
    if target_scatter:
        bk = 1
    steps = -(-p.slots // bk)
    args = _backward_args(q, k, v, nbr, edges, lse, amax, dout, delta, p)
    shapes, names = [], []
    if need_q:
        shapes.append(jax.ShapeDtypeStruct((n * h * p.d,), acc))
        names.append("dq")
    for i in range(4):
        if need_edge[i]:
            shapes.append(jax.ShapeDtypeStruct((n * p.slots * _edge_grad_width(p, i, h, bh),), acc))
            names.append(i)
    aliases, extra = {}, []
    if target_scatter:
        # Padding slots add their zeros into an extra row n_src (atomics cannot be masked in
        # the interpreter); the padded width keeps the atomics' columns unmasked too.
        for name, width in (("dk", p.dp), ("dv", p.dvp)):
            aliases[len(args) + len(extra)] = len(shapes)
            extra.append(jnp.zeros(((n_src + 1) * h * width,), acc))
            shapes.append(jax.ShapeDtypeStruct(((n_src + 1) * h * width,), acc))
            names.append(name)

    def kernel(q_ref, k_ref, v_ref, nbr_ref, *refs):
        edge_refs, rest = _edge_refs(p, refs)
        lse_ref, amax_ref, do_ref, delta_ref = rest[:4]
        outs = dict(zip(names, rest[4 + len(extra) :]))
        i, hblock = pl.program_id(0), pl.program_id(1)
        heads = hblock * bh + jnp.arange(bh, dtype=jnp.int32)
        qi = _row_block(q_ref, i, heads, h, p.d, p.dp, True, acc)
        doi = _row_block(do_ref, i, heads, h, p.dv, p.dvp, True, acc)
        lse_i = lse_ref[i * h + heads]
        amax_i = amax_ref[i * h + heads]
        delta_i = delta_ref[i * h + heads].astype(acc)

        def step(t, dq):
            slot, in_row, edge, j, valid = _slot_block(p, nbr_ref, i, t, bk, n_src)
            kj, vj, ev, qk, s, P0 = _recomputed_edges(p, k_ref, v_ref, edge_refs, qi, lse_i, j, edge, heads, h, valid, acc)
            dpu = jnp.sum(doi[None] * vj, axis=2)
            P, ds, eg = _edge_step(p, s, qk, ev, P0, dpu, delta_i[None, :], slot[:, None], amax_i[None, :])
            dsg = _times(ds, ev[G]) * p.scale
            # every slot of the row is written (padding slots' gradients are zeros)
            _store_edge_grads([outs[i_] for i_ in range(4) if need_edge[i_]], p, eg, need_edge, edge, heads, hblock,
                              in_row, h)  # fmt: skip
            if target_scatter:
                row = jnp.where(valid, j, n_src)[:, None, None]
                if need_k:
                    c = jnp.arange(p.dp, dtype=jnp.int32)
                    idx = (row * h + heads[None, :, None]) * p.dp + c[None, None, :]
                    pl_triton.atomic_add(outs["dk"], idx, dsg[:, :, None] * qi[None])
                if need_v:
                    c = jnp.arange(p.dvp, dtype=jnp.int32)
                    idx = (row * h + heads[None, :, None]) * p.dvp + c[None, None, :]
                    pl_triton.atomic_add(outs["dv"], idx, _times(P, ev[U])[:, :, None] * doi[None])
            if need_q:
                dq = dq + jnp.sum(dsg[:, :, None] * kj, axis=0)
            return dq

        dq = jax.lax.fori_loop(0, steps, step, jnp.zeros((bh, p.dp), acc))
        if need_q:
            _store_rows(outs["dq"], i, heads, h, p.d, p.dp, dq)

    results = pallas_call(kernel, shapes, (n, h // bh), config.num_warps, name="jequi_attention_bwd_targets",
                          aliases=aliases)(*args, *extra)  # fmt: skip
    results = dict(zip(names, results))
    dq = results["dq"].reshape(n, h, p.d) if need_q else None
    dk = results["dk"].reshape(n_src + 1, h, p.dp)[:n_src, :, : p.d] if target_scatter and need_k else None
    dv = results["dv"].reshape(n_src + 1, h, p.dvp)[:n_src, :, : p.dv] if target_scatter and need_v else None
    return dq, dk, dv, _edge_grads(p, [results[i] for i in range(4) if need_edge[i]], need_edge, n, h, bh)


def transposed_neighbors(nbr, n_src: int):
    """``(order, offsets)``: the flat slots ``i * K + t`` sorted by their neighbour (stable),
    and the offsets ``[N_src + 2]`` of each source's slots in ``order`` (padding slots last):
    the transposed neighbour list the deterministic backward walks."""
    flat = nbr.reshape(-1)
    valid = (flat >= 0) & (flat < n_src)
    keys = jnp.where(valid, flat, n_src)
    return csr(keys, n_src)


@functools.partial(jax.jit, static_argnames=("p", "needs", "config"))
def backward_sources(q, k, v, nbr, edges, lse, amax, dout, delta, order, offsets, *, p: Problem, needs: tuple,
                     config: AttentionConfig = DEFAULT):  # fmt: skip
    """``(dk, dv, coef, per-edge gradients over the four slots)`` of the flagged inputs by a
    pass over sources: each program walks the edges into its source in the order of
    :func:`transposed_neighbors`, recomputes ``P`` and ``ds`` per edge, writes its ``dk`` and
    ``dv`` sums once and each edge's gradients at the edge. ``coef [N * K * H]``: each valid
    edge's ``ds g scale`` for :func:`backward_queries` when ``dq`` is needed (else None);
    padding slots are never visited, so their ``coef`` is unwritten and their gradients stay
    at the zeros the outputs start from."""
    n, h, _ = q.shape
    n_src = k.shape[0]
    need_q, need_k, need_v, need_edge = _needs(p, needs)
    acc = _acc_dtype(q.dtype)
    bh, _, be = blocks(p, config)
    args = _backward_args(q, k, v, nbr, edges, lse, amax, dout, delta, p)
    num_slots = n * p.slots
    shapes, names = [], []
    for name, flag, width in (("dk", need_k, p.d), ("dv", need_v, p.dv)):
        if flag:
            shapes.append(jax.ShapeDtypeStruct((n_src * h * width,), acc))
            names.append(name)
    if need_q:
        shapes.append(jax.ShapeDtypeStruct((num_slots * h,), acc))
        names.append("coef")
    aliases, zeros = {}, []
    for i in range(4):
        if need_edge[i]:
            size = num_slots * _edge_grad_width(p, i, h, bh)
            aliases[len(args) + 2 + len(zeros)] = len(shapes)
            zeros.append(jnp.zeros((size,), acc))
            shapes.append(jax.ShapeDtypeStruct((size,), acc))
            names.append(i)

    def kernel(q_ref, k_ref, v_ref, nbr_ref, *refs):
        edge_refs, rest = _edge_refs(p, refs)
        lse_ref, amax_ref, do_ref, delta_ref, order_ref, off_ref = rest[:6]
        outs = dict(zip(names, rest[6 + len(zeros) :]))
        j, hblock = pl.program_id(0), pl.program_id(1)
        heads = hblock * bh + jnp.arange(bh, dtype=jnp.int32)
        kj = _row_block(k_ref, j, heads, h, p.d, p.dp, True, acc)  # [BH, dp]
        vj = _row_block(v_ref, j, heads, h, p.dv, p.dvp, True, acc)  # [BH, dvp]
        start, end = off_ref[j], off_ref[j + 1]

        def step(t, carry):
            dk, dv = carry
            pos = start + t * be + jnp.arange(be, dtype=jnp.int32)
            valid = pos < end
            edge = jnp.where(valid, order_ref[jnp.minimum(pos, num_slots - 1)], 0)
            i = jax.lax.div(edge, jnp.int32(p.slots))  # non-negative: no floor correction
            slot = edge - i * p.slots
            qi = _row_block(q_ref, i, heads, h, p.d, p.dp, valid, acc)  # [BE, BH, dp]
            doi = _row_block(do_ref, i, heads, h, p.dv, p.dvp, valid, acc)  # [BE, BH, dvp]
            rows = (i * h)[:, None] + heads[None, :]
            vmask = valid[:, None]
            lse_i = masked_load(lse_ref, rows, vmask & (heads[None, :] >= 0))
            amax_i = masked_load(amax_ref, rows, vmask & (heads[None, :] >= 0))
            delta_i = masked_load(delta_ref, rows, vmask & (heads[None, :] >= 0)).astype(acc)
            ev = _edge_block(edge_refs, p, edge, heads, valid, acc)
            qk = jnp.sum(qi * kj[None], axis=2)
            s = _logits(p, qk, ev)
            P0 = jnp.where(vmask, jnp.exp(jnp.where(vmask, s, 0.0) - lse_i), 0.0)
            dpu = jnp.sum(doi * vj[None], axis=2)
            P, ds, eg = _edge_step(p, s, qk, ev, P0, dpu, delta_i, slot[:, None], amax_i)
            dsg = _times(ds, ev[G]) * p.scale
            _store_edge_grads([outs[i_] for i_ in range(4) if need_edge[i_]], p, eg, need_edge, edge, heads, hblock,
                              valid, h)  # fmt: skip
            if need_q:
                masked_store(outs["coef"], edge[:, None] * h + heads[None, :], dsg, vmask)
            if need_k:
                dk = dk + jnp.sum(dsg[:, :, None] * qi, axis=0)
            if need_v:
                dv = dv + jnp.sum(_times(P, ev[U])[:, :, None] * doi, axis=0)
            return dk, dv

        count = jax.lax.div(end - start + (be - 1), jnp.int32(be))
        dk, dv = jax.lax.fori_loop(0, count, step, (jnp.zeros((bh, p.dp), acc), jnp.zeros((bh, p.dvp), acc)))
        if need_k:
            _store_rows(outs["dk"], j, heads, h, p.d, p.dp, dk)
        if need_v:
            _store_rows(outs["dv"], j, heads, h, p.dv, p.dvp, dv)

    results = pallas_call(kernel, shapes, (n_src, h // bh), config.num_warps, name="jequi_attention_bwd_sources",
                          aliases=aliases)(*args, order, offsets, *zeros)  # fmt: skip
    results = dict(zip(names, results))
    dk = results["dk"].reshape(n_src, h, p.d) if need_k else None
    dv = results["dv"].reshape(n_src, h, p.dv) if need_v else None
    grads = _edge_grads(p, [results[i] for i in range(4) if need_edge[i]], need_edge, n, h, bh)
    return dk, dv, results.get("coef"), grads


@functools.partial(jax.jit, static_argnames=("p", "config"))
def backward_queries(k, nbr, coef, *, p: Problem, config: AttentionConfig = DEFAULT):
    """``dq [N, H, d] = sum_t coef_it k_j`` over each target's valid slots, ``coef`` the
    edges' ``ds g scale`` from :func:`backward_sources`: a pass over targets that gathers only
    keys, so its step takes as many slots as fit ``tile_elements`` key values (``d`` wide)."""
    n = nbr.shape[0]
    n_src, h, _ = k.shape
    acc = coef.dtype
    bh, _, _ = blocks(p, config)
    fit = max(1, config.tile_elements // (bh * p.dp))
    bk = config.block_neighbors or min(1 << (fit.bit_length() - 1), _pow2(p.slots))
    steps = -(-p.slots // bk)

    def kernel(k_ref, nbr_ref, coef_ref, dq_ref):
        i, hblock = pl.program_id(0), pl.program_id(1)
        heads = hblock * bh + jnp.arange(bh, dtype=jnp.int32)

        def step(t, dq):
            _, _, edge, j, valid = _slot_block(p, nbr_ref, i, t, bk, n_src)
            kj = _row_block(k_ref, j, heads, h, p.d, p.dp, valid, acc)  # [BK, BH, dp]
            c = masked_load(coef_ref, edge[:, None] * h + heads[None, :], valid[:, None] & (heads[None, :] >= 0))
            return dq + jnp.sum(c[:, :, None] * kj, axis=0)

        dq = jax.lax.fori_loop(0, steps, step, jnp.zeros((bh, p.dp), acc))
        _store_rows(dq_ref, i, heads, h, p.d, p.dp, dq)

    (dq,) = pallas_call(kernel, [jax.ShapeDtypeStruct((n * h * p.d,), acc)], (n, h // bh), config.num_warps,
                        name="jequi_attention_bwd_queries")(k.reshape(-1), nbr.reshape(-1), coef)  # fmt: skip
    return dq.reshape(n, h, p.d)


# --- forward mode ---------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("p", "config"))
def tangent(q, k, v, nbr, edges, out, lse, amax, tangents, *, p: Problem, config: AttentionConfig = DEFAULT):
    """The JVP ``d out`` for the tangents ``(dq, dk, dv, *edge tangents)`` (None for a zero
    tangent; edge tangents in :data:`EDGE_NAMES` order, shaped as their inputs), one pass over
    targets with ``P`` from the forward's ``lse``. With ``dP_t = P0_t (e_t ds_t + de_t)`` (the
    logits' tangent ``ds`` without the max's) ``d out = sum_t (dP_t u_t + P_t du_t) v_j + P_t u_t
    dv_j - out (sum_t dP_t + (eps / Z) ds_amax)``: the max's tangent enters only through eps."""
    n, h, _ = q.shape
    n_src = k.shape[0]
    bh, bk, _ = blocks(p, config)
    steps = -(-p.slots // bk)
    acc = _acc_dtype(q.dtype)
    dq, dk, dv, *dedges = tangents
    has_t = [t is not None for t in dedges]
    t_heads = [hb if t is not None else None for hb, t in zip(p.edge_heads, dedges)]
    tp = dataclasses.replace(p, edge_heads=tuple(t_heads))
    node_args = [a.reshape(-1) for a in (dq, dk, dv) if a is not None]

    def kernel(q_ref, k_ref, v_ref, nbr_ref, *refs):
        edge_refs, rest = _edge_refs(p, refs)
        out_ref, lse_ref, amax_ref = rest[:3]
        rest = list(rest[3:])
        dq_ref = rest.pop(0) if dq is not None else None
        dk_ref = rest.pop(0) if dk is not None else None
        dv_ref = rest.pop(0) if dv is not None else None
        tedge_refs, rest = _edge_refs(tp, rest)
        (dout_ref,) = rest
        i, hblock = pl.program_id(0), pl.program_id(1)
        heads = hblock * bh + jnp.arange(bh, dtype=jnp.int32)
        qi = _row_block(q_ref, i, heads, h, p.d, p.dp, True, acc)
        dqi = None if dq_ref is None else _row_block(dq_ref, i, heads, h, p.d, p.dp, True, acc)
        lse_i = lse_ref[i * h + heads]
        amax_i = amax_ref[i * h + heads]

        def step(t, carry):
            a, sdp, extra = carry
            slot, in_row, edge, j, valid = _slot_block(p, nbr_ref, i, t, bk, n_src)
            kj, vj, ev, qk, s, P0 = _recomputed_edges(p, k_ref, v_ref, edge_refs, qi, lse_i, j, edge, heads, h, valid, acc)
            tv = _edge_block(tedge_refs, tp, edge, heads, valid, acc)
            P = _times(P0, ev[E])
            dqk = None
            if dqi is not None:
                dqk = jnp.sum(dqi[None] * kj, axis=2)
            if dk_ref is not None:
                dkj = _row_block(dk_ref, j, heads, h, p.d, p.dp, valid, acc)
                term = jnp.sum(qi[None] * dkj, axis=2)
                dqk = term if dqk is None else dqk + term
            ds = None
            if dqk is not None:
                ds = _times(dqk, ev[G]) * p.scale
            if tv[G] is not None:
                term = tv[G] * (p.scale * qk)
                ds = term if ds is None else ds + term
            if tv[B] is not None:
                ds = tv[B] if ds is None else ds + tv[B]
            dP = None
            if ds is not None:
                dP = P * ds
                if p.eps:
                    extra = extra + jnp.sum(jnp.where(slot[:, None] == amax_i[None, :], -p.eps * P0 * ds, 0.0), axis=0)
            if tv[E] is not None:
                dP = P0 * tv[E] if dP is None else dP + P0 * tv[E]
            coef = None
            if dP is not None:
                sdp = sdp + jnp.sum(dP, axis=0)
                coef = _times(dP, ev[U])
            if tv[U] is not None:
                coef = P * tv[U] if coef is None else coef + P * tv[U]
            if coef is not None:
                a = a + jnp.sum(coef[:, :, None] * vj, axis=0)
            if dv_ref is not None:
                dvj = _row_block(dv_ref, j, heads, h, p.dv, p.dvp, valid, acc)
                a = a + jnp.sum(_times(P, ev[U])[:, :, None] * dvj, axis=0)
            return a, sdp, extra

        init = (jnp.zeros((bh, p.dvp), acc), jnp.zeros((bh,), acc), jnp.zeros((bh,), acc))
        a, sdp, extra = jax.lax.fori_loop(0, steps, step, init)
        outi = _row_block(out_ref, i, heads, h, p.dv, p.dvp, True, acc)
        res = a - outi * (sdp - extra)[:, None]
        _store_rows(dout_ref, i, heads, h, p.dv, p.dvp, res)

    (dout,) = pallas_call(
        kernel, [jax.ShapeDtypeStruct((n * h * p.dv,), q.dtype)], (n, h // bh), config.num_warps,
        name="jequi_attention_jvp",
    )(
        q.reshape(-1), k.reshape(-1), v.reshape(-1), nbr.reshape(-1), *_edge_arrays(p, edges), out.reshape(-1),
        lse.reshape(-1), amax.reshape(-1), *node_args, *(t.reshape(-1) for t, has in zip(dedges, has_t) if has),
    )  # fmt: skip
    return dout.reshape(n, h, p.dv)
