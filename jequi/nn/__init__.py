"""Neural-network layers around jequi's tensor product and fused convolution.

One module per framework, imported on demand (each needs its framework installed):

* :mod:`jequi.nn.linen` - Flax linen modules,
* :mod:`jequi.nn.nnx` - Flax nnx modules,
* :mod:`jequi.nn.haiku` - Haiku modules,
* :mod:`jequi.nn.equinox` - Equinox modules (``pip install jequi[equinox]``).

Each offers ``TensorProduct`` and ``Conv``: the weights are either internal (one shared
weight vector, a parameter initialised like e3nn-jax's: normal with ``tp.weight_std``) or
passed at call time (e.g. per-edge weights from a radial MLP). Inputs may be
``e3nn_jax.IrrepsArray`` or plain arrays; ``backend`` selects the kernels like the ops do
(default: the fastest available).

Each also offers ``SO2Conv(irreps_in, irreps_out, m_max)``: :func:`jequi.so2_conv` along edge
vectors, with internal shared weights or per-edge ``weights=`` (:class:`jequi.SO2Layout`).
"""
