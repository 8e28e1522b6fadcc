"""Pallas kernels of MACE's symmetric contraction (:class:`jequi.SymmetricContraction`):
forward, tangent (forward mode) and backward, each the polynomial of
:mod:`jequi.symmetric_basis` unrolled per channel vector, its nonzero coefficients Python
floats in the code.

A program owns one *block* of rows of one species (the caller builds the blocks with :func:`jequi.species.species_blocks`) and a chunk of channels on the lanes. It loads
its species' reduced weights once, then walks its rows: each row's channel components are
loaded once, each monomial ``x_a x_b ...`` is formed once (monomials in lexicographic order, so
a prefix product is reused by the next ones) and added, with its coefficients, into one
accumulator per (reduced weight, output component); the accumulators meet the weights at the
end. The backward recomputes them, sums ``<g, basis>`` over the block's rows into the block's
weight gradient (a per-block partial that :func:`jequi.species.species_sum` adds per
species in a fixed order: deterministic) and pulls ``g`` back to ``x`` through the same monomials.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jequi.symmetric_basis import SymmetricContractionDescriptor

from .heuristics import width_warps
from .lowering import fma, masked_load, masked_store, pallas_call

MAX_LANES = 128


class Plan(NamedTuple):
    """The unrolled form of a descriptor: per coupling component its offset and stride in a row
    of ``x``, per output component the same in a row of the output, and the terms grouped by
    monomial (lexicographic): ``(mono, ((component, j, coef), ...))``."""

    mul: int
    d_in: int
    d_out: int
    num_reduced: int
    layout: str
    x_comps: tuple  # (offset, dim, m) per coupling component
    out_comps: tuple  # (offset, dim, m) per output component
    by_mono: tuple


@functools.lru_cache(maxsize=128)
def plan(desc: SymmetricContractionDescriptor) -> Plan:
    x_comps, off = [], 0
    for _, ir in desc.irreps_in:
        x_comps += [(off, ir.dim, m) for m in range(ir.dim)]
        off += desc.mul * ir.dim
    out_comps, starts = [], []
    for block in desc.blocks:
        starts.append(len(out_comps))
        out_comps += [(block.offset, block.ir.dim, m) for m in range(block.ir.dim)]
    grouped = {}
    for t in desc.terms:
        grouped.setdefault(t.mono, []).append((starts[t.out] + t.m, t.j, t.coef))
    by_mono = tuple((mono, tuple(grouped[mono])) for mono in sorted(grouped))
    return Plan(desc.mul, desc.irreps_in.dim, desc.irreps_out.dim, desc.num_reduced, desc.layout, tuple(x_comps), tuple(out_comps), by_mono)


def lanes(mul: int) -> int:
    """Channels per program: the multiplicity rounded up to a power of two, at most 128."""
    return min(MAX_LANES, 1 << max(0, (mul - 1).bit_length()))


def _index(p: Plan, comp, c):
    offset, dim, m = comp
    return offset + (c * dim + m if p.layout == "mul_ir" else m * p.mul + c)


def _lanes(p: Plan):
    from jax.experimental import pallas as pl

    kb = lanes(p.mul)
    c = pl.program_id(1) * kb + jnp.arange(kb, dtype=jnp.int32)
    return pl.program_id(0), c, c < p.mul


def _load_weights(p: Plan, w_ref, species, c, cmask):
    return [masked_load(w_ref, (species * p.num_reduced + j) * p.mul + c, cmask) for j in range(p.num_reduced)]


def _load_row(p: Plan, ref, n, width, comps, c, mask):
    base = jnp.maximum(n, 0) * width
    return [masked_load(ref, base + _index(p, comp, c), mask) for comp in comps]


def _store_row(p: Plan, ref, n, width, comps, values, c, mask):
    base = jnp.maximum(n, 0) * width
    for comp, v in zip(comps, values):
        masked_store(ref, base + _index(p, comp, c), v, mask)


def _accumulate(acc: dict, key, coef: float, value):
    acc[key] = coef * value if key not in acc else fma(coef, value, acc[key])


def _monomials(p: Plan, xs, txs=None):
    """``(mono, value, tangent)`` for each monomial of the plan in order; each prefix product is
    formed once (``tangent`` is None without `txs`: dual numbers otherwise)."""
    cache = {(): (None, None)}

    def get(mono):
        if mono not in cache:
            head, last = get(mono[:-1]), mono[-1]
            v0, t0 = head
            x, tx = xs[last], None if txs is None else txs[last]
            if v0 is None:
                cache[mono] = (x, tx)
            else:
                cache[mono] = (v0 * x, None if txs is None else fma(v0, tx, t0 * x))
        return cache[mono]

    for mono, terms in p.by_mono:
        v, t = get(mono)
        yield mono, terms, v, t


def _basis(p: Plan, xs):
    """``{(component, j): sum of coef * monomial}`` for one row."""
    acc = {}
    for _, terms, v, _ in _monomials(p, xs):
        for comp, j, coef in terms:
            _accumulate(acc, (comp, j), coef, v)
    return acc


def _contract(p: Plan, acc: dict, w, dtype, kb):
    """Each output component: the accumulators times the block's reduced weights."""
    out = [None] * len(p.out_comps)
    for (comp, j), v in sorted(acc.items()):
        out[comp] = w[j] * v if out[comp] is None else fma(w[j], v, out[comp])
    return [jnp.zeros((kb,), dtype) if o is None else o for o in out]


