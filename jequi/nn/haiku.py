"""Haiku modules for jequi's tensor product and fused convolution (see :mod:`jequi.nn`)."""

from __future__ import annotations

import haiku as hk

from . import _common


class _Weighted(hk.Module):
    def __init__(self, tp, backend: str | None = None, name: str | None = None):
        super().__init__(name=name)
        self.tp = _common.check_tp(tp)
        self.backend = backend

    def _w(self, weights):
        if weights is not None:
            return weights
        return hk.get_parameter(
            "weights", (self.tp.weight_numel,), init=lambda shape, dtype: _common.init_weights(self.tp, hk.next_rng_key(), dtype)
        )


class TensorProduct(_Weighted):
    """``tp(x, y, w)`` with ``w`` the internal parameter ``"weights"`` or the ``weights`` argument."""

    def __call__(self, x, y, weights=None):
        return self.tp(x, y, self._w(weights), backend=self.backend)


class Conv(_Weighted):
    """``tp.conv(x, y, w, graph)``: a fused graph convolution (graph: :class:`jequi.Graph`)."""

    def __call__(self, x, y, graph, weights=None):
        return self.tp.conv(x, y, self._w(weights), graph, backend=self.backend)


class SO2Conv(hk.Module):
    """``jequi.so2_conv(x, vectors, w, irreps_out, m_max=m_max)`` with ``w`` the internal parameter
    ``"weights"`` (shared, :meth:`jequi.SO2Layout.init_weights`) or the ``weights`` argument."""

    def __init__(self, irreps_in, irreps_out, m_max: int | None = None, name: str | None = None):
        super().__init__(name=name)
        self.layout = _common.so2_layout(irreps_in, irreps_out, m_max)

    def __call__(self, x, vectors, weights=None):
        if weights is None:
            weights = hk.get_parameter(
                "weights", (self.layout.weight_numel,), init=lambda shape, dtype: self.layout.init_weights(hk.next_rng_key(), dtype)
            )
        return _common.so2_call(self.layout, x, vectors, weights)
