"""Nequix (Koker et al. 2025, github atomicarchitects/nequix, MIT licence) on jequi's conv,
with Nequix's own parameters and checkpoint format.

Nequix is a NequIP-style foundation potential in Equinox on e3nn-jax. Per layer (its
``NequixConvolution``):

- ``linear_1`` (e3nn linear), then the channelwise (``uvu``) conv of the senders' features
  with the edges' spherical harmonics; its per-edge, per-channel weights are a radial MLP
  (no biases, silu) of a Bessel basis times a polynomial cutoff. Here that conv is
  :meth:`jequi.TensorProduct.radial_conv`, with the MLP's last layer inside the conv;
- the sum over neighbours divided by ``sqrt(avg_n_neighbors)``;
- ``linear_2`` plus a linear skip of the layer's input (per species where
  ``index_weights``);
- an RMS layer norm (:func:`rms_layer_norm`), then e3nn's gate.

A linear readout of the last layer's scalars gives per-atom energies
``readout * scale + shift + atom_energies[species]``.

The parameters are a flat dict keyed by the Equinox module's paths, each array in Nequix's
layout. Examples: ``layers.0.radial_mlp.layers.2.weights`` and
``layers.1.linear_2.w[0,0] 128x0e,256x0e`` (e3nn-jax's ``Linear`` names its weights so).
:func:`read_nqx` reads a ``.nqx`` checkpoint into them and :func:`write_nqx` writes one. The
format is one JSON line of hyper-parameters, then every array of the module in Equinox's leaf
order as ``.npy`` records. :func:`parameter_shapes` is that order.

Nequix's package sets ``jax_default_matmul_precision`` to ``"highest"`` when imported, so its
float32 matmuls never run in TF32. :attr:`NequixConfig.precision`'s default, ``"float32"``
(:mod:`jequi.models.precision`), does the same inside the model only.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import pathlib

import e3nn_jax as e3nn
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..atoms import edge_vectors
from ..graph import Graph
from ..products import channelwise
from .architecture import RadiusGraphModel
from .named import flat_parameters, init_named, with_parameter
from .nequip import species_index
from .precision import conv_dtype, exact_geometry, policy

# Nequix's training sets: MPtrj's 89 elements (Z = 1-83, 89-94), in index order.
MP_SPECIES = tuple(range(1, 84)) + tuple(range(89, 95))


@dataclasses.dataclass(frozen=True)
class NequixConfig(RadiusGraphModel):
    """Hyper-parameters; the defaults are the released Nequix models' (``nequix-mp-1``,
    ``nequix-oam-1``: 4 layers, ``128x0e+64x1o+32x2e+32x3o``, r_max 6 Å).

    The fields map onto a ``.nqx`` file's JSON keys (:data:`NQX_KEYS`). ``species``: atomic
    numbers in index order (Nequix sorts them). ``precision``: the policy of
    :mod:`jequi.models.precision` (``"float32"``: matmuls at ``"highest"``, as Nequix's package
    sets them; ``"tf32"``, ``"bf16-mixed"``: docs/precision.md). ``backend`` / ``conv`` /
    ``edge_chunks``: as in :class:`jequi.models.NequIPConfig`; ``conv="e3nn"`` runs Nequix's own
    gather, e3nn-jax product and scatter.
    """

    species: tuple[int, ...] = MP_SPECIES
    cutoff: float = 6.0
    hidden: str = "128x0e+64x1o+32x2e+32x3o"
    sh_lmax: int = 3
    num_layers: int = 4
    num_basis: int = 8
    radial_mlp_size: int = 64
    radial_mlp_layers: int = 2
    polynomial_p: float = 6.0
    mlp_init_scale: float = 4.0
    index_weights: bool = False
    layer_norm: bool = True
    shift: float = 0.0
    scale: float = 1.0
    avg_num_neighbors: float = 1.0
    precision: str = "float32"
    backend: str | None = None
    conv: object = "jequi"
    edge_chunks: int | None = None

    def __post_init__(self):
        if list(self.species) != sorted(set(self.species)):
            raise ValueError(f"species must be distinct atomic numbers in increasing order (Nequix's index order), got {self.species}")
        if self.num_layers < 1 or self.radial_mlp_layers < 1:
            raise ValueError(f"num_layers and radial_mlp_layers must be >= 1, got {self.num_layers}, {self.radial_mlp_layers}")
        if e3nn.Irreps(self.hidden).count("0e") == 0:
            raise ValueError(f"hidden must hold scalars (0e) for the readout, got {self.hidden!r}")

    def species_index(self, numbers) -> np.ndarray:
        """Atomic numbers -> indices into :attr:`species` (ValueError for unknown elements)."""
        return species_index(self.species, numbers)

    def module(self) -> Nequix:
        return Nequix(self)

    def energies(self, params, species, positions, graph, cell=None, exchange=None):
        """Per-atom energies: the model interface of the calculator, MD, sharding and training."""
        return atomic_energies(flat_parameters(params), self, species, positions, graph, cell, exchange)

    def init_params(self, key, species=None, positions=None, graph=None, cell=None) -> dict:
        """``{"params": {name: array}}`` with Nequix's initialisation (its MLP's scaled normal,
        e3nn's linears' unit normal, layer-norm weights one, atom energies zero)."""
        return init_named(parameter_shapes(self), functools.partial(init_parameter, self), key)

    def with_species_energies(self, params, energies) -> dict:
        """`params` with the atom energies set to `energies` (``(num_species,)``; :func:`train`'s fit)."""
        return with_parameter(params, "atom_energies", energies)


# --- the layers' shapes ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Linear:
    """One e3nn-jax ``Linear``: its functional form, its weight names in instruction order and
    the irreps its output is rechunked to."""

    fn: e3nn.FunctionalLinear
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    irreps_out: e3nn.Irreps


def _linear(irreps_in, irreps_out, force_irreps_out: bool = False, num_indexed: int | None = None) -> _Linear:
    """e3nn-jax's ``Linear(irreps_in, irreps_out, force_irreps_out=...)``, as its Equinox module
    builds it: the input regrouped; the output filtered to the input's irreps and simplified
    unless forced; weights named ``w[i_in,i_out] <mul_ir_in>,<mul_ir_out>``."""
    irreps_in = e3nn.Irreps(irreps_in).regroup()
    irreps_out = e3nn.Irreps(irreps_out)
    if not force_irreps_out:
        irreps_out = irreps_out.filter(keep=irreps_in).simplify()
    fn = e3nn.FunctionalLinear(irreps_in, irreps_out)
    names, shapes = [], []
    for ins in fn.instructions:
        if ins.i_in == -1:
            raise ValueError("biases are not part of Nequix's linears")
        names.append(f"w[{ins.i_in},{ins.i_out}] {fn.irreps_in[ins.i_in]},{fn.irreps_out[ins.i_out]}")
        shapes.append(((num_indexed,) if num_indexed else ()) + tuple(ins.path_shape))
    return _Linear(fn, tuple(names), tuple(shapes), irreps_out)


@dataclasses.dataclass(frozen=True)
class _Layer:
    linear_1: _Linear
    linear_2: _Linear
    skip: _Linear
    tp: object  # jequi.TensorProduct of the conv (channelwise, outputs sorted as Nequix's Sort)
    norm_irreps: e3nn.Irreps  # the layer norm's (and the gate's input) irreps
    mlp_sizes: tuple[int, ...]


@functools.lru_cache(maxsize=16)
def layers(config: NequixConfig) -> tuple[_Layer, ...]:
    """Each layer's linears, conv product and irreps, as Nequix's constructor builds them."""
    hidden = e3nn.Irreps(config.hidden)
    sh = e3nn.Irreps.spherical_harmonics(config.sh_lmax)
    irreps_in = e3nn.Irreps(f"{len(config.species)}x0e")
    out = []
    for i in range(config.num_layers):
        output = hidden if i < config.num_layers - 1 else hidden.filter("0e")
        tp = channelwise(irreps_in, sh, output)
        gates = e3nn.Irreps(f"{output.num_irreps - output.count('0e')}x0e")
        norm_irreps = (output + gates).regroup()
        out.append(_Layer(
            linear_1=_linear(irreps_in, irreps_in),
            linear_2=_linear(tp.irreps_out, norm_irreps),
            skip=_linear(irreps_in, norm_irreps, force_irreps_out=True, num_indexed=len(config.species) if config.index_weights else None),
            tp=tp,
            norm_irreps=norm_irreps,
            mlp_sizes=(config.num_basis,) + (config.radial_mlp_size,) * config.radial_mlp_layers + (tp.weight_numel,),
        ))  # fmt: skip
        irreps_in = output
    return tuple(out)


def _readout(config: NequixConfig) -> _Linear:
    return _linear(e3nn.Irreps(config.hidden).filter("0e"), "0e")


def _linear_shapes(prefix: str, lin: _Linear) -> dict:
    # Equinox stores a Linear's weights in a dict, whose leaves JAX orders by sorted key.
    return {f"{prefix}.{n}": s for n, s in sorted(zip(lin.names, lin.shapes))}


def parameter_shapes(config: NequixConfig) -> dict:
    """``{name: shape}`` of every parameter, in the ``.nqx`` file's (Equinox's leaf) order."""
    shapes = {"atom_energies": (len(config.species),)}
    for i, layer in enumerate(layers(config)):
        p = f"layers.{i}"
        sizes = layer.mlp_sizes
        shapes.update({f"{p}.radial_mlp.layers.{k}.weights": (a, b) for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))})
        for name in ("linear_1", "linear_2", "skip"):
            shapes.update(_linear_shapes(f"{p}.{name}", getattr(layer, name)))
        if config.layer_norm:
            shapes.update({f"{p}.layer_norm.affine_weight.{j}": (mul,) for j, (mul, _) in enumerate(layer.norm_irreps)})
    shapes.update(_linear_shapes("readout", _readout(config)))
    return shapes


