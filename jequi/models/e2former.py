"""An E2Former-style interatomic potential: node-centric equivariant attention whose values are
EAAS products (:func:`jequi.sh_tensor_product`) built per source node, run by
:func:`jequi.neighbor_attention` over a padded neighbour list ``[N, K]``.

Per interaction block (E2Former-V2, Huang et al. 2026; ``/work/shared/E2FORMER.md``):

* invariant queries and keys ``q, k [N, H, d]``: an MLP of the node's per-degree bilinear
  invariants (the scalars ``h_0e`` and, per channel of each ``l > 0`` block,
  ``<h_l, h_l> / (2l + 1)``);
* per-edge scalars from the radial distance: the attention ``envelope`` and ``post_scale``
  hold the smooth cutoff envelope (so energies and forces are continuous as atoms cross the
  cutoff, also for a node losing its last neighbour), the ``logit_bias`` and a per-head
  radial weight come from an MLP of a Bessel basis;
* values ``[EAAS(h_j, r_ij) || h_j]`` split into ``H`` heads, with ``EAAS(h, r) = (h (x)
  Y^1(r / r_c))`` (e3nn's CG product with the *solid* degree-1 harmonic, filtered to the hidden
  irreps' degrees and parities), built **per source node** (below), and the target-side term;
* a linear layer on the message, e3nn's gate and a linear self-connection; per-atom energies
  are a linear readout plus a per-species shift, forces ``-dE/dpositions``.

The per-node values, exactly. ``Y^1`` of a vector is linear (``Y^1(r) = sqrt(3) r``, component
normalization), and the product is bilinear, so with ``P_j`` the position of source ``j`` (a
periodic image included) and ``p_i`` that of target ``i``, both relative to one local origin
``o`` (any constant shared by an edge's two ends)::

    EAAS(h_j, P_j - p_i) = EAAS(h_j, P_j - o) - EAAS(h_j, p_i - o)

and, with the attention's per-edge weights ``alpha_ij = P_ij u_ij`` (softmax times post_scale,
per head, shared by the head's channels)::

    sum_j alpha_ij EAAS(h_j, r_ij) = sum_j alpha_ij EAAS(h_j, P_j - o) - EAAS(sum_j alpha_ij h_j, p_i - o)
                                     `--- attention on per-source values ---'  `-- target-side term --'

The second sum over ``j`` is the ``h_j`` half of the same attention call, so one call on the
per-source values ``v_j = [EAAS(h_j, P_j - o) || h_j]`` ``[N_src, H, D_tp + D_h]`` gives both;
nothing of size ``N x K x D_v`` exists. This is an identity (exact up to float rounding), not
an approximation: the model is the per-edge model. The rounding: the two terms are of size
``|P - o| / r_c`` and their difference of size ``|r_ij| / r_c``, so float32 loses
``log10(|P - o| / |r_ij|)`` digits; local origins keep ``|P - o|`` at the structure's size
(:func:`neighbor_list` takes per-node origins; :meth:`E2FormerConfig.prepare_batches` uses
each structure's centroid), or at a tile's (:func:`tile_origins`: a node seen from a target of
another tile is a ghost source carrying that tile's origin). Periodic images are explicit *ghost* source nodes (a copy of the
node's features at ``p_j + S @ cell``), so edges across the boundary are exact too. What the
identity does not cover, and this model does not use: harmonics of degree > 1 of
``r_ij`` (not linear in ``r_ij``) and direction-only harmonics ``Y(r_hat)`` (the radial factor
``1 / |r_ij|`` is per edge; here the solid harmonic's ``|r_ij| / r_c`` is kept, and radial
dependence enters through the per-edge scalars).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import e3nn_jax as e3nn
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..attention import neighbor_attention
from ..attention.heads import head_irreps, merge_heads, split_heads
from ..eaas import sh_tensor_product
from .architecture import with_species_shift
from .data import bucket
from .nequip import _linear, _normal_init, species_index


@dataclasses.dataclass(frozen=True)
class E2FormerConfig:
    """Hyper-parameters. ``species``: the atomic numbers the model knows, in index order. Every
    multiplicity of ``hidden`` (and ``num_scalars``) must be divisible by ``heads``."""

    species: tuple[int, ...] = (13, 28, 29, 46, 47, 78, 79)  # Al Ni Cu Pd Ag Pt Au (EMT's metals)
    cutoff: float = 4.5
    hidden: str = "32x0e+16x1o+8x2e"
    num_layers: int = 2
    heads: int = 4
    head_dim: int = 8  # d of the invariant q, k
    num_basis: int = 8
    radial_hidden: int = 16
    qk_hidden: int = 32
    energy_scale: float = 1.0
    backend: str | None = None  # neighbor_attention's backend (None: pallas on GPU, xla elsewhere)
    values: str = "node"  # "node": per-source values (the identity above); "edge": the direct per-edge oracle
    growth: float = 1.25  # size buckets of K and of the source count (neighbor_list)

    def species_index(self, numbers) -> np.ndarray:
        """Atomic numbers -> indices into :attr:`species` (ValueError for unknown elements)."""
        return species_index(self.species, numbers)

    def module(self) -> E2Former:
        """The Flax module (what :func:`jequi.models.train.train` builds for this config)."""
        return E2Former(self)

    def init_params(self, key, species, positions, neighbors, cell=None):
        """:func:`init_params` (what :func:`jequi.models.train.train` calls for this config)."""
        return init_params(self, key, species, positions, neighbors, cell)

    def with_species_energies(self, params, energies) -> dict:
        """`params` with ``species_shift`` set to `energies` (:func:`jequi.models.train.train`'s fit)."""
        return with_species_shift(params, energies)

    def prepare_batches(self, batches):
        """:class:`~jequi.models.data.Batch` es with their ``graph`` replaced by a
        :class:`Neighbors` (one K and one source count for all: one compilation; local origins
        at each structure's centroid): the hook :func:`jequi.models.train.make_batches` calls."""
        return prepare_batches(self, batches)


# --- the neighbour list ------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Neighbors:
    """A radius graph as a padded neighbour list over *source* nodes (:func:`neighbor_list`).

    * ``neighbors [N, K]`` int32: the sources of target ``i``'s edges in slots ``0..deg(i)-1``,
      then ``num_sources`` (out of range: padding);
    * ``source_node [N_src]`` int32: the node whose features source ``s`` carries: ``s`` for
      ``s < N``, then one *ghost* per distinct (node, nonzero periodic shift) pair, then padding
      (node 0, never referenced);
    * ``source_shift [N_src, 3]``: the ghost's cell shift (integer shifts times ``cell``, or
      Cartesian with ``cell = I``; as :class:`jequi.Graph`'s ``shifts``); zero for ``s < N``;
    * ``origin [N, 3]``: each target's local origin, and ``source_origin [N_src, 3]`` each
      source's: every edge's source has its target's origin (a node seen from targets of another
      origin, e.g. another spatial tile, is a ghost too).
    """

    neighbors: jax.Array
    source_node: jax.Array
    source_shift: jax.Array
    origin: jax.Array
    source_origin: jax.Array

    @property
    def num_nodes(self) -> int:
        return self.neighbors.shape[0]

    @property
    def num_sources(self) -> int:
        return self.source_node.shape[0]


def neighbor_sizes(senders, receivers, num_nodes: int, shifts=None, origin=None) -> tuple[int, int]:
    """``(max degree, sources needed)`` of an edge list (the minimum ``K`` and ``N_src`` of
    :func:`neighbor_list`; take the largest over batches to give them one shape)."""
    s, r, sh = _valid_edges(senders, receivers, num_nodes, shifts)
    degree = int(np.bincount(r, minlength=num_nodes).max(initial=0))
    return degree, num_nodes + len(_ghosts(s, r, sh, _origins(origin, num_nodes))[0])


def _origins(origin, num_nodes):
    if origin is None:
        return np.zeros((num_nodes, 3))
    return np.array(np.broadcast_to(np.asarray(origin, np.float64), (num_nodes, 3)))


def _ghosts(s, r, sh, origin):
    """The ghost sources of the edges: unique rows ``(sender, shift, target's origin)`` of the
    edges with a nonzero shift or an origin that differs from the sender's own; and each edge's
    row in them (-1: the sender itself)."""
    ghost = np.any(sh != 0, axis=1) | np.any(origin[s] != origin[r], axis=1)
    keys, inverse = np.unique(np.column_stack([s[ghost], sh[ghost], origin[r[ghost]]]), axis=0, return_inverse=True)
    index = np.full(len(s), -1)
    index[ghost] = inverse.reshape(-1)
    return keys, index


def _valid_edges(senders, receivers, num_nodes, shifts):
    s, r = np.asarray(senders).astype(np.int64), np.asarray(receivers).astype(np.int64)
    if s.shape != r.shape or s.ndim != 1:
        raise ValueError(f"senders {s.shape} and receivers {r.shape} must be 1-D of one length")
    valid = (s >= 0) & (s < num_nodes) & (r >= 0) & (r < num_nodes)
    sh = np.zeros((len(s), 3)) if shifts is None else np.asarray(shifts, np.float64).reshape(len(s), 3)
    return s[valid], r[valid], sh[valid]


def neighbor_list(
    senders, receivers, num_nodes: int, shifts=None, *, origin=None, max_neighbors: int | None = None,
    num_sources: int | None = None, growth: float = 1.25,
) -> Neighbors:  # fmt: skip
    """The edges ``senders[e] -> receivers[e]`` (cell shifts ``shifts[e]``; out-of-range
    indices are padding and dropped) as a :class:`Neighbors` padded neighbour list, on the host.

    ``K`` is ``max_neighbors``, or the max degree rounded up to a size bucket (``growth``
    apart, :func:`jequi.models.bucket`), so that structures of similar size share one
    compilation; ``N_src`` likewise from ``num_nodes`` plus the ghosts (one per distinct
    (sender, shift, target's origin) with a nonzero shift or an origin other than the sender's).
    ``origin``: ``[N, 3]`` or ``[3]`` local origins (default zeros; see the module docstring: any
    origins are exact, positions near them keep float32 accurate).
    ValueError if ``max_neighbors`` or ``num_sources`` is too small.
    """
    s, r, sh = _valid_edges(senders, receivers, num_nodes, shifts)
    origin = _origins(origin, num_nodes)
    keys, index = _ghosts(s, r, sh, origin)
    source = np.where(index >= 0, num_nodes + index, s)
    needed = num_nodes + len(keys)
    if num_sources is None:
        num_sources = bucket(needed, minimum=16, growth=growth)
    if num_sources < needed:
        raise ValueError(f"num_sources={num_sources} is smaller than the {needed} sources these edges need")
    counts = np.bincount(r, minlength=num_nodes)
    degree = int(counts.max(initial=0))
    if max_neighbors is None:
        max_neighbors = bucket(degree, minimum=8, growth=growth)
    if max_neighbors < degree:
        raise ValueError(f"max_neighbors={max_neighbors} is smaller than the largest degree {degree}")
    order = np.argsort(r, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(counts)])
    rank = np.arange(len(r)) - offsets[r[order]]
    nbr = np.full((num_nodes, max_neighbors), num_sources, np.int32)
    nbr[r[order], rank] = source[order]
    pad = num_sources - needed
    source_node = np.concatenate([np.arange(num_nodes), keys[:, 0].astype(np.int64), np.zeros(pad, np.int64)]).astype(np.int32)
    source_shift = np.concatenate([np.zeros((num_nodes, 3)), keys[:, 1:4].reshape(-1, 3), np.zeros((pad, 3))])
    source_origin = np.concatenate([origin, keys[:, 4:7].reshape(-1, 3), np.zeros((pad, 3))])
    return Neighbors(*(jnp.asarray(a) for a in (nbr, source_node, source_shift, origin, source_origin)))


