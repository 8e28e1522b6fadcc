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


class SO2Conv(eqx.Module):
    """``jequi.so2_conv(x, vectors, w, irreps_out, m_max=m_max)`` with ``w`` the internal
    ``weights`` or the ``weights`` argument."""

    layout: object = eqx.field(static=True)  # jequi.SO2Layout
    weights: jax.Array | None

    def __init__(self, irreps_in, irreps_out, m_max: int | None = None, *, key):
        """`key` initialises shared weights (:meth:`jequi.SO2Layout.init_weights`); ``key=None``
        makes a layer without them, whose calls pass ``weights=``."""
        self.layout = _common.so2_layout(irreps_in, irreps_out, m_max)
        self.weights = None if key is None else self.layout.init_weights(key)

    def __call__(self, x, vectors, weights=None):
        if weights is None:
            if self.weights is None:
                raise TypeError("this layer was made with key=None (no internal weights): pass weights=")
            weights = self.weights
        return _common.so2_call(self.layout, x, vectors, weights)
