"""Spatial decomposition of one structure over devices: who owns which atom, which ghosts each
device needs, and the padded per-device arrays (host side, numpy).

Space is cut into a grid of regions (``grid = (p0, p1, p2)`` regions along the cell's three
axes, ``p0 * p1 * p2`` devices), the cut planes along each axis at quantiles of the atoms'
coordinates, so every region holds about as many atoms (equal volumes in uniform bulk). Device
``d`` owns the atoms of region ``d`` and computes their energies; the atoms it reads but does
not own are its *ghosts*. Any assignment of atoms to devices gives the single-device result
(the graph, not geometry, decides what a device needs); regions only keep the ghosts few.

Two schemes (:data:`SCHEMES`), told apart by how deep the ghosts reach in the radius graph:

* ``"exchange"``: ghosts one hop deep (the senders of edges into owned atoms, within one cutoff).
  A device runs its layers on its own atoms only, and the ghosts' features are sent by their
  owners before every convolution (``jax.lax.ppermute``); edge work is never duplicated.
* ``"halo"``: ghosts ``num_layers`` hops deep (within ``num_layers`` cutoffs). A device runs the
  whole model on its atoms and ghosts (the edges into atoms up to ``num_layers - 1`` hops away),
  with no communication inside the model; the ghosts' work is redundant.

In both, positions are sent once at the start and the ghosts' forces return to their owners
by the transpose of that send. Sizes are padded to geometric buckets
(:func:`jequi.models.data.bucket`), so molecular dynamics recompiles only when a device's
atom, ghost or edge count leaves its bucket.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from .data import bucket

SCHEMES = ("exchange", "halo")


@dataclasses.dataclass(frozen=True)
class Decomposition:
    """How one structure is split. ``devices``: how many; ``scheme``: one of :data:`SCHEMES`;
    ``grid``: regions along the cell's three axes (product ``devices``; None: the grid whose cut
    planes cut the least area per volume, see :func:`choose_grid`); ``growth``, ``min_atoms``,
    ``min_edges``: the size buckets per-device arrays are padded to."""

    devices: int = 1
    scheme: str = "exchange"
    grid: tuple[int, int, int] | None = None
    growth: float = 1.25
    min_atoms: int = 8
    min_edges: int = 64

    def __post_init__(self):
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise ValueError(f"devices must be a positive int, got {self.devices!r}")
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        if self.grid is not None:
            grid = tuple(self.grid)
            if len(grid) != 3 or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in grid):
                raise ValueError(f"grid must be three positive ints (regions along each cell axis), got {self.grid!r}")
            if math.prod(grid) != self.devices:
                raise ValueError(f"grid {grid} has {math.prod(grid)} regions but devices is {self.devices}")
            object.__setattr__(self, "grid", grid)
        if not self.growth > 1:
            raise ValueError(f"growth must be > 1, got {self.growth!r}")
        if self.min_atoms < 1 or self.min_edges < 1:
            raise ValueError(f"min_atoms and min_edges must be >= 1, got {self.min_atoms}, {self.min_edges}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """The static shapes of the per-device arrays (hashable: a compiled function's key).

    ``owned`` rows of own atoms; ghost rows in one block per ``shifts[i]`` (device ``d``
    receives the block from device ``(d - shifts[i]) % devices``) of ``sends[i]`` rows;
    ``edges`` edge slots; ``depth``: how many hops the ghosts reach (1 for ``"exchange"``,
    ``num_layers`` for ``"halo"``)."""

    devices: int
    scheme: str
    owned: int
    shifts: tuple[int, ...]
    sends: tuple[int, ...]
    edges: int
    depth: int

    @property
    def ghosts(self) -> int:
        return sum(self.sends)

    @property
    def local(self) -> int:
        """Rows of own atoms and ghosts: the convolutions' senders."""
        return self.owned + self.ghosts

    @property
    def nodes(self) -> int:
        """Rows the layers run on: own atoms (``"exchange"``), own atoms and ghosts (``"halo"``)."""
        return self.owned if self.scheme == "exchange" else self.local


@dataclasses.dataclass(frozen=True)
class Shards:
    """One structure split over ``layout.devices`` devices: numpy arrays with a leading device
    axis, padded to ``layout``. Local rows of a device: its own atoms (``owned`` rows), then
    its ghost blocks.

    * ``num_atoms``: the structure's; ``cell`` ``(3, 3)``: its cell;
    * ``atom_ids`` ``(D, owned)``: the structure's index of each own row (-1: padding);
    * ``species`` ``(D, layout.nodes)``: species indices of the rows the layers run on;
    * ``positions`` ``(D, owned, 3)``: own atoms' positions (ghosts' are sent by their owners);
    * ``senders``, ``receivers`` ``(D, edges)``: local rows (-1: padding edge), in receiver order;
    * ``shifts`` ``(D, edges, 3)``: each edge's integer cell shift (the structure's);
    * ``sends``: per shift, ``(D, sends[i])`` own rows that device ``d`` sends to device ``(d +
      shifts[i]) % D``, in the order of the receiver's ghost block (padding: row 0, unread);
    * ``grid``: regions along each axis; ``counts``: per device, real ``owned``, ``ghosts`` and
      ``edges`` (what the padding holds, for reports).
    """

    layout: Layout
    num_atoms: int
    atom_ids: np.ndarray
    species: np.ndarray
    positions: np.ndarray
    cell: np.ndarray
    senders: np.ndarray
    receivers: np.ndarray
    shifts: np.ndarray
    sends: tuple[np.ndarray, ...]
    grid: tuple[int, int, int]
    counts: dict

    @property
    def atom_mask(self) -> np.ndarray:
        """``(D, owned)``: True on real own rows."""
        return self.atom_ids >= 0

    def gather(self, values) -> np.ndarray:
        """Per-device values of own rows ``(D, owned, ...)`` in the structure's atom order ``(N, ...)``."""
        values = np.asarray(values)
        if values.shape[:2] != self.atom_ids.shape:
            raise ValueError(f"values must have per-device shape {self.atom_ids.shape} + (...), got {values.shape}")
        out = np.zeros((self.num_atoms,) + values.shape[2:], values.dtype)
        mask = self.atom_mask
        out[self.atom_ids[mask]] = values[mask]
        return out


def axis_coordinates(positions, cell, pbc) -> tuple[np.ndarray, np.ndarray]:
    """Coordinates along the three axes regions are cut on, and each axis's extent in Å:
    fractional coordinates (wrapped into ``[0, 1)`` along periodic axes) where the cell is
    non-degenerate, else Cartesian ones (fractional along the periodic axes)."""
    positions = np.asarray(positions, np.float64).reshape(-1, 3)
    cell = np.asarray(cell, np.float64).reshape(3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, bool), (3,))
    span = lambda c: np.ptp(c, axis=0) if len(c) else np.zeros(3)  # noqa: E731
    if abs(np.linalg.det(cell)) > 1e-12:
        frac = positions @ np.linalg.inv(cell)
        frac[:, pbc] %= 1.0
        heights = abs(np.linalg.det(cell)) / np.linalg.norm(np.cross(cell[[1, 2, 0]], cell[[2, 0, 1]]), axis=1)
        return frac, np.where(pbc, heights, span(frac) * heights)
    coords, extent = positions.copy(), span(positions)
    if pbc.any():
        frac = positions @ np.linalg.pinv(cell)
        coords[:, pbc] = frac[:, pbc] % 1.0
        extent[pbc] = np.linalg.norm(cell, axis=1)[pbc]
    return coords, extent


