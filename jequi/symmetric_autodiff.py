"""Derivatives of the symmetric-contraction kernels (:mod:`pallas_kernels.symmetric`): three
JAX primitives, built as :mod:`jequi.eaas_autodiff` builds the EAAS product's.

* ``jequi_sc`` (forward): ``out`` from ``(x, wr)`` (rows and reduced weights);
* ``jequi_sc_jvp``: ``dout`` for tangents ``(tx, twr)``, linear in them (the tangent kernel);
* ``jequi_sc_vjp``: those of ``(gx, gwr)`` of ``<g, out>`` that its static ``needs`` asks for,
  linear in ``g`` (the backward kernel, its weight gradient added per species in a fixed order;
  a transpose asks only for the gradients of the tangents it transposes, so an MD step's
  forces never compute the weights' gradient).

* ``jequi_sc_second``: the backward's derivative in ``x`` along ``t``, ``(H t, M t)`` with
  ``H = d2<g, out>/dx2`` and ``M = d2<g, out>/dwr dx``, linear in ``t``, from four backward
  kernel calls (:func:`_second_impl`).

The two first linear primitives are each other's transpose, so ``jax.grad`` runs the backward
kernel, ``jax.jvp`` the tangent kernel, and force training (reverse of reverse) transposes the
backward's ``g``-linear part into the tangent kernel. The backward's derivative in ``(x, wr)``:
in ``wr`` it is the backward kernel with the tangent as weights (the contraction is linear in its
weights); in ``x`` it is ``jequi_sc_second``, whose transpose is itself (``H`` is symmetric)
plus the backward kernel (``M^T b = d gx/d wr [b]``). So force training runs on kernels only.
The derivatives of ``jequi_sc_second`` in ``x`` (third order) are autodiff of the pure-JAX
reference (:func:`jequi.symmetric_basis.reference`): correct at every order, at XLA's speed. The rows'
schedule (``rows``, ``block_species``: :func:`jequi.species.species_blocks`) is an
integer operand; ``vmap`` folds the batch into the rows and the species groups.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from . import species, symmetric_basis
from .symmetric_basis import SymmetricContractionDescriptor
from .tangents import instantiate, nonzero


def _kernels():
    """:mod:`pallas_kernels.symmetric`, imported on first use: jequi's API loads kernel packages when a
    product runs, so that ``jequi``, ``pallas_kernels`` and ``ffi`` import in any order."""
    from pallas_kernels import symmetric

    return symmetric


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
second_p = core.Primitive("jequi_sc_second")
second_p.multiple_results = True


def _forward_impl(x, wr, rows, bs, *, spec: Spec):
    return _kernels().forward(spec.desc, x, wr, rows, bs, block=spec.block)


def _jvp_impl(x, wr, tx, twr, rows, bs, *, spec: Spec):
    return _kernels().tangent(spec.desc, x, wr, tx, twr, rows, bs, block=spec.block)


def _vjp_impl(x, wr, g, rows, bs, *, spec: Spec, needs):
    outs = _kernels().backward(spec.desc, x, wr, g, rows, bs, block=spec.block, needs=needs)
    if needs[1]:
        outs[-1] = species.species_sum(outs[-1], bs, wr.shape[0])
    return outs


# The four-point central stencil f'(0) = (8 (f(1) - f(-1)) - (f(2) - f(-2))) / 12, exact for
# polynomials of degree <= 4 in the step: gx has degree correlation - 1 in x and the weight
# gradient degree correlation, so for correlation <= 4 the derivative is exact up to rounding.
STENCIL = ((1.0, 8.0), (-1.0, -8.0), (2.0, -1.0), (-2.0, 1.0))


def _second_impl(x, wr, g, t, rows, bs, *, spec: Spec, needs):
    """``(H t, M t)`` (those `needs` asks for): the derivative of the backward kernel's
    ``(gx, gwr)`` along ``x + s t``, by :data:`STENCIL` on four backward calls. Each row steps by
    its own ``eps_n`` (so that ``|eps_n t_n| = |x_n|``, or 1 where ``x_n`` is zero), with its ``g``
    divided by ``eps_n``: gx of a row depends on that row alone and both gradients are linear in
    ``g``, so the steps cancel exactly. Measured against the reference's autodiff:
    tests/test_symmetric.py (float64 to 1e-11, float32 to 2e-5)."""
    size = lambda a: jnp.sqrt(jnp.mean(a * a, axis=1, keepdims=True))  # noqa: E731
    rx, rt = size(x), size(t)
    eps = jnp.where(rt > 0, jnp.where(rx > 0, rx, 1.0) / jnp.where(rt > 0, rt, 1.0), 1.0)
    gs = g / eps
    total = None
    for step, weight in STENCIL:
        outs = _kernels().backward(spec.desc, x + (step * eps) * t, wr, gs, rows, bs, block=spec.block, needs=needs)
        total = [weight * o for o in outs] if total is None else [a + weight * o for a, o in zip(total, outs)]
    total = [a / 12.0 for a in total]
    if needs[1]:
        total[-1] = species.species_sum(total[-1], bs, wr.shape[0])
    return total


def _summed(outs, terms):
    """The tangents of a multiple-result rule: its `terms` (lists like `outs`) added, or zeros."""
    if not terms:
        return [_zero_out(o) for o in outs]
    return [sum(parts[1:], parts[0]) for parts in zip(*terms)]


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
    (second_p, _second_impl,
     lambda x, wr, g, t, rows, bs, *, spec, needs: _needed([x.update(weak_type=False), wr.update(weak_type=False)], needs)),
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
    """Linear in ``g`` and in ``wr`` (the backward kernel with the tangent as ``g`` or as the
    weights); in ``x`` the second-derivative primitive."""
    x, wr, g, rows, bs = primals
    outs = vjp_p.bind(x, wr, g, rows, bs, spec=spec, needs=needs)
    terms = []
    if nonzero(tangents[2]):
        terms.append(vjp_p.bind(x, wr, tangents[2], rows, bs, spec=spec, needs=needs))
    if nonzero(tangents[1]) and needs[0]:  # gx is linear in wr; gwr does not depend on it
        (dgx,) = vjp_p.bind(x, tangents[1], g, rows, bs, spec=spec, needs=(True, False))
        terms.append(_needed([dgx, jnp.zeros_like(wr)], needs))
    if nonzero(tangents[0]):
        terms.append(second_p.bind(x, wr, g, tangents[0], rows, bs, spec=spec, needs=needs))
    return outs, _summed(outs, terms)


def _reference_second(spec: Spec, x, wr, g, t, rows, bs, needs):
    """``(H t, M t)`` by autodiff of the reference (for the second primitive's own derivatives)."""
    inner = lambda a: _needed(jax.vjp(lambda a_, b_: _reference(spec, a_, b_, rows, bs), a, wr)[1](g), needs)  # noqa: E731
    return jax.jvp(inner, (x,), (t,))[1]


def _second_jvp(primals, tangents, *, spec: Spec, needs):
    """Linear in ``t`` and ``g`` (the primitive again), linear in ``wr`` for ``H t`` (``M t``
    does not depend on ``wr``); in ``x`` the reference's third derivative."""
    x, wr, g, t, rows, bs = primals
    outs = second_p.bind(x, wr, g, t, rows, bs, spec=spec, needs=needs)
    terms = []
    for i in (3, 2):
        if nonzero(tangents[i]):
            args = [x, wr, g, t]
            args[i] = tangents[i]
            terms.append(second_p.bind(*args, rows, bs, spec=spec, needs=needs))
    if nonzero(tangents[1]) and needs[0]:
        (dh,) = second_p.bind(x, tangents[1], g, t, rows, bs, spec=spec, needs=(True, False))
        terms.append(_needed([dh, jnp.zeros_like(wr)], needs))
    if nonzero(tangents[0]):
        terms.append(jax.jvp(lambda a: _reference_second(spec, a, wr, g, t, rows, bs, needs), (x,), (tangents[0],))[1])
    return outs, _summed(outs, terms)


def _second_transpose(cts, x, wr, g, t, rows, bs, *, spec: Spec, needs):
    """For ``t``: ``H a + M^T b`` with cotangents ``(a, b)``; ``H`` is symmetric (the primitive
    again) and ``M^T b`` is the backward kernel's ``gx`` with ``b`` as the weights. For ``g`` or
    ``wr`` (third-order terms) the reference's autodiff."""
    a, b = _spread(cts, needs)
    a, b = (None if c is None or not nonzero(c) else c for c in (a, b))
    out = [None] * 6
    if a is None and b is None:
        return out
    if ad.is_undefined_primal(t):
        parts = []
        if a is not None:
            parts += second_p.bind(x, wr, g, a, rows, bs, spec=spec, needs=(True, False))
        if b is not None:
            parts += vjp_p.bind(x, b, g, rows, bs, spec=spec, needs=(True, False))
        out[3] = sum(parts[1:], parts[0])
    for i in (1, 2):  # wr or g: at most one is linear here, the others are values
        if ad.is_undefined_primal((x, wr, g, t)[i]):
            aval = (x, wr, g, t)[i].aval
            full = _needed([jnp.zeros(x.shape, aval.dtype) if a is None else a,
                            jnp.zeros(wr.aval.shape if i == 1 else wr.shape, aval.dtype) if b is None else b], needs)  # fmt: skip

            def f(v, i=i):
                vals = [x, wr, g, t]
                vals[i] = v
                return _reference_second(spec, *vals, rows, bs, needs)

            out[i] = jax.vjp(f, jnp.zeros(aval.shape, aval.dtype))[1](full)[0]
    return out


def _jvp_transpose(ct, x, wr, tx, twr, rows, bs, *, spec: Spec):
    """``J^T ct`` for the tangent operands: the backward kernel, for those operands only."""
    needs = (ad.is_undefined_primal(tx), ad.is_undefined_primal(twr))
    if not nonzero(ct) or not any(needs):
        return [None] * 6
    gx, gwr = _spread(vjp_p.bind(x, wr, ct, rows, bs, spec=spec, needs=needs), needs)
    return [None, None, gx, gwr, None, None]


def _vjp_transpose(cts, x, wr, g, rows, bs, *, spec: Spec, needs):
    """For ``g``: the tangent kernel with the gradients' cotangents. For ``wr`` (``gx`` is linear
    in it): ``M a`` for the cotangent ``a`` of ``gx``, the second primitive's weight part (``M``,
    the mixed derivative, does not depend on ``wr``)."""
    cx, cw = _spread(cts, needs)
    cx, cw = (None if c is None or not nonzero(c) else c for c in (cx, cw))
    out = [None] * 5
    if cx is None and cw is None:
        return out
    if ad.is_undefined_primal(g):
        out[2] = jvp_p.bind(x, wr, jnp.zeros_like(x) if cx is None else cx, jnp.zeros_like(wr) if cw is None else cw, rows, bs, spec=spec)
    if ad.is_undefined_primal(wr) and cx is not None:
        zeros = jnp.zeros(wr.aval.shape, wr.aval.dtype)
        (out[1],) = second_p.bind(x, zeros, g, cx, rows, bs, spec=spec, needs=(False, True))
    return out


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


for _p, _rule in ((forward_p, _forward_jvp), (jvp_p, _jvp_jvp), (vjp_p, _vjp_jvp), (second_p, _second_jvp)):
    ad.primitive_jvps[_p] = _rule
    batching.primitive_batchers[_p] = _batch(_p)
ad.primitive_transposes[jvp_p] = _jvp_transpose
ad.primitive_transposes[vjp_p] = _vjp_transpose
ad.primitive_transposes[second_p] = _second_transpose


def contract(spec: Spec, x, wr, rows, block_species):
    """The contraction of rows ``x (N, irreps_in.dim)`` with reduced weights ``wr (groups,
    num_reduced, mul)`` over a schedule, by the kernels: differentiable to any order in both
    modes, batchable."""
    return forward_p.bind(x, wr, rows, block_species, spec=spec)
