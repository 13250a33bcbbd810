"""Ragged all-to-all over one mesh axis: each device sends a contiguous run of its rows
to every device of the axis, runs of any length (expert parallelism's dispatch).

On GPUs it is ``jax.lax.ragged_all_to_all`` (XLA's ragged-all-to-all: only the rows
sent move). XLA's CPU backend has no such op (jax 0.10: "not supported by XLA:CPU"),
so on CPUs the same exchange is computed from an all-gather of every device's rows:
the same result, and the same gradient (the transpose of a gather), at the cost of
moving everything, which tests do not mind.

Both ask the caller to lay the runs out as expert parallelism does: in every
device's output buffer, the runs arrive in the senders' order, back to back from
row 0 (``output_offsets`` on device ``i`` for destination ``j``: the rows devices
``0..i-1`` send ``j``). The rows after the last run are zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def exchange(rows: jax.Array, out_rows: int, input_offsets: jax.Array,
             send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array,
             axis: str, platform: str) -> jax.Array:
    """``rows`` (n, ...) of this device; per device ``j`` of ``axis``: ``send_sizes[j]``
    rows from ``input_offsets[j]`` go to ``j``'s output at ``output_offsets[j]``, and
    ``recv_sizes[j]`` rows come from ``j``. Returns this device's (out_rows, ...).
    ``platform``: the step's (``ndjax.parallel.platforms.current()`` outside the shard_map,
    whose body runs with no active rules)."""
    ints = [a.astype(jnp.int32) for a in (input_offsets, send_sizes, output_offsets,
                                          recv_sizes)]
    if platform == "gpu":
        out = jnp.zeros((out_rows, *rows.shape[1:]), rows.dtype)
        return jax.lax.ragged_all_to_all(rows, out, *ints, axis_name=axis)
    return _gathered_exchange(rows, out_rows, *ints, axis)


def _gathered_exchange(rows, out_rows, input_offsets, send_sizes, output_offsets,
                       recv_sizes, axis):
    """The exchange from an all-gather of every device's rows and offsets (CPUs)."""
    del recv_sizes  # implied by the senders' sizes
    me = jax.lax.axis_index(axis)
    # In float32: XLA:CPU aborts compiling the bfloat16 reduce-scatter that is this
    # all-gather's transpose (jax 0.10-0.11: "Invalid binary instruction opcode copy").
    # The CPU compiler widens bf16 collectives to f32 anyway, so nothing is lost.
    every = jax.lax.all_gather(rows.astype(jnp.promote_types(rows.dtype, jnp.float32)),
                               axis)                           # (devices, n, ...)
    starts = jax.lax.all_gather(input_offsets, axis)[:, me]   # each sender's run for me
    sizes = jax.lax.all_gather(send_sizes, axis)[:, me]
    at = jax.lax.all_gather(output_offsets, axis)[:, me]      # where each run lands
    r = jnp.arange(out_rows)
    sender = jnp.clip(jnp.searchsorted(at + sizes, r, side="right"), 0, every.shape[0] - 1)
    valid = r < jnp.sum(sizes)
    index = jnp.clip(starts[sender] + r - at[sender], 0, rows.shape[0] - 1)
    got = every[sender, index]
    return jnp.where(valid.reshape(-1, *(1,) * (rows.ndim - 1)), got,
                     jnp.zeros_like(got)).astype(rows.dtype)
