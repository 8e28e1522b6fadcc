"""The models' precision policies: which tensors a model stores in half precision and how its
linear layers multiply (``precision=`` of every architecture config, ``JequiCalculator``,
``DeviceMD`` and ``train``). Measured accuracy and speed of each: docs/precision.md.

* ``"float32"``: float32 everywhere, matmuls at full float32 precision (the default: the
  pretrained models' own numbers).
* ``"tf32"``: the linear layers and the radial MLP multiply in TF32 (float32 accumulation) on a
  GPU; the CPU has no TF32 and multiplies in float32. Everything is stored in float32.
* ``"bf16-mixed"``: the convolutions' operands are stored in bfloat16: the edge tensors (the
  spherical harmonics and the radial MLP's weights, rounded as they are made), the node
  features they gather and the messages they sum (the kernels compute and sum in float32,
  jequi.dtypes); the linear layers multiply bfloat16-rounded inputs with float32 accumulation.
  Node states between layers, energies, forces, stresses, positions and the MD integrator stay
  in float32.

Under every policy the geometry (edge vectors with their cell shifts, spherical harmonics,
radial basis) is computed at full float32 precision (:func:`exact_geometry`): a cell rounded to
bfloat16 would move periodic images by |cell| 2^-9, about 0.01 Å.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Policy:
    name: str
    # jax_default_matmul_precision of the model's linears and radial MLP, on a GPU and on a CPU
    matmul_gpu: str
    matmul_cpu: str
    # the dtype the convolutions' operands and messages are stored in (None: the model's float32)
    conv_dtype: object = None

    def matmuls(self):
        """A context in which the model's matmuls run at this policy's precision."""
        on_gpu = jax.default_backend() == "gpu"
        return jax.default_matmul_precision(self.matmul_gpu if on_gpu else self.matmul_cpu)


POLICIES = {
    "float32": Policy("float32", "highest", "highest"),
    "tf32": Policy("tf32", "TF32_TF32_F32", "highest"),
    "bf16-mixed": Policy("bf16-mixed", "BF16_BF16_F32", "BF16_BF16_F32", jnp.bfloat16),
}


def exact_geometry():
    """A context in which matmuls run at full float32 precision, whatever the policy's."""
    return jax.default_matmul_precision("highest")


def policy(name: str) -> Policy:
    """The :class:`Policy` called `name` (ValueError naming the choices otherwise)."""
    if name not in POLICIES:
        raise ValueError(f"precision must be one of {', '.join(map(repr, POLICIES))}, got {name!r}")
    return POLICIES[name]


def conv_dtype(config):
    """The dtype `config`'s policy stores its convolutions' operands in (None: the model's own);
    ValueError for a half-precision policy on a conv other than jequi's, which has no such storage."""
    dtype = policy(config.precision).conv_dtype
    if dtype is not None and config.conv != "jequi":
        raise ValueError(f"precision={config.precision!r} stores the convolutions in half precision: it needs conv='jequi'")
    return dtype


def with_precision(config, name: str | None):
    """`config` (an architecture's) with precision policy `name` (None: as it is). A config
    without a ``precision`` field runs float32 only."""
    if name is None:
        return config
    policy(name)
    if not any(f.name == "precision" for f in dataclasses.fields(config)):
        if name == "float32":
            return config
        raise ValueError(f"{type(config).__name__} has no precision policy but float32; got {name!r}")
    return dataclasses.replace(config, precision=name)
