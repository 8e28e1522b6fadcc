"""Derivatives of the EAAS kernels (:mod:`pallas_kernels.eaas`): three JAX primitives, as
:mod:`jequi.attention.autodiff` builds the attention's.

* ``jequi_eaas`` (forward): ``z`` from ``(x, r)``, rows ``(N, in.dim)`` and ``(N, 3)``;
* ``jequi_eaas_jvp``: ``dz`` for tangents ``(tx, tr)``, linear in them (the tangent kernel);
* ``jequi_eaas_vjp``: ``(gx, gr)`` of ``<g, z>``, linear in ``g`` (the backward kernel).

The two linear primitives are each other's transpose, so ``jax.grad`` runs the backward kernel,
``jax.jvp`` the tangent kernel, and reverse of reverse (force training) transposes the
backward's ``g``-linear part into the tangent kernel. The part of a second derivative that
differentiates the kernels in ``(x, r)`` themselves is autodiff of the XLA product
(:func:`jequi.eaas_reference.product`): correct at every order, at XLA's speed. ``vmap`` folds the batch
into the rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad, batching, mlir

from . import eaas_reference
from .tangents import instantiate, nonzero


def _kernels():
    """:mod:`pallas_kernels.eaas`, imported on first use: jequi's API loads kernel packages when a
    product runs, so that ``jequi``, ``pallas_kernels`` and ``ffi`` import in any order."""
    from pallas_kernels import eaas

    return eaas


@dataclasses.dataclass(frozen=True)
class Spec:
    """The static part of a call: the product's plan (:func:`jequi.eaas._plan`), whether the
    harmonics are normalized, and the kernels' launch shape (``num_warps`` None: the rule of
    :func:`pallas_kernels.heuristics.eaas_warps`)."""

    plan: object
    normalize: bool
    rows_per_program: int = 4
    num_warps: int | None = None

    @property
    def launch(self) -> dict:
        return dict(normalize=self.normalize, rows_per_program=self.rows_per_program, num_warps=self.num_warps)


def _reference(spec: Spec, x, r):
    ds, norm = eaas_reference.frame(r, spec.plan.lmax, spec.normalize)
    return eaas_reference.product(spec.plan, x, ds, norm, (x.shape[0],), x.dtype)


forward_p = core.Primitive("jequi_eaas")
jvp_p = core.Primitive("jequi_eaas_jvp")
vjp_p = core.Primitive("jequi_eaas_vjp")
vjp_p.multiple_results = True


def _by_rows(kernel, spec: Spec, *arrays):
    """``kernel(*arrays)`` over blocks of rows, each with fewer than 2**31 elements per array:
    the kernels index their flat refs in int32."""
    widest = max(spec.plan.irreps_in.dim, spec.plan.irreps_out.dim, 3)
    step = (2**31 - 1) // widest
    n = arrays[0].shape[0]
    if n <= step:
        return kernel(*arrays)
    parts = [kernel(*(a[i : i + step] for a in arrays)) for i in range(0, n, step)]
    if isinstance(parts[0], tuple):
        return tuple(jnp.concatenate(p) for p in zip(*parts))
    return jnp.concatenate(parts)


def _forward_impl(x, r, *, spec: Spec):
    return _by_rows(lambda *a: _kernels().forward(spec.plan, *a, **spec.launch), spec, x, r)


def _jvp_impl(x, r, tx, tr, *, spec: Spec):
    return _by_rows(lambda *a: _kernels().tangent(spec.plan, *a, **spec.launch), spec, x, r, tx, tr)


def _vjp_impl(x, r, g, *, spec: Spec):
    return list(_by_rows(lambda *a: _kernels().backward(spec.plan, *a, **spec.launch), spec, x, r, g))


def _out_aval(x, spec: Spec):
    return x.update(shape=(x.shape[0], spec.plan.irreps_out.dim), weak_type=False)


for _p, _impl, _abstract in (
    (forward_p, _forward_impl, lambda x, r, *, spec: _out_aval(x, spec)),
    (jvp_p, _jvp_impl, lambda x, r, tx, tr, *, spec: _out_aval(x, spec)),
    (vjp_p, _vjp_impl, lambda x, r, g, *, spec: [x.update(weak_type=False), r.update(weak_type=False)]),
):
    _p.def_impl(_impl)
    _p.def_abstract_eval(_abstract)
    mlir.register_lowering(_p, mlir.lower_fun(_impl, multiple_results=_p.multiple_results))




def _forward_jvp(primals, tangents, *, spec: Spec):
    x, r = primals
    z = forward_p.bind(x, r, spec=spec)
    if not any(nonzero(t) for t in tangents):
        return z, ad.Zero(z.aval.to_tangent_aval())
    return z, jvp_p.bind(x, r, instantiate(tangents[0], x), instantiate(tangents[1], r), spec=spec)


def _jvp_jvp(primals, tangents, *, spec: Spec):
    """Linear in ``(tx, tr)`` (the kernel again with their tangents); in ``(x, r)`` the XLA
    product's second derivative."""
    x, r, tx, tr = primals
    out = jvp_p.bind(x, r, tx, tr, spec=spec)
    terms = []
    if nonzero(tangents[2]) or nonzero(tangents[3]):
        terms.append(jvp_p.bind(x, r, instantiate(tangents[2], tx), instantiate(tangents[3], tr), spec=spec))
    if nonzero(tangents[0]) or nonzero(tangents[1]):
        inner = lambda x_, r_: jax.jvp(lambda a, b: _reference(spec, a, b), (x_, r_), (tx, tr))[1]  # noqa: E731
        terms.append(jax.jvp(inner, (x, r), (instantiate(tangents[0], x), instantiate(tangents[1], r)))[1])
    if not terms:
        return out, ad.Zero(out.aval.to_tangent_aval())
    return out, sum(terms[1:], terms[0])


