"""Derivatives of every order, forward and reverse, of trilinear ops from a backend's kernels.

A CG tensor product ``z = f(x, y, w)`` (and the fused convolution built on it) is linear in
each of ``x``, ``y`` and ``w``. Write ``T(x, y, w, gz) = <gz, f(x, y, w)>``: a form linear
in each of its four *slots*. Every derivative of ``f`` of any order is a sum of partial
derivatives of ``T`` in one slot with the other three filled by arrays:

* slot ``z`` (``gz`` left out): ``f(x, y, w)``, the forward;
* slot ``x``: ``gx = dT/dx (y, w, gz)``, and likewise ``gy``, ``gw``: the backward's gradients.

A backend provides the kernels that evaluate such sums (:class:`Kernels`): ``forward``,
``backward`` (the three gradients against one ``gz``, those in ``needs`` only) and ``second``
(the fused sums of a :class:`jequi.sums.Sums`). This module turns them into one JAX primitive,
``jequi_trilinear``, whose outputs are sums of terms (:class:`Term`) and whose rules are
closed over such sums:

* **JVP** (forward mode): the tangent of a term is the same term with one slot's array
  replaced by its tangent, summed over the slots whose arrays carry a tangent (a symbolic
  zero tangent adds no term). The tangent of ``f`` is three products, the tangent of a
  backward four backward terms.
* **Transpose** (reverse mode): a term is linear in its one tangent array; its transpose
  moves that array's slot to the output and fills the old output slot with the output's
  cotangent (``<ct, dT/dx (t, w, gz)> = <gz, f(ct, t, w)>``-style symmetries of ``T``). So
  the transpose of the forward's JVP is the backward, and the transpose of the backward's
  JVP is the OpenEquivariance double-backward identity (Bharadwaj et al. 2025, eqs.
  3.4-3.5): three forward terms for ``d/dgz`` and pairs of backward terms for ``d/dx``,
  ``d/dy``, ``d/dw``.
* **Batching** (``vmap``): the primitive records each ``vmap`` level's batch axes and runs
  the backend's kernels under ``jax.vmap`` (their own batching rules).
* **Dead code** (``jit``): unused outputs are dropped with their terms, so a kernel never
  computes a gradient the program does not read (a first backward whose ``gw`` only a
  pruned branch used). Kernels are generated when the program is lowered, after pruning.

Since every rule produces the same primitive, derivatives of every order and any mix of
forward and reverse mode (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``, ``jax.hessian``,
``jvp`` of ``grad``) need no further kernels. When the primitive is evaluated, its terms are
packed into as few kernel calls as the kernels allow (:func:`_pack`): all terms of one
call share their ``gz``, and hold at most two arrays per slot (the ``(x, y, w, gz, ggx, ggy,
ggw)`` positions of :mod:`jequi.sums`). A plain forward or backward goes to ``forward`` /
``backward``; the double backward of force training, and a forward-mode tangent (three
products), to one fused ``second`` call.

Only the gradients that can matter are computed: a slot whose array has a zero tangent
contributes no term, and a transpose makes outputs only for the arrays that carry a
tangent. In force training, for instance, the spherical harmonics ``y`` depend on the
positions but not on the parameters, so the loss gradient never computes ``gy`` (on the
Pallas backend, its cross-channel sums are the most expensive part of the backward kernel).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import core
from jax.interpreters import ad, batching, mlir
from jax.interpreters import partial_eval as pe

from .sums import GZ, W, X, Y, Sums

# The slots of T(x, y, w, gz); an output of slot Z is a forward (z has gz's shape).
Z = GZ
SLOTS = (X, Y, W, Z)


@dataclasses.dataclass(frozen=True, eq=False)
class Kernels:
    """A backend's kernels for one descriptor (and graph structure), keyed by identity in JAX's
    caches (build each once). ``aux`` are non-differentiable operands (graph index arrays).

    * ``forward(x, y, w, *aux) -> z``;
    * ``backward(x, y, w, gz, *aux, needs) -> (gx, gy, gw)``, None where ``needs`` is False;
    * ``second(sums, arrays, *aux) -> (dx, dy, dw, dgz)``: the :class:`~jequi.sums.Sums`
      over ``arrays = (x, y, w, gz, ggx, ggy, ggw)`` (None for an array no term reads, but
      ``x``, ``y``, ``w`` and ``gz``, which give the shapes), None for an empty sum."""

    forward: Callable
    backward: Callable
    second: Callable
    name: str = ""  # for printed programs: the backend and product

    def __repr__(self) -> str:
        return f"Kernels({self.name})"


def composed_second(forward: Callable, backward: Callable) -> Callable:
    """``second(sums, arrays, *aux)`` from ``forward`` and ``backward`` calls, one per term:
    for a backend without a fused one (and for sums a fused rule does not cover)."""

    def second(sums: Sums, arrays, *aux):
        def total(values):
            return functools.reduce(jnp.add, values) if values else None

        def gradient(slot, pairs):
            values = []
            for pair in pairs:
                operands = list(arrays[:3])
                for s, pos in zip([s for s in (X, Y, W) if s != slot], pair):
                    operands[s] = arrays[pos]
                needs = tuple(s == slot for s in (X, Y, W))
                values.append(backward(*operands, arrays[GZ], *aux, needs=needs)[slot])
            return total(values)

        dgz = total([forward(*(arrays[p] for p in triple), *aux) for triple in sums.out])
        return (*(gradient(slot, pairs) for slot, pairs in zip((X, Y, W), sums.pairs)), dgz)

    return second


class Term(NamedTuple):
    """One term of an output: for each slot ``(x, y, w, z)`` the index of the array in it.
    The output's own slot holds a *context*: an array of that slot's shape that the kernel
    takes but does not read (the primal whose gradient this is, as a backward kernel takes
    ``x`` to compute ``gx``), or None."""

    x: int | None
    y: int | None
    w: int | None
    z: int | None

    def put(self, slot: int, index: int | None) -> "Term":
        return Term(*(index if s == slot else a for s, a in enumerate(self)))


@dataclasses.dataclass(frozen=True)
class Level:
    """One ``vmap`` level: its size, the batch axis (0 or None) of each operand (arrays, then
    aux) and whether each output is batched (else summed over the level: the cotangent of an
    operand the level does not batch)."""

    size: int
    in_axes: tuple
    out_batched: tuple


trilinear_p = core.Primitive("jequi_trilinear")
trilinear_p.multiple_results = True


# --- evaluation: terms to kernel calls ---------------------------------------------------


def _call_accepts(call: dict, k: int, slot: int, term: Term) -> bool:
    if call["outputs"].get(slot, k) != k:
        return False
    if slot != Z and call["gz"] not in (None, term.z):
        return False
    for s in (X, Y, W):
        if s != slot and len(call["operands"][s] | {term[s]}) > 2:
            return False
    return True


def _pack(outputs) -> list[dict]:
    """Kernel calls for the terms of `outputs` (``(slot, terms)`` each): a call takes at most
    one output per slot, one ``gz`` for its backward terms and two arrays per slot (the
    positions of :mod:`jequi.sums`); terms go to the first call that takes them."""
    calls: list[dict] = []
    for k, (slot, terms) in enumerate(outputs):
        for term in terms:
            call = next((c for c in calls if _call_accepts(c, k, slot, term)), None)
            if call is None:
                call = {"outputs": {}, "gz": None, "operands": {X: set(), Y: set(), W: set()}, "terms": [], "context": {}}
                calls.append(call)
            call["outputs"][slot] = k
            call["terms"].append((slot, term))
            if slot != Z:
                call["gz"] = term.z
            for s in (X, Y, W):
                if s != slot:
                    call["operands"][s].add(term[s])
                elif term[s] is not None:
                    call["context"].setdefault(s, term[s])
    return calls


_PLAIN_PAIRS = {X: (Y, W), Y: (X, W), W: (X, Y)}


def _run(kernels: Kernels, call: dict, arrays, aux, shapes, dtype) -> dict:
    """Results ``{output index: value}`` of one packed call."""
    slot_arrays = [None] * 7
    position = {}
    for s in (X, Y, W):
        indices = sorted(call["operands"][s]) or ([call["context"][s]] if s in call["context"] else [])
        for pos, i in zip((s, s + 4), indices):
            slot_arrays[pos], position[i] = arrays[i], pos
        if slot_arrays[s] is None:  # the kernels take it for its shape only
            slot_arrays[s] = jnp.zeros(shapes[s], dtype)
    slot_arrays[GZ] = arrays[call["gz"]] if call["gz"] is not None else None
    sums = {X: [], Y: [], W: [], Z: []}
    for slot, term in call["terms"]:
        sums[slot].append(tuple(position[term[s]] for s in (X, Y, W, Z) if s != slot and s != Z))
    spec = Sums(out=tuple(sums[Z]), dx=tuple(sums[X]), dy=tuple(sums[Y]), dw=tuple(sums[W]))
    outputs = call["outputs"]
    if not any(spec.pairs) and spec.out == ((X, Y, W),):
        return {outputs[Z]: kernels.forward(*slot_arrays[:3], *aux)}
    if not spec.out and all(p in ((), (_PLAIN_PAIRS[s],)) for s, p in zip((X, Y, W), spec.pairs)):
        needs = spec.needs
        grads = kernels.backward(*slot_arrays[:4], *aux, needs=needs)
        return {outputs[s]: g for s, g in zip((X, Y, W), grads) if g is not None}
    if slot_arrays[GZ] is None:  # a forward sum: gz is not read, the kernels take its shape
        slot_arrays[GZ] = jnp.zeros(shapes[Z], dtype)
    results = kernels.second(spec, tuple(slot_arrays), *aux)
    return {outputs[s]: r for s, r in zip((X, Y, W, Z), results) if r is not None}


def _evaluate(*operands, kernels, outputs, shapes, n_aux):
    """The outputs' values: each the sum of its terms over the packed calls."""
    arrays, aux = operands[: len(operands) - n_aux], operands[len(operands) - n_aux :]
    dtype = arrays[0].dtype
    values: list[list] = [[] for _ in outputs]
    for call in _pack(outputs):
        for k, v in _run(kernels, call, arrays, aux, shapes, dtype).items():
            values[k].append(v)
    return [functools.reduce(jnp.add, v) for v in values]


