"""The decoder stack under full rematerialisation: keep each layer's input, nothing else.

``remat=full`` needs exactly one thing per layer for the backward pass: the
layer's input (the residual stream, in the compute dtype). ``jax.checkpoint``
inside ``lax.scan`` asks for that too, but XLA's CPU compiler cannot update a
bfloat16 stack in place and keeps a float32 copy of it beside the bfloat16 one
(the ``float-normalization-bf16`` pass): on CPU, where layouts are planned and
memory is checked ahead of time, a bfloat16 run then looks 3x bigger than it is
on a GPU. This scan saves the inputs itself, 16-bit floats bitcast to uint16,
which every backend stores as they are, and recomputes each layer in the
backward pass with ``jax.vjp``, one layer's activations at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Layer = Callable[[jax.Array, Any, tuple], jax.Array]  # (h, layer params, consts) -> h


def _to_bits(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def _zero_cotangent(x: jax.Array) -> Any:
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def scan_full_remat(layer: Layer, h: jax.Array, params: Any, consts: tuple) -> jax.Array:
    """``h`` through every layer of the stacked ``params`` (leading axis: layers).

    ``consts`` (RoPE tables, segment ids) are the same for every layer and get no
    gradient. ``layer`` must not close over traced values.
    """
    @jax.custom_vjp
    def run(h, params, consts):
        return jax.lax.scan(lambda c, p: (layer(c, p, consts), None), h, params)[0]

    def forward(h, params, consts):
        out, inputs = jax.lax.scan(lambda c, p: (layer(c, p, consts), _to_bits(c)), h, params)
        return out, (inputs, params, consts)

    def backward(saved, g):
        inputs, params, consts = saved

        def step(g, layer_inputs):
            bits, p = layer_inputs
            _, vjp = jax.vjp(lambda x, q: layer(x, q, consts), _from_bits(bits, h.dtype), p)
            g_h, g_p = vjp(g)
            return g_h, g_p

        g_h, g_params = jax.lax.scan(step, g, (inputs, params), reverse=True)
        return g_h, g_params, jax.tree.map(_zero_cotangent, consts)

    run.defvjp(forward, backward)
    return run(h, params, consts)
