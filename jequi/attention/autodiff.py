"""Derivatives of the fused neighbour attention: three JAX primitives over the Pallas kernels.

* ``jequi_attention`` (forward): ``(out, lse, amax)`` from ``X = (q, k, v, *edge scalars)``;
  ``lse`` and ``amax`` are the saved statistics (:func:`pallas_kernels.attention.forward`).
* ``jequi_attention_jvp``: ``d out`` for tangents of ``X``, linear in them (the fused tangent
  kernel). It is the forward primitive's JVP.
* ``jequi_attention_vjp``: the gradients of ``<dO, out>`` for the flagged entries of ``X``,
  linear in ``dO`` (the fused FlashAttention-2 backward).

The two linear primitives are each other's transpose (``J t`` and ``J^T dO``), so ``jax.grad``
of the forward runs the fused backward, ``jax.jvp`` the fused tangent kernel, and reverse of
reverse (force training) transposes the backward's ``dO``-linear part into the fused tangent
kernel. The part of a second derivative that differentiates the kernels in their nonlinear
inputs ``X`` (the JVP of ``J`` and ``J^T`` with respect to ``X``) is autodiff of the
materialised reference (:mod:`.reference`): correct at every order, but with the reference's
``N x K x H x D_v`` gathers. The statistics ``lse``, ``amax`` (and ``out`` where the linear
primitives take it) are functions of ``X`` that the rules never differentiate: every rule
recomputes what it needs from ``X``, so their tangents are declared zero.

``vmap`` folds the batch into the node axis (neighbour indices offset per batch entry), so a
batch runs as one kernel launch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from . import reference
from ..tangents import nonzero


if TYPE_CHECKING:
    from pallas_kernels.attention import AttentionConfig, Problem


def _kernels():
    """:mod:`pallas_kernels.attention`, imported on first use: jequi's API loads kernel packages when a
    product runs, so that ``jequi``, ``pallas_kernels`` and ``ffi`` import in any order."""
    from pallas_kernels import attention

    return attention


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of a call: which per-edge scalars are present (in
    :data:`pallas_kernels.attention.EDGE_NAMES` order), scale, eps, scatter mode and the kernels'
    config."""

    edges: tuple
    scale: float
    eps: float
    atomic: bool
    config: AttentionConfig

    @property
    def n_x(self) -> int:
        return 3 + sum(self.edges)

    def problem(self, q, v, nbr, edges) -> Problem:
        heads = [None if a is None else a.shape[-1] for a in edges]
        return _kernels().Problem(q.shape[1], q.shape[2], v.shape[2], nbr.shape[1], tuple(heads), self.scale, self.eps)

    def full_edges(self, present):
        """The four edge slots, None where absent, from the present ones."""
        present = list(present)
        return tuple(present.pop(0) if has else None for has in self.edges)

    def roles(self) -> tuple:
        """``t`` per target, ``s`` per source, ``e`` per edge, for ``X``."""
        return ("t", "s", "s") + ("e",) * sum(self.edges)


def _reference(spec: Spec, xs, nbr):
    q, k, v, *edges = xs
    return reference.neighbor_attention(q, k, v, nbr, *spec.full_edges(edges), scale=spec.scale, eps=spec.eps)


forward_p = core.Primitive("jequi_attention")
forward_p.multiple_results = True
jvp_p = core.Primitive("jequi_attention_jvp")
vjp_p = core.Primitive("jequi_attention_vjp")
vjp_p.multiple_results = True


# --- evaluation -----------------------------------------------------------------------------------


def _forward_impl(*operands, spec: Spec):
    *xs, nbr = operands
    q, k, v, *edges = xs
    edges = spec.full_edges(edges)
    return _kernels().forward(q, k, v, nbr, edges, p=spec.problem(q, v, nbr, edges), config=spec.config)


def _jvp_impl(*operands, spec: Spec, has: tuple):
    n = spec.n_x
    xs, (out, lse, amax), ts, nbr = operands[:n], operands[n : n + 3], list(operands[n + 3 : -1]), operands[-1]
    q, k, v, *edges = xs
    edges = spec.full_edges(edges)
    tangents = [ts.pop(0) if h else None for h in has]
    dq, dk, dv, *tedges = tangents
    return _kernels().tangent(
        q, k, v, nbr, edges, out, lse, amax, (dq, dk, dv, *spec.full_edges(tedges)),
        p=spec.problem(q, v, nbr, edges), config=spec.config,
    )  # fmt: skip


