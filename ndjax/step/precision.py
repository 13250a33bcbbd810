"""The dtypes of a run in one place: parameters, compute, gradient accumulation and
Adam's moments. Later work (fp8 matmuls, other moment stores) extends this object
rather than adding dtype fields across the code."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Precision:
    params: Any = jnp.float32      # parameters as stored (model.param_dtype)
    compute: Any = jnp.float32     # matmuls and activations (model.dtype; auto by platform)
    # Micro-batch gradients are summed in float32 whatever the parameters' dtype:
    # grad_accum slices of one batch give the update of the whole batch.
    grad_accum: Any = jnp.float32
    moments: Any = jnp.float32     # Adam's moments as stored (train.opt_state_dtype)

    @classmethod
    def of(cls, compute: str, params: str, moments: str, platform: str) -> Precision:
        """From the config's names; ``compute="auto"`` is float32 on CPU (the reference
        numerics of the tests) and bfloat16 on accelerators."""
        if compute == "auto":
            compute = "float32" if platform == "cpu" else "bfloat16"
        return cls(params=DTYPES[params], compute=DTYPES[compute], moments=DTYPES[moments])
