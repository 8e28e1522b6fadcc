"""The public tensor-product object: ``TensorProduct``, ``channelwise``, ``fully_connected``."""

from __future__ import annotations

import dataclasses
import functools
import math

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np

from . import backends
from . import graph as graph_lib
from . import autodiff, dtypes
from .descriptor import TensorProductDescriptor
from .irreps import Irreps, as_irreps


@functools.lru_cache(maxsize=512)
def _tp_kernels(desc: TensorProductDescriptor, backend: str) -> autodiff.Kernels:
    b = backends.BACKENDS[backend]
    forward, backward = functools.partial(b.forward, desc), functools.partial(b.backward, desc)
    second = functools.partial(b.second, desc) if b.second else autodiff.composed_second(forward, backward)
    return autodiff.Kernels(forward, backward, second, name=f"{backend}: {desc}")


@functools.lru_cache(maxsize=512)
def _conv_kernels(desc: TensorProductDescriptor, backend: str, static: tuple, kahan: bool) -> autodiff.Kernels:
    b = backends.BACKENDS[backend]
    options = {"kahan": True} if kahan else {}

    def unpack(arrays):
        return graph_lib.Graph.from_index_arrays(arrays, static)

    def forward(x, y, w, *g):
        return b.conv_forward(desc, x, y, w, unpack(g), **options)

    def backward(x, y, w, gout, *g, needs):
        return b.conv_backward(desc, x, y, w, gout, unpack(g), needs=needs, **options)

    def second(spec, arrays, *g):
        return b.conv_second(desc, spec, arrays, unpack(g), **options)

    second = second if b.conv_second else autodiff.composed_second(forward, backward)
    return autodiff.Kernels(forward, backward, second, name=f"{backend} conv{' kahan' if kahan else ''}: {desc}")


def _unwrap(value, irreps: Irreps, name: str, layout: str):
    """Plain array of an input; checks an IrrepsArray's irreps. Returns (array, was_irreps_array).

    An ``IrrepsArray`` holds e3nn's ``mul_ir`` layout, so a product in ``ir_mul`` refuses it
    (its values would be read in the wrong order without any error)."""
    if isinstance(value, e3nn.IrrepsArray):
        if layout != "mul_ir":
            raise ValueError(
                f"{name} is an e3nn_jax.IrrepsArray (layout mul_ir) but this jequi.TensorProduct has "
                f"layout={layout!r}: pass {name}.array transposed to {layout} as a plain array, or build "
                "the product with layout='mul_ir'"
            )
        if value.irreps.simplify() != irreps.simplify():
            raise ValueError(f"{name} has irreps {value.irreps}, expected {irreps}")
        return value.array, True
    if value is None:
        raise TypeError(f"{name} is required")
    return value, False


def _cast(a, dtype):
    """`a` (an array or ``IrrepsArray``) in `dtype`."""
    if isinstance(a, e3nn.IrrepsArray):
        return e3nn.IrrepsArray(a.irreps, a.array.astype(dtype))
    return jnp.asarray(a).astype(dtype)


def _float_dtype(*arrays):
    for name, a in arrays:
        dtype = jnp.result_type(a)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(f"{name} must be a floating-point array, got dtype {dtype}")
    return jnp.result_type(*(a for _, a in arrays))


