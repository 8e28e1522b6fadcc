"""Equinox modules for jequi's tensor product and fused convolution (see :mod:`jequi.nn`)."""

from __future__ import annotations

import equinox as eqx
import jax

from . import _common


class _Weighted(eqx.Module):
    tp: object = eqx.field(static=True)  # jequi.TensorProduct (hashed by identity)
    backend: str | None = eqx.field(static=True)
    weights: jax.Array | None

    def __init__(self, tp, *, key, backend: str | None = None):
        """`key` initialises the internal weights as e3nn-jax does (normal times ``tp.weight_std``);
        ``key=None`` makes a layer without them, whose calls pass ``weights=``."""
        self.tp = _common.check_tp(tp)
        self.backend = backend
        self.weights = None if key is None else _common.init_weights(self.tp, key)

    def _w(self, weights):
        if weights is not None:
            return weights
        if self.weights is None:
            raise TypeError("this layer was made with key=None (no internal weights): pass weights=")
        return self.weights


class TensorProduct(_Weighted):
    """``tp(x, y, w)`` with ``w`` the internal ``weights`` or the ``weights`` argument."""

    def __call__(self, x, y, weights=None):
        return self.tp(x, y, self._w(weights), backend=self.backend)


class Conv(_Weighted):
    """``tp.conv(x, y, w, graph)``: a fused graph convolution (graph: :class:`jequi.Graph`)."""

    def __call__(self, x, y, graph, weights=None):
        return self.tp.conv(x, y, self._w(weights), graph, backend=self.backend)
