"""What a kernel of a trilinear op computes: sums of trilinear terms over the arrays
``(x, y, w, gz, ggx, ggy, ggw)``, one type (:class:`Sums`) that :mod:`jequi.autodiff` builds
and both kernel packages (``pallas_kernels``, ``ffi``) take.

A CG tensor product ``z = f(x, y, w)`` is linear in each of ``x``, ``y`` and ``w``; with the
output cotangent ``gz``, ``T(x, y, w, gz) = <gz, f(x, y, w)>`` is linear in each of its four
slots. A kernel evaluates sums of ``T``'s partial derivatives with arrays in the other slots:

* a forward-like sum (``out``): ``sum of f(a, b, c)`` over triples ``(x-like, y-like, w-like)``;
* a backward-like sum (``dx``, ``dy``, ``dw``): ``dx = sum of dT/dx (b, c, gz)`` over pairs
  ``(y-like, w-like)``, ``dy`` over ``(x-like, w-like)``, ``dw`` over ``(x-like, y-like)``,
  all against ``gz`` (position :data:`GZ`).

The first-order ops have one term (:data:`FORWARD`, :meth:`Sums.gradients`); the double
backward of the identity (:meth:`Sums.of`, the OpenEquivariance identity) and a forward-mode
tangent up to three per result, sharing every read of the arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

# Positions of the arrays a kernel reads, in the tuple the kernels take.
X, Y, W, GZ, GGX, GGY, GGW = range(7)
# Which of ``(gx, gy, gw)`` a backward computes (``needs``): all three.
ALL = (True, True, True)


def _unique(positions) -> tuple[int, ...]:
    return tuple(sorted(set(positions)))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Sums:
    """The sums a kernel computes, as positions in ``(x, y, w, gz, ggx, ggy, ggw)`` (see the
    module docstring): ``out`` triples ``(x-like, y-like, w-like)``; ``dx`` pairs ``(y-like,
    w-like)``, ``dy`` pairs ``(x-like, w-like)``, ``dw`` pairs ``(x-like, y-like)``. An empty
    tuple: that result is not computed. Equal sums hash alike (kernel caches key on them)."""

    out: tuple = ()
    dx: tuple = ()
    dy: tuple = ()
    dw: tuple = ()

    @classmethod
    def gradients(cls, needs=ALL) -> "Sums":
        """The vector-Jacobian product's sums of the gradients `needs` (three bools) asks for."""
        return cls((), *(pairs if need else () for pairs, need in zip((((Y, W),), ((X, W),), ((X, Y),)), needs)))

    @classmethod
    def of(cls, perturbed, nonzero) -> "Sums":
        """The double backward's identity: its terms from which of ``(x, y, w, gz)`` are
        perturbed (the results wanted) and which of ``(ggx, ggy, ggw)`` are nonzero."""
        px, py, pw, pgz = perturbed
        hx, hy, hw = nonzero

        def keep(want, *candidates):
            return tuple(term for term, has in candidates if has) if want else ()

        return cls(
            out=keep(pgz, ((GGX, Y, W), hx), ((X, GGY, W), hy), ((X, Y, GGW), hw)),
            dx=keep(px, ((GGY, W), hy), ((Y, GGW), hw)),
            dy=keep(py, ((GGX, W), hx), ((X, GGW), hw)),
            dw=keep(pw, ((GGX, Y), hx), ((X, GGY), hy)),
        )

    def of_kind(self, backward: bool) -> "Sums":
        """The sums a forward-like (or `backward`-like) kernel computes: the others emptied."""
        return Sums((), self.dx, self.dy, self.dw) if backward else Sums(self.out)

    @property
    def pairs(self) -> tuple[tuple, tuple, tuple]:
        """``(dx, dy, dw)``: the backward-like sums' pairs."""
        return self.dx, self.dy, self.dw

    @property
    def needs(self) -> tuple[bool, bool, bool]:
        """Which of ``(gx, gy, gw)`` the backward-like sums compute."""
        return bool(self.dx), bool(self.dy), bool(self.dw)

    @property
    def summed(self) -> bool:
        """Whether the forward-like sum has several terms (the double backward's ``dgz``)."""
        return len(self.out) > 1

    @property
    def x_likes(self) -> tuple[int, ...]:
        """The positions read in slot ``x``."""
        return _unique([a for a, _, _ in self.out] + [a for a, _ in self.dy + self.dw])

    @property
    def y_likes(self) -> tuple[int, ...]:
        """The positions read in slot ``y``."""
        return _unique([b for _, b, _ in self.out] + [b for b, _ in self.dx] + [b for _, b in self.dw])

    @property
    def w_likes(self) -> tuple[int, ...]:
        """The positions read in slot ``w``."""
        return _unique([c for _, _, c in self.out] + [c for _, c in self.dx + self.dy])

    @property
    def reads(self) -> tuple[int, ...]:
        """Every position some term reads (never ``gz``, which the backward-like sums read
        apart), sorted."""
        return _unique([*self.x_likes, *self.y_likes, *self.w_likes])

    def evaluate(self, forward_sum: Callable, backward_sum: Callable) -> tuple:
        """``(dx, dy, dw, out)`` from a pair of kernels: ``backward_sum(sums)`` of the
        backward-like sums and ``forward_sum(sums)`` of the forward-like one, each called only
        where it has terms (None where a result is not wanted)."""
        grads = backward_sum(self.of_kind(backward=True)) if any(self.pairs) else (None,) * 3
        return (*grads, forward_sum(self.of_kind(backward=False)) if self.out else None)


# The first-order ops: the product and its vector-Jacobian product.
FORWARD = Sums(out=((X, Y, W),))
BACKWARD = Sums.gradients()
