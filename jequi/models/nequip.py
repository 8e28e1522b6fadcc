"""A NequIP-style interatomic potential built on ``tp.conv``, in Flax linen and in Haiku.

The architecture is written once, in :func:`atomic_energies`, against a parameter function
``param(name, shape, std)`` (a normal initialiser with that standard deviation; 0 means
zeros); :class:`NequIP` (Flax linen) and :func:`nequip_haiku` (Haiku) only supply it. So
both frameworks hold the same parameters under the same names, and give the same energy.

Per interaction block (NequIP, Batzner et al. 2022): a linear layer, the fused
convolution ``x (x) Y(r_hat)`` with per-edge weights from an MLP of a Bessel radial basis
times a polynomial cutoff envelope (its last layer applied inside the conv,
:meth:`jequi.TensorProduct.radial_conv`), a linear layer, a gated nonlinearity and a linear
self-connection. Per-atom energies are a linear readout plus a per-species shift; forces are
minus the gradient of the energy with respect to the positions (:func:`energy_and_forces`).
"""

from __future__ import annotations

import dataclasses
import math
import functools

import e3nn_jax as e3nn
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..atoms import edge_vectors
from ..graph import Graph
from ..products import TensorProduct, channelwise
from .architecture import RadiusGraphModel, with_species_shift
from .precision import conv_dtype, exact_geometry, policy


def species_index(species, numbers) -> np.ndarray:
    """Atomic numbers -> indices into a model's `species` (ValueError for unknown elements)."""
    numbers = np.asarray(numbers)
    lookup = {z: i for i, z in enumerate(species)}
    unknown = sorted(set(numbers.tolist()) - set(lookup))
    if unknown:
        raise ValueError(f"elements {unknown} are not in the model's species {tuple(species)}")
    return np.array([lookup[z] for z in numbers.tolist()], np.int32)


@dataclasses.dataclass(frozen=True)
class NequIPConfig(RadiusGraphModel):
    """Hyper-parameters. ``species``: the atomic numbers the model knows, in index order."""

    species: tuple[int, ...] = (13, 28, 29, 46, 47, 78, 79)  # Al Ni Cu Pd Ag Pt Au (EMT's metals)
    cutoff: float = 4.5
    hidden: str = "32x0e+8x1o+4x2e"
    sh_lmax: int = 2
    num_layers: int = 2
    num_basis: int = 8
    radial_hidden: int = 16
    avg_num_neighbors: float = 30.0
    energy_scale: float = 1.0
    backend: str | None = None  # jequi backend for the convolutions (default: fastest)
    # "jequi" (fused tp.conv), "e3nn" (gather, e3nn-jax product, segment_sum: a baseline), or a
    # function ``conv(tp, x, sh, weights, graph) -> IrrepsArray`` of tp.irreps_out (another
    # library's convolution in the same model, as benchmarks/model_step.py runs cuEquivariance)
    conv: object = "jequi"
    # edge chunks of the "jequi" conv (TensorProduct.radial_conv; None: its memory rule)
    edge_chunks: int | None = None
    # "float32", "tf32" or "bf16-mixed" (jequi.models.precision; docs/precision.md)
    precision: str = "float32"

    def species_index(self, numbers) -> np.ndarray:
        """Atomic numbers -> indices into :attr:`species` (ValueError for unknown elements)."""
        return species_index(self.species, numbers)

    def energies(self, params, species, positions, graph, cell=None, exchange=None):
        """Per-atom energies from the linen or Haiku parameters (:func:`atomic_energies`): the
        model interface the calculator, MD and sharding call (:class:`jequi.models.MACEConfig`
        has the same)."""
        named = model_parameters(params)
        return atomic_energies(lambda name, shape, std: named[name], self, species, positions, graph, cell, exchange)

    def module(self) -> NequIP:
        return NequIP(self)

    def init_params(self, key, species, positions, graph, cell=None) -> dict:
        """The linen model's ``{"params": ...}``, initialised on one batch's arrays."""
        return NequIP(self).init(key, species, positions, graph, cell)

    def with_species_energies(self, params, energies) -> dict:
        """`params` with ``species_shift`` set to `energies` (:func:`train`'s fit)."""
        return with_species_shift(params, energies)