def _impl(*operands, kernels, outputs, roles, primal_of, shapes, n_aux, levels):
    f = functools.partial(_evaluate, kernels=kernels, outputs=outputs, shapes=shapes, n_aux=n_aux)
    for level in reversed(levels):  # the innermost level is applied first
        f = _vmapped(f, level)
    return f(*operands)


def _vmapped(f, level: Level):
    def batched(*operands):
        outs = jax.vmap(f, in_axes=level.in_axes, out_axes=0, axis_size=level.size)(*operands)
        return [o if b else o.sum(axis=0) for o, b in zip(outs, level.out_batched)]

    return batched


def _abstract_eval(*avals, kernels, outputs, roles, primal_of, shapes, n_aux, levels):
    """Each output has its slot's shape (with the batch axes of the levels that batch it),
    the arrays' dtype, and the type (sharding, varying axes) of an array of its slot, so no
    backend code runs here."""
    del kernels, primal_of
    arrays = avals[: len(avals) - n_aux]
    dtype = arrays[0].dtype
    result = []
    for k, (slot, _) in enumerate(outputs):
        batch = tuple(level.size for level in levels if level.out_batched[k])
        template = next((a for a, r in zip(arrays, roles) if r == slot), arrays[0])
        result.append(template.update(shape=batch + tuple(shapes[slot]), dtype=dtype, weak_type=False))
    return result


