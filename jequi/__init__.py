"""jequi: fast O(3)-equivariant Clebsch-Gordan tensor products and graph convolutions in JAX.

>>> import jequi
>>> tp = jequi.channelwise("32x0e+16x1o", "0e+1o+2e", "0e+1o+2e")
>>> z = tp(x, y, w)                                   # e3nn-jax's numbers, any backend
>>> graph = jequi.Graph.build(senders, receivers, num_nodes)   # once per structure
>>> out = tp.conv(x, y, w, graph)

Layers for Flax (linen, nnx), Haiku and Equinox: :mod:`jequi.nn`; a NequIP-style potential, its
training and a shipped model: :mod:`jequi.models`. ``jequi.tensor_product`` is
``e3nn_jax.tensor_product`` on jequi's kernels (docs/migration.md).
"""

from . import problems
from .attention import neighbor_attention
from .atoms import edge_vectors, graph_from_atoms, radius_edges
from .backends import available_backends, default_backend
from .descriptor import Path, Segment, TensorProductDescriptor
from .drop_in import tensor_product
from .graph import Graph
from .irreps import Irrep, Irreps
from .products import TensorProduct, channelwise, fully_connected

__version__ = "0.1.0"

__all__ = [
    "Graph",
    "Irrep",
    "Irreps",
    "Path",
    "Segment",
    "TensorProduct",
    "TensorProductDescriptor",
    "available_backends",
    "channelwise",
    "default_backend",
    "edge_vectors",
    "fully_connected",
    "graph_from_atoms",
    "neighbor_attention",
    "problems",
    "radius_edges",
    "tensor_product",
]
