"""Derivatives of trilinear ops from two kernels: forward and backward.

A CG tensor product ``z = f(x, y, w)`` (and the fused convolution built on it) is linear in
each of ``x``, ``y`` and ``w``. A backend therefore only has to provide

* ``forward(x, y, w, *aux) -> z`` and
* ``backward(x, y, w, gz, *aux) -> (gx, gy, gw)``, the vector-Jacobian product,

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

Because the rule above is written with ``op`` and ``op_backward`` themselves, its own VJP
is again this rule: reverse-mode derivatives of every order need no further kernels.
``jit`` works because everything is traceable; ``vmap`` works because custom_vjp functions
batch by batching their rules, whose pieces are batchable kernels. Forward-mode (``jvp``)
is not available, as for any ``custom_vjp`` function.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
from jax.custom_derivatives import SymbolicZero


def _is_zero(ct) -> bool:
    return ct is None or isinstance(ct, SymbolicZero)


def _total(terms):
    """Sum of a list of cotangents; None (a zero cotangent) for an empty list."""
    return sum(terms[1:], terms[0]) if terms else None


class TrilinearOp(NamedTuple):
    """The pair of differentiable functions built by :func:`trilinear_op`."""

    apply: Callable  # (x, y, w, *aux) -> z
    backward: Callable  # (x, y, w, gz, *aux) -> (gx, gy, gw)


def trilinear_op(forward: Callable, backward: Callable) -> TrilinearOp:
    """Wrap a backend's ``forward``/``backward`` kernels into differentiable functions."""

    @jax.custom_vjp
    def apply(x, y, w, *aux):
        return forward(x, y, w, *aux)

    # The fwd rules call the custom_vjp functions, not the raw kernels: a higher derivative
    # differentiates the fwd rule itself, which must therefore never reach a bare kernel.
    def apply_fwd(x, y, w, *aux):
        return apply(x, y, w, *aux), (x, y, w, aux)

    def apply_bwd(res, gz):
        x, y, w, aux = res
        return (*backward_op(x, y, w, gz, *aux), *(None for _ in aux))

    apply.defvjp(apply_fwd, apply_bwd)

    @jax.custom_vjp
    def backward_op(x, y, w, gz, *aux):
        return backward(x, y, w, gz, *aux)

    def backward_fwd(x, y, w, gz, *aux):
        x, y, w, gz, *aux = (a.value for a in (x, y, w, gz, *aux))
        return backward_op(x, y, w, gz, *aux), (x, y, w, gz, aux)

    def backward_bwd(res, cts):
        x, y, w, gz, aux = res
        ggx, ggy, ggw = cts
        dgz, dx, dy, dw = [], [], [], []
        if not _is_zero(ggx):
            dgz.append(apply(ggx, y, w, *aux))
            _, gy1, gw1 = backward_op(ggx, y, w, gz, *aux)
            dy.append(gy1)
            dw.append(gw1)
        if not _is_zero(ggy):
            dgz.append(apply(x, ggy, w, *aux))
            gx2, _, gw2 = backward_op(x, ggy, w, gz, *aux)
            dx.append(gx2)
            dw.append(gw2)
        if not _is_zero(ggw):
            dgz.append(apply(x, y, ggw, *aux))
            gx3, gy3, _ = backward_op(x, y, ggw, gz, *aux)
            dx.append(gx3)
            dy.append(gy3)
        return (_total(dx), _total(dy), _total(dw), _total(dgz), *(None for _ in aux))

    backward_op.defvjp(backward_fwd, backward_bwd, symbolic_zeros=True)
    return TrilinearOp(apply, backward_op)
