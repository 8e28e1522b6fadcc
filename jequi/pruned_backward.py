"""A backend's backward kernel as one JAX primitive that computes only the gradients used.

A kernel (a ``pallas_call``, an FFI call) is one equation with one output per gradient, and
XLA cannot drop an output of a custom call: a program that uses ``gx`` and ``gy`` of a
backward but not ``gw`` still pays for ``gw``'s sums and its writes. That is the case of a
double backward whose loss reads ``gx`` and ``gy`` only (weights that do not depend on what
the first gradient is taken for): its first backward runs in the primal pass, where
``needs`` still says all three (that ``gw`` is unused is known only later, when JAX prunes
the linearized program).

:func:`bind` calls ``backward`` through the primitive ``jequi_backward``, whose ``needs`` is
a parameter. Its dead-code rule (``jax.interpreters.partial_eval.dce_rules``, applied when a
traced program is pruned: under ``jit``, not in eager op-by-op execution) rebinds it with
the ``needs`` of the outputs still used, or drops it; the kernel is generated when the
program is lowered, after the pruning, so it never computes the dropped gradients. Under
``vmap`` the primitive binds again with the batched function (:class:`_Batched`), so
batching keeps the pruning.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import batching, mlir
from jax.interpreters import partial_eval as pe

backward_p = core.Primitive("jequi_backward")
backward_p.multiple_results = True


def bind(backward: Callable, needs: tuple[bool, ...], x, y, w, gz, *aux) -> tuple:
    """``backward(x, y, w, gz, *aux, needs=needs)`` as ``(gx, gy, gw)`` with None where not
    needed, through ``jequi_backward`` (``backward`` must be hashable and stable: it keys
    JAX's caches)."""
    needs = tuple(bool(n) for n in needs)
    outs = iter(backward_p.bind(x, y, w, gz, *aux, backward=backward, needs=needs))
    return tuple(next(outs) if need else None for need in needs)


def _impl(*args, backward, needs):
    return [g for g, need in zip(backward(*args, needs=needs), needs) if need]


def _abstract_eval(*avals, backward, needs):
    """Each needed gradient has the type of its primal (``x``, ``y`` or ``w``: shape, dtype,
    sharding, varying axes), so no backend code runs here; :func:`_batch` keeps that true for
    a batched backward."""
    del backward
    return [a.update(weak_type=False) for a, need in zip(avals[:3], needs) if need]


@dataclasses.dataclass(frozen=True)
class _Batched:
    """``backward`` under ``jax.vmap`` with the operands' batch axes (0 or None)."""

    backward: Callable
    in_axes: tuple

    def __call__(self, *args, needs):
        return jax.vmap(lambda *a: self.backward(*a, needs=needs), in_axes=self.in_axes)(*args)


def _batch(args, dims, *, backward, needs):
    """Batch axes are moved to the front, and a primal whose gradient is needed is broadcast
    over the batch where it is unbatched (its gradient is one per batch member anyway), so
    each gradient again has its primal's type."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    moved, axes = [], []
    for k, (a, d) in enumerate(zip(args, dims)):
        if d is not None:
            a, d = jnp.moveaxis(a, d, 0), 0
        elif k < 3 and needs[k]:
            a, d = jnp.broadcast_to(a, (size, *a.shape)), 0
        moved.append(a)
        axes.append(d)
    outs = backward_p.bind(*moved, backward=_Batched(backward, tuple(axes)), needs=needs)
    return outs, [0] * len(outs)


def _dce(used_outputs, *rest):
    """Keep the used gradients only. The rule's arguments are ``(used_outputs, eqn)`` in jax
    0.11 and ``(used_outputs, live_ins, eqn)`` from 0.12 on: ``eqn`` is the last."""
    eqn = rest[-1]
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    if all(used_outputs):
        return [True] * len(eqn.invars), eqn
    used = iter(used_outputs)
    needs = tuple(need and next(used) for need in eqn.params["needs"])
    kept = [v for v, u in zip(eqn.outvars, used_outputs) if u]
    return [True] * len(eqn.invars), eqn.replace(params={**eqn.params, "needs": needs}, outvars=kept)


backward_p.def_impl(_impl)
backward_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(backward_p, mlir.lower_fun(_impl, multiple_results=True))
batching.primitive_batchers[backward_p] = _batch
pe.dce_rules[backward_p] = _dce
