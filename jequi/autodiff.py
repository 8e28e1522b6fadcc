"""Derivatives of trilinear ops from two kernels: forward and backward.

A CG tensor product ``z = f(x, y, w)`` (and the fused convolution built on it) is linear in
each of ``x``, ``y`` and ``w``. A backend therefore only has to provide

* ``forward(x, y, w, *aux) -> z`` and
* ``backward(x, y, w, gz, *aux, needs) -> (gx, gy, gw)``, the vector-Jacobian product,
  where ``needs`` (three static bools) says which of the three gradients to compute; the
  others are returned as ``None`` and a kernel never computes them,

where ``aux`` are non-differentiable operands (graph indices). :func:`trilinear_op` wraps
them as two ``jax.custom_vjp`` functions:

* ``apply``, whose VJP calls ``backward``;
* ``backward_op``, whose VJP is the OpenEquivariance identity (Bharadwaj et al. 2025,
  eqs. 3.4-3.5). With cotangents ``(ggx, ggy, ggw)`` of ``(gx, gy, gw)``::

      d/dgz = f(ggx, y, w) + f(x, ggy, w) + f(x, y, ggw)          (3 forward calls)
      d/dx  = B(x, ggy, w, gz).gx + B(x, y, ggw, gz).gx
      d/dy  = B(ggx, y, w, gz).gy + B(x, y, ggw, gz).gy
      d/dw  = B(ggx, y, w, gz).gw + B(x, ggy, w, gz).gw               (3 backward calls)

  It holds because ``<ggx, gx> = <gz, f(ggx, y, w)>`` (``gx`` is the derivative of the
  trilinear form ``<gz, f(x, y, w)>``), and likewise for ``y`` and ``w``. The paper counts
  seven calls; since our ``backward`` returns all three gradients at once, six suffice, and
  fewer when a cotangent is a symbolic zero (e.g. ``ggx`` when ``x`` does not depend on the
  positions in force training).

Only the gradients that can matter are computed. Each ``fwd`` rule records which of its
inputs are *perturbed* (carry a nonzero tangent at that level of differentiation; JAX's
``symbolic_zeros``), and the matching ``bwd`` asks ``backward`` for those only. In force
training, for instance, the spherical harmonics ``y`` depend on the positions but not on the
parameters, so the loss gradient's backward calls never compute ``gy`` (on the Pallas
backend, its cross-channel sums are the most expensive part of the backward kernel), and each
of the three backward calls above skips the gradient its cotangent replaces. The other way
round, a gradient that is computed but then not used (``gw`` of the first backward when a
loss reads ``gx`` and ``gy`` only) is dropped when JAX prunes the program
(:mod:`jequi.pruned_backward`).

A backend may fuse the rule (``second`` of :func:`trilinear_op`): the identity's sums,
described by a :class:`SecondOrder`, in one pass per kind of result. The pallas backend runs
``d/dgz`` as one forward-like kernel over up to three triples and ``d/dx, d/dy, d/dw`` as one
backward-like kernel over up to two pairs each, instead of up to three forward and three
backward calls (each reading its own copies of ``x, y, w, gz``) and the XLA additions. Both
backends' batched products run both sums in one kernel where it pays
(``pallas_kernels.fuses_second``, ``ffi.ops.fuses_second``).

Because the rule above is written with ``apply`` and ``backward_op`` themselves, its own VJP
is again this rule: reverse-mode derivatives of every order need no further kernels (a fused
second order is differentiated through the composed rule).
``jit`` works because everything is traceable; ``vmap`` works because custom_vjp functions
batch by batching their rules, whose pieces are batchable kernels. Forward-mode (``jvp``)
is not available, as for any ``custom_vjp`` function.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
from jax.custom_derivatives import SymbolicZero

from . import pruned_backward


def _is_zero(ct) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


def _total(terms):
    """Sum of a list of cotangents; None (a zero cotangent) for an empty list."""
    return sum(terms[1:], terms[0]) if terms else None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Perturbed:
    """Which primal inputs of a ``fwd`` rule carry a tangent: static data in the residuals."""

    flags: tuple[bool, ...]

    @classmethod
    def of(cls, *primals) -> "_Perturbed":
        return cls(tuple(bool(p.perturbed) for p in primals))


# Positions of the double backward's operands in the tuple it passes around
# ``(x, y, w, gz, ggx, ggy, ggw)``; the terms of :class:`SecondOrder` name them so.
X, Y, W, GZ, GGX, GGY, GGW = range(7)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SecondOrder:
    """The terms of the identity above that one double backward computes, as positions in
    ``(x, y, w, gz, ggx, ggy, ggw)``:

    * ``dgz``: triples ``(x-like, y-like, w-like)``, ``d/dgz = sum of f(...)`` over them;
    * ``dx``: pairs ``(y-like, w-like)``, ``d/dx = sum of B(., y, w, gz).gx``;
    * ``dy``: pairs ``(x-like, w-like)``; ``dw``: pairs ``(x-like, y-like)``, likewise.

    Only terms whose cotangent is nonzero and whose result is wanted (the input is perturbed)
    appear. A backend with a fused second order computes each sum in one kernel pass: the
    ``B`` terms of all three results share their reads of ``x, y, w, gz`` (and the
    cotangents), and nothing is written but the four results."""

    dgz: tuple = ()
    dx: tuple = ()
    dy: tuple = ()
    dw: tuple = ()

    @classmethod
    def of(cls, perturbed, nonzero) -> "SecondOrder":
        """From which of ``(x, y, w, gz)`` are perturbed and which of ``(ggx, ggy, ggw)``
        are nonzero."""
        px, py, pw, pgz = perturbed
        hx, hy, hw = nonzero

        def keep(want, *candidates):
            return tuple(term for term, has in candidates if has) if want else ()

        return cls(
            dgz=keep(pgz, ((GGX, Y, W), hx), ((X, GGY, W), hy), ((X, Y, GGW), hw)),
            dx=keep(px, ((GGY, W), hy), ((Y, GGW), hw)),
            dy=keep(py, ((GGX, W), hx), ((X, GGW), hw)),
            dw=keep(pw, ((GGX, Y), hx), ((X, GGY), hy)),
        )

    def __bool__(self) -> bool:
        return bool(self.dgz or self.dx or self.dy or self.dw)

    @property
    def pairs(self) -> tuple:
        """``(dx, dy, dw)``: the backward-like sums' pairs, as a backward kernel takes them."""
        return (self.dx, self.dy, self.dw)

    def evaluate(self, forward_sum: Callable, backward_sum: Callable) -> tuple:
        """``(dx, dy, dw, dgz)`` from a backend's pair of fused kernels: ``forward_sum(dgz
        triples)`` and ``backward_sum((dx, dy, dw) pairs)``, each called only where it has
        terms (None where a result is not wanted)."""
        grads = backward_sum(self.pairs) if any(self.pairs) else (None,) * 3
        return (*grads, forward_sum(self.dgz) if self.dgz else None)


