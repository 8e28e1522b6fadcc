"""Radius graphs of atomic structures (ase ``Atoms``), periodic boundaries included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .graph import Graph


def graph_from_atoms(atoms, cutoff: float) -> Graph:
    """The radius graph of `atoms`: an edge ``j -> i`` for every neighbour ``j`` of atom ``i``
    within `cutoff` (Å), periodic images included, no self-edges.

    Uses ase's linear-time cell-list neighbour list (``ase.neighborlist.neighbor_list``).
    ``senders = j``, ``receivers = i``; ``graph.shifts`` holds the integer cell shift ``S``
    of each edge, so that the edge vector is ``pos[j] - pos[i] + S @ cell``
    (:func:`edge_vectors`), differentiable in the positions.
    """
    from ase.neighborlist import neighbor_list

    if not cutoff > 0:
        raise ValueError(f"cutoff must be positive, got {cutoff!r}")
    i, j, shifts = neighbor_list("ijS", atoms, float(cutoff), self_interaction=False)
    n = len(atoms)
    return Graph.build(j.astype(np.int32), i.astype(np.int32), n, n, shifts=shifts.astype(np.float64))


def edge_vectors(graph: Graph, positions, cell=None):
    """``pos[senders] - pos[receivers] + shifts @ cell`` per edge, ``(E, 3)``."""
    vectors = positions[graph.senders] - positions[graph.receivers]
    if graph.shifts is not None and cell is not None:
        vectors = vectors + graph.shifts.astype(vectors.dtype) @ jnp.asarray(cell, vectors.dtype)
    return vectors
