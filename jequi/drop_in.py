"""e3nn-jax's functional tensor product on jequi's kernels: :func:`tensor_product`.

``jequi.tensor_product(x, y)`` is ``e3nn_jax.tensor_product(x, y)``: the same values, output
irreps and order, ``IrrepsArray`` in and out, so that an e3nn-jax model swaps it in one line.
It runs as one :class:`jequi.TensorProduct` of unweighted paths (one per output block:
``uvuv``, or ``uvu`` / ``uvv`` where one input block has multiplicity one), built once per set of irreps and options (cached), whose output is already in
e3nn's final order: the result is one flat array in e3nn's ``mul_ir`` layout, which e3nn's
next operations (``* radial``, ``scatter_sum``, ``Linear``) read as views, with no sort or
concatenation between them.
"""

from __future__ import annotations

import dataclasses
import functools

import e3nn_jax as e3nn
import jax.numpy as jnp
import numpy as np

from .irreps import Irrep, Irreps
from .products import TensorProduct


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How one ``(irreps, zero flags, options)`` case runs: the regrouping of the inputs (``order1``,
    ``order2``: the input blocks in sorted order, or None when already sorted), the product
    (None when no path touches data) and the output's irreps and zero flags."""

    order1: tuple | None
    order2: tuple | None
    irreps_in1: Irreps
    irreps_in2: Irreps
    tp: TensorProduct | None
    irreps_out: Irreps
    zero_flags: tuple


def _filter_irreps(filter_ir_out) -> tuple | None:
    """e3nn's accepted filters (irreps string, ``Irreps``, one ``Irrep``, a list of irreps) as a
    tuple of :class:`Irrep`; None keeps every output."""
    if filter_ir_out is None:
        return None
    try:
        if isinstance(filter_ir_out, str):
            filter_ir_out = Irreps(filter_ir_out)
        if isinstance(filter_ir_out, Irrep):
            filter_ir_out = [filter_ir_out]
        return tuple(Irrep(ir) for ir in filter_ir_out)
    except Exception as exc:  # e3nn raises ValueError, AssertionError or TypeError
        raise ValueError(f"filter_ir_out: cannot interpret {filter_ir_out!r} as a list of irreps ({exc})") from exc


def _simplified_flags(irreps: Irreps, flags, simple: Irreps) -> tuple:
    """Zero flags of `simple` (= ``irreps.simplify()``), as e3nn's ``IrrepsArray.rechunk``: a
    merged block is zero when every value in it is."""
    per_value = np.concatenate([np.full(mul * ir.dim, z, dtype=bool) for z, (mul, ir) in zip(flags, irreps)] or [np.zeros(0, bool)])
    return tuple(bool(np.all(per_value[s])) for s in simple.slices())


def _regrouped(irreps: Irreps, flags: tuple, regroup: bool):
    """e3nn's ``IrrepsArray.regroup()`` of an input: (order of its blocks or None, irreps, flags)."""
    if not regroup:
        return None, irreps, flags
    irreps_sorted, _, inv = irreps.sort()
    flags_sorted = tuple(flags[i] for i in inv)
    simple = irreps_sorted.simplify()
    order = None if tuple(inv) == tuple(range(len(irreps))) else tuple(inv)
    return order, simple, _simplified_flags(irreps_sorted, flags_sorted, simple)


def _mode(mul1: int, mul2: int) -> str:
    """The mode of one ``(mul1 x ir1) x (mul2 x ir2)`` block: ``uvuv`` in general; ``uvu`` when
    ``mul2 == 1`` and ``uvv`` when ``mul1 == 1`` (the same values and order, and modes the GPU
    kernels run: features times spherical harmonics, the usual case, leave the XLA backend)."""
    if mul2 == 1:
        return "uvu"
    if mul1 == 1:
        return "uvv"
    return "uvuv"