def tile_origins(positions, tile: float):
    """Per-node origins at the centres of cubic tiles of side `tile` (Å): with them the float32
    cancellation of the per-source values is bounded by the tile, not the structure (at the cost
    of ghost sources for the neighbours across tile faces)."""
    positions = np.asarray(positions, np.float64)
    return (np.floor(positions / tile) + 0.5) * tile


def neighbors_from_graph(graph, origin=None, **kwargs) -> Neighbors:
    """:func:`neighbor_list` of a :class:`jequi.Graph` (concrete, on the host)."""
    shifts = None if graph.shifts is None else np.asarray(graph.shifts)
    return neighbor_list(np.asarray(graph.senders), np.asarray(graph.receivers), graph.num_nodes, shifts, origin=origin, **kwargs)


def neighbors_from_atoms(atoms, cutoff: float, tile: float | None = None, **kwargs) -> Neighbors:
    """The radius graph of ase ``atoms`` (:func:`jequi.atoms.radius_edges`, integer shifts: pass
    ``atoms.cell`` as the model's ``cell``), local origin at the centroid of the positions, or at
    the centres of tiles of side `tile` (:func:`tile_origins`)."""
    from ..atoms import radius_edges

    senders, receivers, shifts = radius_edges(atoms, cutoff)
    positions = np.asarray(atoms.positions)
    kwargs.setdefault("origin", positions.mean(axis=0) if tile is None else tile_origins(positions, tile))
    return neighbor_list(senders, receivers, len(atoms), shifts, **kwargs)