def init_parameter(config: NequixConfig, name: str, shape: tuple, key):
    """One parameter as Nequix initialises it."""
    if name == "atom_energies":
        return jnp.zeros(shape, jnp.float32)
    if ".layer_norm." in name:
        return jnp.ones(shape, jnp.float32)
    if ".radial_mlp.layers." in name:
        last = int(name.split(".")[4]) == config.radial_mlp_layers
        return jax.random.normal(key, shape) * np.sqrt((1.0 if last else config.mlp_init_scale) / shape[0])
    return jax.random.normal(key, shape)  # e3nn-jax's Linear: unit normal, normalised in the forward


# --- the model -------------------------------------------------------------------------------
def _apply_linear(p: dict, prefix: str, lin: _Linear, x: e3nn.IrrepsArray, species=None) -> e3nn.IrrepsArray:
    ws = [p[f"{prefix}.{n}"] for n in lin.names]
    x = x.regroup()
    if species is None:
        y = jax.vmap(lambda v: lin.fn(ws, v))(x)
    else:  # indexed: each node its species' weights
        y = jax.vmap(lambda w, v: lin.fn(w, v))([w[species] for w in ws], x)
    return y.rechunk(lin.irreps_out)


def rms_layer_norm(x: e3nn.IrrepsArray, weights, eps: float = 1e-12) -> e3nn.IrrepsArray:
    """Nequix's ``RMSLayerNorm`` (ESEN's, without centering): every irrep block divided by one
    per-node root mean square in which each block counts ``1 / (dim * blocks)``, then scaled per
    channel by its affine weight."""
    blocks = len(x.irreps)
    norm = sum(jnp.mean(jnp.sum(c**2 / (ir.dim * blocks), axis=-2), axis=-1) for (_, ir), c in zip(x.irreps, x.chunks))
    scale = jax.lax.rsqrt(norm + eps)[:, None, None]
    chunks = [c * w[:, None] * scale for c, w in zip(x.chunks, weights)]
    return e3nn.from_chunks(x.irreps, chunks, x.shape[:-1], x.dtype)