# --- the primitive's rules ----------------------------------------------------------------


def _bind(arrays, aux, *, kernels, outputs, roles, primal_of, shapes, levels):
    return trilinear_p.bind(
        *arrays, *aux, kernels=kernels, outputs=tuple(outputs), roles=tuple(roles), primal_of=tuple(primal_of),
        shapes=shapes, n_aux=len(aux), levels=tuple(levels),
    )  # fmt: skip


def _jvp(primals, tangents, *, kernels, outputs, roles, primal_of, shapes, n_aux, levels):
    """Each term's tangent: the term with one slot's array replaced by its tangent, for every
    slot whose array has a nonzero tangent."""
    params = dict(kernels=kernels, outputs=outputs, roles=roles, primal_of=primal_of, shapes=shapes, n_aux=n_aux, levels=levels)
    primal_out = trilinear_p.bind(*primals, **params)
    n = len(primals) - n_aux
    arrays, aux = list(primals[:n]), primals[n:]
    roles, primal_of = list(roles), list(primal_of)
    tangent_index = {}
    for i, t in enumerate(tangents[:n]):
        if type(t) is not ad.Zero:
            tangent_index[i] = len(arrays)
            arrays.append(t)
            roles.append(roles[i])
            primal_of.append(i)
    new_outputs, kept = [], []
    for k, (slot, terms) in enumerate(outputs):
        new_terms = tuple(
            term.put(s, tangent_index[term[s]]) for term in terms for s in SLOTS if s != slot and term[s] in tangent_index
        )
        if new_terms:
            new_outputs.append((slot, new_terms))
            kept.append(k)
    if not new_outputs:
        return primal_out, [ad.Zero(o.aval.to_tangent_aval()) for o in primal_out]
    new_levels = [
        dataclasses.replace(
            lv,
            in_axes=lv.in_axes[:n] + tuple(lv.in_axes[i] for i in tangent_index) + lv.in_axes[n:],
            out_batched=tuple(lv.out_batched[k] for k in kept),
        )
        for lv in levels
    ]
    tangent_out = _bind(arrays, aux, kernels=kernels, outputs=new_outputs, roles=roles, primal_of=primal_of, shapes=shapes, levels=new_levels)
    out = [ad.Zero(o.aval.to_tangent_aval()) for o in primal_out]
    for k, t in zip(kept, tangent_out):
        out[k] = t
    return primal_out, out


