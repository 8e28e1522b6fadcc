"""Graphs for ``TensorProduct.conv``: validation of index arrays and the precomputed
:class:`Graph` that the convolution kernels walk.

Out-of-range indices never write outside the output: an edge whose sender is not in
``[0, num_senders)`` or whose receiver is not in ``[0, num_nodes)`` contributes nothing
(and receives zero gradient). Range checks cannot raise under ``jit`` (values are not
known at trace time), so they are applied as this masking rule instead.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
import numpy as np


def check_num_nodes(num_nodes, name: str = "num_nodes") -> int:
    """`num_nodes` as an int: it sets an output's shape, so it must be known when JAX traces."""
    if isinstance(num_nodes, jax.core.Tracer):
        raise ValueError(
            f"jequi: {name} must be a static Python int, but it is a traced value ({num_nodes}) inside a JAX "
            f"transform: under jax.jit mark it static (static_argnums / static_argnames), or build the "
            f"jequi.Graph outside the transform and pass the Graph (its {name} is static)"
        )
    if isinstance(num_nodes, (np.ndarray, jax.Array)) and num_nodes.ndim == 0 and np.issubdtype(num_nodes.dtype, np.integer):
        num_nodes = int(num_nodes)  # a concrete integer scalar array
    if not isinstance(num_nodes, numbers.Integral) or isinstance(num_nodes, bool) or num_nodes < 0:
        raise ValueError(f"{name} must be a non-negative Python int (static), got {num_nodes!r}")
    return int(num_nodes)


def check_indices(senders, receivers, num_edges: int | None = None):
    """Check dtypes and shapes of `senders` and `receivers` (1-D integer arrays of one length)."""
    for name, idx in (("senders", senders), ("receivers", receivers)):
        dtype = np.dtype(idx.dtype if hasattr(idx, "dtype") else np.asarray(idx).dtype)
        if not np.issubdtype(dtype, np.integer):
            raise TypeError(f"{name} must be an integer array, got dtype {dtype}")
        shape = np.shape(idx)
        if len(shape) != 1:
            raise ValueError(f"{name} must be 1-D (one entry per edge), got shape {shape}")
        if num_edges is not None and shape[0] != num_edges:
            raise ValueError(f"{name} has {shape[0]} entries but y/w have {num_edges} edges")
    if np.shape(senders) != np.shape(receivers):
        raise ValueError(f"senders {np.shape(senders)} and receivers {np.shape(receivers)} differ in length")


def csr_offsets(keys, num_rows: int):
    """``(num_rows + 2,)`` int32 offsets of the rows ``0..num_rows`` of `keys` (values in ``[0,
    num_rows]``) once sorted. Counted and summed in int32 whatever ``jax_enable_x64`` says: the
    kernels read int32, and an int64 sum would be a second copy of the index arithmetic."""
    counts = jnp.zeros(num_rows + 1, jnp.int32).at[keys].add(1, mode="drop")
    return jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])


