"""Flax linen modules for jequi's tensor product and fused convolution (see :mod:`jequi.nn`)."""

from __future__ import annotations

import flax.linen as nn

from . import _common


class TensorProduct(nn.Module):
    """``tp(x, y, w)`` with ``w`` the internal parameter ``"weights"`` or the ``weights`` argument."""

    tp: object  # jequi.TensorProduct
    backend: str | None = None

    @nn.compact
    def __call__(self, x, y, weights=None):
        tp = _common.check_tp(self.tp)
        if weights is None:
            weights = self.param("weights", lambda key: _common.init_weights(tp, key))
        return tp(x, y, weights, backend=self.backend)


class Conv(nn.Module):
    """``tp.conv(x, y, w, graph)``: a fused graph convolution (graph: :class:`jequi.Graph`)."""

    tp: object  # jequi.TensorProduct
    backend: str | None = None

    @nn.compact
    def __call__(self, x, y, graph, weights=None):
        tp = _common.check_tp(self.tp)
        if weights is None:
            weights = self.param("weights", lambda key: _common.init_weights(tp, key))
        return tp.conv(x, y, weights, graph, backend=self.backend)


class SO2Conv(nn.Module):
    """``jequi.so2_conv(x, vectors, w, irreps_out, m_max=m_max)`` with ``w`` the internal parameter
    ``"weights"`` (shared, :meth:`jequi.SO2Layout.init_weights`) or the ``weights`` argument
    (e.g. per edge)."""

    irreps_in: object
    irreps_out: object
    m_max: int | None = None

    @nn.compact
    def __call__(self, x, vectors, weights=None):
        layout = _common.so2_layout(self.irreps_in, self.irreps_out, self.m_max)
        if weights is None:
            weights = self.param("weights", lambda key: layout.init_weights(key))
        return _common.so2_call(layout, x, vectors, weights)
