"""jequi's CUDA JIT path: kernels generated per descriptor as CUDA C++, compiled with nvcc and
run through one XLA FFI handler (see :mod:`.build`, :mod:`.codegen`, :mod:`.schedule`).

Backend ``"cuda"`` (``jequi/backends/cuda.py``) calls :mod:`.ops`.
"""

from . import schedule
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

__all__ = [
    "schedule", "available", "backward", "backward_sum", "conv_backward", "conv_backward_sum", "conv_forward",
    "conv_forward_sum", "forward", "forward_sum", "fuses_second", "second_sum", "unsupported_reason",
]  # fmt: skip