def csr(keys, num_rows: int):
    """Stable order of `keys` (values in ``[0, num_rows]``) and offsets of rows ``0..num_rows``
    (:func:`csr_offsets`): a CSR list, as ``Graph`` and attention's transposed neighbours keep."""
    return jnp.argsort(keys, stable=True).astype(jnp.int32), csr_offsets(keys, num_rows)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Graph:
    """A graph prepared once and reused by every convolution of a model.

    Build it with :meth:`Graph.build` (works under ``jit`` and ``vmap``) or
    :func:`jequi.graph_from_atoms`. Fields (``E`` edges):

    * ``senders``, ``receivers`` ``(E,)`` int32, in the caller's edge order; an edge with an
      out-of-range index has been mapped to ``(0, num_nodes)`` (it contributes nothing);
    * ``receiver_order`` ``(E,)``: edge ids sorted by receiver (stable), and
      ``receiver_offsets`` ``(num_nodes + 1,)``: receiver ``r``'s edges are
      ``receiver_order[receiver_offsets[r]:receiver_offsets[r + 1]]`` (dropped edges come
      last, after ``receiver_offsets[-1]``);
    * ``sender_order`` ``(E,)`` and ``sender_offsets`` ``(num_senders + 2,)``: the same by
      sender (the transpose), with the dropped edges as a last bucket ``num_senders``;
    * ``receiver_senders = senders[receiver_order]`` and ``sender_receivers =
      receivers[sender_order]``: the kernels read them in walk order (one dependent load
      less per edge);
    * ``shifts`` ``(E, 3)`` or None: periodic cell shifts of each edge (see
      :func:`jequi.edge_vectors`);
    * ``num_nodes``, ``num_senders`` (static): rows of the output and of ``x``;
    * ``edges_sorted`` (static): the edges were given in receiver order (checked on the host
      when the indices are concrete), so ``receiver_order`` is the identity and the forward
      kernel reads edge rows in sequence.
    """

    senders: jax.Array
    receivers: jax.Array
    receiver_order: jax.Array
    receiver_offsets: jax.Array
    sender_order: jax.Array
    sender_offsets: jax.Array
    receiver_senders: jax.Array
    sender_receivers: jax.Array
    shifts: jax.Array | None = None
    num_nodes: int = dataclasses.field(default=0, metadata=dict(static=True))
    num_senders: int = dataclasses.field(default=0, metadata=dict(static=True))
    edges_sorted: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def build(cls, senders, receivers, num_nodes: int, num_senders: int | None = None, shifts=None, *,
              edges_sorted: bool | None = None, padding_node: int | None = None) -> Graph:  # fmt: skip
        """Prepare the graph with edges ``senders[e] -> receivers[e]`` (any order).

        ``num_nodes`` (static) is the number of receiving nodes (output rows),
        ``num_senders`` (static, default ``num_nodes``) the number of rows of ``x``.

        ``edges_sorted``: None finds out on the host where the indices are concrete (traced,
        they count as unsorted); True promises that the kept edges are in receiver order with
        the dropped ones last, which saves the receiver sort under ``jit`` and is checked where
        the indices are concrete (a ValueError if it does not hold); False never assumes it.

        ``padding_node``: a node that padding edges point at, the jraph way (a padding graph's
        node, e.g. ``num_nodes - 1``). Every edge into or out of it is dropped like an
        out-of-range edge, so it costs nothing; its own output row is zero.
        """
        check_indices(senders, receivers)
        num_nodes = check_num_nodes(num_nodes)
        num_senders = check_num_nodes(num_nodes if num_senders is None else num_senders, "num_senders")
        if padding_node is not None and not (isinstance(padding_node, (int, np.integer)) and 0 <= padding_node < max(num_nodes, num_senders)):
            raise ValueError(f"padding_node must be a node index in [0, {max(num_nodes, num_senders)}), got {padding_node!r}")
        on_host = _sorted_on_host(senders, receivers, num_nodes, num_senders, padding_node)
        if edges_sorted and on_host is False:
            raise ValueError("edges_sorted=True, but the kept edges are not in receiver order (with dropped edges last)")
        promised = bool(edges_sorted) and on_host is None  # traced: the caller's word
        edges_sorted = bool(on_host) if edges_sorted is None else bool(edges_sorted)
        senders = jnp.asarray(senders, jnp.int32)
        receivers = jnp.asarray(receivers, jnp.int32)
        valid = (senders >= 0) & (senders < num_senders) & (receivers >= 0) & (receivers < num_nodes)
        if padding_node is not None:
            valid &= (senders != padding_node) & (receivers != padding_node)
        senders, receivers = jnp.where(valid, senders, 0), jnp.where(valid, receivers, num_nodes)
        if promised:  # in order already: the identity, offsets from the counts
            receiver_order = jnp.arange(receivers.shape[0], dtype=jnp.int32)
            receiver_offsets = csr_offsets(receivers, num_nodes)
        else:
            receiver_order, receiver_offsets = csr(receivers, num_nodes)
        sender_order, sender_offsets = csr(jnp.where(valid, senders, num_senders), num_senders)
        if shifts is not None:
            shifts = jnp.asarray(shifts)
            if shifts.shape != (senders.shape[0], 3):
                raise ValueError(f"shifts must have shape (num_edges, 3) = ({senders.shape[0]}, 3), got {shifts.shape}")
        return cls(
            senders, receivers, receiver_order, receiver_offsets[:-1], sender_order, sender_offsets,
            senders[receiver_order], receivers[sender_order], shifts, num_nodes, num_senders, edges_sorted,
        )  # fmt: skip

    def __hash__(self):
        # jax.jit hashes static arguments; a Graph holds arrays (its sizes are static already)
        raise TypeError(
            "jequi.Graph is not hashable (it holds index arrays): pass it to jax.jit as a regular "
            "argument, not in static_argnums / static_argnames (num_nodes and num_senders stay static)"
        )

    @property
    def num_edges(self) -> int:
        return self.senders.shape[-1]

    @property
    def index_arrays(self) -> tuple:
        """The integer arrays the kernels read (non-differentiable operands of the conv ops)."""
        return tuple(getattr(self, f) for f in _INDEX_FIELDS)

    @property
    def static(self) -> tuple:
        """``(num_nodes, num_senders, edges_sorted)``."""
        return self.num_nodes, self.num_senders, self.edges_sorted

    @classmethod
    def from_index_arrays(cls, arrays, static) -> Graph:
        """Inverse of (:attr:`index_arrays`, :attr:`static`), without ``shifts``."""
        num_nodes, num_senders, edges_sorted = static
        return cls(*arrays, shifts=None, num_nodes=num_nodes, num_senders=num_senders, edges_sorted=edges_sorted)


