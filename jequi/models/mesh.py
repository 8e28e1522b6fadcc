"""The 1-D device mesh that every multi-device path of jequi.models shares (the sharded
calculator, :mod:`jequi.models.distributed`; data-parallel training,
:mod:`jequi.models.data_parallel`), below both. After ``jax.distributed.initialize`` the mesh
spans every process's devices (one process per GPU, as on a cluster: docs/distributed.md), and
:func:`to_host` brings a result spread over them to each process."""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils
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


def to_host(x) -> np.ndarray:
    """`x` as a numpy array on this host: the whole array also where its shards live on other
    processes' devices (gathered from them: every process must call it)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)