def _vjp_jvp(primals, tangents, *, spec: Spec):
    """Linear in ``g`` (the backward kernel with its tangent); in ``(x, r)`` the XLA product's
    second derivative."""
    x, r, g = primals
    outs = vjp_p.bind(x, r, g, spec=spec)
    terms = []
    if nonzero(tangents[2]):
        terms.append(vjp_p.bind(x, r, tangents[2], spec=spec))
    if nonzero(tangents[0]) or nonzero(tangents[1]):
        inner = lambda x_, r_: jax.vjp(lambda a, b: _reference(spec, a, b), x_, r_)[1](g)  # noqa: E731
        terms.append(jax.jvp(inner, (x, r), (instantiate(tangents[0], x), instantiate(tangents[1], r)))[1])
    if not terms:
        return outs, [ad.Zero(o.aval.to_tangent_aval()) for o in outs]
    return outs, [sum(parts[1:], parts[0]) for parts in zip(*terms)]


def _jvp_transpose(ct, x, r, tx, tr, *, spec: Spec):
    """``J^T ct`` for the tangent operands: the backward kernel."""
    if not nonzero(ct):
        return [None, None, None, None]
    gx, gr = vjp_p.bind(x, r, ct, spec=spec)
    return [None, None, gx if ad.is_undefined_primal(tx) else None, gr if ad.is_undefined_primal(tr) else None]


def _vjp_transpose(cts, x, r, g, *, spec: Spec):
    """``J ct`` for ``g``: the tangent kernel with the gradients' cotangents."""
    if not ad.is_undefined_primal(g) or not any(nonzero(c) for c in cts):
        return [None, None, None]
    return [None, None, jvp_p.bind(x, r, instantiate(cts[0], x), instantiate(cts[1], r), spec=spec)]


def _fold(operands, dims):
    size = next(a.shape[d] for a, d in zip(operands, dims) if d is not None)
    moved = [jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(operands, dims)]
    return [a.reshape(size * a.shape[1], *a.shape[2:]) for a in moved], size


def _unfold(a, size):
    return a.reshape(size, a.shape[0] // size, *a.shape[1:])


def _batch(p):
    def rule(operands, dims, *, spec: Spec):
        folded, size = _fold(operands, dims)
        out = p.bind(*folded, spec=spec)
        if p.multiple_results:
            return [_unfold(o, size) for o in out], [0] * len(out)
        return _unfold(out, size), 0

    return rule


for _p, _rule in ((forward_p, _forward_jvp), (jvp_p, _jvp_jvp), (vjp_p, _vjp_jvp)):
    ad.primitive_jvps[_p] = _rule
    batching.primitive_batchers[_p] = _batch(_p)
ad.primitive_transposes[jvp_p] = _jvp_transpose
ad.primitive_transposes[vjp_p] = _vjp_transpose


def fused_product(spec: Spec, x, r):
    """The EAAS product of rows ``x (N, in.dim)`` (regrouped) and ``r (N, 3)`` by the kernels,
    differentiable to any order in both modes, batchable. ``x`` and ``r`` share one dtype (the
    backward kernel writes both gradients in it)."""
    if x.dtype != r.dtype:
        raise ValueError(f"x and r must share a dtype, got {x.dtype} and {r.dtype}")
    return forward_p.bind(x, r, spec=spec)
