"""Pallas GPU kernels of jequi (Triton lowering on GPU, interpret mode on CPU).

Modules: :mod:`.row_code` (the row-code generators), :mod:`.per_row` and :mod:`.row_blocks`
(the batched kernels), :mod:`.conv` (the fused convolution), :mod:`.batched` (which batched
kernels run a descriptor), :mod:`.config` (the knobs, one frozen value) and :mod:`.heuristics`
(the rules that pick them per problem), :mod:`.lowering` (where the kernels run)."""

from .batched import backward, backward_sum, forward, forward_sum, fuses_second, second_sum
from .config import DEFAULT, Config
from .conv import conv_backward, conv_backward_sum, conv_forward, conv_forward_sum
from .lowering import on_gpu
from .row_code import ALL, SUPPORTED_MODES, unsupported_modes

__all__ = [
    "ALL", "Config", "DEFAULT", "SUPPORTED_MODES", "backward", "backward_sum", "conv_backward", "conv_backward_sum",
    "conv_forward", "conv_forward_sum", "forward", "forward_sum", "fuses_second", "on_gpu", "second_sum",
    "unsupported_modes",
]  # fmt: skip
