"""Radius graphs of atomic structures (ase ``Atoms``), periodic boundaries included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .graph import Graph


def radius_edges(atoms, cutoff: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The edges of :func:`graph_from_atoms` as host arrays ``(senders, receivers, shifts)``
    (int32, int32, float64 ``(E, 3)``), without building a :class:`Graph` (for batching many
    structures into one graph: building each one's graph would run device ops per structure).

    Uses ase's linear-time cell-list neighbour list (``ase.neighborlist.neighbor_list``).
    """
    from ase.neighborlist import neighbor_list

    if not cutoff > 0:
        raise ValueError(f"cutoff must be positive, got {cutoff!r}")
    i, j, shifts = neighbor_list("ijS", atoms, float(cutoff), self_interaction=False)
    return j.astype(np.int32), i.astype(np.int32), shifts.astype(np.float64)


def graph_from_atoms(atoms, cutoff: float) -> Graph:
    """The radius graph of `atoms`: an edge ``j -> i`` for every neighbour ``j`` of atom ``i``
    within `cutoff` (Å), periodic images included, no self-edges.

    ``senders = j``, ``receivers = i`` (:func:`radius_edges`); ``graph.shifts`` holds the
    integer cell shift ``S`` of each edge, so that the edge vector is
    ``pos[j] - pos[i] + S @ cell`` (:func:`edge_vectors`), differentiable in the positions.
    """
    senders, receivers, shifts = radius_edges(atoms, cutoff)
    return Graph.build(senders, receivers, len(atoms), len(atoms), shifts=shifts)


def edge_vectors(graph: Graph, positions, cell=None):
    """``pos[senders] - pos[receivers] + shifts @ cell`` per edge, ``(E, 3)``."""
    vectors = positions[graph.senders] - positions[graph.receivers]
    if graph.shifts is not None and cell is not None:
        vectors = vectors + exact_matmul(graph.shifts.astype(vectors.dtype), jnp.asarray(cell, vectors.dtype))
    return vectors


def exact_matmul(a, b):
    """``a @ b`` at full precision, for geometry (positions, cells, strains): a GPU's default
    float32 matmul is TF32, which rounds positions by about 1e-3 relative (0.02 Å at 37 Å;
    docs/precision.md)."""
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