def _vjp_impl(*operands, spec: Spec, needs: tuple):
    n = spec.n_x
    xs, (out, lse, amax), dout, nbr = operands[:n], operands[n : n + 3], operands[n + 3], operands[-1]
    q, k, v, *edges = xs
    edges = spec.full_edges(edges)
    acc = jnp.promote_types(dout.dtype, jnp.float32)
    delta = jnp.sum(dout.astype(acc) * out.astype(acc), axis=-1)
    grads = _kernels().backward(
        q, k, v, nbr, edges, lse, amax, dout, delta, p=spec.problem(q, v, nbr, edges), needs=needs,
        atomic=spec.atomic, config=spec.config,
    )  # fmt: skip
    return [g for g in grads if g is not None]


def _forward_abstract(*avals, spec: Spec):
    q, v = avals[0], avals[2]
    n, h = q.shape[:2]
    acc = jnp.promote_types(q.dtype, jnp.float32)
    return [
        q.update(shape=(n, h, v.shape[2]), dtype=q.dtype, weak_type=False),
        q.update(shape=(n, h), dtype=acc, weak_type=False),
        q.update(shape=(n, h), dtype=jnp.int32, weak_type=False),
    ]


def _jvp_abstract(*avals, spec: Spec, has: tuple):
    q, v = avals[0], avals[2]
    return q.update(shape=(q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype, weak_type=False)


def _vjp_abstract(*avals, spec: Spec, needs: tuple):
    return [a.update(weak_type=False) for a, need in zip(avals[: spec.n_x], needs) if need]


# --- rules ----------------------------------------------------------------------------------------



def _zeros_like(aval):
    return ad.Zero(aval.to_tangent_aval())


def _full(values, like):
    """`values` with symbolic zeros instantiated like the arrays of `like`."""
    return tuple(jnp.zeros_like(a) if not nonzero(t) else t for t, a in zip(values, like))


def _forward_jvp(primals, tangents, *, spec: Spec):
    outs = forward_p.bind(*primals, spec=spec)
    n = spec.n_x
    has = tuple(nonzero(t) for t in tangents[:n])
    if not any(has):
        return outs, [_zeros_like(o.aval) for o in outs]
    ts = [t for t in tangents[:n] if nonzero(t)]
    dout = jvp_p.bind(*primals[:n], *outs, *ts, primals[-1], spec=spec, has=has)
    return outs, [dout, _zeros_like(outs[1].aval), _zeros_like(outs[2].aval)]


def _reference_tangent(spec: Spec, xs, nbr, ts):
    return jax.jvp(lambda *a: _reference(spec, a, nbr), tuple(xs), tuple(ts))[1]


def _jvp_jvp(primals, tangents, *, spec: Spec, has: tuple):
    """Linear in the tangent operands (the kernel again with their tangents); in ``X`` the
    reference's second derivative."""
    n = spec.n_x
    out = jvp_p.bind(*primals, spec=spec, has=has)
    xs, stats, ts, nbr = primals[:n], primals[n : n + 3], primals[n + 3 : -1], primals[-1]
    t_xs, t_ts = tangents[:n], tangents[n + 3 : -1]
    terms = []
    positions = [i for i, h in enumerate(has) if h]
    inner = [(i, t) for i, t in zip(positions, t_ts) if nonzero(t)]
    if inner:
        new_has = tuple(i in dict(inner) for i in range(n))
        terms.append(jvp_p.bind(*xs, *stats, *(t for _, t in inner), nbr, spec=spec, has=new_has))
    if any(nonzero(t) for t in t_xs):
        full_ts = list(jnp.zeros_like(x) for x in xs)
        for i, t in zip(positions, ts):
            full_ts[i] = t
        terms.append(jax.jvp(lambda *a: _reference_tangent(spec, a, nbr, full_ts), tuple(xs), _full(t_xs, xs))[1])
    if not terms:
        return out, _zeros_like(out.aval)
    return out, sum(terms[1:], terms[0])


def _reference_gradient(spec: Spec, xs, nbr, dout, needs):
    _, pullback = jax.vjp(lambda *a: _reference(spec, a, nbr), *xs)
    return [g for g, need in zip(pullback(dout), needs) if need]


def _vjp_jvp(primals, tangents, *, spec: Spec, needs: tuple):
    """Linear in ``dO`` (the fused backward with its tangent); in ``X`` the reference's second
    derivative."""
    n = spec.n_x
    outs = vjp_p.bind(*primals, spec=spec, needs=needs)
    xs, stats, dout, nbr = primals[:n], primals[n : n + 3], primals[n + 3], primals[-1]
    t_xs, t_dout = tangents[:n], tangents[n + 3]
    terms = []
    if nonzero(t_dout):
        terms.append(vjp_p.bind(*xs, *stats, t_dout, nbr, spec=spec, needs=needs))
    if any(nonzero(t) for t in t_xs):
        terms.append(jax.jvp(lambda *a: tuple(_reference_gradient(spec, a, nbr, dout, needs)), tuple(xs), _full(t_xs, xs))[1])
    if not terms:
        return outs, [_zeros_like(o.aval) for o in outs]
    return outs, [sum(parts[1:], parts[0]) for parts in zip(*terms)]


def _jvp_transpose(ct, *operands, spec: Spec, has: tuple):
    """``J^T ct`` for the tangent operands: the fused backward."""
    n = spec.n_x
    result = [None] * len(operands)
    if not nonzero(ct):
        return result
    positions = [i for i, h in enumerate(has) if h]
    linear = [ad.is_undefined_primal(operands[n + 3 + k]) for k in range(len(positions))]
    needs = tuple(i in [p for p, lin in zip(positions, linear) if lin] for i in range(n))
    if not any(needs):
        return result
    grads = iter(vjp_p.bind(*operands[: n + 3], ct, operands[-1], spec=spec, needs=needs))
    for k, (pos, lin) in enumerate(zip(positions, linear)):
        if lin:
            result[n + 3 + k] = next(grads)
    return result


def _vjp_transpose(cts, *operands, spec: Spec, needs: tuple):
    """``J ct`` for ``dO``: the fused tangent kernel with the gradients' cotangents."""
    n = spec.n_x
    result = [None] * len(operands)
    positions = [i for i, need in enumerate(needs) if need]
    pairs = [(i, ct) for i, ct in zip(positions, cts) if nonzero(ct)]
    if not pairs or not ad.is_undefined_primal(operands[n + 3]):
        return result
    has = tuple(i in dict(pairs) for i in range(n))
    result[n + 3] = jvp_p.bind(*operands[: n + 3], *(ct for _, ct in pairs), operands[-1], spec=spec, has=has)
    return result


# --- vmap: the batch folded into the node axis ----------------------------------------------------


def _fold(operands, dims, roles):
    """Operands with the batch folded into their node axis: per-target and per-edge arrays
    ``[B, N, ...] -> [B * N, ...]``, per-source ``[B, N_src, ...] -> [B * N_src, ...]`` and the
    neighbour indices offset by ``b * N_src`` (padding kept out of range). Unbatched operands
    are broadcast. Returns the folded operands and the batch size."""
    size = next(a.shape[d] for a, d in zip(operands, dims) if d is not None)
    moved = [
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in zip(operands, dims)
    ]  # fmt: skip
    n_src = moved[roles.index("s")].shape[1]
    folded = []
    for a, role in zip(moved, roles):
        if role == "n":
            valid = reference.valid_slots(a, n_src)
            offset = (jnp.arange(size, dtype=a.dtype) * n_src)[:, None, None]
            a = jnp.where(valid, a + offset, -1)
        folded.append(a.reshape(size * a.shape[1], *a.shape[2:]))
    return folded, size


def _unfold(outs, size):
    return [o.reshape(size, o.shape[0] // size, *o.shape[1:]) for o in outs]


def _forward_batch(operands, dims, *, spec: Spec):
    folded, size = _fold(operands, dims, spec.roles() + ("n",))
    return _unfold(forward_p.bind(*folded, spec=spec), size), [0, 0, 0]


def _jvp_batch(operands, dims, *, spec: Spec, has: tuple):
    t_roles = tuple(r for r, h in zip(spec.roles(), has) if h)
    folded, size = _fold(operands, dims, spec.roles() + ("t",) * 3 + t_roles + ("n",))
    return _unfold([jvp_p.bind(*folded, spec=spec, has=has)], size)[0], 0


def _vjp_batch(operands, dims, *, spec: Spec, needs: tuple):
    folded, size = _fold(operands, dims, spec.roles() + ("t",) * 4 + ("n",))
    outs = vjp_p.bind(*folded, spec=spec, needs=needs)
    return _unfold(outs, size), [0] * len(outs)


for _p, _impl, _abstract, _jvp_rule, _batch in (
    (forward_p, _forward_impl, _forward_abstract, _forward_jvp, _forward_batch),
    (jvp_p, _jvp_impl, _jvp_abstract, _jvp_jvp, _jvp_batch),
    (vjp_p, _vjp_impl, _vjp_abstract, _vjp_jvp, _vjp_batch),
):
    _p.def_impl(_impl)
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=_p.multiple_results))
    ad.primitive_jvps[_p] = _jvp_rule
    batching.primitive_batchers[_p] = _batch
ad.primitive_transposes[jvp_p] = _jvp_transpose
ad.primitive_transposes[vjp_p] = _vjp_transpose


def fused_attention(spec: Spec, xs, nbr):
    """``out`` of the fused kernels, differentiable in ``xs = (q, k, v, *present edge
    scalars)`` to any order in both modes, batchable."""
    out, _, _ = forward_p.bind(*xs, nbr, spec=spec)
    return out
