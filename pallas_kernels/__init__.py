"""Pallas GPU kernels of jequi (Triton lowering on GPU, interpret mode on CPU)."""

from .conv import conv_backward, conv_forward
from .lowering import on_gpu
from .tensor_product import ALL, SUPPORTED_MODES, backward, forward, unsupported_modes

__all__ = ["ALL", "SUPPORTED_MODES", "backward", "conv_backward", "conv_forward", "forward", "on_gpu", "unsupported_modes"]
