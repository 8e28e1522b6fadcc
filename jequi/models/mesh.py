"""The 1-D device mesh that every multi-device path of jequi.models shares (the sharded
calculator and MD, :mod:`jequi.models.distributed`; data-parallel training,
:mod:`jequi.models.data_parallel`), below both."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

AXIS = "atoms"


def device_mesh(devices: int | None = None) -> Mesh:
    """A 1-D mesh (axis :data:`AXIS`) of the first `devices` devices (None: all of them)."""
    available = jax.devices()
    devices = len(available) if devices is None else devices
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices must be a positive int, got {devices!r}")
    if devices > len(available):
        raise ValueError(
            f"{devices} devices requested but JAX sees {len(available)} ({available[0].platform}); on a CPU, set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} (or jax.config.update('jax_num_cpu_devices', "
            f"{devices})) before JAX starts"
        )
    return Mesh(np.array(available[:devices]), (AXIS,))


# The kernels' custom calls (pallas_call, ffi_call) give outputs with no varying-axes type, which
# shard_map's type check rejects; nothing here needs it: each device differentiates its own
# energy, and only results are summed (psum) or sent (ppermute). Passed to every shard_map of
# distributed and data_parallel; tests/multidevice_checks.py runs the Pallas kernels inside one.
CHECK_VMA = False
