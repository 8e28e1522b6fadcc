"""Flax nnx modules for jequi's tensor product and fused convolution (see :mod:`jequi.nn`)."""

from __future__ import annotations

from flax import nnx

from . import _common


class _Weighted(nnx.Module):
    def __init__(self, tp, *, internal_weights: bool = True, backend: str | None = None, rngs: nnx.Rngs | None = None):
        self.tp = _common.check_tp(tp)
        self.backend = backend
        if internal_weights:
            if rngs is None:
                raise TypeError("internal weights need rngs=nnx.Rngs(...)")
            self.weights = nnx.Param(_common.init_weights(self.tp, rngs.params()))
        else:
            self.weights = None

    def _w(self, weights):
        if weights is None:
            if self.weights is None:
                raise TypeError("this layer has no internal weights: pass weights=")
            return self.weights[...]
        return weights


class TensorProduct(_Weighted):
    """``tp(x, y, w)``; internal weights (``internal_weights=True``, needs ``rngs``) or ``weights=``."""

    def __call__(self, x, y, weights=None):
        return self.tp(x, y, self._w(weights), backend=self.backend)


class Conv(_Weighted):
    """``tp.conv(x, y, w, graph)``: a fused graph convolution (graph: :class:`jequi.Graph`)."""

    def __call__(self, x, y, graph, weights=None):
        return self.tp.conv(x, y, self._w(weights), graph, backend=self.backend)


class SO2Conv(nnx.Module):
    """``jequi.so2_conv(x, vectors, w, irreps_out, m_max=m_max)``; internal shared weights
    (``internal_weights=True``, needs ``rngs``) or ``weights=``."""

    def __init__(self, irreps_in, irreps_out, m_max: int | None = None, *, internal_weights: bool = True, rngs: nnx.Rngs | None = None):
        self.layout = _common.so2_layout(irreps_in, irreps_out, m_max)
        if internal_weights:
            if rngs is None:
                raise TypeError("internal weights need rngs=nnx.Rngs(...)")
            self.weights = nnx.Param(self.layout.init_weights(rngs.params()))
        else:
            self.weights = None

    def __call__(self, x, vectors, weights=None):
        if weights is None:
            if self.weights is None:
                raise TypeError("this layer has no internal weights: pass weights=")
            weights = self.weights[...]
        return _common.so2_call(self.layout, x, vectors, weights)