def prepare_batches(config: E2FormerConfig, batches):
    """See :meth:`E2FormerConfig.prepare_batches`."""
    edges = []
    for b in batches:
        g = b.graph
        edges.append((np.asarray(g.senders), np.asarray(g.receivers), g.num_nodes, None if g.shifts is None else np.asarray(g.shifts)))
    origins = []
    for b in batches:
        node_graph, mask, pos = np.asarray(b.node_graph), np.asarray(b.node_mask), np.asarray(b.positions)
        origin = np.zeros_like(pos)
        for g in np.unique(node_graph[mask]):
            sel = node_graph == g
            origin[sel] = pos[sel].mean(axis=0)
        origins.append(origin)
    sizes = [neighbor_sizes(*e, origin=o) for e, o in zip(edges, origins)]
    k = bucket(max(d for d, _ in sizes), minimum=8, growth=config.growth)
    n_src = bucket(max(n for _, n in sizes), minimum=16, growth=config.growth)
    out = []
    for b, e, origin in zip(batches, edges, origins):
        nb = neighbor_list(*e, origin=origin, max_neighbors=k, num_sources=n_src)
        out.append(dataclasses.replace(b, graph=nb))
    return out


# --- the attention with per-source values ---------------------------------------------------------
def _tp(h, vectors, filter_irs):
    """``EAAS(h, r)``: the CG product with the solid degree-1 harmonic of ``r``."""
    return sh_tensor_product(h, vectors, "1o", filter_ir_out=filter_irs, normalize=False)