def model_parameters(params) -> dict:
    """The parameters by name, from the Flax linen model's ``{"params": ...}`` or the Haiku
    model's ``{"nequip": ...}``."""
    for key in ("params", "nequip"):
        if isinstance(params, dict) and key in params:
            return params[key]
    raise ValueError(f"params must be the linen model's {{'params': ...}} or the Haiku model's {{'nequip': ...}}, got keys "
                     f"{list(params) if isinstance(params, dict) else type(params).__name__}")  # fmt: skip


@functools.lru_cache(maxsize=64)
def _conv_tp(irreps_x: str, irreps_sh: str, filter_out: str) -> TensorProduct:
    return channelwise(irreps_x, irreps_sh, filter_out)


def _linear(param, name: str, x: e3nn.IrrepsArray, irreps_out) -> e3nn.IrrepsArray:
    """e3nn-jax's equivariant linear layer with this model's parameters."""
    lin = e3nn.FunctionalLinear(x.irreps, e3nn.Irreps(irreps_out))
    ws = [param(f"{name}.w{i}", ins.path_shape, ins.weight_std) for i, ins in enumerate(lin.instructions)]
    return jax.vmap(lambda v: lin(ws, v))(x)


def _radial_mlp(param, name: str, sizes):
    """The radial MLP as ``(hidden_fn, kernel)``: its layers up to the last hidden values, a
    function of the radial basis rows, and its last layer's matrix (weights
    ``hidden_fn(basis) @ kernel``); the conv applies both chunk by chunk of edges
    (:meth:`TensorProduct.radial_conv`), so no per-edge hidden values outlive a chunk."""
    ws = [param(f"{name}.w{i}", (a, b), 1.0) for i, (a, b) in enumerate(zip(sizes[:-2], sizes[1:-1]))]

    def hidden_fn(x):
        for w, a in zip(ws, sizes[:-2]):
            x = jax.nn.silu(x @ w / math.sqrt(a))
        return x / math.sqrt(sizes[-2])

    last = len(sizes) - 2
    return hidden_fn, param(f"{name}.w{last}", tuple(sizes[-2:]), 1.0)


def _convolve(config: NequIPConfig, tp: TensorProduct, x, sh, radial, hidden_fn, kernel, graph: Graph):
    dtype = conv_dtype(config)
    if config.conv == "jequi":
        out = tp.radial_conv(x, sh, radial, kernel, graph, hidden_fn=hidden_fn, edge_chunks=config.edge_chunks, dtype=dtype, backend=config.backend)
        return out.astype(x.dtype)
    weights = hidden_fn(radial) @ kernel
    if callable(config.conv):
        return config.conv(tp, x, sh, weights, graph)
    if config.conv == "e3nn":  # what jequi replaces: an |E| x out.dim buffer and a scatter
        from e3nn_jax.legacy import FunctionalTensorProduct

        f = FunctionalTensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, list(tp.instructions))
        z = jax.vmap(f.left_right)(weights, x[graph.senders], sh)
        return e3nn.IrrepsArray(tp.irreps_out, jax.ops.segment_sum(z.array, graph.receivers, num_segments=graph.num_nodes))
    raise ValueError(f"conv must be 'jequi', 'e3nn' or a function, got {config.conv!r}")


def atomic_energies(param, config: NequIPConfig, species, positions, graph: Graph, cell=None, exchange=None):
    """Per-atom energies ``(N,)`` of one structure or of several batched into one graph.

    ``species``: indices into ``config.species`` ``(N,)``; ``positions`` ``(N, 3)`` in Å;
    ``graph``: the radius graph (:func:`jequi.graph_from_atoms` or
    :func:`jequi.models.data.batch`); ``cell``: ``(3, 3)`` for periodic shifts (or None).
    ``exchange``: for one device's part of a structure split over devices
    (:mod:`jequi.models.distributed`), a function appending the ghost atoms' rows (from the
    devices that own them) to an array of this device's atoms' rows, applied to each
    convolution's input; ``species`` then holds this device's atoms, ``positions`` those atoms
    followed by the ghosts, and ``graph`` has this device's atoms as receivers, all as senders.
    """
    with policy(config.precision).matmuls():
        return _atomic_energies(param, config, species, positions, graph, cell, exchange)