@functools.lru_cache(maxsize=512)
def _plan(irreps1: Irreps, irreps2: Irreps, flags1: tuple, flags2: tuple, filter_ir_out, irrep_normalization: str, regroup: bool) -> _Plan:
    """The product of one case (see :class:`_Plan`); cached, so a jitted model builds it once."""
    order1, in1, f1 = _regrouped(irreps1, flags1, regroup)
    order2, in2, f2 = _regrouped(irreps2, flags2, regroup)
    # e3nn's loop: blocks of input 1, of input 2, then ir1 x ir2, each a (mul1 * mul2, ir) block
    blocks = []
    for i1, (mul1, ir1) in enumerate(in1):
        for i2, (mul2, ir2) in enumerate(in2):
            for ir in ir1 * ir2:
                if filter_ir_out is None or ir in filter_ir_out:
                    blocks.append((i1, i2, mul1 * mul2, ir, f1[i1] or f2[i2]))
    out, p, inv = Irreps([(mul, ir) for _, _, mul, ir, _ in blocks]).sort()  # stable, as e3nn's
    flags = tuple(blocks[k][4] for k in inv)
    instructions = sorted(
        (i1, i2, p[k], _mode(in1[i1].mul, in2[i2].mul), False) for k, (i1, i2, mul, _, zero) in enumerate(blocks) if not zero and mul > 0
    )
    tp = None
    if instructions:
        tp = TensorProduct(in1, in2, out, instructions, irrep_normalization=irrep_normalization, path_normalization="element")
    if regroup:
        simple = out.simplify()
        out, flags = simple, _simplified_flags(out, flags, simple)
    return _Plan(order1, order2, in1, in2, tp, out, flags)


def _reorder(array, irreps: Irreps, order: tuple | None):
    """The last axis of `array` with the blocks of `irreps` in `order` (e3nn's ``sort``)."""
    if order is None:
        return array
    slices = irreps.slices()
    return jnp.concatenate([array[..., slices[i]] for i in order], axis=-1)


def _options(filter_ir_out, irrep_normalization):
    if irrep_normalization is None:
        irrep_normalization = e3nn.config("irrep_normalization")
    if irrep_normalization not in ("component", "norm", "none"):
        raise ValueError(f"irrep_normalization must be 'component', 'norm' or 'none', got {irrep_normalization!r}")
    return _filter_irreps(filter_ir_out), irrep_normalization


def tensor_product(
    input1,
    input2,
    *,
    filter_ir_out=None,
    irrep_normalization: str | None = None,
    regroup_output: bool = True,
    backend: str | None = None,
):
    """``e3nn_jax.tensor_product(input1, input2, ...)`` on jequi's kernels: every
    ``(mul1 x ir1) x (mul2 x ir2) -> (mul1 * mul2) x ir_out`` block, unweighted.

    Args:
        input1, input2: ``e3nn_jax.IrrepsArray`` (a plain array is ``Nx0e``, as in e3nn), with
            leading dims that broadcast; or both irreps (``Irreps`` or strings), which gives the
            output irreps alone, as e3nn does.
        filter_ir_out: keep only these output irreps (irreps string, ``Irreps``, an ``Irrep``
            or a list of them); None keeps all.
        irrep_normalization: ``"component"``, ``"norm"`` or ``"none"``; None means e3nn's
            ``e3nn.config("irrep_normalization")``.
        regroup_output: regroup the inputs and the output (sort and merge equal irreps), as
            e3nn does; False keeps one output block per pair of input blocks, sorted.
        backend: jequi's backend (``"xla"``, ...); None picks the default for the product.

    Returns:
        ``IrrepsArray`` with e3nn's irreps, values and zero flags (blocks that a zero-flagged
        input block makes zero are not computed).
    """
    filter_irs, normalization = _options(filter_ir_out, irrep_normalization)
    regroup = bool(regroup_output)
    if isinstance(input1, (str, Irreps)) or isinstance(input2, (str, Irreps)):
        if not (isinstance(input1, (str, Irreps)) and isinstance(input2, (str, Irreps))):
            raise TypeError("tensor_product takes two IrrepsArrays, or two irreps (for the output irreps alone), not one of each")
        irreps1, irreps2 = Irreps(input1), Irreps(input2)
        return _plan(irreps1, irreps2, (False,) * len(irreps1), (False,) * len(irreps2), filter_irs, normalization, regroup).irreps_out

    input1, input2 = e3nn.as_irreps_array(input1), e3nn.as_irreps_array(input2)
    dtype = jnp.result_type(input1.array, input2.array)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.ones(()).dtype  # e3nn: integer inputs give the default float dtype
    x, y = input1.array.astype(dtype), input2.array.astype(dtype)
    try:
        leading = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1])
    except ValueError as exc:
        raise ValueError(f"leading dims of input1 {x.shape} and input2 {y.shape} do not broadcast") from exc

    plan = _plan(input1.irreps, input2.irreps, tuple(input1.zero_flags), tuple(input2.zero_flags), filter_irs, normalization, regroup)
    if plan.tp is None:
        z = jnp.zeros((*leading, plan.irreps_out.dim), dtype)
    else:
        x = _reorder(x, input1.irreps, plan.order1)
        y = _reorder(y, input2.irreps, plan.order2)
        z = plan.tp(x, y, jnp.zeros((0,), dtype), backend=backend)  # broadcasts the leading dims
    return e3nn.IrrepsArray(plan.irreps_out, z, zero_flags=plan.zero_flags)