class TrilinearOp(NamedTuple):
    """The pair of differentiable functions built by :func:`trilinear_op`."""

    apply: Callable  # (x, y, w, *aux) -> z
    backward: Callable  # (needs, x, y, w, gz, *aux) -> (gx, gy, gw), None where not needed


def trilinear_op(forward: Callable, backward: Callable, second: Callable | None = None) -> TrilinearOp:
    """Wrap a backend's ``forward``/``backward`` kernels into differentiable functions.

    ``second(spec, arrays, *aux) -> (dx, dy, dw, dgz)`` (optional) is a backend's fused
    double backward: the sums of a :class:`SecondOrder` ``spec`` over ``arrays = (x, y, w,
    gz, ggx, ggy, ggw)`` (None for a zero cotangent), None for an empty sum. Without it the
    double backward composes ``forward`` and ``backward`` calls; with it, the composition is
    the fused op's derivative (third and higher orders)."""

    @jax.custom_vjp
    def apply(x, y, w, *aux):
        return forward(x, y, w, *aux)

    # The fwd rules call the custom_vjp functions, not the raw kernels: a higher derivative
    # differentiates the fwd rule itself, which must therefore never reach a bare kernel.
    def apply_fwd(x, y, w, *aux):
        perturbed = _Perturbed.of(x, y, w)
        x, y, w, *aux = (a.value for a in (x, y, w, *aux))
        return apply(x, y, w, *aux), (x, y, w, aux, perturbed)

    def apply_bwd(res, gz):
        x, y, w, aux, perturbed = res
        if _is_zero(gz) or not any(perturbed.flags):
            return (None,) * (3 + len(aux))
        return (*backward_op(perturbed.flags, x, y, w, gz, *aux), *(None for _ in aux))

    apply.defvjp(apply_fwd, apply_bwd, symbolic_zeros=True)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def backward_op(needs, x, y, w, gz, *aux):
        return pruned_backward.bind(backward, needs, x, y, w, gz, *aux)

    def backward_fwd(needs, x, y, w, gz, *aux):
        perturbed = _Perturbed.of(x, y, w, gz)
        x, y, w, gz, *aux = (a.value for a in (x, y, w, gz, *aux))
        return backward_op(needs, x, y, w, gz, *aux), (x, y, w, gz, aux, perturbed)

    def backward_bwd(needs, res, cts):
        x, y, w, gz, aux, perturbed = res
        spec = SecondOrder.of(perturbed.flags, [not _is_zero(ct) for ct in cts])
        if not spec:
            return (None,) * (4 + len(aux))
        arrays = (x, y, w, gz, *(None if _is_zero(ct) else ct for ct in cts))
        dx, dy, dw, dgz = (second_op if second else composed)(spec, arrays, *aux)
        return (dx, dy, dw, dgz, *(None for _ in aux))

    backward_op.defvjp(backward_fwd, backward_bwd, symbolic_zeros=True)

    def composed(spec, arrays, *aux):
        """The sums of `spec` from ``apply`` and ``backward_op`` calls: one backward call per
        substituted cotangent, ``B(a, b, c, gz)`` giving the pairs ``(b, c)`` of ``dx``,
        ``(a, c)`` of ``dy`` and ``(a, b)`` of ``dw``."""
        gz = arrays[GZ]
        dgz = _total([apply(*(arrays[i] for i in term), *aux) for term in spec.dgz])
        sums = ([], [], [])
        for a, b, c in ((GGX, Y, W), (X, GGY, W), (X, Y, GGW)):
            wanted = ((b, c) in spec.dx, (a, c) in spec.dy, (a, b) in spec.dw)
            if any(wanted):
                grads = backward_op(wanted, arrays[a], arrays[b], arrays[c], gz, *aux)
                for terms, grad in zip(sums, grads):
                    if grad is not None:
                        terms.append(grad)
        return (*(_total(terms) for terms in sums), dgz)

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def second_op(spec, arrays, *aux):
        return tuple(second(spec, arrays, *aux))

    def second_fwd(spec, arrays, *aux):
        perturbed = _Perturbed(tuple(a is not None and bool(a.perturbed) for a in arrays))
        arrays, aux = tuple(None if a is None else a.value for a in arrays), tuple(a.value for a in aux)
        return second_op(spec, arrays, *aux), (arrays, aux, perturbed)

    def second_bwd(spec, res, cts):
        """The VJP of the composed rule, over the perturbed inputs and the results with a
        nonzero cotangent only (so its own calls still skip what is not needed)."""
        arrays, aux, perturbed = res
        live = [k for k, ct in enumerate(cts) if not _is_zero(ct)]
        moving = [k for k, p in enumerate(perturbed.flags) if p]
        if not live or not moving:
            return ((None,) * len(arrays), *(None for _ in aux))

        def results(*values):
            full = list(arrays)
            for k, v in zip(moving, values):
                full[k] = v
            out = composed(spec, tuple(full), *aux)
            return [out[k] for k in live]

        _, vjp = jax.vjp(results, *(arrays[k] for k in moving))
        grads = dict(zip(moving, vjp([cts[k] for k in live])))
        return (tuple(grads.get(k) for k in range(len(arrays))), *(None for _ in aux))

    if second:
        second_op.defvjp(second_fwd, second_bwd, symbolic_zeros=True)
    return TrilinearOp(apply, backward_op)