def edge_attention(q, k, v_edge, nbr, logit_bias, envelope, post_scale):
    """The materialised attention with per-*edge* values ``v_edge [N, K, H, D]`` (the
    definition of :func:`jequi.neighbor_attention`, ``eps = 0``): the direct form the per-node
    values replace (an oracle; ``N x K x D`` in memory)."""
    n_src = k.shape[0]
    valid = ((nbr >= 0) & (nbr < n_src))[..., None]
    kj = k[jnp.where(valid[..., 0], nbr, 0)]
    s = jnp.einsum("nhd,nkhd->nkh", q, kj) / math.sqrt(q.shape[-1]) + logit_bias
    mu = jnp.max(jnp.where(valid, s, -jnp.inf), axis=1, keepdims=True)
    mu = jnp.where(jnp.isfinite(mu), mu, 0.0)
    a = jnp.where(valid, jnp.exp(jnp.where(valid, s, mu) - mu) * envelope, 0.0)
    z = jnp.sum(a, axis=1)[..., None]
    acc = jnp.einsum("nkh,nkhd->nhd", a * post_scale, v_edge)
    return jnp.where(z > 0, acc / jnp.where(z > 0, z, 1.0), 0.0)


def equivariant_attention(q, k, h, source_node, p_src, p_dst, nbr, *, heads, filter_irs, logit_bias, envelope,
                          post_scale, backend=None, values="node"):  # fmt: skip
    """The block's message ``[sum_j alpha_ij EAAS(h_j, r_ij) || sum_j alpha_ij h_j]`` (heads
    merged, an ``IrrepsArray`` ``[N, ...]``), ``alpha`` the attention weights.

    ``q [N, H, d]``, ``k [N, H, d]``, ``h`` an ``IrrepsArray`` ``[N, dim]`` (node features);
    ``source_node [N_src]``; ``p_src [N_src, 3]``, ``p_dst [N, 3]``: source and target
    positions relative to the local origin, in units of the cutoff; ``nbr [N, K]`` over the
    sources; per-edge ``logit_bias``, ``envelope``, ``post_scale`` ``[N, K, H]``.
    ``values="node"``: per-source values and the target-side term (the identity of the module
    docstring; nothing ``N x K x D``); ``"edge"``: ``EAAS(h_j, r_ij)`` per edge, materialised.
    """
    hi = head_irreps(h.irreps, heads)
    h_src = split_heads(h, heads)[source_node]  # [N_src, H, D_h]
    k_src = k[source_node]
    if values == "node":
        tp_src = _tp(e3nn.IrrepsArray(hi, h_src), p_src[:, None, :], filter_irs)  # [N_src, H, D_tp]
        v = jnp.concatenate([tp_src.array, h_src], axis=-1)
        out = neighbor_attention(q, k_src, v, nbr, logit_bias=logit_bias, envelope=envelope, post_scale=post_scale,
                                 backend=backend)  # fmt: skip
        d_tp = tp_src.irreps.dim
        out_h = out[..., d_tp:]
        target = _tp(e3nn.IrrepsArray(hi, out_h), p_dst[:, None, :], filter_irs)  # the target-side term
        msg_tp, tp_irreps = out[..., :d_tp] - target.array, tp_src.irreps
    elif values == "edge":
        valid = (nbr >= 0) & (nbr < k_src.shape[0])
        j = jnp.where(valid, nbr, 0)
        r = p_src[j] - p_dst[:, None, :]  # [N, K, 3]
        tp_edge = _tp(e3nn.IrrepsArray(hi, h_src[j]), r[:, :, None, :], filter_irs)  # [N, K, H, D_tp]
        v_edge = jnp.concatenate([tp_edge.array, h_src[j]], axis=-1)
        out = edge_attention(q, k_src, v_edge, nbr, logit_bias, envelope, post_scale)
        d_tp = tp_edge.irreps.dim
        msg_tp, tp_irreps, out_h = out[..., :d_tp], tp_edge.irreps, out[..., d_tp:]
    else:
        raise ValueError(f"values must be 'node' or 'edge', got {values!r}")
    tp_full = e3nn.Irreps([(mul * heads, ir) for mul, ir in tp_irreps])
    return e3nn.concatenate([merge_heads(msg_tp, tp_full), merge_heads(out_h, h.irreps)])