def _atomic_energies(param, config: NequIPConfig, species, positions, graph: Graph, cell, exchange):
    hidden = e3nn.Irreps(config.hidden)
    sh_irreps = e3nn.Irreps.spherical_harmonics(config.sh_lmax)
    valid = graph.receivers < graph.num_nodes
    with exact_geometry():  # edge vectors, harmonics, radial basis: float32 under every policy
        vectors = edge_vectors(graph, positions, cell)
        vectors = jnp.where(valid[:, None], vectors, jnp.array([config.cutoff, 0.0, 0.0], vectors.dtype))
        r = jnp.sqrt(jnp.sum(vectors**2, axis=-1))
        sh = e3nn.spherical_harmonics(sh_irreps, vectors, normalize=True, normalization="component")
        envelope = e3nn.poly_envelope(5, 2)(r / config.cutoff)
        radial = e3nn.bessel(r, config.num_basis, config.cutoff) * envelope[:, None]

    onehot = jax.nn.one_hot(species, len(config.species), dtype=positions.dtype)
    h = e3nn.IrrepsArray(f"{hidden.count('0e')}x0e", onehot @ param("embed", (len(config.species), hidden.count("0e")), 1.0))
    for layer in range(config.num_layers):
        x = _linear(param, f"layer{layer}.up", h, h.irreps)
        if exchange is not None:
            x = e3nn.IrrepsArray(x.irreps, exchange(x.array))
        tp = _conv_tp(str(x.irreps), str(sh_irreps), str(hidden))
        hidden_fn, kernel = _radial_mlp(param, f"layer{layer}.radial", (config.num_basis, config.radial_hidden, tp.weight_numel))
        message = _convolve(config, tp, x, sh, radial, hidden_fn, kernel, graph) / math.sqrt(config.avg_num_neighbors)
        gated = hidden.filter(drop=["0e", "0o"])
        gate_irreps = e3nn.Irreps(f"{hidden.count('0e') + gated.num_irreps}x0e") + gated
        update = e3nn.gate(_linear(param, f"layer{layer}.down", message, gate_irreps))
        h = update + _linear(param, f"layer{layer}.self", h, update.irreps)
    energies = _linear(param, "readout", h, "0e").array[:, 0] * config.energy_scale
    return energies + param("species_shift", (len(config.species),), 0.0)[species]


def energy_and_forces(energy_fn, positions, *args):
    """``(E, F)`` with ``F = -dE/dpositions`` for a scalar ``energy_fn(positions, *args)``."""
    energy, grad = jax.value_and_grad(energy_fn)(positions, *args)
    return energy, -grad


# --- frameworks ------------------------------------------------------------------------------
def _normal_init(std):
    return lambda key, shape, dtype=jnp.float32: std * jax.random.normal(key, shape, dtype)


class NequIP(nn.Module):
    """The model in Flax linen: ``apply(params, species, positions, graph, cell) -> (N,)``."""

    config: NequIPConfig = NequIPConfig()

    @nn.compact
    def __call__(self, species, positions, graph, cell=None):
        def param(name, shape, std):
            return self.param(name, _normal_init(std), shape, positions.dtype)

        return atomic_energies(param, self.config, species, positions, graph, cell)


def nequip_haiku(config: NequIPConfig = NequIPConfig()):
    """The model in Haiku: ``hk.transform``-ed ``(species, positions, graph, cell) -> (N,)``.

    Its parameters are ``{"nequip": {name: array}}`` with the linen model's names:
    ``{"nequip": linen_params["params"]}`` runs it with the linen model's parameters.
    """
    import haiku as hk

    def fn(species, positions, graph, cell=None):
        with hk.experimental.name_scope("nequip"):

            def param(name, shape, std):
                return hk.get_parameter(name, shape, positions.dtype, init=lambda s, d: _normal_init(std)(hk.next_rng_key(), s, d))

            return atomic_energies(param, config, species, positions, graph, cell)

    return hk.without_apply_rng(hk.transform(fn))
