"""MACE (Batatia et al. 2022) on jequi's kernels: the ScaleShiftMACE architecture of
MACE-MP-0 and MACE-OFF, with mace-torch's parameters under mace-torch's own names.

Per interaction ``t`` (``docs/mace.md`` section 5 lists every fact this follows):

- ``linear_up``, then the channelwise conv of the senders' features with the edges' spherical
  harmonics, its per-edge weights a radial MLP of a Bessel basis times a polynomial cutoff
  (:meth:`jequi.TensorProduct.radial_conv`: the MLP's last layer runs inside the conv);
- ``linear`` into ``K x (0e + 1o + ... + lmax)``, divided by ``avg_num_neighbors``;
- the element-dependent ``skip_tp`` (:class:`jequi.IndexedLinear`): on the message in the first
  block (``RealAgnosticInteractionBlock``), on the layer's input as a residual in the later
  ones (``RealAgnosticResidualInteractionBlock``);
- the symmetric contraction (:class:`jequi.SymmetricContraction`, per species) and ``linear``,
  plus the residual; a linear readout per layer, an MLP readout on the last;
- per atom ``E0[species] + scale * sum(readouts) + shift``.

The parameters are a flat dict keyed by mace-torch's ``state_dict`` names (``interactions.0.
conv_tp_weights.layer3.weight``, ``products.1.symmetric_contractions.contractions.0.weights_max``
...), each array in mace-torch's layout, so :func:`from_mace_torch` only copies and
:func:`from_mace_jax` only renames (and re-expresses a reduced-basis contraction). Two
conventions differ from e3nn-jax's and are applied inside the model, not to the numbers: the
edge vector points from sender to receiver (``pos[r] - pos[s]``, the opposite of
:func:`jequi.atoms.edge_vectors`), and the conv's Clebsch-Gordan coefficients carry
e3nn-torch's signs (:func:`jequi.symmetric_basis.torch_wigner_3j`; a sign per conv path,
multiplied onto the radial MLP's last layer).
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

from ..atoms import edge_vectors
from ..graph import Graph
from ..indexed_linear import IndexedLinear
from ..products import TensorProduct, channelwise
from ..symmetric import SymmetricContraction
from ..symmetric_basis import torch_wigner_3j
from .architecture import RadiusGraphModel
from .named import flat_parameters, init_named, with_parameter
from .nequip import species_index
from .precision import conv_dtype, exact_geometry, policy

# e3nn-torch's normalize2mom(silu) constant, what mace-torch's radial MLP and readout multiply
# silu by (e3nn-jax's normalize_function gives 1.676562056080, mace-jax stores 1.67425609: a
# checkpoint's own value goes in MACEConfig.activation_scale).
TORCH_SILU_SCALE = 1.679176792399


@dataclasses.dataclass(frozen=True)
class MACEConfig(RadiusGraphModel):
    """Hyper-parameters; the defaults are MACE-MP-0 "medium" (89 elements, 4.69 M parameters).

    ``species``: atomic numbers in index order (mace-torch's ``atomic_numbers``);
    ``atomic_energies``: the E0s in that order (None: zeros, as :func:`~jequi.models.train.train`
    then fits them); ``hidden``: ``K x 0e + K x 1o`` (``K x 0e`` for a scalar model);
    ``first_residual``: the first block is a ``RealAgnosticResidualInteractionBlock``, as in
    MACE-MP-0 (its 4,688,497 parameters count that block's skip), rather than a
    ``RealAgnosticInteractionBlock`` (mace-torch's constructor default).
    ``backend``: jequi's backend for the convs (None: the fastest); ``contraction_backend``:
    ``"pallas"`` or ``"xla"`` for the symmetric contraction (None: Pallas on a GPU).
    ``conv`` / ``contraction``: ``"jequi"`` or, for another library's kernels in the same model
    (``benchmarks/mace_step.py``), ``"e3nn"`` (gather, e3nn-jax's product, ``segment_sum``) or a
    function ``conv(tp, x, sh, weights, graph)`` (``IrrepsArray`` x and sh);
    ``contraction(sc, x, species, weights)``; ``skip(linear, x, species, w)`` (the
    :class:`jequi.IndexedLinear` and its flat weights).
    """

    species: tuple[int, ...] = tuple(range(1, 84)) + tuple(range(89, 95))
    atomic_energies: tuple[float, ...] | None = None
    cutoff: float = 6.0
    num_bessel: int = 8
    polynomial_p: int = 5
    sh_lmax: int = 3
    hidden: str = "128x0e+128x1o"
    correlation: int = 3
    num_layers: int = 2
    radial_mlp: tuple[int, ...] = (64, 64, 64)
    readout_mlp: int = 16
    avg_num_neighbors: float = 61.96
    scale: float = 1.0
    shift: float = 0.0
    first_residual: bool = True
    activation_scale: float = TORCH_SILU_SCALE
    backend: str | None = None
    contraction_backend: str | None = None
    conv: object = "jequi"
    contraction: object = "jequi"
    skip: object = "jequi"
    edge_chunks: int | None = None
    # "float32", "tf32" or "bf16-mixed" (jequi.models.precision; docs/precision.md)
    precision: str = "float32"

    def __post_init__(self):
        hidden = e3nn.Irreps(self.hidden)
        muls = {mul for mul, _ in hidden}
        if len(muls) != 1 or hidden.count("0e") == 0:
            raise ValueError(f"hidden must be K x 0e (+ K x more irreps) of one multiplicity K, got {self.hidden!r}")
        if self.atomic_energies is not None and len(self.atomic_energies) != len(self.species):
            raise ValueError(f"atomic_energies has {len(self.atomic_energies)} values for {len(self.species)} species")
        if self.num_layers < 1 or not 1 <= self.correlation <= 4:
            raise ValueError(f"num_layers must be >= 1 and correlation 1-4, got {self.num_layers}, {self.correlation}")

    @property
    def channels(self) -> int:
        return e3nn.Irreps(self.hidden)[0].mul

    def species_index(self, numbers) -> np.ndarray:
        """Atomic numbers -> indices into :attr:`species` (ValueError for unknown elements)."""
        return species_index(self.species, numbers)

    def module(self) -> MACE:
        return MACE(self)

    def energies(self, params, species, positions, graph, cell=None, exchange=None):
        """Per-atom energies: the model interface of the calculator, MD, sharding and training."""
        return atomic_energies(flat_parameters(params), self, species, positions, graph, cell, exchange)

    def init_params(self, key, species=None, positions=None, graph=None, cell=None) -> dict:
        """``{"params": {name: array}}``: mace-torch's initialisation (standard normal; the
        contraction's divided by its number of paths), E0s from :attr:`atomic_energies`."""
        return init_named(parameter_shapes(self), functools.partial(init_parameter, self), key)

    def with_species_energies(self, params, energies) -> dict:
        """`params` with the E0s set to `energies` (``(num_species,)``; :func:`train`'s fit)."""
        return with_parameter(params, "atomic_energies_fn.atomic_energies", energies)


def init_parameter(config: MACEConfig, name: str, shape: tuple, key):
    """One parameter as mace-torch initialises it: standard normal (the normalization is in
    the layers), the contraction's divided by its number of paths; E0s, scale and shift from
    the config."""
    if name == "atomic_energies_fn.atomic_energies":
        return jnp.asarray(config.atomic_energies or (0.0,) * len(config.species), jnp.float32)
    if name == "scale_shift.scale":
        return jnp.asarray(config.scale, jnp.float32)
    if name == "scale_shift.shift":
        return jnp.asarray(config.shift, jnp.float32)
    w = jax.random.normal(key, shape)
    return w / shape[1] if ".symmetric_contractions." in name else w


# --- the layers' structure, as values --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Layer:
    irreps_in: e3nn.Irreps  # node features into the block
    irreps_out: e3nn.Irreps  # node features out of it (hidden; 0e only on the last layer)
    residual: bool
    tp: TensorProduct
    signs: np.ndarray  # (weight_numel,): e3nn-torch's CG signs over jequi's, per conv weight
    contraction: SymmetricContraction
    skip: IndexedLinear


def _conv_signs(tp: TensorProduct) -> np.ndarray:
    """Per weight of the channelwise conv, e3nn-torch's Clebsch-Gordan sign over e3nn-jax's."""
    signs = []
    for ins in tp.instructions:
        l1, l2, l3 = (irreps[i].ir.l for irreps, i in ((tp.irreps_in1, ins[0]), (tp.irreps_in2, ins[1]), (tp.irreps_out, ins[2])))
        ours = np.asarray(e3nn.clebsch_gordan(l1, l2, l3), np.float64)
        s = np.sign(np.sum(ours * torch_wigner_3j(l1, l2, l3)))
        signs.append(np.full(tp.irreps_in1[ins[0]].mul, s))
    return np.concatenate(signs)


@functools.lru_cache(maxsize=16)
def layers(config: MACEConfig) -> tuple[_Layer, ...]:
    """The blocks' irreps and jequi products, built once per config."""
    hidden = e3nn.Irreps(config.hidden)
    k = config.channels
    sh = e3nn.Irreps.spherical_harmonics(config.sh_lmax)
    target = e3nn.Irreps([(k, ir) for _, ir in sh])  # K x (0e + 1o + 2e + 3o)
    out, irreps_in = [], e3nn.Irreps(f"{k}x0e")
    for t in range(config.num_layers):
        irreps_out = hidden if t < config.num_layers - 1 else e3nn.Irreps(f"{k}x0e")
        residual = t > 0 or config.first_residual
        tp = channelwise(irreps_in, sh, target)
        sc = SymmetricContraction(target, irreps_out, config.correlation, len(config.species))
        skip = IndexedLinear(irreps_in, irreps_out, len(config.species)) if residual else IndexedLinear(target, target, len(config.species))
        out.append(_Layer(irreps_in, irreps_out, residual, tp, _conv_signs(tp), sc, skip))
        irreps_in = irreps_out
    return tuple(out)


def _linear_numel(irreps_in, irreps_out) -> int:
    return sum(mi * mo for mi, ii in irreps_in for mo, io in irreps_out if ii == io)


def parameter_shapes(config: MACEConfig) -> dict:
    """Every parameter's mace-torch name and shape, in ``state_dict`` order."""
    s, k = len(config.species), config.channels
    shapes = {"node_embedding.linear.weight": (s * k,), "atomic_energies_fn.atomic_energies": (s,)}
    sizes = (config.num_bessel, *config.radial_mlp)
    for t, layer in enumerate(layers(config)):
        p = f"interactions.{t}."
        shapes[p + "linear_up.weight"] = (_linear_numel(layer.irreps_in, layer.irreps_in),)
        for i, (a, b) in enumerate(zip(sizes, (*sizes[1:], layer.tp.weight_numel))):
            shapes[p + f"conv_tp_weights.layer{i}.weight"] = (a, b)
        shapes[p + "linear.weight"] = (_linear_numel(layer.tp.irreps_out, layer.contraction.irreps_in),)
        shapes[p + "skip_tp.weight"] = (layer.skip.weight_numel,)
        for name, shape in layer.contraction.weight_shapes.items():
            shapes[f"products.{t}.symmetric_contractions.{name}"] = shape
        shapes[f"products.{t}.linear.weight"] = (_linear_numel(layer.irreps_out, layer.irreps_out),)
        if t < config.num_layers - 1:
            shapes[f"readouts.{t}.linear.weight"] = (k,)
        else:
            shapes[f"readouts.{t}.linear_1.weight"] = (k * config.readout_mlp,)
            shapes[f"readouts.{t}.linear_2.weight"] = (config.readout_mlp,)
    shapes["scale_shift.scale"] = ()
    shapes["scale_shift.shift"] = ()
    return shapes


# --- the pieces ------------------------------------------------------------------------------
def linear(x, irreps_in: e3nn.Irreps, irreps_out: e3nn.Irreps, w):
    """e3nn-torch's ``o3.Linear`` (no biases) on ``x (N, irreps_in.dim)`` in ``mul_ir``: one
    ``(mul_in, mul_out)`` block per equal-irrep pair, flat in ``(i_in, i_out)`` order, each output
    divided by ``sqrt`` of its paths' summed ``mul_in``; one matrix product per output irrep."""
    n = x.shape[0]
    offsets = np.cumsum([0] + [mul * ir.dim for mul, ir in irreps_in])
    blocks, pos = {}, 0
    for i, (mi, ii) in enumerate(irreps_in):
        for o, (mo, io) in enumerate(irreps_out):
            if ii == io:
                blocks.setdefault(o, []).append((i, pos))
                pos += mi * mo
    if pos != w.shape[0]:
        raise ValueError(f"linear {irreps_in} -> {irreps_out} has {pos} weights, got {w.shape[0]}")
    parts = []
    for o, (mo, io) in enumerate(irreps_out):
        if o not in blocks:
            parts.append(jnp.zeros((n, mo * io.dim), x.dtype))
            continue
        xs = jnp.concatenate([x[:, offsets[i] : offsets[i + 1]].reshape(n, irreps_in[i].mul, io.dim) for i, _ in blocks[o]], axis=1)
        ws = jnp.concatenate([w[p : p + irreps_in[i].mul * mo].reshape(irreps_in[i].mul, mo) for i, p in blocks[o]], axis=0)
        y = jnp.einsum("nud,uw->nwd", xs, ws.astype(x.dtype) / math.sqrt(ws.shape[0]))  # at the policy's precision
        parts.append(y.reshape(n, mo * io.dim))
    return jnp.concatenate(parts, axis=1)


def radial_basis(config: MACEConfig, r):
    """mace-torch's Bessel basis times its polynomial cutoff (``p``), zero from ``r_max`` on."""
    rc, p = config.cutoff, config.polynomial_p
    n = jnp.arange(1, config.num_bessel + 1, dtype=r.dtype)
    bessel = math.sqrt(2.0 / rc) * jnp.sin(n * np.pi * r[:, None] / rc) / r[:, None]
    u = r / rc
    envelope = 1 - (p + 1) * (p + 2) / 2 * u**p + p * (p + 2) * u ** (p + 1) - p * (p + 1) / 2 * u ** (p + 2)
    return bessel * (envelope * (r < rc))[:, None]


def _convolve(config: MACEConfig, tp: TensorProduct, x, sh, radial, hidden_fn, kernel, graph: Graph):
    dtype = conv_dtype(config)
    if config.conv == "jequi":
        out = tp.radial_conv(x, sh, radial, kernel, graph, hidden_fn=hidden_fn, edge_chunks=config.edge_chunks, dtype=dtype, backend=config.backend)
        return out.astype(x.dtype)
    weights = hidden_fn(radial) @ kernel
    if callable(config.conv):
        out = config.conv(tp, e3nn.IrrepsArray(tp.irreps_in1, x), e3nn.IrrepsArray(tp.irreps_in2, sh), weights, graph)
        return out.array if isinstance(out, e3nn.IrrepsArray) else out
    if config.conv == "e3nn":
        from e3nn_jax.legacy import FunctionalTensorProduct

        f = FunctionalTensorProduct(tp.irreps_in1, tp.irreps_in2, tp.irreps_out, list(tp.instructions))
        z = jax.vmap(f.left_right)(weights, e3nn.IrrepsArray(tp.irreps_in1, x[graph.senders]), e3nn.IrrepsArray(tp.irreps_in2, sh))
        return jax.ops.segment_sum(z.array, graph.receivers, num_segments=graph.num_nodes)
    raise ValueError(f"conv must be 'jequi', 'e3nn' or a function, got {config.conv!r}")


def _contract(config: MACEConfig, sc: SymmetricContraction, x, species, weights):
    if config.contraction == "jequi":
        return sc(x, species, weights, backend=config.contraction_backend)
    if callable(config.contraction):
        return config.contraction(sc, x, species, weights)
    raise ValueError(f"contraction must be 'jequi' or a function, got {config.contraction!r}")


def _skip(config: MACEConfig, lin: IndexedLinear, x, species, w):
    if config.skip == "jequi":
        return lin(x, species, w)
    if callable(config.skip):
        return config.skip(lin, x, species, w)
    raise ValueError(f"skip must be 'jequi' or a function, got {config.skip!r}")


def atomic_energies(p: dict, config: MACEConfig, species, positions, graph: Graph, cell=None, exchange=None):
    """Per-atom energies ``(N,)`` from the flat parameters `p` (mace-torch's names).

    ``species``: indices into ``config.species``; ``graph``: the radius graph (padding edges with
    receiver index out of range add nothing); ``cell`` ``(3, 3)`` for periodic shifts.
    ``exchange``: as :func:`jequi.models.nequip.atomic_energies` (a device's part of a structure:
    appends the ghost atoms' rows to each conv's input)."""
    with policy(config.precision).matmuls():
        return _atomic_energies(p, config, species, positions, graph, cell, exchange)


def _atomic_energies(p: dict, config: MACEConfig, species, positions, graph: Graph, cell, exchange):
    dtype = positions.dtype
    s, k = len(config.species), config.channels
    sh_irreps = e3nn.Irreps.spherical_harmonics(config.sh_lmax)
    valid = graph.receivers < graph.num_nodes
    with exact_geometry():  # edge vectors, harmonics, radial basis: float32 under every policy
        vectors = -edge_vectors(graph, positions, cell)  # mace-torch's: pos[receiver] - pos[sender]
        vectors = jnp.where(valid[:, None], vectors, jnp.array([config.cutoff, 0.0, 0.0], dtype))
        r = jnp.sqrt(jnp.sum(vectors**2, axis=-1))
        sh = e3nn.spherical_harmonics(sh_irreps, vectors, normalize=True, normalization="component").array
        radial = radial_basis(config, r)

    e0 = jax.lax.stop_gradient(p["atomic_energies_fn.atomic_energies"].astype(dtype))[species]
    onehot = jax.nn.one_hot(species, s, dtype=dtype)
    h = onehot @ p["node_embedding.linear.weight"].astype(dtype).reshape(s, k) / math.sqrt(s)
    readouts = jnp.zeros(species.shape, dtype)
    c = config.activation_scale
    for t, layer in enumerate(layers(config)):
        pre = f"interactions.{t}."
        sc = _skip(config, layer.skip, h, species, p[pre + "skip_tp.weight"]) if layer.residual else None
        x = linear(h, layer.irreps_in, layer.irreps_in, p[pre + "linear_up.weight"])
        if exchange is not None:
            x = exchange(x)
        mlp = [p[pre + f"conv_tp_weights.layer{i}.weight"] for i in range(len(config.radial_mlp) + 1)]
        kernel = mlp[-1].astype(dtype) * jnp.asarray(layer.signs, dtype)
        message = _convolve(config, layer.tp, x, sh, radial, _radial_hidden(config, mlp), kernel, graph)
        message = linear(message, layer.tp.irreps_out, layer.contraction.irreps_in, p[pre + "linear.weight"]) / config.avg_num_neighbors
        if not layer.residual:
            message = _skip(config, layer.skip, message, species, p[pre + "skip_tp.weight"])
        prefix = f"products.{t}.symmetric_contractions."
        weights = {name: p[prefix + name].astype(dtype) for name in layer.contraction.weight_shapes}
        h = _contract(config, layer.contraction, message, species, weights)
        h = linear(h, layer.irreps_out, layer.irreps_out, p[f"products.{t}.linear.weight"])
        if sc is not None:
            h = h + sc
        if t < config.num_layers - 1:
            readouts = readouts + h[:, :k] @ p[f"readouts.{t}.linear.weight"].astype(dtype) / math.sqrt(k)
        else:
            m = config.readout_mlp
            z = h[:, :k] @ p[f"readouts.{t}.linear_1.weight"].astype(dtype).reshape(k, m) / math.sqrt(k)
            readouts = readouts + (c * jax.nn.silu(z)) @ p[f"readouts.{t}.linear_2.weight"].astype(dtype) / math.sqrt(m)
    scale = jax.lax.stop_gradient(p["scale_shift.scale"].astype(dtype))
    shift = jax.lax.stop_gradient(p["scale_shift.shift"].astype(dtype))
    return e0 + scale * readouts + shift


def _radial_hidden(config: MACEConfig, mlp):
    """The radial MLP's hidden layers (``mlp[:-1]``) and the last layer's ``1 / sqrt(fan_in)``."""
    c = config.activation_scale

    def hidden_fn(h):
        for w in mlp[:-1]:
            h = c * jax.nn.silu(h @ w.astype(h.dtype) / math.sqrt(w.shape[0]))
        return h / math.sqrt(mlp[-1].shape[0])

    return hidden_fn


class MACE(nn.Module):
    """The model in Flax linen: ``apply(params, species, positions, graph, cell) -> (N,)``.

    Its parameters are ``{"params": {mace-torch name: array}}`` (:meth:`MACEConfig.init_params`
    makes them with mace-torch's initialisation; ``init`` here does the same)."""

    config: MACEConfig = MACEConfig()

    @nn.compact
    def __call__(self, species, positions, graph, cell=None):
        config = self.config
        p = {name: self.param(name, lambda key, n=name, s=shape: init_parameter(config, n, s, key))
             for name, shape in parameter_shapes(config).items()}  # fmt: skip
        return atomic_energies(p, self.config, species, positions, graph, cell)


# --- loading mace-torch's and mace-jax's models -------------------------------------------------
def _numpy_state(state) -> dict:
    return {k: np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v) for k, v in dict(state).items()}


def mace_torch_config(state_dict, avg_num_neighbors: float, first_residual: bool = False, **overrides) -> MACEConfig:
    """The :class:`MACEConfig` of a ScaleShiftMACE ``state_dict`` (numpy or torch arrays): what
    the numbers say (species, E0s, r_max, layers, channels, hidden irreps, correlation, radial
    MLP, readout width, scale and shift); ``avg_num_neighbors`` and the first block's class are
    not in a state_dict and are given."""
    sd = _numpy_state(state_dict)
    s = len(sd["atomic_numbers"])
    k = sd["node_embedding.linear.weight"].size // s
    layers_ = int(sd["num_interactions"])
    n_hidden = sd["products.0.linear.weight"].size // (k * k) if layers_ > 1 else 1
    lmax = sd["interactions.0.linear.weight"].size // (k * k) - 1  # K x 0e (x) Y: one K x K block an l
    sh = e3nn.Irreps.spherical_harmonics(lmax)
    mlp = []
    while f"interactions.0.conv_tp_weights.layer{len(mlp)}.weight" in sd:
        mlp.append(sd[f"interactions.0.conv_tp_weights.layer{len(mlp)}.weight"].shape)
    degrees = 1 + sum(1 for name in sd if name.startswith("products.0.symmetric_contractions.contractions.0.weights."))
    fields = dict(
        species=tuple(int(z) for z in sd["atomic_numbers"]),
        atomic_energies=tuple(float(e) for e in np.ravel(sd["atomic_energies_fn.atomic_energies"])),
        cutoff=float(sd["r_max"]),
        num_bessel=mlp[0][0],
        polynomial_p=int(sd.get("radial_embedding.cutoff_fn.p", 5)),
        sh_lmax=lmax,
        hidden="+".join(f"{k}x{ir}" for _, ir in list(sh)[:n_hidden]),
        correlation=degrees,
        num_layers=layers_,
        radial_mlp=tuple(b for _, b in mlp[:-1]),
        readout_mlp=sd[f"readouts.{layers_ - 1}.linear_2.weight"].size,
        avg_num_neighbors=float(avg_num_neighbors),
        scale=float(sd["scale_shift.scale"]),
        shift=float(sd["scale_shift.shift"]),
        first_residual=first_residual,
    )
    return MACEConfig(**{**fields, **overrides})


def from_mace_torch(model, avg_num_neighbors: float | None = None, *, first_residual: bool | None = None, **overrides):
    """``(params, config)`` of a mace-torch ScaleShiftMACE (the module, or its ``state_dict``
    with ``avg_num_neighbors`` and ``first_residual`` given), with the full e3nn contraction
    basis (``use_reduced_cg=False``, MACE-MP-0's and MACE-OFF's). The parameters are the
    state_dict's arrays under their own names, unchanged."""
    if hasattr(model, "state_dict"):
        state = model.state_dict()
        avg_num_neighbors = float(model.interactions[0].avg_num_neighbors) if avg_num_neighbors is None else avg_num_neighbors
        if first_residual is None:
            first_residual = "Residual" in type(model.interactions[0]).__name__
    else:
        state = model
        if avg_num_neighbors is None:
            raise ValueError("a state_dict does not hold avg_num_neighbors: pass it (the model's interactions[0].avg_num_neighbors)")
    sd = _numpy_state(state)
    config = mace_torch_config(sd, avg_num_neighbors, bool(first_residual), **overrides)
    params = {}
    for name, shape in parameter_shapes(config).items():
        if name not in sd:
            raise ValueError(f"the state_dict has no {name!r}: not a ScaleShiftMACE of this architecture (a reduced-basis "
                             f"contraction, use_reduced_cg=True, has other shapes)")  # fmt: skip
        if sd[name].shape != shape:
            raise ValueError(f"{name}: shape {sd[name].shape}, expected {shape} (a reduced-basis contraction, use_reduced_cg=True?)")
        params[name] = sd[name]
    return {"params": params}, config


def _mace_jax_state(model) -> dict:
    """mace-jax's nnx state as ``{"a/b/c": numpy array}``."""
    from flax import nnx

    flat = nnx.to_flat_state(nnx.state(model))
    return {"/".join(str(p) for p in path): np.asarray(v.value if hasattr(v, "value") else v[...]) for path, v in flat}


def _fit_contraction(sc: SymmetricContraction, evaluate, num_species: int, rows: int = 64, seed: int = 0) -> dict:
    """Weights of `sc` (mace-torch's basis) giving the same function as ``evaluate(x3, z)``,
    another implementation's contraction (``x3 (rows, K, dim)``: every channel's components;
    ``z``: a species; returns ``(rows, irreps_out.dim)`` in ``mul_ir``), whatever basis that
    one's weights are in: its values on random features, every channel given the same ones,
    solved by least squares per output irrep against the basis functions of `sc` (all
    channels share them; the channels' weights are independent). Raises where the fit is not
    exact, i.e. the two contractions are not the same family of polynomials."""
    d = sc.descriptor
    k = d.irreps_in[0].mul
    feats = np.random.default_rng(seed).standard_normal((rows, d.irreps_in.dim // k))
    x3 = np.repeat(feats[:, None, :], k, axis=1)
    # the same features in e3nn's flat mul_ir layout, for sc
    parts, a = [], 0
    for _, ir in d.irreps_in:
        parts.append(np.repeat(feats[:, None, a : a + ir.dim], k, axis=1).reshape(rows, -1))
        a += ir.dim
    x_flat = jnp.asarray(np.concatenate(parts, axis=1))
    species = jnp.zeros(rows, jnp.int32)
    shapes = sc.weight_shapes
    zero = {n: np.zeros(s) for n, s in shapes.items()}
    out_offsets = np.cumsum([0] + [m * ir.dim for m, ir in d.irreps_out])
    result = {n: np.zeros(s) for n, s in shapes.items()}
    for i, (_, ir) in enumerate(d.irreps_out):
        names = [n for n in shapes if n.startswith(f"contractions.{i}.")]
        columns, index = [], []
        for n in names:
            for j in range(shapes[n][1]):
                w = dict(zero)
                w[n] = np.zeros(shapes[n])
                w[n][0, j, :] = 1.0
                y = np.asarray(sc(x_flat, species, {m: jnp.asarray(v) for m, v in w.items()}, backend="xla"))
                columns.append(y[:, out_offsets[i] : out_offsets[i] + ir.dim].ravel())  # channel 0
                index.append((n, j))
        basis = np.stack(columns, axis=1)  # (rows * dim, paths)
        for z in range(num_species):
            target = np.asarray(evaluate(x3, z), np.float64)[:, out_offsets[i] : out_offsets[i + 1]]
            target = target.reshape(rows, k, ir.dim).transpose(0, 2, 1).reshape(rows * ir.dim, k)
            w, *_ = np.linalg.lstsq(basis, target, rcond=None)
            error = np.abs(basis @ w - target).max()
            if error > 1e-6 * max(1.0, np.abs(target).max()):
                raise ValueError(f"the contraction into {ir} is not MACE's polynomial family in mace-torch's basis (fit error {error:.2e})")
            for (n, j), row in zip(index, w):
                result[n][z, j, :] = row
    return result


def from_mace_jax(model, **overrides):
    """``(params, config)`` of a mace-jax ``ScaleShiftMACE`` (the nnx module, github
    ACEsuit/mace-jax): its linears, radial MLPs, skip products, readouts, E0s, scale and shift
    copied under mace-torch's names (mace-jax's cue layouts are e3nn's flat order); its
    symmetric contractions, reduced (``use_reduced_cg=True``) or full basis, whatever the cue
    group, re-expressed in mace-torch's full basis by :func:`_fit_contraction` (exact to
    float64 rounding). Energies and forces equal mace-jax's (``tests/fixtures/
    check_from_mace_jax.py``, run against mace-jax's source; ``docs/mace.md`` says how)."""
    st = _mace_jax_state(model)
    first = type(model.interactions[0]).__name__
    if not first.startswith("RealAgnostic"):
        raise ValueError(f"interaction block {first} is not MACE-MP-0's (RealAgnostic[Residual]InteractionBlock)")
    for t, block in enumerate(model.interactions):
        group = getattr(getattr(block, "conv_tp", None), "group", None)
        if group is not None and getattr(group, "__name__", str(group)) != "O3_e3nn":
            raise ValueError(f"interactions.{t}.conv_tp uses the cue group {group}; jequi's MACE has e3nn-torch's (O3_e3nn) signs")
    layers_ = len(model.interactions)
    s = len(model.atomic_numbers)
    mlp, i = [], 0
    while f"interactions/0/conv_tp_weights/layers/{i}/weight" in st:
        mlp.append(st[f"interactions/0/conv_tp_weights/layers/{i}/weight"].shape)
        i += 1
    act = float(st.get("interactions/0/conv_tp_weights/layers/0/act_scale", TORCH_SILU_SCALE))
    readout_act = float(st.get("_normalize2mom_consts_var/silu", act))
    if abs(act - readout_act) > 1e-12:
        raise ValueError(f"the radial MLP's silu constant {act} differs from the readout's {readout_act}")
    hidden = e3nn.Irreps(str(model.hidden_irreps))
    fields = dict(
        species=tuple(int(z) for z in model.atomic_numbers),
        atomic_energies=tuple(float(e) for e in np.ravel(st["atomic_energies_fn/atomic_energies"])),
        cutoff=float(model.r_max),
        num_bessel=int(model.num_bessel),
        polynomial_p=int(model.num_polynomial_cutoff),
        sh_lmax=int(model.max_ell),
        hidden=str(hidden),
        correlation=int(np.max(np.atleast_1d(model.correlation))),
        num_layers=layers_,
        radial_mlp=tuple(b for _, b in mlp[:-1]),
        readout_mlp=st[f"readouts/{layers_ - 1}/linear_2/weight"].size,
        avg_num_neighbors=float(model.interactions[0].avg_num_neighbors),
        scale=float(st["scale_shift/scale"]),
        shift=float(st["scale_shift/shift"]),
        first_residual="Residual" in first,
        activation_scale=act,
    )
    config = MACEConfig(**{**fields, **overrides})
    params = {}
    for name, shape in parameter_shapes(config).items():
        if ".symmetric_contractions." in name:
            continue
        source = name.replace("conv_tp_weights.layer", "conv_tp_weights.layers.").replace(".", "/")
        if source not in st:
            raise ValueError(f"the mace-jax state has no {source!r} (for {name})")
        if st[source].size != math.prod(shape):
            raise ValueError(f"{source}: {st[source].shape} does not fit {name} {shape}")
        params[name] = st[source].reshape(shape)
    for t, layer in enumerate(layers(config)):
        block = model.products[t].symmetric_contractions
        evaluate = lambda x3, z, b=block: b(jnp.asarray(x3), jnp.full((x3.shape[0],), z, jnp.int32))  # noqa: E731
        fitted = _fit_contraction(layer.contraction, evaluate, s)
        for n, v in fitted.items():
            params[f"products.{t}.symmetric_contractions.{n}"] = v
    return {"params": params}, config
