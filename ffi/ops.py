"""The CUDA kernels as JAX functions on flat arrays, with the kernel packages' one contract
(``pallas_kernels`` exposes the same functions): the four first-order ops and the sums of a
:class:`~jequi.sums.Sums` over ``arrays = (x, y, w, gz, ggx, ggy, ggw)`` (``gz`` at
``arrays[GZ]``, shared weights where ``arrays[W]`` is 1-D), batched and as the fused
convolution over a :class:`jequi.Graph`; :func:`jequi.backends.kernels.backend` makes a backend
of them."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jequi.dtypes import STORED
from jequi.graph import RowParts, part_edges, row_parts
from jequi.row_fixup import add_extras
from jequi.sums import ALL, FORWARD, Sums

from . import build, build_search, codegen, schedule
from .config import DEFAULT, Config
from .launch import FIRST_ORDER, computed

# The operands' dtypes the generated kernels take: half precision is stored and widened to float32
# as it loads (jequi.dtypes; :meth:`.launch.Plan._result_dtypes` for the results the kernel leaves
# in float32, which are summed here and rounded once).
DTYPES = STORED
# Spill stores (bytes per thread) up to which the double backward's dgz runs inside its
# backward kernel (tp_second, :func:`fuses_second`): fusing paid for a kernel that spilled a
# few hundred bytes, and was a wash for one that spilled about two thousand
# (benchmarks/results/2026-11-26-h100-fused-second-order.md; docs/tuning.md#ops-fused_spill_bytes).
FUSED_SPILL_BYTES = 1024


def available() -> bool:
    """Whether the kernels can run here: a CUDA GPU as JAX's default device and a toolchain.
    On a GPU without the toolchain it warns once, naming the reason: the products the CUDA
    kernels would run then go to Pallas, and that should not happen unsaid."""
    if jax.default_backend() != "gpu":
        return False
    missing = build.toolchain_missing()
    if missing is not None:
        _warn_unbuildable(missing)
    return missing is None


@functools.cache
def _warn_unbuildable(reason: str) -> None:
    import warnings

    warnings.warn(f"jequi: the 'cuda' backend cannot be built on this GPU machine: {reason}; the products it would run use "
                  "'pallas' instead (pip install \"jax[cuda13]\" brings nvcc, or set CUDA_HOME)", RuntimeWarning, stacklevel=3)  # fmt: skip


@functools.lru_cache(maxsize=256)
def unsupported_reason(desc) -> str | None:
    """Why the kernels cannot run `desc` (its trilinear view), or None (once per descriptor:
    every call of a product resolves its backend)."""
    bad = schedule.unsupported(desc)
    if bad:
        return f"the cuda backend runs mode(s) {', '.join(schedule.SUPPORTED_MODES)}, not {', '.join(sorted(bad))}"
    if not schedule.terms(desc):
        return "no path of the product has a nonzero coefficient"
    try:
        codegen.generate(desc, np.dtype(np.float64), "conv_backward")
    except ValueError as exc:
        return str(exc)
    return None


def _zeroed(desc, needs) -> tuple[int, ...]:
    """The results of a backward computing the gradients `needs` that must start at zero
    (:attr:`~jequi.TensorProductDescriptor.untouched`: the kernels write only the segments and
    weights their terms reach; ``gy``'s unread components are stored as zeros), numbered among
    the results computed."""
    x, w = desc.untouched.x, desc.untouched.w
    computed = [i for i, need in enumerate(needs) if need]
    return tuple(computed.index(i) for i, partial in ((0, x), (2, w)) if needs[i] and partial)


# Kernels generated in this process, by (descriptor, dtype, kind, sums, shared, config).
generated: dict[tuple, codegen.Kernel] = {}


def kernel(desc, dtype, kind: str, sums: Sums = FIRST_ORDER, shared: bool = False, config: Config = DEFAULT) -> codegen.Kernel:
    """The generated kernel of `config`, made once per process (:func:`.build_search.make`)."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"the cuda backend runs {', '.join(d.name for d in DTYPES)}, not {dtype}")
    sums = computed(kind, sums)
    key = (desc, dtype, kind, sums, bool(shared), config)
    if key not in generated:
        generated[key] = build_search.make(desc, dtype, kind, sums, shared, config)
    return generated[key]


def clear():
    """Forget the generated kernels (to rebuild them, e.g. with another ``build.CACHE_DIR``)."""
    generated.clear()


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _results(k, named_shapes):
    """The result structs of kernel `k`: ``(name, shape)`` pairs, each in the kernel's dtype
    for that result (:meth:`~.codegen.Kernel.result_dtype`)."""
    return [_struct(shape, k.result_dtype(name)) for name, shape in named_shapes]


def _call(k, arrays, outs, grid_x, scalars, indices=(), zero=()):
    """Run `k` on the operands it takes from ``arrays = (x, y, w, gz, ggx, ggy, ggw)`` (a
    prefix of it where the rest is not read), then `indices`; results `zero` start at zero."""
    operands = [arrays[pos] for pos in k.arrays]
    return build.call(k, (*operands, *indices), outs, grid_x, arrays[0].size, scalars, zero)


def forward_sum(desc, arrays, sums: Sums = FORWARD, config: Config = DEFAULT):
    """``sum of f(arrays[a], arrays[b], arrays[c])`` over the triples ``(a, b, c)`` of
    ``sums.out`` (the default: the product of ``(x, y, w)``)."""
    x, _, w = arrays[:3]
    n = x.shape[0]
    k = kernel(desc, x.dtype, "tp_forward", sums, w.ndim == 1, config)
    zero = (0,) if desc.untouched.out else ()
    return _call(k, arrays, _struct((n, desc.dims[2]), k.result_dtype("out")), -(-n // k.chunk) * k.groups, [n], zero=zero)


def _gradients(k, needs, results, shared: bool, dtype):
    """``(gx, gy, gw)`` in `dtype` (the operands'), with None for those not computed: the
    groups' gy partials and the blocks' shared-weight partials summed (in the kernel's math
    dtype where it is half precision's float32, then rounded once)."""
    results = iter(results)
    gx, gy, gw = (next(results) if need else None for need in needs)
    if gy is not None:
        gy = jnp.sum(gy, axis=-3) if k.groups > 1 else gy[..., 0, :, :]
    if gw is not None and shared:
        gw = jnp.sum(gw, axis=-2)
    return tuple(None if g is None else g.astype(dtype) for g in (gx, gy, gw))


def backward_sum(desc, arrays, sums: Sums, config: Config = DEFAULT):
    """``(gx, gy, gw)``: each the sum of the backward against ``gz = arrays[GZ]`` over its
    pairs in ``sums.pairs``; None for a gradient without pairs."""
    return _batched_backward(desc, arrays, "tp_backward", sums.of_kind(backward=True), config)


def second_sum(desc, arrays, sums: Sums, config: Config = DEFAULT):
    """``(gx, gy, gw, out)``: :func:`backward_sum` and :func:`forward_sum` of `sums` in one
    kernel (``tp_second``), which reads each row's operands once for both; see
    :func:`fuses_second` for when it runs."""
    return _batched_backward(desc, arrays, "tp_second", sums, config)


def _batched_backward(desc, arrays, kind: str, sums: Sums, config: Config):
    """The results of a batched backward `kind`: the gradients `sums` asks for, then
    ``tp_second``'s forward sum."""
    x, _, w = arrays[:3]
    n = x.shape[0]
    d1, d2, dout = desc.dims
    shared = w.ndim == 1
    k = kernel(desc, x.dtype, kind, sums, shared, config)
    blocks = -(-n // k.chunk)
    shapes = [("gx", (n, d1)), ("gy", (k.groups, n, d2)), ("gw", (blocks, desc.weight_numel) if shared else (n, desc.weight_numel))]
    outs = _results(k, [s for s, need in zip(shapes, sums.needs) if need])
    zero = _zeroed(desc, sums.needs)
    fused = kind == "tp_second"
    if fused:
        outs += _results(k, [("out", (n, dout))])
        zero += (len(outs) - 1,) if desc.untouched.out else ()
    results = _call(k, arrays, outs, blocks * k.groups, [n], zero=zero)
    gradients = _gradients(k, sums.needs, results[:-1] if fused else results, shared, x.dtype)
    return (*gradients, results[-1]) if fused else gradients


def fuses_second(desc, dtype, sums: Sums, shared: bool = False, config: Config = DEFAULT) -> bool:
    """Whether the double backward's ``dgz`` (``sums.out``) and gradients (``sums.pairs``) run
    as one kernel (:func:`second_sum`) in `dtype` (with `shared` weights) rather than two: both wanted, every output segment of `desc`
    reached from one ``x`` segment (:func:`~.schedule.outputs_follow_x`), and the fused kernel
    spilling at most :data:`FUSED_SPILL_BYTES` (it is then built, once). One kernel reads each
    row once, and was the faster on every product measured; the two-kernel alternative stays
    only for products the fused one cannot run (docs/tuning.md#schedule-fused_second_order)."""
    if not (sums.out and any(sums.pairs) and schedule.outputs_follow_x(desc)):
        return False
    k = kernel(desc, dtype, "tp_second", sums, shared, config)
    return build.resources(build.cubin(k.source))["spill_stores"] <= FUSED_SPILL_BYTES


def forward(desc, x, y, w, config: Config = DEFAULT):
    """``z (N, out.dim)`` from ``x (N, in1.dim)``, ``y (N, in2.dim)``, ``w (N, nw)`` or ``(nw,)``."""
    return forward_sum(desc, (x, y, w), FORWARD, config)


def backward(desc, x, y, w, gz, needs=ALL, config: Config = DEFAULT):
    """``(gx, gy, gw)``, None for those not flagged in `needs`; shared weights get ``gw``
    summed over rows."""
    return backward_sum(desc, (x, y, w, gz), Sums.gradients(needs), config)


def _no_kahan(kahan: bool):
    if kahan:
        raise ValueError("the CUDA kernels have no compensated (Kahan) sums; use backend='pallas'")


def _parts(offsets, graph) -> RowParts:
    """The row parts the conv kernels' blocks walk (:func:`jequi.graph.row_parts`: hubs split)."""
    return row_parts(offsets, graph.num_edges, part_edges(offsets.shape[-1] - 1, graph.num_edges))


def _conv_call(k, arrays, graph, parts: RowParts, order, other, outs, zero):
    """Run conv kernel `k`, a block per row part and group, on its operands, `order` and
    `other` (the walk's edge order and the other end of each edge) and the parts."""
    scalars = [graph.num_nodes, graph.num_senders, graph.num_edges, parts.num_parts, max(1, parts.num_extras)]
    indices = (order, other, parts.offsets, parts.rows, parts.slots)
    return _call(k, arrays, outs, parts.num_parts * k.groups, scalars, indices, zero)


def conv_forward_sum(desc, arrays, graph, sums: Sums = FORWARD, config: Config = DEFAULT, *, kahan: bool = False):
    """:func:`forward_sum` of the fused convolution over `graph`: ``x``-like rows gathered by
    sender, the sums of each receiver's edges (hubs in parts, their partial sums added after).
    `kahan` (compensated sums) is refused."""
    _no_kahan(kahan)
    x, _, w = arrays[:3]
    k = kernel(desc, x.dtype, "conv_forward", sums, w.ndim == 1, config)
    parts = _parts(graph.receiver_offsets, graph)
    outs = _results(k, [("out", (graph.num_nodes, desc.dims[2])), ("extra", (max(1, parts.num_extras), desc.dims[2]))])
    zero = (0, 1) if desc.untouched.out else ()
    out, extras = _conv_call(k, arrays, graph, parts, graph.receiver_order, graph.receiver_senders, outs, zero)
    return add_extras(out, extras, parts.firsts).astype(x.dtype)


def conv_backward_sum(desc, arrays, graph, sums: Sums, config: Config = DEFAULT, *, kahan: bool = False):
    """:func:`backward_sum` of the fused convolution over `graph`: ``gx`` per sender, ``gy``
    and ``gw`` per edge; with ``config.atomic_conv_backward`` from a receiver walk that adds
    ``gx`` with atomics (fewer bytes through L2, not bitwise deterministic; ``codegen``'s
    ``conv_atomic_backward``). `kahan` (compensated sums) is refused."""
    _no_kahan(kahan)
    x, _, w = arrays[:3]
    d1, d2, _ = desc.dims
    shared = w.ndim == 1
    atomic = config.atomic_conv_backward
    sums = sums.of_kind(backward=True)
    k = kernel(desc, x.dtype, "conv_atomic_backward" if atomic else "conv_backward", sums, shared, config)
    ns, e = graph.num_senders, graph.num_edges
    if atomic:  # the receivers' CSR with the dropped edges as a last row
        offsets = jnp.concatenate([graph.receiver_offsets, jnp.full(graph.receiver_offsets.shape[:-1] + (1,), e, jnp.int32)], -1)
        order, other = graph.receiver_order, graph.receiver_senders
    else:
        offsets, order, other = graph.sender_offsets, graph.sender_order, graph.sender_receivers
    parts = _parts(offsets, graph)
    shapes = [("gx", (ns, d1)), ("gy", (k.groups, e, d2)), ("gw", (parts.num_parts, desc.weight_numel) if shared else (e, desc.weight_numel))]
    outs = _results(k, [s for s, need in zip(shapes, sums.needs) if need])
    zero = {*_zeroed(desc, sums.needs), *((0,) if atomic and sums.needs[0] else ())}
    extras = not atomic and sums.needs[0]
    if extras:  # the gx partial sums of the senders' parts past their first, after gx
        outs.insert(1, _struct((max(1, parts.num_extras), d1), k.result_dtype("gxe")))
        zero = {i + (i > 0) for i in zero} | ({1} if 0 in zero else set())
    results = list(_conv_call(k, arrays, graph, parts, order, other, outs, tuple(sorted(zero))))
    if extras:
        gx, gx_extras = results[:2]
        results[:2] = [add_extras(gx, gx_extras, parts.firsts[..., : ns + 1])]
    return _gradients(k, sums.needs, results, shared, x.dtype)


def conv_forward(desc, x, y, w, graph, config: Config = DEFAULT, *, kahan: bool = False):
    """``out (num_nodes, out.dim)``: the sum over each receiver's edges of the product of its
    sender's ``x`` row and the edge's ``y`` and ``w`` rows."""
    return conv_forward_sum(desc, (x, y, w), graph, FORWARD, config, kahan=kahan)


def conv_backward(desc, x, y, w, gz, graph, needs=ALL, config: Config = DEFAULT, *, kahan: bool = False):
    """``(gx, gy, gw)`` of :func:`conv_forward` for the output cotangent ``gz``, None for those
    not flagged in `needs`."""
    return conv_backward_sum(desc, (x, y, w, gz), graph, Sums.gradients(needs), config, kahan=kahan)
