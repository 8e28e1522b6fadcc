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