def _launch(p: Plan, num_blocks: int):
    kb = lanes(p.mul)
    return (num_blocks, -(-p.mul // kb)), width_warps(kb)


def _check(p: Plan, n: int):
    if n * max(p.d_in, p.d_out) >= 2**31:
        raise ValueError(f"{n} rows of {max(p.d_in, p.d_out)} values pass the kernels' int32 indexing: call in parts")


@functools.partial(jax.jit, static_argnames=("desc", "block"))
def forward(desc, x, wr, rows, block_species, *, block: int):
    """``(N, irreps_out.dim)``: the contraction of rows ``x (N, irreps_in.dim)`` with reduced
    weights ``wr (S, num_reduced, mul)``; ``rows (num_blocks * block,)`` the row of each slot
    (-1 for none) and ``block_species (num_blocks,)`` each block's species."""
    p, n, dtype = plan(desc), x.shape[0], x.dtype
    _check(p, n)
    kb = lanes(p.mul)

    def kernel(rows_ref, bs_ref, x_ref, w_ref, o_ref):
        blk, c, cmask = _lanes(p)
        w = _load_weights(p, w_ref, bs_ref[blk], c, cmask)

        def row(r, carry):
            n_ = rows_ref[blk * block + r]
            mask = cmask & (n_ >= 0)
            xs = _load_row(p, x_ref, n_, p.d_in, p.x_comps, c, mask)
            out = _contract(p, _basis(p, xs), w, dtype, kb)
            _store_row(p, o_ref, n_, p.d_out, p.out_comps, out, c, mask)
            return carry

        jax.lax.fori_loop(0, block, row, 0)

    grid, warps = _launch(p, block_species.shape[0])
    out = pallas_call(kernel, jax.ShapeDtypeStruct((n * p.d_out,), dtype), grid, warps, name="jequi_sc_fwd")(
        rows, block_species, x.reshape(-1), wr.reshape(-1)
    )
    return out.reshape(n, p.d_out)


@functools.partial(jax.jit, static_argnames=("desc", "block"))
def tangent(desc, x, wr, tx, twr, rows, block_species, *, block: int):
    """The forward's derivative at ``(x, wr)`` along ``(tx, twr)`` (linear in them)."""
    p, n, dtype = plan(desc), x.shape[0], x.dtype
    _check(p, n)
    kb = lanes(p.mul)

    def kernel(rows_ref, bs_ref, x_ref, w_ref, tx_ref, tw_ref, o_ref):
        blk, c, cmask = _lanes(p)
        s = bs_ref[blk]
        w, tw = _load_weights(p, w_ref, s, c, cmask), _load_weights(p, tw_ref, s, c, cmask)

        def row(r, carry):
            n_ = rows_ref[blk * block + r]
            mask = cmask & (n_ >= 0)
            xs = _load_row(p, x_ref, n_, p.d_in, p.x_comps, c, mask)
            txs = _load_row(p, tx_ref, n_, p.d_in, p.x_comps, c, mask)
            acc, dacc = {}, {}
            for _, terms, v, t in _monomials(p, xs, txs):
                for comp, j, coef in terms:
                    _accumulate(acc, (comp, j), coef, v)
                    _accumulate(dacc, (comp, j), coef, t)
            out = _contract(p, dacc, w, dtype, kb)
            for (comp, j), v in sorted(acc.items()):
                out[comp] = fma(tw[j], v, out[comp])
            _store_row(p, o_ref, n_, p.d_out, p.out_comps, out, c, mask)
            return carry

        jax.lax.fori_loop(0, block, row, 0)

    grid, warps = _launch(p, block_species.shape[0])
    out = pallas_call(kernel, jax.ShapeDtypeStruct((n * p.d_out,), dtype), grid, warps, name="jequi_sc_jvp")(
        rows, block_species, x.reshape(-1), wr.reshape(-1), tx.reshape(-1), twr.reshape(-1)
    )
    return out.reshape(n, p.d_out)


@functools.partial(jax.jit, static_argnames=("desc", "block", "needs"))
def backward(desc, x, wr, g, rows, block_species, *, block: int, needs: tuple[bool, bool] = (True, True)):
    """``[gx (N, irreps_in.dim), gw_blocks (num_blocks, num_reduced, mul)]``, those that `needs`
    asks for: the gradient of ``<g, forward(...)>`` in ``x`` and, per block, in its species'
    reduced weights (add them per species with :func:`jequi.species.species_sum`). A
    gradient not asked for is not computed (an MD step needs ``gx`` alone: the kernel then holds
    no weight-gradient accumulators)."""
    p, n, dtype = plan(desc), x.shape[0], x.dtype
    need_x, need_w = needs
    _check(p, n)
    kb = lanes(p.mul)
    nb = block_species.shape[0]

    def kernel(rows_ref, bs_ref, x_ref, w_ref, g_ref, *out_refs):
        gx_ref, gw_ref = (out_refs[0] if need_x else None), (out_refs[-1] if need_w else None)
        blk, c, cmask = _lanes(p)
        w = _load_weights(p, w_ref, bs_ref[blk], c, cmask)

        def row(r, gw):
            n_ = rows_ref[blk * block + r]
            mask = cmask & (n_ >= 0)
            xs = _load_row(p, x_ref, n_, p.d_in, p.x_comps, c, mask)
            gs = _load_row(p, g_ref, n_, p.d_out, p.out_comps, c, mask)
            wg = {}  # (component, j) -> w_j g_component, formed on first use
            basis, gx = {}, [None] * len(xs)
            for mono, terms, v, _ in _monomials(p, xs):
                cm = None
                for comp, j, coef in terms:
                    if need_w:
                        _accumulate(basis, (comp, j), coef, v)
                    if need_x:
                        if (comp, j) not in wg:
                            wg[comp, j] = w[j] * gs[comp]
                        cm = coef * wg[comp, j] if cm is None else fma(coef, wg[comp, j], cm)
                if need_x:
                    for k, a in enumerate(mono):  # d(x_a x_b ...)/dx_a: the other factors
                        others = [xs[b] for i, b in enumerate(mono) if i != k]
                        term = cm if not others else cm * functools.reduce(lambda u, v_: u * v_, others)
                        gx[a] = term if gx[a] is None else gx[a] + term
            if need_x:
                gx = [jnp.zeros((kb,), dtype) if v is None else v for v in gx]
                _store_row(p, gx_ref, n_, p.d_in, p.x_comps, gx, c, mask)
            if not need_w:
                return gw
            gw = list(gw)
            for (comp, j), t in sorted(basis.items()):  # <g, basis> per reduced weight
                gw[j] = fma(gs[comp], t, gw[j])
            return tuple(gw)

        carry = tuple(jnp.zeros((kb,), dtype) for _ in range(p.num_reduced)) if need_w else 0
        gw = jax.lax.fori_loop(0, block, row, carry)
        if need_w:
            for j, v in enumerate(gw):
                masked_store(gw_ref, (blk * p.num_reduced + j) * p.mul + c, v, cmask)

    shapes = [jax.ShapeDtypeStruct((n * p.d_in,), dtype)] * need_x + [jax.ShapeDtypeStruct((nb * p.num_reduced * p.mul,), dtype)] * need_w
    grid, warps = _launch(p, nb)
    outs = pallas_call(kernel, tuple(shapes), grid, warps, name="jequi_sc_bwd")(rows, block_species, x.reshape(-1), wr.reshape(-1), g.reshape(-1))
    outs = list(outs)
    result = []
    if need_x:
        result.append(outs.pop(0).reshape(n, p.d_in))
    if need_w:
        result.append(outs.pop(0).reshape(nb, p.num_reduced, p.mul))
    return result