def _transpose(cts, *operands, kernels, outputs, roles, primal_of, shapes, n_aux, levels):
    """The cotangent of each linear array: the terms that hold it, with its slot made the
    output (its primal as the context) and the old output slot filled with that output's
    cotangent."""
    n = len(operands) - n_aux
    aux = operands[n:]
    linear = [i for i in range(n) if ad.is_undefined_primal(operands[i])]
    known = [i for i in range(n) if i not in linear]
    index = {i: j for j, i in enumerate(known)}
    arrays = [operands[i] for i in known]
    new_roles = [roles[i] for i in known]
    new_primal_of = [index.get(primal_of[i], -1) for i in known]
    ct_index = {}
    for k, ct in enumerate(cts):
        if type(ct) is not ad.Zero:
            ct_index[k] = len(arrays)
            arrays.append(ct)
            new_roles.append(outputs[k][0])
            new_primal_of.append(-1)
    new_outputs, targets = [], []
    for i in linear:
        slot = roles[i]
        context = index.get(primal_of[i])
        terms = []
        for k, (out_slot, out_terms) in enumerate(outputs):
            if k in ct_index:
                for term in out_terms:
                    if term[slot] == i:
                        terms.append(Term(*(
                            ct_index[k] if s == out_slot else context if s == slot else index[term[s]] for s in SLOTS
                        )))  # fmt: skip
        if terms:
            new_outputs.append((slot, tuple(terms)))
            targets.append(i)
    result = [None] * len(operands)
    if not new_outputs:
        return result
    new_levels = []
    for lv in levels:
        ct_axes = tuple(0 if lv.out_batched[k] else None for k in ct_index)
        new_levels.append(Level(
            lv.size,
            tuple(lv.in_axes[i] for i in known) + ct_axes + lv.in_axes[n:],
            tuple(lv.in_axes[i] is not None for i in targets),
        ))  # fmt: skip
    values = _bind(arrays, aux, kernels=kernels, outputs=new_outputs, roles=new_roles, primal_of=new_primal_of, shapes=shapes, levels=new_levels)
    for i, v in zip(targets, values):
        result[i] = v
    return result