def choose_grid(devices: int, extent, pbc) -> tuple[int, int, int]:
    """The grid of ``devices`` regions whose cut planes have the least area per volume (each
    plane adds two ghost layers): ``sum_a planes_a / extent_a``, with ``p_a`` planes along a
    periodic axis and ``p_a - 1`` along an open one; ties go to fewer cut axes (fewer
    neighbours to exchange with)."""
    extent = np.asarray(extent, np.float64)
    pbc = np.broadcast_to(np.asarray(pbc, bool), (3,))

    def cost(grid):
        planes = [(p if periodic else p - 1) if p > 1 else 0 for p, periodic in zip(grid, pbc)]
        area = sum(n / e if e > 0 else math.inf for n, e in zip(planes, extent) if n)
        return area, sum(p > 1 for p in grid)

    grids = [g for g in itertools.product(range(1, devices + 1), repeat=3) if math.prod(g) == devices]
    return min(grids, key=cost)


def regions(positions, cell, pbc, devices: int, grid=None) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(owner, grid)``: the device owning each atom ``(N,)`` and the grid used. Along an axis cut
    into ``p`` regions, the cut values are the coordinates of the atoms at ranks ``k N / p``
    (``k = 1 .. p - 1``), and an atom belongs to the region after every cut at or below it: an
    atom on a cut plane goes to the upper region, and ties may leave a region empty."""
    coords, extent = axis_coordinates(positions, cell, pbc)
    grid = choose_grid(devices, extent, pbc) if grid is None else tuple(grid)
    index = np.zeros(len(coords), np.int64)
    for axis, p in enumerate(grid):
        c = coords[:, axis]
        ranked = np.sort(c)
        cuts = ranked[(np.arange(1, p) * len(c)) // p] if len(c) else np.zeros(p - 1)
        index = index * p + np.searchsorted(cuts, c, side="right")
    return index, grid


def _reach(owned, senders, receivers, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """Masks over atoms: those within `depth` hops of the `owned` ones against the edges'
    direction (what the owned atoms' energies read), and those within ``depth - 1`` hops (whose
    incoming edges the device computes)."""
    inner = reached = owned
    for hop in range(depth):
        if hop:
            inner = reached
        reached = inner.copy()
        reached[senders[inner[receivers]]] = True
    return reached, inner


def split(positions, cell, pbc, species, senders, receivers, edge_shifts, decomposition: Decomposition, num_layers: int) -> Shards:
    """Split one structure over ``decomposition.devices`` devices (see the module docstring).

    ``positions`` ``(N, 3)``, ``cell`` ``(3, 3)``, ``pbc`` ``(3,)``; ``species`` ``(N,)`` the
    model's species indices; ``senders``, ``receivers``, ``edge_shifts``: the radius graph
    (:func:`jequi.models.neighbour_edges`); ``num_layers``: the model's (the halo's depth).
    """
    dec = decomposition
    positions = np.asarray(positions, np.float64).reshape(-1, 3)
    n = len(positions)
    species = np.asarray(species)
    senders, receivers = np.asarray(senders, np.int64), np.asarray(receivers, np.int64)
    edge_shifts = np.asarray(edge_shifts, np.float64).reshape(-1, 3)
    if n == 0:
        raise ValueError("the structure has no atoms")
    if species.shape != (n,):
        raise ValueError(f"species must have shape ({n},) (one per atom), got {species.shape}")
    if senders.shape != receivers.shape or senders.ndim != 1 or len(edge_shifts) != len(senders):
        raise ValueError(f"senders {senders.shape}, receivers {receivers.shape} and shifts {edge_shifts.shape} must describe the same edges")
    if len(senders) and (min(senders.min(), receivers.min()) < 0 or max(senders.max(), receivers.max()) >= n):
        raise ValueError(f"edge indices must lie in [0, {n})")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
    devices = dec.devices
    depth = 1 if dec.scheme == "exchange" else num_layers
    owner, grid = regions(positions, cell, pbc, devices, dec.grid)
    row = np.zeros(n, np.int64)  # each atom's row among its owner's own atoms
    own = [np.flatnonzero(owner == d) for d in range(devices)]
    for d in range(devices):
        row[own[d]] = np.arange(len(own[d]))

    blocks, edges = [], []  # per device: {shift: ghost atoms from device d - shift}, kept edges
    for d in range(devices):
        reached, inner = _reach(owner == d, senders, receivers, depth)
        ghosts = np.flatnonzero(reached & (owner != d))
        shift = (d - owner[ghosts]) % devices
        blocks.append({k: ghosts[shift == k] for k in np.unique(shift).tolist()})
        edges.append(np.flatnonzero(inner[receivers]))
    shifts = tuple(sorted({k for b in blocks for k in b}))
    size = lambda count, minimum: bucket(count, minimum, dec.growth)  # noqa: E731
    layout = Layout(
        devices=devices,
        scheme=dec.scheme,
        owned=size(max(len(o) for o in own), dec.min_atoms),
        shifts=shifts,
        sends=tuple(size(max(len(b.get(k, ())) for b in blocks), dec.min_atoms) for k in shifts),
        edges=size(max(len(e) for e in edges), dec.min_edges),
        depth=depth,
    )

    atom_ids = np.full((devices, layout.owned), -1, np.int64)
    out_species = np.zeros((devices, layout.nodes), np.int32)
    out_positions = np.zeros((devices, layout.owned, 3))
    out_senders = np.full((devices, layout.edges), -1, np.int32)
    out_receivers = np.full((devices, layout.edges), -1, np.int32)
    out_shifts = np.zeros((devices, layout.edges, 3))
    out_sends = [np.zeros((devices, s), np.int32) for s in layout.sends]
    counts = {"owned": np.zeros(devices, np.int64), "ghosts": np.zeros(devices, np.int64), "edges": np.zeros(devices, np.int64)}
    for d in range(devices):
        local = np.full(n, -1, np.int64)
        local[own[d]] = np.arange(len(own[d]))
        start = layout.owned
        for i, k in enumerate(shifts):
            block = blocks[d].get(k, np.zeros(0, np.int64))
            local[block] = start + np.arange(len(block))
            out_sends[i][(d - k) % devices, : len(block)] = row[block]
            start += layout.sends[i]
        atom_ids[d, : len(own[d])] = own[d]
        out_positions[d, : len(own[d])] = positions[own[d]]
        rows = np.flatnonzero(local >= 0)
        rows = rows[local[rows] < layout.nodes]
        out_species[d, local[rows]] = species[rows]
        e = edges[d]
        s, r = local[senders[e]], local[receivers[e]]
        order = np.argsort(r, kind="stable")
        out_senders[d, : len(e)] = s[order]
        out_receivers[d, : len(e)] = r[order]
        out_shifts[d, : len(e)] = edge_shifts[e[order]]
        counts["owned"][d], counts["ghosts"][d], counts["edges"][d] = len(own[d]), sum(len(b) for b in blocks[d].values()), len(e)
    return Shards(
        layout, n, atom_ids, out_species, out_positions, np.asarray(cell, np.float64).reshape(3, 3), out_senders, out_receivers,
        out_shifts, tuple(out_sends), grid, counts,
    )  # fmt: skip