def bessel_basis(r, num_basis: int, r_max: float):
    """Nequix's Bessel basis ``2/r_max sin(n pi r / r_max) / r`` (its r -> 0 limit at 0)."""
    n = jnp.arange(1, num_basis + 1, dtype=r.dtype) * jnp.pi
    safe = jnp.where(r == 0.0, 1.0, r)[:, None]
    return 2.0 / r_max * jnp.where(r[:, None] == 0.0, n / r_max, jnp.sin(n * safe / r_max) / safe)


def polynomial_cutoff(r, r_max: float, p: float):
    """Nequix's polynomial envelope of degree ``p`` (1 at 0, zero with its first derivatives at r_max)."""
    x = r / r_max
    out = 1.0 - (p + 1.0) * (p + 2.0) / 2.0 * x**p + p * (p + 2.0) * x ** (p + 1.0) - p * (p + 1.0) / 2.0 * x ** (p + 2.0)
    return jnp.where(x < 1.0, out, 0.0)


def _convolve(config: NequixConfig, layer: _Layer, x, sh, radial, hidden_fn, kernel, graph: Graph):
    dtype = conv_dtype(config)
    if config.conv == "jequi":
        out = layer.tp.radial_conv(
            x, sh, radial, kernel, graph, hidden_fn=hidden_fn, edge_chunks=config.edge_chunks, dtype=dtype, backend=config.backend
        )
        return out.astype(x.dtype)
    weights = hidden_fn(radial) @ kernel
    if callable(config.conv):
        return config.conv(layer.tp, x, sh, weights, graph)
    if config.conv == "e3nn":  # Nequix as shipped: gather, e3nn-jax's product, per-channel weights, scatter
        m = e3nn.tensor_product(x[graph.senders], sh, filter_ir_out=layer.tp.irreps_out) * weights
        m = e3nn.IrrepsArray(m.irreps, jnp.where((graph.receivers < graph.num_nodes)[:, None], m.array, 0.0))
        return e3nn.scatter_sum(m, dst=jnp.clip(graph.receivers, 0, graph.num_nodes - 1), output_size=graph.num_nodes)
    raise ValueError(f"conv must be 'jequi', 'e3nn' or a function, got {config.conv!r}")