def _batch(operands, dims, *, kernels, outputs, roles, primal_of, shapes, n_aux, levels):
    """A new outermost level: batch axes moved to the front, every output batched."""
    size = next(a.shape[d] for a, d in zip(operands, dims) if d is not None)
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(operands, dims)]
    level = Level(size, tuple(None if d is None else 0 for d in dims), (True,) * len(outputs))
    outs = trilinear_p.bind(
        *moved, kernels=kernels, outputs=outputs, roles=roles, primal_of=primal_of, shapes=shapes, n_aux=n_aux,
        levels=(level, *levels),
    )  # fmt: skip
    return outs, [0] * len(outs)


def _dce(used_outputs, *rest):
    """Keep the used outputs (and the arrays their terms read, with their primals). The rule's
    arguments are ``(used_outputs, eqn)`` in jax 0.11 and ``(used_outputs, live_ins, eqn)``
    from 0.12 on: ``eqn`` is the last."""
    eqn = rest[-1]
    if not any(used_outputs):
        return [False] * len(eqn.invars), None
    if all(used_outputs):
        return [True] * len(eqn.invars), eqn
    p = eqn.params
    n = len(eqn.invars) - p["n_aux"]
    kept = [k for k, used in enumerate(used_outputs) if used]
    outputs = [p["outputs"][k] for k in kept]
    live = {a for _, terms in outputs for term in terms for a in term if a is not None}
    live |= {p["primal_of"][i] for i in live if p["primal_of"][i] >= 0}
    arrays = sorted(live)
    index = {i: j for j, i in enumerate(arrays)}
    outputs = tuple(
        (slot, tuple(Term(*(None if a is None else index[a] for a in term)) for term in terms)) for slot, terms in outputs
    )
    levels = tuple(
        Level(lv.size, tuple(lv.in_axes[i] for i in arrays) + lv.in_axes[n:], tuple(lv.out_batched[k] for k in kept))
        for lv in p["levels"]
    )
    params = {
        **p,
        "outputs": outputs,
        "roles": tuple(p["roles"][i] for i in arrays),
        "primal_of": tuple(index.get(p["primal_of"][i], -1) for i in arrays),
        "levels": levels,
    }
    used_inputs = [i in index for i in range(n)] + [True] * p["n_aux"]
    invars = [v for v, used in zip(eqn.invars, used_inputs) if used]
    outvars = [v for v, used in zip(eqn.outvars, used_outputs) if used]
    return used_inputs, eqn.replace(params=params, invars=invars, outvars=outvars)


trilinear_p.def_impl(_impl)
trilinear_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(trilinear_p, mlir.lower_fun(_impl, multiple_results=True))
ad.primitive_jvps[trilinear_p] = _jvp
ad.primitive_transposes[trilinear_p] = _transpose
batching.primitive_batchers[trilinear_p] = _batch
pe.dce_rules[trilinear_p] = _dce


def apply(kernels: Kernels, x, y, w, *aux, z_shape: tuple):
    """``z = f(x, y, w)`` (``z`` of shape `z_shape`) through ``jequi_trilinear``: differentiable
    in ``x``, ``y`` and ``w`` to any order in both modes, batchable, with the kernels of
    `kernels` (``aux``: their non-differentiable operands)."""
    shapes = (tuple(x.shape), tuple(y.shape), tuple(w.shape), tuple(z_shape))
    (z,) = _bind(
        (x, y, w), aux, kernels=kernels, outputs=((Z, (Term(0, 1, 2, None),)),), roles=(X, Y, W), primal_of=(-1, -1, -1),
        shapes=shapes, levels=(),
    )  # fmt: skip
    return z
