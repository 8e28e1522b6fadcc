"""The CUDA kernels as JAX functions on flat arrays (the ``"cuda"`` backend's four ops)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import build, codegen, schedule

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
# Spill stores (bytes per thread) a kernel under the register cap of Config.min_warps may have
# before it is rebuilt under a looser one: a few words in L1 cost less than half the warps.
SPILL_BYTES = 64


def available() -> bool:
    """Whether the kernels can run here: a CUDA GPU as JAX's default device and a toolchain."""
    return jax.default_backend() == "gpu" and build.toolchain_missing() is None


@functools.lru_cache(maxsize=256)
def unsupported_reason(desc) -> str | None:
    """Why the kernels cannot run `desc` (its trilinear view), or None (once per descriptor:
    every call of a product resolves its backend)."""
    bad = schedule.unsupported(desc)
    if bad:
        return f"the cuda backend runs mode(s) {', '.join(schedule.SUPPORTED_MODES)}, not {', '.join(sorted(bad))}"
    try:
        codegen.generate(desc, np.dtype(np.float64), "conv_backward")
    except ValueError as exc:
        return str(exc)
    return None


# Kernels generated in this process, by (descriptor, dtype, kind, needs, shared).
generated: dict[tuple, codegen.Kernel] = {}


def kernel(desc, dtype, kind: str, needs=(True, True, True), shared: bool = False) -> codegen.Kernel:
    """The generated kernel (made once per process, with the schedule's current config)."""
    dtype = np.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"the cuda backend runs float32 and float64, not {dtype}")
    key = (desc, dtype, kind, tuple(needs), bool(shared))
    if key not in generated:
        # the register cap of Config.min_warps, loosened until the kernel (nearly) stops spilling
        most = schedule.DEFAULT.min_warps
        for warps in dict.fromkeys((most, most * 3 // 4, most // 2, 0)):
            k = codegen.generate(desc, dtype, kind, needs, shared, dataclasses.replace(schedule.DEFAULT, min_warps=warps))
            if build.resources(build.cubin(k.source))["spill_stores"] <= SPILL_BYTES:
                break
        generated[key] = k
    return generated[key]


def clear():
    """Forget the generated kernels (after a change of ``schedule.DEFAULT``)."""
    generated.clear()


def _struct(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def forward(desc, x, y, w):
    n = x.shape[0]
    _, _, dout = desc.dims
    k = kernel(desc, x.dtype, "tp_forward", shared=w.ndim == 1)
    return build.call(k, (x, y, w), _struct((n, dout), x.dtype), -(-n // k.chunk) * k.groups, x.size, [n])


def _gradients(k, needs, results, shared: bool):
    """``(gx, gy, gw)`` with None for those not computed: the groups' gy partials and the
    blocks' shared-weight partials summed."""
    results = iter(results)
    gx, gy, gw = (next(results) if need else None for need in needs)
    if gy is not None:
        gy = jnp.sum(gy, axis=-3) if k.groups > 1 else gy[..., 0, :, :]
    if gw is not None and shared:
        gw = jnp.sum(gw, axis=-2)
    return gx, gy, gw


def backward(desc, x, y, w, gz, needs=(True, True, True)):
    n = x.shape[0]
    d1, d2, _ = desc.dims
    shared = w.ndim == 1
    k = kernel(desc, x.dtype, "tp_backward", tuple(needs), shared)
    blocks = -(-n // k.chunk)
    shapes = [(n, d1), (k.groups, n, d2), (blocks, desc.weight_numel) if shared else (n, desc.weight_numel)]
    outs = [_struct(s, x.dtype) for s, need in zip(shapes, needs) if need]
    results = build.call(k, (x, y, w, gz), outs, blocks * k.groups, x.size, [n])
    return _gradients(k, needs, results, shared)


def conv_forward(desc, x, y, w, graph):
    _, _, dout = desc.dims
    k = kernel(desc, x.dtype, "conv_forward", shared=w.ndim == 1)
    args = (x, y, w, graph.receiver_order, graph.receiver_senders, graph.receiver_offsets)
    scalars = [graph.num_nodes, graph.num_senders, graph.num_edges]
    return build.call(k, args, _struct((graph.num_nodes, dout), x.dtype), graph.num_nodes * k.groups, x.size, scalars)


def conv_backward(desc, x, y, w, gout, graph, needs=(True, True, True)):
    d1, d2, _ = desc.dims
    shared = w.ndim == 1
    k = kernel(desc, x.dtype, "conv_backward", tuple(needs), shared)
    ns, e = graph.num_senders, graph.num_edges
    shapes = [(ns, d1), (k.groups, e, d2), (ns + 1, desc.weight_numel) if shared else (e, desc.weight_numel)]
    outs = [_struct(s, x.dtype) for s, need in zip(shapes, needs) if need]
    args = (x, y, w, gout, graph.sender_order, graph.sender_receivers, graph.sender_offsets)
    results = build.call(k, args, outs, (ns + 1) * k.groups, x.size, [graph.num_nodes, ns, e])
    return _gradients(k, needs, results, shared)
