"""jequi's CUDA JIT path: kernels generated per descriptor as CUDA C++, compiled with nvcc and
run through one XLA FFI handler.

Modules: :mod:`.config` (the knobs, one frozen value), :mod:`.schedule` (what each warp
computes), :mod:`.launch` (a kernel's launch plan), :mod:`.ctext` and :mod:`.emit` (C text and
the pieces of a kernel), :mod:`.codegen` (the kernels of each kind), :mod:`.build_search` (which
build of a kernel runs), :mod:`.build` (nvcc and the FFI launcher), :mod:`.ops` (the kernels as
JAX functions, the contract ``pallas_kernels`` shares). Backends ``"cuda"`` and
``"cuda-atomic"`` are :mod:`.ops` through :mod:`jequi.backends.kernels`.
"""

from . import schedule
from .config import DEFAULT, Config
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
    "Config", "DEFAULT", "schedule", "available", "backward", "backward_sum", "conv_backward", "conv_backward_sum",
    "conv_forward", "conv_forward_sum", "forward", "forward_sum", "fuses_second", "second_sum", "unsupported_reason",
]  # fmt: skip