_INDEX_FIELDS = (
    "senders", "receivers", "receiver_order", "receiver_offsets", "sender_order", "sender_offsets",
    "receiver_senders", "sender_receivers",
)  # fmt: skip


def _sorted_on_host(senders, receivers, num_nodes: int, num_senders: int, padding_node=None) -> bool | None:
    """For concrete indices, whether the kept edges are in receiver order: all valid, or (with
    a `padding_node`) its edges all after the others. None when traced."""
    try:
        s, r = np.asarray(senders), np.asarray(receivers)
    except jax.errors.TracerArrayConversionError:
        return None
    valid = (s >= 0) & (s < num_senders) & (r >= 0) & (r < num_nodes)
    if padding_node is None:
        return bool(np.all(valid) and np.all(np.diff(r) >= 0))
    dropped = (s == padding_node) | (r == padding_node)
    kept = valid & ~dropped
    effective = np.where(kept, r, num_nodes)
    return bool(np.all(kept | dropped) and np.all(np.diff(effective) >= 0))


# --- rows split into parts: what a conv kernel's program walks ---------------------------------
# A row (a receiver's or a sender's edges, or the bucket of dropped edges) longer than
# HUB_FACTOR times the mean row is split into parts of at most that many edges, so no program
# walks a hub (or a padding bucket) alone while the others idle; below MIN_PART_EDGES edges a
# part is not worth its fixup.
HUB_FACTOR = 2
MIN_PART_EDGES = 8


def part_edges(num_rows: int, num_edges: int, fill_edges: int | None = None) -> int:
    """The most edges one program walks (static): :data:`HUB_FACTOR` times the mean row, or
    `fill_edges` where that is smaller (a kernel's choice to split rows of a graph too small to
    fill the GPU), but at least :data:`MIN_PART_EDGES`."""
    most = HUB_FACTOR * -(-num_edges // max(num_rows, 1))
    if fill_edges is not None:
        most = min(most, fill_edges)
    return max(MIN_PART_EDGES, most)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParts:
    """A CSR's rows cut into parts of at most ``most`` edges, in edge order: the work items of a
    conv kernel (one program each). ``P`` parts (a static bound, ``rows + edges // most``; the
    parts past the last real one are empty), fields:

    * ``offsets`` ``(P + 1,)``: part ``p`` walks edges ``offsets[p]:offsets[p + 1]`` of the CSR's
      order (consecutive parts of a row are consecutive ranges);
    * ``rows`` ``(P,)``: the row each part belongs to (the last row for the empty ones);
    * ``slots`` ``(P,)``: where a part writes its partial sum: its row for a row's first part,
      else ``num_rows + e`` for its index ``e`` among the other parts (an *extra*);
    * ``firsts`` ``(num_rows + 1,)``: row ``r``'s parts are ``firsts[r]:firsts[r + 1]``, so its
      extras are ``firsts[r] - r : firsts[r + 1] - r - 1``;
    * ``num_rows`` (static).

    The partial sums are added in part order (:func:`jequi.row_fixup.add_extras`): the split
    depends on the graph alone, so results stay bitwise reproducible.
    """

    offsets: jax.Array
    rows: jax.Array
    slots: jax.Array
    firsts: jax.Array
    num_rows: int = dataclasses.field(default=0, metadata=dict(static=True))

    @property
    def num_parts(self) -> int:
        return self.rows.shape[-1]

    @property
    def num_extras(self) -> int:
        """Rows of the extras buffer (``num_parts - num_rows``)."""
        return self.num_parts - self.num_rows


def row_parts(offsets, num_edges: int, most: int) -> RowParts:
    """:class:`RowParts` of the CSR ``offsets`` (``(rows + 1,)``, edges ``offsets[r]:offsets[r +
    1]`` of row ``r``; edges past ``offsets[-1]`` are not walked) with at most `most` edges a part.
    Runs under ``jit`` and ``vmap``."""
    num_rows = offsets.shape[-1] - 1
    offsets = offsets.astype(jnp.int32)
    counts = offsets[1:] - offsets[:-1]
    parts = jnp.maximum(1, -(-counts // most))
    firsts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(parts, dtype=jnp.int32)])
    bound = num_rows + num_edges // most  # sum of max(1, ceil(c / most)) <= rows + sum(c) / most
    p = jnp.arange(bound, dtype=jnp.int32)
    real = p < firsts[-1]
    row = jnp.clip(jnp.searchsorted(firsts, p, side="right").astype(jnp.int32) - 1, 0, num_rows - 1)
    part = p - firsts[row]
    starts = jnp.where(real, offsets[row] + part * most, offsets[-1])
    slots = jnp.where(real & (part == 0), row, num_rows + p - row - 1)
    return RowParts(jnp.concatenate([starts, offsets[-1:]]), row, slots.astype(jnp.int32), firsts, num_rows)
