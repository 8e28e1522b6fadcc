"""Pallas GPU kernels of jequi (Triton lowering on GPU, interpret mode on CPU)."""

from .batched import backward, backward_sum, forward, forward_sum, fuses_second, second_sum
from .conv import conv_backward, conv_backward_sum, conv_forward, conv_forward_sum
from .lowering import on_gpu
from .tensor_product import ALL, SUPPORTED_MODES, unsupported_modes

__all__ = [
    "ALL", "SUPPORTED_MODES", "backward", "backward_sum", "conv_backward", "conv_backward_sum", "conv_forward",
    "conv_forward_sum", "forward", "forward_sum", "fuses_second", "on_gpu", "second_sum", "unsupported_modes",
]  # fmt: skip