class TensorProduct:
    """A Clebsch-Gordan tensor product ``z = w . P . (x (x) y)``, as e3nn defines it.

    Args:
        irreps_in1, irreps_in2, irreps_out: irreps of ``x``, ``y`` and ``z`` (strings in e3nn
            notation or ``e3nn_jax.Irreps``).
        instructions: e3nn tuples ``(i_in1, i_in2, i_out, mode, has_weight[, path_weight])``;
            modes ``uvw``, ``uvu``, ``uvv``, ``uuw``, ``uuu``, ``uvuv``.
        shared_weights: if True, ``w`` must be one ``(weight_numel,)`` vector for all rows.
            (A 1-D ``w`` is always broadcast as shared weights.)
        irrep_normalization: ``"component"``, ``"norm"`` or ``"none"``.
        path_normalization: ``"element"``, ``"path"`` or an exponent in [0, 1].
        gradient_normalization: ``"path"`` (e3nn-jax's default: normalization in the forward
            pass) or ``"element"`` (normalization in the weights' init, see
            :attr:`weight_std`), or an exponent.
            These three take ``None`` (the default) as e3nn does: the value of ``e3nn.config``
            when the product is built.
        layout: ``"mul_ir"`` (e3nn's) or ``"ir_mul"`` (cuEquivariance's) for x, y and z.
        in1_var, in2_var, out_var: e3nn's per-irrep input and output variances (None: ones),
            which scale the paths' normalization as in ``FunctionalTensorProduct``.

    Values and weight order equal
    ``e3nn_jax.legacy.FunctionalTensorProduct(...).left_right(w, x, y)`` row by row.
    """

    def __init__(
        self,
        irreps_in1,
        irreps_in2,
        irreps_out,
        instructions,
        shared_weights: bool = False,
        irrep_normalization: str | None = None,
        path_normalization=None,
        gradient_normalization=None,
        layout: str = "mul_ir",
        *,
        in1_var=None,
        in2_var=None,
        out_var=None,
    ):
        self.descriptor = TensorProductDescriptor(
            irreps_in1,
            irreps_in2,
            irreps_out,
            instructions,
            in1_var=in1_var,
            in2_var=in2_var,
            out_var=out_var,
            irrep_normalization=irrep_normalization,
            path_normalization=path_normalization,
            gradient_normalization=gradient_normalization,
            layout=layout,
        )
        self.shared_weights = bool(shared_weights)

    def _irreps_array(self, z) -> e3nn.IrrepsArray:
        """`z` as e3nn's ``IrrepsArray``, its output blocks that no path reaches flagged zero
        (as e3nn's products flag them, so e3nn's ops can skip them)."""
        return e3nn.IrrepsArray(self.irreps_out, z, zero_flags=self._zero_flags)

    @functools.cached_property
    def _zero_flags(self) -> tuple[bool, ...]:
        reached = {p.i_out for p in self.descriptor.active_paths}
        return tuple(i not in reached for i in range(len(self.irreps_out)))

    # --- descriptive properties ---------------------------------------------------------
    irreps_in1 = property(lambda self: self.descriptor.irreps_in1)
    irreps_in2 = property(lambda self: self.descriptor.irreps_in2)
    irreps_out = property(lambda self: self.descriptor.irreps_out)
    instructions = property(lambda self: self.descriptor.instructions)

    @property
    def weight_numel(self) -> int:
        """Length of the flat weight vector of one row."""
        return self.descriptor.weight_numel

    @property
    def weight_std(self) -> np.ndarray:
        """Per-weight init standard deviation (e3nn's ``weight_std``), shape ``(weight_numel,)``."""
        return np.concatenate(
            [np.full(p.weight_numel, p.weight_std) for p in self.descriptor.paths] or [np.zeros(0)]
        )

    def __repr__(self) -> str:
        return (
            f"TensorProduct({self.irreps_in1} x {self.irreps_in2} -> {self.irreps_out}, "
            f"{len(self.descriptor.paths)} paths, {self.weight_numel} weights)"
        )

    # --- argument handling --------------------------------------------------------------
    def _weights(self, w):
        if w is None:
            if self.weight_numel:
                raise TypeError(f"w is required: this product has {self.weight_numel} weights")
            return jnp.zeros((0,), jnp.float32)
        w = jnp.asarray(w) if not isinstance(w, jax.Array) else w
        if w.ndim == 0 or w.shape[-1] != self.weight_numel:
            raise ValueError(f"w has shape {w.shape}; its last axis must be weight_numel={self.weight_numel}")
        if self.shared_weights and w.ndim != 1:
            raise ValueError(f"shared_weights=True needs w of shape ({self.weight_numel},), got {w.shape}")
        return w

    def _inputs(self, x, y, w):
        x, wrap_x = _unwrap(x, self.irreps_in1, "x", self.descriptor.layout)
        y, wrap_y = _unwrap(y, self.irreps_in2, "y", self.descriptor.layout)
        x, y = jnp.asarray(x), jnp.asarray(y)
        w = self._weights(w)
        dtype = _float_dtype(("x", x), ("y", y), ("w", w))
        d1, d2, _ = self.descriptor.dims
        for name, a, d, irreps in (("x", x, d1, self.irreps_in1), ("y", y, d2, self.irreps_in2)):
            if a.ndim == 0 or a.shape[-1] != d:
                raise ValueError(f"{name} has shape {a.shape}; its last axis must be {irreps}.dim={d}")
        return x.astype(dtype), y.astype(dtype), w.astype(dtype), wrap_x or wrap_y

    def _kernel_weights(self, w):
        """Weights of the trilinear view: w followed by ones for the unweighted paths."""
        extra = self.descriptor.trilinear.weight_numel - self.weight_numel
        if not extra:
            return w
        return jnp.concatenate([w, jnp.ones((*w.shape[:-1], extra), w.dtype)], axis=-1)

    # --- calls ------------------------------------------------------------------------------
    def __call__(self, x, y, w=None, *, backend: str | None = None, out_dtype=None, math_dtype=None):
        """``z[...] = tp(x[...], y[...], w[...])`` with broadcasting over leading dims.

        ``x (..., in1.dim)``, ``y (..., in2.dim)``, ``w (..., weight_numel)`` or shared
        ``(weight_numel,)``; ``IrrepsArray`` inputs give an ``IrrepsArray`` output.
        ``backend``: ``"xla"`` (pure JAX) or another registered backend; default: the fastest
        available on the default JAX platform. ``out_dtype`` (default: the inputs' promoted
        dtype) and ``math_dtype`` (float32 or float64; default float32 for half-precision
        inputs, else their dtype): :func:`jequi.dtypes.plan`.
        """
        x, y, w, wrap = self._inputs(x, y, w)
        p = dtypes.plan(x.dtype, out_dtype, math_dtype)
        x, y, w = p.inputs(x, y, w)
        shared = w.ndim == 1
        b = backends.resolve(backend, self.descriptor.trilinear, shared, dtype=p.stored)
        try:
            batch = jnp.broadcast_shapes(x.shape[:-1], y.shape[:-1], () if shared else w.shape[:-1])
        except ValueError as exc:
            raise ValueError(
                f"leading dims of x {x.shape}, y {y.shape} and w {w.shape} do not broadcast"
            ) from exc
        d1, d2, dout = self.descriptor.dims
        n = math.prod(batch)
        if n == 0 or dout == 0:
            z = jnp.zeros((*batch, dout), p.out)
        else:
            xf = jnp.broadcast_to(x, (*batch, d1)).reshape(n, d1)
            yf = jnp.broadcast_to(y, (*batch, d2)).reshape(n, d2)
            wf = w if shared else jnp.broadcast_to(w, (*batch, w.shape[-1])).reshape(n, -1)
            wf = self._kernel_weights(wf)
            z = autodiff.apply(_tp_kernels(self.descriptor.trilinear, b.name), xf, yf, wf, z_shape=(n, dout))
            z = p.output(z.reshape(*batch, dout))
        return self._irreps_array(z) if wrap else z

    def conv(self, x, y, w, graph, receivers=None, num_nodes=None, *, backend: str | None = None, kahan: bool = False,
             out_dtype=None, math_dtype=None):  # fmt: skip
        """Fused graph convolution ``out[r] = sum_{e: receivers[e]=r} tp(x[senders[e]], y[e], w[e])``.

        ``x (num_senders, in1.dim)`` node features, ``y (E, in2.dim)`` and ``w (E,
        weight_numel)`` (or shared ``(weight_numel,)``) per edge. The graph is a
        :class:`jequi.Graph` (build it once per structure and reuse it in every layer), or
        raw ``senders, receivers[, num_nodes]`` integer ``(E,)`` arrays in any order, from which
        one is built on each call; ``num_nodes`` (static int, default ``x.shape[0]``) is the
        number of output rows. Edges whose sender or receiver is out of range contribute
        nothing (see :mod:`jequi.graph`). Batches of equal-size graphs: ``jax.vmap``.

        ``kahan=True`` (``backend="pallas"``): compensated summation of each node's sums, for
        f32 accuracy on high-degree nodes.

        The ``pallas`` and ``cuda`` convs are bitwise reproducible from run to run;
        ``"cuda-atomic"`` (GPU, channelwise products) adds the backward's ``gx`` with
        atomics: faster on wide products such as MACE's (docs/benchmarks.md), not reproducible
        bit for bit.

        ``out_dtype`` and ``math_dtype``: as for :meth:`__call__` (:func:`jequi.dtypes.plan`).
        """
        x, y, w, wrap = self._inputs(x, y, w)
        p = dtypes.plan(x.dtype, out_dtype, math_dtype)
        x, y, w = p.inputs(x, y, w)
        b = backends.resolve(backend, self.descriptor.trilinear, w.ndim == 1, conv=True, dtype=p.stored)
        if kahan and not b.supports_kahan:
            raise ValueError(f"kahan=True needs a backend with compensated sums (pallas), not {b.name!r}")
        if x.ndim != 2 or y.ndim != 2 or w.ndim > 2:
            raise ValueError(
                f"conv takes x (nodes, {x.shape[-1]}), y (edges, {y.shape[-1]}) and w (edges, "
                f"{self.weight_numel}) or ({self.weight_numel},); got {x.shape}, {y.shape}, {w.shape} "
                "(use jax.vmap for batches of graphs)"
            )
        num_edges = y.shape[0]
        if w.ndim == 2 and w.shape[0] != num_edges:
            raise ValueError(f"w has {w.shape[0]} rows but y has {num_edges} edges")
        if isinstance(graph, graph_lib.Graph):
            if receivers is not None or num_nodes is not None:
                raise TypeError("pass either a Graph or senders, receivers[, num_nodes], not both")
            if graph.num_senders != x.shape[0]:
                raise ValueError(f"the graph has {graph.num_senders} senders but x has {x.shape[0]} rows")
            if graph.num_edges != num_edges:
                raise ValueError(f"the graph has {graph.num_edges} edges but y has {num_edges}")
        else:
            if receivers is None:
                raise TypeError("conv needs a Graph or both senders and receivers")
            graph_lib.check_indices(graph, receivers, num_edges)
            num_nodes = graph_lib.check_num_nodes(x.shape[0] if num_nodes is None else num_nodes)
            graph = graph_lib.Graph.build(graph, receivers, num_nodes, x.shape[0])
        dout = self.descriptor.dims[2]
        if num_edges == 0 or x.shape[0] == 0 or graph.num_nodes == 0 or dout == 0:
            out = jnp.zeros((graph.num_nodes, dout), p.out)
        else:
            kernels = _conv_kernels(self.descriptor.trilinear, b.name, graph.static, bool(kahan))
            out = autodiff.apply(kernels, x, y, self._kernel_weights(w), *graph.index_arrays, z_shape=(graph.num_nodes, dout))
            out = p.output(out)
        return self._irreps_array(out) if wrap else out

    def radial_conv(self, x, y, hidden, kernel, graph, receivers=None, num_nodes=None, *, hidden_fn=None, edge_chunks: int | None = None,
                    dtype=None, backend: str | None = None, kahan: bool = False, out_dtype=None, math_dtype=None):  # fmt: skip
        """:meth:`conv` with per-edge weights ``w = hidden_fn(hidden) @ kernel`` (a radial MLP),
        without the whole ``(E, weight_numel)`` weight array in memory.

        ``hidden (E, B)``: per-edge inputs of the MLP; ``hidden_fn``: its layers before the last
        (rows ``(e, B) -> (e, H)``; None: the identity, ``hidden`` are the last hidden values);
        ``kernel (H, weight_numel)``: its last layer's matrix. The edges run in ``edge_chunks``
        chunks (default: enough that one chunk's weights hold at most
        :func:`edge_chunk_values`, an eighth of the GPU's memory); each chunk's hidden values and weights are computed,
        used and dropped, and recomputed for the backward (``jax.checkpoint``), so the memory
        of a model's largest graph is set by its ``B`` inputs a edge rather than
        ``weight_numel`` weights (or ``H`` hidden values) a edge. One chunk is plain
        ``conv(x, y, hidden_fn(hidden) @ kernel, graph)``. The graph is a :class:`jequi.Graph`
        or raw ``senders, receivers[, num_nodes]``, as :meth:`conv` takes them; every backend,
        derivative order and ``vmap`` works as for :meth:`conv`.

        ``dtype``: the dtype the conv's operands are stored in (``x``, ``y`` and the weights,
        rounded to it as they are made; the output is in it too), e.g. ``jnp.bfloat16`` for a
        half-precision policy (docs/precision.md); None: as :meth:`conv` promotes them.
        ``out_dtype`` and ``math_dtype``: as for :meth:`conv` (:func:`jequi.dtypes.plan`). The
        chunks' results are summed in the math dtype and rounded once, at the end.
        """
        if isinstance(graph, graph_lib.Graph):
            if receivers is not None or num_nodes is not None:
                raise TypeError("pass either a Graph or senders, receivers[, num_nodes], not both")
        else:  # raw indices, as conv takes them: a Graph built here (build one per structure to reuse it)
            if receivers is None:
                raise TypeError("radial_conv needs a Graph or both senders and receivers")
            rows = jnp.shape(x.array if isinstance(x, e3nn.IrrepsArray) else x)[0]
            graph_lib.check_indices(graph, receivers, jnp.shape(hidden)[0])
            num_nodes = graph_lib.check_num_nodes(rows if num_nodes is None else num_nodes)
            graph = graph_lib.Graph.build(graph, receivers, num_nodes, rows)
        hidden, kernel = jnp.asarray(hidden), jnp.asarray(kernel)
        hidden_fn = (lambda h: h) if hidden_fn is None else hidden_fn
        if kernel.ndim != 2 or kernel.shape[1] != self.weight_numel:
            raise ValueError(f"kernel has shape {kernel.shape}; expected (hidden, weight_numel={self.weight_numel})")
        if hidden.ndim != 2 or hidden.shape[0] != graph.num_edges:
            raise ValueError(f"hidden has shape {hidden.shape}; expected (edges={graph.num_edges}, features)")
        width = jax.eval_shape(hidden_fn, jax.ShapeDtypeStruct(hidden.shape, hidden.dtype)).shape
        if width != (graph.num_edges, kernel.shape[0]):
            raise ValueError(f"hidden_fn(hidden) has shape {width}; expected (edges, hidden) = ({graph.num_edges}, {kernel.shape[0]})")
        num_edges = graph.num_edges
        if jnp.shape(y)[0] != num_edges:  # before the chunks cut y (conv checks the rest)
            raise ValueError(f"y has {jnp.shape(y)[0]} rows but the graph has {num_edges} edges")
        if dtype is not None:
            if not jnp.issubdtype(dtype, jnp.floating):
                raise TypeError(f"dtype must be a floating dtype, got {dtype}")
            x, y = _cast(x, dtype), _cast(y, dtype)

        def weights(h):
            w = hidden_fn(h) @ kernel
            return w if dtype is None else w.astype(dtype)

        if edge_chunks is None:
            edge_chunks = -(-num_edges * self.weight_numel // edge_chunk_values(hidden.dtype if dtype is None else dtype))
        if not isinstance(edge_chunks, int) or edge_chunks < 1:
            raise ValueError(f"edge_chunks must be a positive int, got {edge_chunks!r}")
        edge_chunks = min(edge_chunks, max(num_edges, 1))
        if edge_chunks == 1:
            return self.conv(x, y, weights(hidden), graph, backend=backend, kahan=kahan, out_dtype=out_dtype, math_dtype=math_dtype)
        # each chunk's conv returns in the math dtype and the chunks are summed in it (jequi.dtypes:
        # partial sums after a kernel stay in float32 for half precision); one rounding at the end
        stored = jnp.result_type(*(a.array if isinstance(a, e3nn.IrrepsArray) else a for a in (x, y)),
                                 jax.eval_shape(weights, jax.ShapeDtypeStruct(hidden.shape, hidden.dtype)).dtype)  # fmt: skip
        p = dtypes.plan(stored, out_dtype, math_dtype)

        wrap = isinstance(x, e3nn.IrrepsArray) or isinstance(y, e3nn.IrrepsArray)
        x, _ = _unwrap(x, self.irreps_in1, "x", self.descriptor.layout)
        y, _ = _unwrap(y, self.irreps_in2, "y", self.descriptor.layout)
        # converted here once, not by every chunk's conv (and its recomputation in the backward)
        x, y = jnp.asarray(x).astype(p.math), jnp.asarray(y).astype(p.math)
        size = -(-num_edges // edge_chunks)
        pad = edge_chunks * size - num_edges

        def chunked(a, fill):
            a = jnp.concatenate([a, jnp.full((pad, *a.shape[1:]), fill, a.dtype)]) if pad else a
            return a.reshape(edge_chunks, size, *a.shape[1:])

        # padding edges go to receiver num_nodes: out of range, they contribute nothing
        build = lambda s, r: graph_lib.Graph.build(s, r, graph.num_nodes, graph.num_senders)  # noqa: E731
        graphs = jax.vmap(build)(chunked(graph.senders, 0), chunked(graph.receivers, graph.num_nodes))
        # consecutive edges of a graph in receiver order are in receiver order (padding last)
        graphs = dataclasses.replace(graphs, edges_sorted=graph.edges_sorted)

        # prevent_cse (the default): where XLA unrolls the scan, the backward's recomputed weights
        # must not be merged with the forward's, which would keep every chunk's until the backward
        @jax.checkpoint
        def part(x, kernel, h, y, g):
            return self.conv(x, y, weights(h), g, backend=backend, kahan=kahan, out_dtype=p.math, math_dtype=math_dtype)

        def step(out, chunk):
            return out + part(x, kernel, *chunk), None

        # the first chunk starts the sum: a zeros carry would not be typed as varying over the
        # mesh axes where this runs inside shard_map (jequi.models.distributed), and XLA keeps
        # one zeros array of the output's size alive from one layer's scan to the next. Its inputs
        # pass a barrier with x, else XLA computes its weights (which read no layer's features)
        # where the radial basis is made, and every layer's stay alive until that layer runs.
        chunks = (chunked(hidden, 0), chunked(y, 0), graphs)
        x, first = jax.lax.optimization_barrier((x, jax.tree.map(lambda a: a[0], chunks)))
        out = part(x, kernel, *first)
        out, _ = jax.lax.scan(step, out, jax.tree.map(lambda a: a[1:], chunks))
        out = p.output(out)
        return self._irreps_array(out) if wrap else out


# One chunk of TensorProduct.radial_conv may hold this fraction of the device's memory in
# weights (EDGE_CHUNK_VALUES values where the device reports none, the CPU): fewer chunks, fewer
# recomputed radial-MLP matmuls in the backward, with room left for cotangents
# (docs/tuning.md#radial_conv-edge_chunk_values).
EDGE_CHUNK_FRACTION = 1 / 8
EDGE_CHUNK_VALUES = 2**30


def edge_chunk_values(dtype) -> int:
    """The most weights one chunk of :meth:`TensorProduct.radial_conv` holds by default, for
    weights of `dtype`: :data:`EDGE_CHUNK_FRACTION` of the device's memory."""
    limit = _bytes_limit()
    return int(limit * EDGE_CHUNK_FRACTION) // jnp.dtype(dtype).itemsize if limit else EDGE_CHUNK_VALUES


def _bytes_limit() -> int | None:
    """This process's first device's memory as XLA's allocator reports it, or None (the CPU;
    another process's devices report none)."""
    return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


def channelwise(irreps_in1, irreps_in2, filter_irreps_out, **kwargs) -> TensorProduct:
    """The MACE/NequIP channelwise (``uvu``) product.

    One weighted ``uvu`` path for every ``(in1, in2, ir_out)`` with ``ir_out`` in
    ``ir1 x ir2`` and in ``filter_irreps_out`` (None: every ``ir_out``, as e3nn's
    ``filter_ir_out=None``); each path gets its own ``mul_in1 x ir_out`` output block, and
    output blocks are sorted by irrep (as MACE's ``tp_out_irreps_with_instructions`` and
    OpenEquivariance's ``ChannelwiseTPP``).
    """
    irreps_in1 = as_irreps(irreps_in1, "irreps_in1")
    irreps_in2 = as_irreps(irreps_in2, "irreps_in2")
    allowed = None
    if filter_irreps_out is not None:
        allowed = {ir for _, ir in as_irreps(filter_irreps_out, "filter_irreps_out")}
    outs, instructions = [], []
    for i, (mul, ir1) in enumerate(irreps_in1):
        for j, (_, ir2) in enumerate(irreps_in2):
            for ir in ir1 * ir2:
                if allowed is None or ir in allowed:
                    instructions.append((i, j, len(outs), "uvu", True))
                    outs.append((mul, ir))
    if not instructions:
        raise ValueError(
            f"channelwise({irreps_in1}, {irreps_in2}, {filter_irreps_out}) has no path: no output irrep of "
            f"{irreps_in1} x {irreps_in2} passes the filter (None keeps every output)"
        )
    irreps_out, perm, _ = Irreps(outs).sort()
    instructions = sorted(((i, j, perm[k], m, t) for i, j, k, m, t in instructions), key=lambda ins: ins[2])
    return TensorProduct(irreps_in1, irreps_in2, irreps_out, instructions, **kwargs)


def fully_connected(irreps_in1, irreps_in2, irreps_out, **kwargs) -> TensorProduct:
    """The fully connected (``uvw``) product: every allowed ``(in1, in2, out)`` triple, weighted."""
    irreps_in1 = as_irreps(irreps_in1, "irreps_in1")
    irreps_in2 = as_irreps(irreps_in2, "irreps_in2")
    irreps_out = as_irreps(irreps_out, "irreps_out")
    instructions = [
        (i1, i2, io, "uvw", True)
        for i1, (_, ir1) in enumerate(irreps_in1)
        for i2, (_, ir2) in enumerate(irreps_in2)
        for io, (_, iro) in enumerate(irreps_out)
        if iro in ir1 * ir2
    ]
    return TensorProduct(irreps_in1, irreps_in2, irreps_out, instructions, **kwargs)