def atomic_energies(p: dict, config: NequixConfig, species, positions, graph: Graph, cell=None, exchange=None):
    """Per-atom energies ``(N,)``; arguments as :func:`jequi.models.nequip.atomic_energies`
    (``exchange``: the ghost rows of each conv's input, for a structure split over devices)."""
    with policy(config.precision).matmuls():
        return _atomic_energies(p, config, species, positions, graph, cell, exchange)


def _atomic_energies(p, config, species, positions, graph, cell, exchange):
    sh_irreps = e3nn.Irreps.spherical_harmonics(config.sh_lmax)
    valid = graph.receivers < graph.num_nodes
    with exact_geometry():  # edge vectors, harmonics, radial basis: float32 under every policy
        vectors = edge_vectors(graph, positions, cell)
        vectors = jnp.where(valid[:, None], vectors, jnp.array([config.cutoff, 0.0, 0.0], vectors.dtype))
        sq = jnp.sum(vectors**2, axis=-1)
        r = jnp.sqrt(jnp.where(sq == 0.0, 1.0, sq)) * (sq != 0.0)
        radial = bessel_basis(r, config.num_basis, config.cutoff) * polynomial_cutoff(r, config.cutoff, config.polynomial_p)[:, None]
        sh = e3nn.spherical_harmonics(sh_irreps, vectors, normalize=True, normalization="component")

    h = e3nn.IrrepsArray(f"{len(config.species)}x0e", jax.nn.one_hot(species, len(config.species), dtype=positions.dtype))
    for i, layer in enumerate(layers(config)):
        pre = f"layers.{i}"
        x = _apply_linear(p, f"{pre}.linear_1", layer.linear_1, h)
        if exchange is not None:
            x = e3nn.IrrepsArray(x.irreps, exchange(x.array))
        mlp = [p[f"{pre}.radial_mlp.layers.{k}.weights"] for k in range(len(layer.mlp_sizes) - 1)]

        def hidden_fn(b, mlp=mlp):
            for w in mlp[:-1]:
                b = jax.nn.silu(b @ w)
            return b

        message = _convolve(config, layer, x, sh, radial, hidden_fn, mlp[-1], graph) / math.sqrt(config.avg_num_neighbors)
        skip = _apply_linear(p, f"{pre}.skip", layer.skip, h, species if config.index_weights else None)
        h = _apply_linear(p, f"{pre}.linear_2", layer.linear_2, e3nn.IrrepsArray(layer.tp.irreps_out, message.array)) + skip
        if config.layer_norm:
            h = rms_layer_norm(h, [p[f"{pre}.layer_norm.affine_weight.{j}"] for j in range(len(layer.norm_irreps))])
        h = e3nn.gate(h, even_act=jax.nn.silu, odd_act=jax.nn.tanh, even_gate_act=jax.nn.silu)
    energies = _apply_linear(p, "readout", _readout(config), h).array[:, 0]
    shift = jax.lax.stop_gradient(p["atom_energies"])[species]
    return energies * config.scale + config.shift + shift


