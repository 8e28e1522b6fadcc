"""Derivatives of the symmetric-contraction kernels (:mod:`pallas_kernels.symmetric`): three
JAX primitives, built as :mod:`jequi.eaas_autodiff` builds the EAAS product's.

* ``jequi_sc`` (forward): ``out`` from ``(x, wr)`` (rows and reduced weights);
* ``jequi_sc_jvp``: ``dout`` for tangents ``(tx, twr)``, linear in them (the tangent kernel);
* ``jequi_sc_vjp``: those of ``(gx, gwr)`` of ``<g, out>`` that its static ``needs`` asks for,
  linear in ``g`` (the backward kernel, its weight gradient added per species in a fixed order;
  a transpose asks only for the gradients of the tangents it transposes, so an MD step's
  forces never compute the weights' gradient).

The two linear primitives are each other's transpose, so ``jax.grad`` runs the backward kernel,
``jax.jvp`` the tangent kernel, and force training (reverse of reverse) transposes the
backward's ``g``-linear part into the tangent kernel. The part of a second derivative that
differentiates the kernels in ``(x, wr)`` themselves is autodiff of the pure-JAX reference
(:func:`jequi.symmetric_basis.reference`): correct at every order, at XLA's speed. The rows'
schedule (``rows``, ``block_species``: :func:`jequi.species.species_blocks`) is an
integer operand; ``vmap`` folds the batch into the rows and the species groups.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from pallas_kernels import symmetric as kernels

from . import species, symmetric_basis
from .symmetric_basis import SymmetricContractionDescriptor
from .tangents import instantiate, nonzero


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of a call: the descriptor and the rows per block (one species a block)."""

    desc: SymmetricContractionDescriptor
    block: int


def row_species(rows, block_species, n: int, block: int):
    """Each row's species group (an index into the weights' first axis) from a schedule, in
    which every row has a slot."""
    slot_species = jnp.repeat(block_species, block)
    return jnp.zeros((n,), jnp.int32).at[jnp.where(rows < 0, n, rows)].set(slot_species, mode="drop")


def _reference(spec: Spec, x, wr, rows, block_species):
    return symmetric_basis.reference(spec.desc, x, row_species(rows, block_species, x.shape[0], spec.block), wr)


forward_p = core.Primitive("jequi_sc")
jvp_p = core.Primitive("jequi_sc_jvp")
vjp_p = core.Primitive("jequi_sc_vjp")
vjp_p.multiple_results = True


def _forward_impl(x, wr, rows, bs, *, spec: Spec):
    return kernels.forward(spec.desc, x, wr, rows, bs, block=spec.block)


def _jvp_impl(x, wr, tx, twr, rows, bs, *, spec: Spec):
    return kernels.tangent(spec.desc, x, wr, tx, twr, rows, bs, block=spec.block)


def _vjp_impl(x, wr, g, rows, bs, *, spec: Spec, needs):
    outs = kernels.backward(spec.desc, x, wr, g, rows, bs, block=spec.block, needs=needs)
    if needs[1]:
        outs[-1] = species.species_sum(outs[-1], bs, wr.shape[0])
    return outs


def _needed(pair, needs):
    return [v for v, need in zip(pair, needs) if need]


def _spread(outs, needs):
    """``(gx, gwr)`` with None for a gradient `needs` left out."""
    outs = list(outs)
    return [outs.pop(0) if need else None for need in needs]


def _out_aval(x, spec: Spec):
    return x.update(shape=(x.shape[0], spec.desc.irreps_out.dim), weak_type=False)


for _p, _impl, _abstract in (
    (forward_p, _forward_impl, lambda x, wr, rows, bs, *, spec: _out_aval(x, spec)),
    (jvp_p, _jvp_impl, lambda x, wr, tx, twr, rows, bs, *, spec: _out_aval(x, spec)),
    (vjp_p, _vjp_impl, lambda x, wr, g, rows, bs, *, spec, needs: _needed([x.update(weak_type=False), wr.update(weak_type=False)], needs)),
):
    _p.def_impl(_impl)
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=_p.multiple_results))




def _zero_out(out):
    return ad.Zero(out.aval.to_tangent_aval())


def _forward_jvp(primals, tangents, *, spec: Spec):
    x, wr, rows, bs = primals
    out = forward_p.bind(x, wr, rows, bs, spec=spec)
    if not (nonzero(tangents[0]) or nonzero(tangents[1])):
        return out, _zero_out(out)
    return out, jvp_p.bind(x, wr, instantiate(tangents[0], x), instantiate(tangents[1], wr), rows, bs, spec=spec)


