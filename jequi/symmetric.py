"""MACE's product basis (``jequi.SymmetricContraction``) and element-dependent linear
(``jequi.IndexedLinear``), with mace-torch's parameters.

>>> sc = jequi.SymmetricContraction("128x0e+128x1o+128x2e+128x3o", "128x0e+128x1o", 3, num_species=10)
>>> weights = sc.init_weights(jax.random.key(0))     # {name: (10, num_params, 128)}, as mace-torch names them
>>> b = sc(x, species, weights)                        # x (..., 2048), species (...,) ints -> (..., 512)

The values are mace-torch's ``SymmetricContraction`` (its generalised Clebsch-Gordan tensors,
built in :mod:`jequi.symmetric_basis` from e3nn's coefficients), evaluated through a reduced
basis; ``backend="pallas"`` runs them in the kernels of :mod:`pallas_kernels.symmetric`
(default on a GPU), ``"xla"`` in plain JAX (default on a CPU).
"""

from __future__ import annotations

import math

import e3nn_jax as e3nn
import jax
import jax.numpy as jnp

from . import symmetric_autodiff, symmetric_basis
from .dtypes import plan
from .species import node_inputs, species_blocks
from .irreps import as_irreps

BACKENDS = ("xla", "pallas")
# Rows a kernel program walks, all of one species: each species' last block is partly empty, so
# the padding is at most (num_species + 1) * BLOCK rows a call.
BLOCK = 16


def _default_backend() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


class SymmetricContraction:
    """MACE's symmetric contraction: per node, channel and output irrep ``L``, the polynomial
    ``sum_nu sum_k w_nu[species, k, c] U_nu[M, i1..i_nu, k] x[c, i1] ... x[c, i_nu]`` of degree
    up to `correlation` in the channel's components (mace-torch's ``SymmetricContraction`` with
    ``use_reduced_cg=False``; :mod:`jequi.symmetric_basis`).

    Args:
        irreps_in: ``K x (0e + 1o + ...)``: every irrep with one multiplicity ``K``.
        irreps_out: ``K x L1 + K x L2 + ...`` (MACE: ``128x0e+128x1o``).
        correlation: 1 to 4 (MACE uses 3).
        num_species: the weights' first axis; ``species`` index it.
        layout: ``"mul_ir"`` (e3nn's) or ``"ir_mul"`` for ``x`` and the output.

    ``weights`` is a dict with :attr:`weight_shapes`' keys: mace-torch's parameter names below
    ``symmetric_contractions.``, so a checkpoint's arrays load unchanged.
    """

    def __init__(self, irreps_in, irreps_out, correlation: int, num_species: int, *, layout: str = "mul_ir"):
        self.descriptor = symmetric_basis.descriptor(
            as_irreps(irreps_in, "irreps_in"), as_irreps(irreps_out, "irreps_out"), correlation, num_species, layout
        )

    irreps_in = property(lambda self: self.descriptor.irreps_in)
    irreps_out = property(lambda self: self.descriptor.irreps_out)
    correlation = property(lambda self: self.descriptor.correlation)
    num_species = property(lambda self: self.descriptor.num_species)
    weight_shapes = property(lambda self: self.descriptor.weight_shapes)

    def __repr__(self) -> str:
        d = self.descriptor
        return f"SymmetricContraction({d.irreps_in} -> {d.irreps_out}, correlation={d.correlation}, num_species={d.num_species})"

    def init_weights(self, key, dtype=jnp.float32) -> dict:
        """mace-torch's initialisation: standard normal divided by the number of paths."""
        keys = jax.random.split(key, len(self.weight_shapes))
        return {name: jax.random.normal(k, shape, dtype) / shape[1] for k, (name, shape) in zip(keys, self.weight_shapes.items())}

    def _check_weights(self, weights):
        if not isinstance(weights, dict):
            raise TypeError(f"weights must be a dict of {sorted(self.weight_shapes)}, got {type(weights).__name__}")
        expected = self.weight_shapes
        if set(weights) != set(expected):
            missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
            raise ValueError(f"weights: missing {missing}, unexpected {extra} (see weight_shapes)")
        for name, shape in expected.items():
            if tuple(jnp.shape(weights[name])) != shape:
                raise ValueError(f"weights[{name!r}] has shape {tuple(jnp.shape(weights[name]))}, expected {shape}")

    def __call__(self, x, species, weights: dict, *, backend: str | None = None, out_dtype=None, math_dtype=None):
        """``(..., irreps_out.dim)`` from ``x (..., irreps_in.dim)`` and integer ``species
        (...)`` (same leading dims); an ``IrrepsArray`` ``x`` gives an ``IrrepsArray``. A species
        outside ``[0, num_species)`` raises where ``species`` is concrete; under ``jit`` such a
        row gives zero and gets zero gradient. ``out_dtype`` and ``math_dtype``: :func:`jequi.dtypes.plan`
        (default: the result in the inputs' dtype, half precision computed in float32)."""
        d = self.descriptor
        x, species, wrap = node_inputs(x, species, d.irreps_in, d.num_species, d.layout)
        p = plan(x.dtype, out_dtype, math_dtype)  # computed in p.math, the output rounded once
        x = x.astype(p.math)
        self._check_weights(weights)
        backend = backend or _default_backend()
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r} for a symmetric contraction; known: {', '.join(BACKENDS)}")
        batch = x.shape[:-1]
        n = math.prod(batch)
        wr = d.reduced_weights({k: jnp.asarray(v, x.dtype) for k, v in weights.items()})
        wr = jnp.concatenate([wr, jnp.zeros((1, *wr.shape[1:]), wr.dtype)])  # the out-of-range species' group
        xf, sf = x.reshape(n, x.shape[-1]), species.reshape(n).astype(jnp.int32)  # no -1: zero rows
        if n == 0:
            out = jnp.zeros((0, d.irreps_out.dim), x.dtype)
        elif backend == "xla":
            sf = jnp.where((sf >= 0) & (sf < d.num_species), sf, d.num_species)
            out = symmetric_basis.reference(d, xf, sf, wr)
        else:
            rows, block_species = species_blocks(sf, d.num_species, BLOCK)
            out = symmetric_autodiff.contract(symmetric_autodiff.Spec(d, BLOCK), xf, wr, rows, block_species)
        out = out.reshape(*batch, d.irreps_out.dim).astype(p.out)
        return e3nn.IrrepsArray(d.irreps_out, out) if wrap else out