class Nequix(nn.Module):
    """The model in Flax linen: ``apply(params, species, positions, graph, cell) -> (N,)``, its
    parameters ``{"params": {Nequix name: array}}`` (:meth:`NequixConfig.init_params`)."""

    config: NequixConfig = NequixConfig()

    @nn.compact
    def __call__(self, species, positions, graph, cell=None):
        config = self.config
        p = {name: self.param(name, lambda key, n=name, s=shape: init_parameter(config, n, s, key))
             for name, shape in parameter_shapes(config).items()}  # fmt: skip
        return atomic_energies(p, config, species, positions, graph, cell)


# --- Nequix's checkpoint format ----------------------------------------------------------------
# NequixConfig field <- .nqx JSON key (Nequix's load_model reads these, nequix/model.py)
NQX_KEYS = {
    "cutoff": "cutoff", "hidden": "hidden_irreps", "sh_lmax": "lmax", "num_layers": "n_layers",
    "num_basis": "radial_basis_size", "radial_mlp_size": "radial_mlp_size", "radial_mlp_layers": "radial_mlp_layers",
    "polynomial_p": "radial_polynomial_p", "mlp_init_scale": "mlp_init_scale", "index_weights": "index_weights",
    "layer_norm": "layer_norm", "shift": "shift", "scale": "scale", "avg_num_neighbors": "avg_n_neighbors",
}  # fmt: skip


def config_from_nqx(meta: dict, **overrides) -> NequixConfig:
    """The :class:`NequixConfig` of a ``.nqx`` file's JSON header."""
    missing = sorted({"atomic_numbers", *NQX_KEYS.values()} - set(meta))
    if missing:
        raise ValueError(f"not a Nequix checkpoint header: keys {missing} are missing")
    fields = {f: meta[k] for f, k in NQX_KEYS.items()}
    return NequixConfig(species=tuple(sorted(int(z) for z in meta["atomic_numbers"])), **{**fields, **overrides})


def read_nqx(path, **overrides) -> tuple[dict, NequixConfig, dict]:
    """``(params, config, header)`` of a Nequix ``.nqx`` checkpoint. The arrays are read in
    :func:`parameter_shapes`'s order and checked shape by shape, and nothing may follow them.
    The numbers are unchanged (float32 as saved). `overrides`: :class:`NequixConfig` fields
    (``backend``, ``conv``...)."""
    raw = pathlib.Path(path).read_bytes()
    line, _, rest = raw.partition(b"\n")
    try:
        meta = json.loads(line.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a Nequix .nqx checkpoint (its first line is not JSON: {e})") from None
    config = config_from_nqx(meta, **overrides)
    f = io.BytesIO(rest)
    params = {}
    for name, shape in parameter_shapes(config).items():
        try:
            a = np.load(f, allow_pickle=False)
        except (ValueError, EOFError) as e:
            raise ValueError(f"{path}: the arrays end before {name!r} {shape} ({e})") from None
        if a.shape != shape:
            raise ValueError(f"{path}: {name!r} has shape {a.shape}, expected {shape} for this header's model")
        params[name] = jnp.asarray(a)
    # What follows the model's arrays Nequix's load_model does not read. The released files end
    # with a newline, and nequix-oam-1 also appends its training config as 0-d records. So any
    # such tail is allowed, but a tail that holds a full-size array means the header
    # under-describes the model.
    while rest[f.tell():].strip():
        try:
            a = np.load(f, allow_pickle=False)
        except (ValueError, EOFError) as e:
            raise ValueError(f"{path}: unreadable bytes follow the model's arrays ({e})") from None
        if a.ndim:
            raise ValueError(f"{path}: an array of shape {a.shape} follows the model's arrays; the header does not describe the model")
    return {"params": params}, config, meta


def write_nqx(path, params, config: NequixConfig, header: dict | None = None) -> None:
    """Write `params` as a ``.nqx`` checkpoint that Nequix's ``load_model`` reads: `header`
    (e.g. :func:`read_nqx`'s, for its provenance keys) updated with `config`'s fields."""
    meta = dict(header or {})
    meta.update({k: getattr(config, f) for f, k in NQX_KEYS.items()})
    meta["atomic_numbers"] = list(config.species)
    p = flat_parameters(params)
    with open(path, "wb") as f:
        f.write((json.dumps(meta) + "\n").encode())
        for name, shape in parameter_shapes(config).items():
            a = np.asarray(p[name], np.float32)
            if a.shape != shape:
                raise ValueError(f"{name!r} has shape {a.shape}, expected {shape}")
            np.save(f, a)
