"""jequi's CUDA JIT path: kernels generated per descriptor as CUDA C++, compiled with nvcc and
run through one XLA FFI handler (see :mod:`.build`, :mod:`.codegen`, :mod:`.schedule`).

Backend ``"cuda"`` (``jequi/backends/cuda.py``) calls :mod:`.ops`.
"""

from . import schedule
from .ops import available, backward, conv_backward, conv_forward, forward, unsupported_reason

__all__ = ["schedule", "available", "backward", "conv_backward", "conv_forward", "forward", "unsupported_reason"]
