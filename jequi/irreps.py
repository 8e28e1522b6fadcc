"""Irreps: jequi uses e3nn-jax's `Irreps` class unchanged (one notation, one implementation)."""

from __future__ import annotations

import e3nn_jax as e3nn

Irreps = e3nn.Irreps
Irrep = e3nn.Irrep


def as_irreps(value, name: str) -> Irreps:
    """Convert `value` (string, `Irreps`, list of (mul, ir)) to `Irreps`, or raise a ValueError naming `name`."""
    if isinstance(value, Irreps):
        return value
    try:
        return Irreps(value)
    except Exception as exc:  # e3nn raises ValueError, AssertionError or TypeError depending on the input
        raise ValueError(f"{name}: cannot interpret {value!r} as irreps ({exc})") from exc
