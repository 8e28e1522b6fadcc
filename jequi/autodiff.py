"""Derivatives of trilinear ops from two kernels: forward and backward.

A CG tensor product ``z = f(x, y, w)`` (and the fused convolution built on it) is linear in
each of ``x``, ``y`` and ``w``. A backend therefore only has to provide

* ``forward(x, y, w, *aux) -> z`` and
* ``backward(x, y, w, gz, *aux, needs) -> (gx, gy, gw)``, the vector-Jacobian product,
  where ``needs`` (three static bools) says which of the three gradients to compute; the
  others are returned as ``None`` and a kernel never computes them,

where ``aux`` are non-differentiable operands (graph indices). :func:`trilinear_op` wraps
them as two ``jax.custom_vjp`` functions:

* ``op``, whose VJP calls ``backward``;
* ``op_backward``, whose VJP is the OpenEquivariance identity (Bharadwaj et al. 2025,
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
of the three backward calls above skips the gradient its cotangent replaces.

Because the rule above is written with ``op`` and ``op_backward`` themselves, its own VJP
is again this rule: reverse-mode derivatives of every order need no further kernels.
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


class TrilinearOp(NamedTuple):
    """The pair of differentiable functions built by :func:`trilinear_op`."""

    apply: Callable  # (x, y, w, *aux) -> z
    backward: Callable  # (needs, x, y, w, gz, *aux) -> (gx, gy, gw), None where not needed


def trilinear_op(forward: Callable, backward: Callable) -> TrilinearOp:
    """Wrap a backend's ``forward``/``backward`` kernels into differentiable functions."""

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
        return tuple(backward(x, y, w, gz, *aux, needs=needs))

    def backward_fwd(needs, x, y, w, gz, *aux):
        perturbed = _Perturbed.of(x, y, w, gz)
        x, y, w, gz, *aux = (a.value for a in (x, y, w, gz, *aux))
        return backward_op(needs, x, y, w, gz, *aux), (x, y, w, gz, aux, perturbed)

    def backward_bwd(needs, res, cts):
        x, y, w, gz, aux, perturbed = res
        px, py, pw, pgz = perturbed.flags
        ggx, ggy, ggw = cts  # None for a gradient that was not computed

        def grads(x, y, w, wanted):  # backward_op for the perturbed inputs among `wanted`
            needs = tuple(a and b for a, b in zip(wanted, (px, py, pw)))
            return backward_op(needs, x, y, w, gz, *aux) if any(needs) else (None,) * 3

        dgz, dx, dy, dw = [], [], [], []
        if not _is_zero(ggx):
            if pgz:
                dgz.append(apply(ggx, y, w, *aux))
            _, gy1, gw1 = grads(ggx, y, w, (False, True, True))
            dy.append(gy1)
            dw.append(gw1)
        if not _is_zero(ggy):
            if pgz:
                dgz.append(apply(x, ggy, w, *aux))
            gx2, _, gw2 = grads(x, ggy, w, (True, False, True))
            dx.append(gx2)
            dw.append(gw2)
        if not _is_zero(ggw):
            if pgz:
                dgz.append(apply(x, y, ggw, *aux))
            gx3, gy3, _ = grads(x, y, ggw, (True, True, False))
            dx.append(gx3)
            dy.append(gy3)
        dx, dy, dw = ([t for t in terms if t is not None] for terms in (dx, dy, dw))
        return (_total(dx), _total(dy), _total(dw), _total(dgz), *(None for _ in aux))

    backward_op.defvjp(backward_fwd, backward_bwd, symbolic_zeros=True)
    return TrilinearOp(apply, backward_op)
