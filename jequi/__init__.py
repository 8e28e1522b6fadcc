"""jequi: fast O(3)-equivariant Clebsch-Gordan tensor products and graph convolutions in JAX.

>>> import jequi
>>> tp = jequi.channelwise("32x0e+16x1o", "0e+1o+2e", "0e+1o+2e")
>>> z = tp(x, y, w)                                   # e3nn-jax's numbers, any backend
>>> graph = jequi.Graph.build(senders, receivers, num_nodes)   # once per structure
>>> out = tp.conv(x, y, w, graph)

Layers for Flax (linen, nnx), Haiku and Equinox: :mod:`jequi.nn`; a NequIP-style potential, its
training and a shipped model: :mod:`jequi.models`. ``jequi.tensor_product`` is
``e3nn_jax.tensor_product`` on jequi's kernels (docs/migration.md). ``jequi.sh_tensor_product``
(a product with spherical harmonics) and ``jequi.so2_conv`` (eSCN's SO(2) convolution) work in
each vector's frame (EAAS, docs/so2.md).
"""

from . import problems
from .attention import neighbor_attention
from .atoms import edge_vectors, graph_from_atoms, radius_edges
from .backends import available_backends, default_backend
from .descriptor import Path, Segment, TensorProductDescriptor
from .drop_in import tensor_product
from .eaas import sh_tensor_product
from .graph import Graph
from .indexed_linear import IndexedLinear
from .irreps import Irrep, Irreps
from .products import TensorProduct, channelwise, fully_connected
from .symmetric import SymmetricContraction
from .so2_conv import SO2Layout, path_weights_from_so2_weights, so2_conv, so2_layout, so2_path_product, so2_weights_from_path_weights

__version__ = "0.1.0"

__all__ = [
    "Graph",
    "IndexedLinear",
    "Irrep",
    "Irreps",
    "Path",
    "SO2Layout",
    "Segment",
    "SymmetricContraction",
    "TensorProduct",
    "TensorProductDescriptor",
    "available_backends",
    "channelwise",
    "default_backend",
    "edge_vectors",
    "fully_connected",
    "graph_from_atoms",
    "neighbor_attention",
    "path_weights_from_so2_weights",
    "problems",
    "radius_edges",
    "sh_tensor_product",
    "so2_conv",
    "so2_layout",
    "so2_path_product",
    "so2_weights_from_path_weights",
    "tensor_product",
]