# --- the model -----------------------------------------------------------------------------------
def _mlp(param, name, x, sizes, act=jax.nn.silu):
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        x = x @ param(f"{name}.w{i}", (a, b), 1.0) / math.sqrt(a)
        if i < len(sizes) - 2:
            x = act(x)
    return x


def invariants(h: e3nn.IrrepsArray):
    """Per-degree bilinear invariants ``[N, C]``: the ``0e`` channels as they are, and
    ``<h_l, h_l> / (2l + 1)`` per channel of every other block."""
    parts = []
    for mul_ir, x in zip(h.irreps, h.chunks):
        if x is None:
            x = jnp.zeros((*h.shape[:-1], mul_ir.mul, mul_ir.ir.dim), h.dtype)
        parts.append(x[..., 0] if mul_ir.ir == e3nn.Irrep("0e") else jnp.sum(x**2, axis=-1) / mul_ir.ir.dim)
    return jnp.concatenate(parts, axis=-1)


@functools.lru_cache(maxsize=16)
def _filter(hidden: str):
    return tuple(sorted({ir for _, ir in e3nn.Irreps(hidden)}, key=lambda ir: (ir.l, -ir.p)))


def atomic_energies(param, config: E2FormerConfig, species, positions, nb: Neighbors, cell=None):
    """Per-atom energies ``(N,)``: ``species`` indices into ``config.species``, ``positions``
    ``(N, 3)`` in Å, ``nb`` a :class:`Neighbors` at ``config.cutoff``, ``cell`` ``(3, 3)`` for the
    periodic shifts (None: the shifts are ignored, as :func:`jequi.edge_vectors` does)."""
    hidden = e3nn.Irreps(config.hidden)
    heads, d = config.heads, config.head_dim
    dtype = positions.dtype
    shift = nb.source_shift.astype(dtype)
    if cell is not None:
        shift = shift @ jnp.asarray(cell, dtype)
    p_abs = positions[nb.source_node] + shift  # [N_src, 3]
    p_src = (p_abs - jax.lax.stop_gradient(nb.source_origin.astype(dtype))) / config.cutoff
    p_dst = (positions - jax.lax.stop_gradient(nb.origin.astype(dtype))) / config.cutoff
    valid = (nb.neighbors >= 0) & (nb.neighbors < nb.num_sources)
    j = jnp.where(valid, nb.neighbors, 0)
    vectors = p_abs[j] - positions[:, None, :]  # [N, K, 3] (3 numbers per edge)
    r2 = jnp.where(valid, jnp.sum(vectors**2, axis=-1), config.cutoff**2)
    r = jnp.sqrt(jnp.maximum(r2, 1e-12))
    envelope = jnp.where(valid, e3nn.poly_envelope(5, 2)(r / config.cutoff), 0.0)
    radial = e3nn.bessel(r, config.num_basis, config.cutoff) * envelope[..., None]  # [N, K, B]

    n_species = len(config.species)
    onehot = jax.nn.one_hot(species, n_species, dtype=dtype)
    n0 = hidden.count("0e")
    h = e3nn.IrrepsArray(f"{n0}x0e", onehot @ param("embed", (n_species, n0), 1.0))
    filter_irs = _filter(config.hidden)
    for layer in range(config.num_layers):
        name = f"layer{layer}"
        inv = invariants(h)
        qk = _mlp(param, f"{name}.qk", inv, (inv.shape[-1], config.qk_hidden, 2 * heads * d)).reshape(-1, 2, heads, d)
        q, k = qk[:, 0], qk[:, 1]
        edge = _mlp(param, f"{name}.radial", radial, (config.num_basis, config.radial_hidden, 2 * heads))
        bias, weight = edge[..., :heads], edge[..., heads:]
        x = _linear(param, f"{name}.value", h, h.irreps)
        message = equivariant_attention(
            q, k, x, nb.source_node, p_src, p_dst, nb.neighbors, heads=heads, filter_irs=filter_irs, logit_bias=bias,
            envelope=envelope[..., None], post_scale=envelope[..., None] * (1.0 + weight), backend=config.backend,
            values=config.values,
        )  # fmt: skip
        gated = hidden.filter(drop=["0e", "0o"])
        gate_irreps = e3nn.Irreps(f"{n0 + gated.num_irreps}x0e") + gated
        update = e3nn.gate(_linear(param, f"{name}.down", message, gate_irreps))
        h = update + _linear(param, f"{name}.self", h, update.irreps)
    energies = _linear(param, "readout", h, "0e").array[:, 0] * config.energy_scale
    return energies + param("species_shift", (n_species,), 0.0)[species]


