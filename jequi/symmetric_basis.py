"""MACE's product basis as data: the generalised Clebsch-Gordan tensors of a symmetric
contraction, in mace-torch's weight layout, and their reduction to a small sparse basis that
the kernels unroll (one source of truth for both; nothing here imports a backend).

MACE (Batatia et al. 2022) builds, per node, channel ``c`` and output irrep ``L``,

    B[c, M] = sum_{nu=1..correlation} sum_k w_nu[species, k, c] sum_{i1..i_nu} U_nu[M, i1, ..., i_nu, k]
              x[c, i1] ... x[c, i_nu],

where ``x[c, :]`` are one channel's components over the coupling irreps ``0e+1o+2e+...`` and
``U_nu`` stacks every coupling path of ``nu`` copies of them to ``L`` (mace-torch's
``mace.tools.cg.U_matrix_real``, built here in the same order and with e3nn-torch's signs
(:func:`torch_wigner_3j`), so that mace-torch's ``weights_max`` / ``weights.j`` load with no
reordering or sign change: :func:`u_matrix`).

Contracted with ``nu`` copies of one vector, only ``U_nu``'s symmetric part counts, and it spans
far fewer functions than ``U_nu`` has paths (at ``0e+1o+2e+3o`` to ``1o``, correlation 3: 51
paths, 12 independent polynomials). :func:`reduce_basis` writes the symmetrised tensor over
monomials ``x_a x_b x_c`` (``a <= b <= c``) as ``A = Q R``: ``Q`` a few of ``A``'s own columns
(the sparsest independent ones) and ``R`` the rest in terms of them. The kernels then evaluate
``sum_j w'[s, j, c] sum_terms Q ... `` with ``w' = R w`` formed once per call (a tiny matmul whose
derivative is XLA's), a fraction of the full tensor's terms.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp
import numpy as np

from .irreps import Irrep, Irreps, as_irreps

LAYOUTS = ("mul_ir", "ir_mul")


# --- mace-torch's generalised CG tensors ------------------------------------------------------
@functools.lru_cache(maxsize=None)
def torch_wigner_3j(l1: int, l2: int, l3: int) -> np.ndarray:
    """e3nn-torch's ``o3.wigner_3j(l1, l2, l3)``, which mace-torch's tensors are built from:
    e3nn-jax's coefficients, but for triplets of odd ``l1 + l2 + l3`` signed so that the sorted
    triplet's first nonzero entry is positive (e3nn-torch's tabulated convention; the two differ
    in sign for, e.g., (1, 2, 2) and (3, 4, 6)). Checked entry by entry against e3nn 0.4.4 for
    ``l1 <= 11, l2 <= 4`` (tests/test_symmetric.py reads that table)."""
    c = np.asarray(e3nn.clebsch_gordan(l1, l2, l3), np.float64)
    if (l1 + l2 + l3) % 2 == 0:
        return c
    base = np.asarray(e3nn.clebsch_gordan(*sorted((l1, l2, l3))), np.float64).ravel()
    return c * np.sign(base[np.flatnonzero(np.abs(base) > 1e-12)[0]])


def _couplings(coupling: Irreps, nu: int, filter_mid):
    """``[(ir, tensor (ir.dim, d, ..., d))]``: mace-torch's ``_wigner_nj`` for ``nu`` copies of
    `coupling` (component normalization), sorted stably by irrep as it sorts them."""
    if nu == 1:
        eye, out, i = np.eye(coupling.dim), [], 0
        for mul, ir in coupling:
            for _ in range(mul):
                out.append((ir, eye[i : i + ir.dim]))
                i += ir.dim
        return out
    out = []
    for ir_left, c_left in _couplings(coupling, nu - 1, filter_mid):
        i = 0
        for mul, ir in coupling:
            for ir_out in ir_left * ir:
                if filter_mid is not None and ir_out not in filter_mid:
                    continue
                cg = torch_wigner_3j(ir_out.l, ir_left.l, ir.l) * math.sqrt(ir_out.dim)
                c = np.einsum("jk,ijl->ikl", c_left.reshape(c_left.shape[0], -1), cg)
                c = c.reshape(ir_out.dim, *([coupling.dim] * (nu - 1)), ir.dim)
                for u in range(mul):
                    e = np.zeros((ir_out.dim, *([coupling.dim] * nu)))
                    e[..., i + u * ir.dim : i + (u + 1) * ir.dim] = c
                    out.append((ir_out, e))
            i += mul * ir.dim
    return sorted(out, key=lambda item: (item[0].l, item[0].p))  # stable: paths of one irrep keep their order


@functools.lru_cache(maxsize=64)
def u_matrix(coupling, ir_out, nu: int) -> np.ndarray:
    """``U (2L+1, d, ..., d, P)`` (``nu`` axes of ``d = coupling.dim``): the ``P`` coupling paths
    of ``nu`` copies of `coupling` to `ir_out`, in mace-torch's order along the last axis (its
    ``U_matrix_real(coupling, ir_out, nu)[-1]``, which squeezes the unit axes that this keeps;
    at correlation 4 the intermediate irreps are the natural-parity ``l < 12`` ones, as there).
    ``P = 0`` where no path reaches `ir_out`."""
    coupling, ir_out = Irreps(coupling), Irrep(ir_out)
    filter_mid = [Irrep(l, (-1) ** l) for l in range(12)] if nu == 4 else None
    paths = [t for ir, t in _couplings(coupling, nu, filter_mid) if ir == ir_out]
    shape = (ir_out.dim, *([coupling.dim] * nu))
    return np.stack(paths, axis=-1) if paths else np.zeros((*shape, 0))


def monomials(d: int, nu: int) -> list[tuple[int, ...]]:
    """The degree-`nu` monomials of ``d`` variables as sorted index tuples ``a <= b <= ...``."""
    return list(itertools.combinations_with_replacement(range(d), nu))


def symmetrized(u: np.ndarray) -> np.ndarray:
    """``A (n_monomials, 2L+1, P)``: the coefficient of each monomial of :func:`monomials` in
    ``sum U[M, i1..i_nu, k] x_i1 ... x_i_nu`` (the sum of U over the monomial's orderings)."""
    nu, d = u.ndim - 2, u.shape[1]
    total = sum(np.transpose(u, (0, *(1 + p for p in perm), nu + 1)) for perm in itertools.permutations(range(nu)))
    monos = monomials(d, nu)
    stab = np.array([math.prod(math.factorial(c) for c in np.unique(m, return_counts=True)[1]) for m in monos], np.float64)
    idx = tuple(np.array(monos).T)
    return np.moveaxis(total[(slice(None), *idx)], 0, 1) / stab[:, None, None]  # each ordering counted |stabiliser| times


def reduce_basis(a: np.ndarray, tol: float = 1e-10) -> tuple[np.ndarray, np.ndarray]:
    """``(Q (n, M, r), R (r, P))`` with ``A = Q R`` (``A`` from :func:`symmetrized`): ``Q``'s
    columns are independent columns of ``A``, the sparsest first, and ``R`` writes every column
    of ``A`` in them (exactly, to float64 rounding)."""
    n, m, p = a.shape
    flat = a.reshape(n * m, p)
    if p == 0:
        return np.zeros((n, m, 0)), np.zeros((0, 0))
    scale = max(np.abs(flat).max(), 1.0)
    order = sorted(range(p), key=lambda k: (np.count_nonzero(np.abs(flat[:, k]) > tol * scale), k))
    chosen, basis = [], np.zeros((n * m, 0))
    for k in order:
        col = flat[:, k]
        resid = col - basis @ (basis.T @ col) if basis.shape[1] else col
        if np.linalg.norm(resid) > 1e-8 * max(np.linalg.norm(col), 1e-300):
            chosen.append(k)
            basis = np.concatenate([basis, (resid / np.linalg.norm(resid))[:, None]], axis=1)
    if not chosen:  # U's paths all antisymmetric: nothing survives x (x) ... (x) x
        return np.zeros((n, m, 0)), np.zeros((0, p))
    chosen.sort()
    q = flat[:, chosen]
    r, *_ = np.linalg.lstsq(q, flat, rcond=None)
    r[np.abs(r) < 1e-13] = 0.0
    if np.abs(q @ r - flat).max() > 1e-9 * scale:
        raise AssertionError("symmetric basis reduction is not exact")
    q[np.abs(q) < tol * scale] = 0.0
    return q.reshape(n, m, len(chosen)), r


# --- the descriptor ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Term:
    """One nonzero of the reduced basis: ``coef * x[a] x[b] ...`` (``mono``, sorted component
    indices of the coupling irreps) into output component ``m`` of output block ``out`` through
    reduced weight ``j`` (an index into ``w'``'s second axis)."""

    mono: tuple[int, ...]
    out: int
    m: int
    j: int
    coef: float


@dataclasses.dataclass(frozen=True)
class Block:
    """One output irrep: its place in the output (``offset`` of its ``mul x ir`` block) and, per
    correlation ``nu = 1..``, the mace-torch weight it reads and the reduction ``R`` from it to
    ``w'[:, j0 : j0 + r]``."""

    ir: Irrep
    offset: int
    params: tuple[int, ...]  # mace-torch's num_params per nu = 1..correlation (1 where no path: a zero U)
    j0: tuple[int, ...]  # first reduced weight per nu
    reductions: tuple  # R (r, P) per nu, as nested tuples (hashable)


class SymmetricContractionDescriptor:
    """The static part of :class:`jequi.SymmetricContraction`: irreps, correlation, species
    count, layout, mace-torch's weight shapes and the reduced basis (:class:`Term` list). Built
    once per argument set (:func:`descriptor`); equal arguments give the same object."""

    def __init__(self, irreps_in, irreps_out, correlation: int, num_species: int, layout: str = "mul_ir"):
        irreps_in, irreps_out = as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out")
        if not isinstance(correlation, (int, np.integer)) or not 1 <= correlation <= 4:
            raise ValueError(f"correlation must be an integer in 1..4, got {correlation!r}")
        if not isinstance(num_species, (int, np.integer)) or num_species < 1:
            raise ValueError(f"num_species must be a positive integer, got {num_species!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        muls = {mul for mul, _ in irreps_in} | {mul for mul, _ in irreps_out}
        if len(irreps_in) == 0 or len(irreps_out) == 0 or len(muls) != 1 or 0 in muls:
            raise ValueError(
                f"a symmetric contraction needs irreps of one multiplicity in and out (K x (0e+1o+...)), "
                f"got irreps_in={irreps_in} and irreps_out={irreps_out}"
            )
        if len({ir for _, ir in irreps_out}) != len(irreps_out):
            raise ValueError(f"irreps_out={irreps_out} repeats an irrep")
        self.irreps_in, self.irreps_out = irreps_in, irreps_out
        self.correlation, self.num_species, self.layout = int(correlation), int(num_species), layout
        self.mul = muls.pop()
        self.coupling = Irreps([(1, ir) for _, ir in irreps_in])
        d = self.coupling.dim
        blocks, terms, j = [], [], 0
        offset = 0
        for index, (_, ir) in enumerate(irreps_out):
            params, j0s, reductions = [], [], []
            for nu in range(1, self.correlation + 1):
                u = u_matrix(self.coupling, ir, nu)
                q, r = reduce_basis(symmetrized(u))
                params.append(max(u.shape[-1], 1))  # mace-torch: one zero path where none exists
                j0s.append(j)
                reductions.append(tuple(map(tuple, r)))
                for mono_index, mono in enumerate(monomials(d, nu)):
                    for m, col in zip(*np.nonzero(q[mono_index])):
                        terms.append(Term(mono, index, int(m), j + int(col), float(q[mono_index, m, col])))
                j += q.shape[-1]
            if not any(reductions):
                raise ValueError(f"no coupling of up to {self.correlation} copies of {self.coupling} reaches {ir}")
            blocks.append(Block(ir, offset, tuple(params), tuple(j0s), tuple(reductions)))
            offset += self.mul * ir.dim
        self.blocks, self.terms, self.num_reduced = tuple(blocks), tuple(terms), j

    def __repr__(self) -> str:
        return (
            f"SymmetricContractionDescriptor({self.irreps_in} -> {self.irreps_out}, correlation={self.correlation}, "
            f"num_species={self.num_species}, layout={self.layout!r}, {len(self.terms)} terms, {self.num_reduced} reduced weights)"
        )

    @property
    def weight_shapes(self) -> dict[str, tuple[int, int, int]]:
        """mace-torch's parameters of its ``SymmetricContraction`` (the names of its
        ``state_dict`` below ``symmetric_contractions.``): per output irrep ``i``,
        ``contractions.i.weights_max`` for the highest correlation and ``contractions.i.weights.t``
        for correlation ``correlation - 1 - t``, each ``(num_species, num_params, mul)``."""
        shapes = {}
        for i, block in enumerate(self.blocks):
            shapes[f"contractions.{i}.weights_max"] = (self.num_species, block.params[-1], self.mul)
            for t in range(self.correlation - 1):
                shapes[f"contractions.{i}.weights.{t}"] = (self.num_species, block.params[self.correlation - 2 - t], self.mul)
        return shapes

    def weight_name(self, i: int, nu: int) -> str:
        """The name in :attr:`weight_shapes` of output irrep `i`'s weight at correlation `nu`."""
        return f"contractions.{i}.weights_max" if nu == self.correlation else f"contractions.{i}.weights.{self.correlation - 1 - nu}"

    def reduced_weights(self, weights: dict):
        """``w' (num_species, num_reduced, mul)`` from mace-torch-layout `weights`: ``R w`` per
        output irrep and correlation (differentiable; the kernels' weights)."""
        parts = []
        for i, block in enumerate(self.blocks):
            for nu in range(1, self.correlation + 1):
                r = np.asarray(block.reductions[nu - 1], np.float64)
                if r.size:
                    w = weights[self.weight_name(i, nu)]
                    parts.append(jnp.einsum("jk,skc->sjc", jnp.asarray(r, w.dtype), w, precision=jax.lax.Precision.HIGHEST))
        return jnp.concatenate(parts, axis=1)

    @functools.cached_property
    def mono_table(self) -> tuple[list[tuple[int, ...]], np.ndarray]:
        """``(monos, dense (n_monos, num_reduced, n_out_components))``: the monomials the terms
        read and the terms as a dense matrix over them (the XLA reference's contraction), output
        components in the order ``(block, m)``; built once (every trace of the reference and of
        the kernels' second derivatives reads it)."""
        monos = sorted({t.mono for t in self.terms}, key=lambda m: (len(m), m))
        where = {m: i for i, m in enumerate(monos)}
        starts = np.cumsum([0] + [b.ir.dim for b in self.blocks])
        dense = np.zeros((len(monos), self.num_reduced, int(starts[-1])))
        for t in self.terms:
            dense[where[t.mono], t.j, starts[t.out] + t.m] += t.coef
        return monos, dense


@functools.lru_cache(maxsize=128)
def descriptor(irreps_in, irreps_out, correlation: int, num_species: int, layout: str = "mul_ir") -> SymmetricContractionDescriptor:
    """The :class:`SymmetricContractionDescriptor` of these arguments (cached: kernels are keyed by it)."""
    return SymmetricContractionDescriptor(irreps_in, irreps_out, correlation, num_species, layout)


# --- layouts ----------------------------------------------------------------------------------
def to_channels(desc: SymmetricContractionDescriptor, x):
    """``x (N, irreps_in.dim)`` in the descriptor's layout as ``(N, mul, d)``: each channel's
    components over the coupling irreps (mace-torch's ``reshape_irreps``)."""
    parts, i = [], 0
    for _, ir in desc.irreps_in:
        block = x[:, i : i + desc.mul * ir.dim]
        i += desc.mul * ir.dim
        if desc.layout == "mul_ir":
            parts.append(block.reshape(-1, desc.mul, ir.dim))
        else:
            parts.append(jnp.swapaxes(block.reshape(-1, ir.dim, desc.mul), 1, 2))
    return jnp.concatenate(parts, axis=-1)


def from_channels(desc: SymmetricContractionDescriptor, out):
    """``(N, mul, sum_L (2L+1))`` as ``(N, irreps_out.dim)`` in the descriptor's layout."""
    parts, i = [], 0
    for block in desc.blocks:
        part = out[:, :, i : i + block.ir.dim]
        i += block.ir.dim
        parts.append(part.reshape(part.shape[0], -1) if desc.layout == "mul_ir" else jnp.swapaxes(part, 1, 2).reshape(part.shape[0], -1))
    return jnp.concatenate(parts, axis=-1)


# --- the pure-JAX reference ---------------------------------------------------------------------
def reference(desc: SymmetricContractionDescriptor, x, species, wr, *, chunk_elements: int = 1 << 26):
    """The contraction of flat rows ``x (N, irreps_in.dim)`` with reduced weights ``wr
    (num_species, num_reduced, mul)`` (:meth:`~SymmetricContractionDescriptor.reduced_weights`)
    for ``species (N,)``: the monomials of each channel, the terms as one dense matrix over them,
    the species' weights. Rows go in chunks so that no intermediate holds more than
    `chunk_elements` values. Plain JAX: the oracle of the kernels and their derivatives of every
    order."""
    monos, dense = desc.mono_table
    n = x.shape[0]
    xc = to_channels(desc, x)  # (N, K, d)
    dense = jnp.asarray(dense, x.dtype)
    by_degree = {}
    for i, m in enumerate(monos):
        by_degree.setdefault(len(m), []).append(i)

    def rows(args):
        xr, sr = args
        feats = []
        for nu in sorted(by_degree):
            idx = np.array([monos[i] for i in by_degree[nu]])  # (n_nu, nu)
            f = xr[:, :, idx[:, 0]]
            for k in range(1, nu):
                f = f * xr[:, :, idx[:, k]]
            feats.append(f)
        f = jnp.concatenate(feats, axis=-1)  # (n, K, n_monos), in mono_table's order
        basis = jnp.einsum("nkq,qjm->nkjm", f, dense, precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("nkjm,njk->nkm", basis, wr[sr], precision=jax.lax.Precision.HIGHEST)

    width = desc.mul * max(len(monos), desc.num_reduced * dense.shape[-1])
    step = max(1, min(n, chunk_elements // max(width, 1)))
    if n <= step:
        out = rows((xc, species))
    else:
        pad = (-n) % step
        xp = jnp.pad(xc, ((0, pad), (0, 0), (0, 0)))
        sp = jnp.pad(species, (0, pad))
        out = jax.lax.map(rows, (xp.reshape(-1, step, *xc.shape[1:]), sp.reshape(-1, step)))
        out = out.reshape(-1, *out.shape[2:])[:n]
    return from_channels(desc, out)
