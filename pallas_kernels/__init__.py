"""Pallas GPU kernels of jequi (Triton lowering on GPU, interpret mode on CPU).

Modules: :mod:`.row_code` (the row-code generators), :mod:`.per_row` and :mod:`.row_blocks`
(the batched kernels), :mod:`.conv` (the fused convolution), :mod:`.ops` (the kernels as JAX
functions, the contract ``ffi`` shares), :mod:`.config` (the knobs, one frozen value) and
:mod:`.heuristics` (the rules that pick them per problem), :mod:`.lowering` (where the kernels
run). Backend ``"pallas"`` is :mod:`.ops` through :mod:`jequi.backends.kernels`."""

from .config import DEFAULT, Config
from .lowering import on_gpu
from .ops import (
    available,
    backward,
    backward_sum,
    conv_backward,
    conv_backward_sum,
    conv_forward,
    conv_forward_sum,
    forward,
    forward_sum,
    fuses_second,
    second_sum,
    unsupported_reason,
)
from .row_code import SUPPORTED_MODES

__all__ = [
    "Config", "DEFAULT", "SUPPORTED_MODES", "available", "backward", "backward_sum", "conv_backward", "conv_backward_sum",
    "conv_forward", "conv_forward_sum", "forward", "forward_sum", "fuses_second", "on_gpu", "second_sum",
    "unsupported_reason",
]  # fmt: skip
