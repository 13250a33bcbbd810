"""All-to-all (Ulysses) context parallelism: sequence shards become head shards.

Ring attention (``ring_attention``) keeps each shard's queries and passes key/value
blocks around the context axis. This is the other way (DeepSpeed-Ulysses): each
device holds ``seq / c`` tokens of every head it has; one all-to-all over the
``context`` axis gives it the whole sequence for ``1 / c`` of those heads, any
one-shard kernel (``dense``, ``blocked``, ``tiled``, and on a GPU ``cudnn`` or
``pallas``) attends over the whole sequence for them, and a second all-to-all
brings the output back to sequence shards. On a GPU that is how context
parallelism gets a fused kernel.

Per layer and pass, each device sends ``(c - 1) / c`` of its q, k, v and output
(forward; the gradients of the same in the backward): about ``(2 h + 2 kv) s d / c``
elements, against ring attention's ``2 kv s d`` per device for its key/value hops
((c - 1) / c of it). The segment ids are gathered whole (4 bytes a token).

What it needs: the heads each device holds after tensor parallelism divide by the
context degree (checked before compiling, ``ndjax.ops.attention``). Where a device
holds fewer kv heads than ``c`` (or a number ``c`` does not divide), each is
repeated just enough (``kv_repeat``) for the query heads of every slice to find
theirs, as tensor parallelism does.

Attention sinks (one logit per query head): each device's share of them, split like
its heads, is sliced as its query heads are, so that the kernel gets the logits of
the heads it attends for; their gradient is autodiff's, summed over the devices.

The sequence must be in its natural order: each all-to-all concatenates the
shards' chunks in shard order. It needs no balancing permutation (ring
attention's zigzag): every device attends over the whole sequence, causal
work the same on each. The gradient is autodiff's: the transpose of an
all-to-all is the reverse all-to-all, and the inner kernel brings its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from ndjax.parallel.rules import Rules, suspended

AXIS = "context"


def kv_repeat(kv_heads: int, heads: int, context: int) -> int:
    """How many times each of a device's ``kv_heads`` is repeated so that each of the
    ``context`` head slices holds whole query groups: the least ``r`` with
    ``kv_heads * r`` divisible by ``context``. Whenever ``context`` divides ``heads``,
    ``r`` divides the group size ``heads / kv_heads``, so the groups stay whole."""
    r = context // math.gcd(kv_heads, context)
    if heads % context or (heads // kv_heads) % r:
        raise ValueError(f"all-to-all attention: {heads} query heads, {kv_heads} kv heads "
                         f"on a device cannot split {context} ways")
    return r


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _repeat_heads(x: jax.Array, r: int) -> jax.Array:
    return jnp.repeat(x, r, axis=2)


def _repeat_forward(x, r):
    return _repeat_heads(x, r), None


def _repeat_backward(r, _, g):
    # Each kv head's gradient is the sum over its copies, in float32 (bfloat16
    # copies summed in bfloat16 would round r - 1 times).
    b, s, h, d = g.shape
    return (g.astype(jnp.float32).reshape(b, s, h // r, r, d).sum(3).astype(g.dtype),)


_repeat_heads.defvjp(_repeat_forward, _repeat_backward)


def _local(kernel: Callable, context: int, q, k, v, segment_ids, *sinks):
    """One device: (b, s/c, h, d) of q (k, v with their kv heads) -> the same of the
    output, attending over the whole sequence for h / c of its heads. ``sinks``: none,
    or its heads' sink logits (h,)."""
    h = q.shape[2] // context
    # to_heads gives context shard j its heads j h .. (j + 1) h - 1: their sinks too.
    sinks = tuple(lax.dynamic_slice_in_dim(x, lax.axis_index(AXIS) * h, h) for x in sinks)
    r = kv_repeat(k.shape[2], q.shape[2], context)
    if r > 1:
        k, v = _repeat_heads(k, r), _repeat_heads(v, r)

    def to_heads(x):  # (b, s/c, n, d) -> (b, s, n/c, d)
        return lax.all_to_all(x, AXIS, split_axis=2, concat_axis=1, tiled=True)

    segment_ids = lax.all_gather(segment_ids, AXIS, axis=1, tiled=True)
    with suspended():  # the kernel sees one device's arrays: no rules apply inside
        out = kernel(to_heads(q), to_heads(k), to_heads(v), segment_ids, *sinks)
    return lax.all_to_all(out, AXIS, split_axis=1, concat_axis=2, tiled=True)


def _specs(rules: Rules, heads: tuple[str, ...], kv_heads: tuple[str, ...]
           ) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    """q's (and the output's), k's and v's, and the segment ids' specs from the rule
    table; the sequence must be split over the context axis alone."""
    q, kv = (tuple(rules.spec(n)) + (None,) * 4 for n in (heads, kv_heads))
    for spec in (q, kv):
        if spec[1] not in (AXIS, (AXIS,)):
            raise ValueError(f"all-to-all attention splits the sequence over {AXIS!r} only; "
                             f"the rule table gives {spec[:4]}")
    return PartitionSpec(*q[:4]), PartitionSpec(*kv[:4]), PartitionSpec(q[0], AXIS)


def all_to_all_attention(kernel: Callable, q: jax.Array, k: jax.Array, v: jax.Array,
                         segment_ids: jax.Array, rules: Rules,
                         heads: tuple[str, ...], kv_heads: tuple[str, ...],
                         sinks: jax.Array | None = None) -> jax.Array:
    """``kernel(q, k, v, segment_ids)`` (a one-shard attention of the whole sequence)
    run with the sequence split over ``rules.mesh``'s context axis. ``heads`` and
    ``kv_heads``: the logical names of q and of k, v, whose rules say how batch and
    heads split too (each device runs the kernel on its own rows and heads).
    ``sinks`` (h,): the heads' sink logits, then ``kernel(q, k, v, segment_ids,
    sinks)`` gets those of the heads it attends for."""
    q_spec, kv_spec, seg_spec = _specs(rules, heads, kv_heads)
    context = rules.mesh.shape[AXIS]
    body = functools.partial(_local, kernel, context)
    with_sinks = () if sinks is None else (sinks,)
    sink_spec = (PartitionSpec(q_spec[2]),) * len(with_sinks)  # split like the heads
    return jax.shard_map(body, mesh=rules.mesh,
                         in_specs=(q_spec, kv_spec, kv_spec, seg_spec, *sink_spec),
                         out_specs=q_spec, check_vma=False)(q, k, v, segment_ids, *with_sinks)