def _jvp_jvp(primals, tangents, *, spec: Spec):
    """Linear in ``(tx, twr)`` (the kernel again with their tangents); in ``(x, wr)`` the
    reference's second derivative."""
    x, wr, tx, twr, rows, bs = primals
    out = jvp_p.bind(x, wr, tx, twr, rows, bs, spec=spec)
    terms = []
    if nonzero(tangents[2]) or nonzero(tangents[3]):
        terms.append(jvp_p.bind(x, wr, instantiate(tangents[2], tx), instantiate(tangents[3], twr), rows, bs, spec=spec))
    if nonzero(tangents[0]) or nonzero(tangents[1]):
        inner = lambda a, b: jax.jvp(lambda a_, b_: _reference(spec, a_, b_, rows, bs), (a, b), (tx, twr))[1]  # noqa: E731
        terms.append(jax.jvp(inner, (x, wr), (instantiate(tangents[0], x), instantiate(tangents[1], wr)))[1])
    if not terms:
        return out, _zero_out(out)
    return out, sum(terms[1:], terms[0])


def _vjp_jvp(primals, tangents, *, spec: Spec, needs):
    """Linear in ``g`` (the backward kernel with its tangent); in ``(x, wr)`` the reference's
    second derivative."""
    x, wr, g, rows, bs = primals
    outs = vjp_p.bind(x, wr, g, rows, bs, spec=spec, needs=needs)
    terms = []
    if nonzero(tangents[2]):
        terms.append(vjp_p.bind(x, wr, tangents[2], rows, bs, spec=spec, needs=needs))
    if nonzero(tangents[0]) or nonzero(tangents[1]):
        inner = lambda a, b: _needed(jax.vjp(lambda a_, b_: _reference(spec, a_, b_, rows, bs), a, b)[1](g), needs)  # noqa: E731
        terms.append(jax.jvp(inner, (x, wr), (instantiate(tangents[0], x), instantiate(tangents[1], wr)))[1])
    if not terms:
        return outs, [_zero_out(o) for o in outs]
    return outs, [sum(parts[1:], parts[0]) for parts in zip(*terms)]


def _jvp_transpose(ct, x, wr, tx, twr, rows, bs, *, spec: Spec):
    """``J^T ct`` for the tangent operands: the backward kernel, for those operands only."""
    needs = (ad.is_undefined_primal(tx), ad.is_undefined_primal(twr))
    if not nonzero(ct) or not any(needs):
        return [None] * 6
    gx, gwr = _spread(vjp_p.bind(x, wr, ct, rows, bs, spec=spec, needs=needs), needs)
    return [None, None, gx, gwr, None, None]


def _vjp_transpose(cts, x, wr, g, rows, bs, *, spec: Spec, needs):
    """``J ct`` for ``g``: the tangent kernel with the gradients' cotangents."""
    cx, cw = _spread(cts, needs)
    cx, cw = (None if c is None or not nonzero(c) else c for c in (cx, cw))
    if not ad.is_undefined_primal(g) or (cx is None and cw is None):
        return [None] * 5
    return [None, None, jvp_p.bind(x, wr, jnp.zeros_like(x) if cx is None else cx, jnp.zeros_like(wr) if cw is None else cw, rows, bs, spec=spec), None, None]


def _batch(p):
    """Fold a ``vmap`` axis into the rows: batch element ``b``'s rows are offset by ``b N`` and
    its species groups by ``b S`` (the weights broadcast to every batch element)."""

    def rule(operands, dims, *, spec: Spec, **params):
        size = next(a.shape[d] for a, d in zip(operands, dims) if d is not None)
        moved = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(operands, dims)]
        *floats, rows, bs = moved
        n, groups = floats[0].shape[1], floats[1].shape[1]
        offsets = jnp.arange(size, dtype=jnp.int32)[:, None]
        rows = jnp.where(rows < 0, -1, rows + offsets * n).reshape(-1)
        bs = (bs + offsets * groups).reshape(-1)
        flat = [a.reshape(size * a.shape[1], *a.shape[2:]) for a in floats]
        out = p.bind(*flat, rows, bs, spec=spec, **params)
        unfold = lambda a: a.reshape(size, a.shape[0] // size, *a.shape[1:])  # noqa: E731
        if p.multiple_results:
            return [unfold(o) for o in out], [0] * len(out)
        return unfold(out), 0

    return rule


for _p, _rule in ((forward_p, _forward_jvp), (jvp_p, _jvp_jvp), (vjp_p, _vjp_jvp)):
    ad.primitive_jvps[_p] = _rule
    batching.primitive_batchers[_p] = _batch(_p)
ad.primitive_transposes[jvp_p] = _jvp_transpose
ad.primitive_transposes[vjp_p] = _vjp_transpose


def contract(spec: Spec, x, wr, rows, block_species):
    """The contraction of rows ``x (N, irreps_in.dim)`` with reduced weights ``wr (groups,
    num_reduced, mul)`` over a schedule, by the kernels: differentiable to any order in both
    modes, batchable."""
    return forward_p.bind(x, wr, rows, block_species, spec=spec)