class E2Former(nn.Module):
    """The model in Flax linen: ``apply(params, species, positions, neighbors, cell) -> (N,)``
    per-atom energies (``neighbors``: a :class:`Neighbors`)."""

    config: E2FormerConfig = E2FormerConfig()

    @nn.compact
    def __call__(self, species, positions, neighbors: Neighbors, cell=None):
        def param(name, shape, std):
            return self.param(name, _normal_init(std), shape, positions.dtype)

        return atomic_energies(param, self.config, species, positions, neighbors, cell)


def init_params(config: E2FormerConfig, key, species, positions, neighbors: Neighbors, cell=None):
    """Parameters of :class:`E2Former` (``{"params": {name: array}}``, the linen layout) from one
    trace of the model (``jax.eval_shape``), without compiling or running it: ``E2Former.init``
    compiles the whole forward (tens of seconds on a CPU). The random draws differ from
    ``init``'s; the distributions are the same."""
    specs = {}

    def record(name, shape, std):
        specs[name] = (shape, std)
        return jnp.zeros(shape, positions.dtype)

    jax.eval_shape(lambda p, nb, c: atomic_energies(record, config, species, p, nb, c), positions, neighbors, cell)
    keys = jax.random.split(key, len(specs))
    params = {}
    for k_, (name, (shape, std)) in zip(keys, sorted(specs.items())):
        params[name] = std * jax.random.normal(k_, shape, positions.dtype) if std else jnp.zeros(shape, positions.dtype)
    return {"params": params}


__all__ = [
    "E2Former", "E2FormerConfig", "init_params", "Neighbors", "atomic_energies", "edge_attention", "equivariant_attention", "invariants",
    "neighbor_list", "neighbor_sizes", "neighbors_from_atoms", "tile_origins", "neighbors_from_graph", "prepare_batches",
]  # fmt: skip
