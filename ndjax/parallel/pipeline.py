"""Pipeline parallelism over the mesh's ``stage`` axis, as one SPMD program.

The decoder's layers are cut into ``stages`` x ``virtual`` runs of equal length (chunks).
Their stacked parameters' leading axis (logical name ``layers``) is split over ``stage``
by the rule table, contiguously: stage s holds the s-th block of the storage order. GPipe
(``virtual`` 1) stores the layers in order, so stage s holds chunk s. The circular
schedule stores them so that stage s holds chunks s, s + S, s + 2S, ... (``storage_order``):
a micro-batch goes round the stages ``virtual`` times. No weight moves in either.

The batch is cut into micro-batches. At each tick every stage runs its chunk on the
micro-batch in front of it: one function vmapped over the stage axis with
``spmd_axis_name="stage"``, which XLA partitions onto the stages' devices. Then the
residual stream moves one stage on, a collective permute between neighbours.

The embedding, the final norm, the LM head and the loss run outside the pipeline on
every stage's devices (replicated over ``stage``), as MaxText's pipeline runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from ndjax.parallel import rules as rules_lib


@dataclasses.dataclass(frozen=True)
class GPipe:
    """GPipe's schedule: micro-batch m enters stage 0 at tick m and leaves the last
    stage at tick m + stages - 1; the backward pass is the forward's reverse. Every
    micro-batch's activations stay alive until its backward pass (the remat policy
    decides how much of them)."""

    stages: int
    microbatches: int

    @property
    def virtual(self) -> int:
        """Chunks of layers per stage: one."""
        return 1

    @property
    def ticks(self) -> int:
        return self.virtual * self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of stage-ticks with no micro-batch to run: (S - 1) / (V M + S - 1)."""
        return (self.stages - 1) / self.ticks


@dataclasses.dataclass(frozen=True)
class Circular(GPipe):
    """The circular (interleaved) schedule, MaxText's and Megatron's forward order:
    each stage holds ``virtual`` chunks of L / (S V) layers, and a micro-batch goes
    round the stages ``virtual`` times. Round v of micro-batch m is on stage s at tick
    v M + m + s, so every stage is busy from tick s to tick V M + s - 1 and the bubble
    is (S - 1) / (V M + S - 1): V times fewer idle ticks, each V times shorter. A
    micro-batch leaves the last stage M - S + 1 ticks before stage 0 takes it again,
    hence M >= S. Each tick saves its chunks' inputs alone, V M + S - 1 of them, and
    the backward pass runs each chunk's forward again (a chunk's weights are picked by
    tick, and the scan would otherwise save every tick's pick)."""

    virtual_stages: int = 2

    @property
    def virtual(self) -> int:
        return self.virtual_stages


def schedule(stages: int, microbatches: int, virtual: int = 1) -> GPipe:
    """GPipe for one chunk per stage, else the circular schedule."""
    return GPipe(stages, microbatches) if virtual == 1 else Circular(stages, microbatches,
                                                                      virtual)


def storage_order(count: int, stages: int, virtual: int) -> np.ndarray:
    """The layer (of ``count``, in order) at each position of the stacked parameters'
    leading axis, which ``stage`` splits into contiguous blocks: stage s's block holds
    chunks s, s + S, ..., s + (V - 1) S of ``count / (S V)`` layers. The identity for
    GPipe (``virtual`` 1)."""
    k = count // (stages * virtual)
    return np.arange(count).reshape(virtual, stages, k).transpose(1, 0, 2).reshape(-1)


def _split_rows(a: jax.Array, m: int) -> jax.Array:
    """(b, ...) -> (m, b/m, ...): micro-batch i is rows i, i + m, i + 2m, ..., so each
    holds an equal share of every data shard's rows (a data shard's rows are contiguous)."""
    return jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1)


def _join_rows(a: jax.Array) -> jax.Array:
    """``_split_rows``' inverse."""
    return jnp.swapaxes(a, 0, 1).reshape(-1, *a.shape[2:])


def _constrain_staged(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """x (stages, *names): split over ``stage`` along its first axis, the rest by the rules."""
    rules = rules_lib.active()
    if rules is None:
        return x
    spec = rules.spec(names)
    return jax.lax.with_sharding_constraint(x, PartitionSpec("stage", *spec))


# (one stage's parameters, h (mb, ...), one micro-batch's per-row inputs) -> (h, stats):
# stats a dict of arrays; keys starting with ``per_layer`` have the stage's layers as their
# leading axis, the others are sums.
StageFn = Callable[[Any, jax.Array, Any], tuple[jax.Array, dict]]


def run(plan: GPipe, stage_fn: StageFn, params: Any, x: jax.Array, per_row: Any,
        x_names: tuple[str | None, ...], per_layer: str) -> tuple[jax.Array, dict]:
    """``x`` (b, ...) through every stage -> (the last stage's output (b, ...), the stats
    summed over micro-batches: those under ``per_layer`` keys (L, ...) in the parameters'
    storage order).

    ``params``: the stacked layers' parameters, leading axis L = S x V x L/(S V) in
    ``storage_order``. ``per_row``: arrays with the batch as leading axis (rotary
    tables, segment ids), cut into micro-batches as ``x`` is. ``x_names``: ``x``'s
    logical axes.
    """
    s, m, v = plan.stages, plan.microbatches, plan.virtual
    staged = jax.tree.map(lambda a: a.reshape(s, v, a.shape[0] // (s * v), *a.shape[1:]),
                          params)
    xs = rules_lib.constrain(_split_rows(x, m), (None, *x_names))
    rows = jax.tree.map(lambda a: _split_rows(a, m), per_row)
    stage_ids = jnp.arange(s)

    def chunk_fn(chunks, rnd, h, consts):
        """One stage: its chunk of round ``rnd`` (a chunk of its own: no weight moves)."""
        chunk = jax.tree.map(lambda a: a[0] if v == 1 else
                             jax.lax.dynamic_index_in_dim(a, rnd, keepdims=False), chunks)
        return stage_fn(chunk, h, consts)

    if v > 1:
        # The scan would save each tick's pick of weights (and what the layers derive
        # from them) for the backward pass: M copies of a stage's weights. Each tick
        # keeps the chunk's input alone, and the backward pass runs the chunk again.
        chunk_fn = jax.checkpoint(chunk_fn, prevent_cse=False,
                                  policy=jax.checkpoint_policies.nothing_saveable)
    stages = jax.vmap(chunk_fn, spmd_axis_name="stage")

    def per_stage(mask: jax.Array) -> jax.Array:
        return mask.reshape(s, *([1] * (len(xs.shape) - 1)))

    def kept(buf: jax.Array, slot: jax.Array, value: jax.Array, mask: jax.Array) -> jax.Array:
        """``buf`` (stages, m, ...) with ``value`` (stages, ...) in slot ``slot`` of the
        stages in ``mask``: each stage writes its own copy, nothing crosses stages."""
        return _constrain_staged(buf.at[:, slot].set(
            jnp.where(per_stage(mask), value, buf[:, slot])), (None, *x_names))

    def inputs_at(t, state, buf):
        """Stage 0 takes micro-batch t in the first round, and in a later round what the
        last stage gave for it (kept in stage 0's slots of ``buf``); stage i > 0 what
        stage i - 1 gave at tick t - 1. Also ``buf`` updated."""
        first = xs[jnp.minimum(t, m - 1)][None]
        shifted = jnp.roll(state, 1, axis=0)  # a collective permute over ``stage``
        if v > 1:
            # What reaches stage 0 is the last stage's output of tick t - 1, micro-batch
            # (t - s) % m's; it waits on stage 0 until that micro-batch's next round, m - s
            # ticks on (written first: with m == s it is taken at once).
            buf = kept(buf, (t - s) % m, shifted, stage_ids == 0)
            first = jnp.where(t < m, first, buf[:, t % m])
        return _constrain_staged(jnp.where(per_stage(stage_ids == 0), first, shifted),
                                 x_names), buf

    def tick(carry, t):
        state, buf, stats = carry
        work = t - stage_ids                     # each stage's (round, micro-batch)
        rnd, mb = jnp.clip(work // m, 0, v - 1), jnp.clip(work % m, 0, m - 1)
        valid = (work >= 0) & (work < v * m)
        consts = jax.tree.map(lambda a: a[mb], rows)
        h, buf = inputs_at(t, state, buf)
        h, st = stages(staged, rnd, h, consts)
        h = _constrain_staged(h, x_names)
        # The last stage's output in its last round is micro-batch (t - (s - 1)) % m's
        # output, kept in the last stage's slots and sent to the other stages once, after
        # the last tick (each tick sending it would cross the stages in the bubble too,
        # and a conditional around the send copies the buffer at every tick).
        done = (stage_ids == s - 1) & valid & (rnd == v - 1)
        buf = kept(buf, jnp.clip(t - (s - 1), 0, v * m - 1) % m, h, done)
        stats = {k: acc + _masked_sum(st[k], valid, rnd, v, k.startswith(per_layer))
                 for k, acc in stats.items()}
        return (h, buf, stats), None

    state0 = _constrain_staged(jnp.zeros((s, *xs.shape[1:]), x.dtype), x_names)
    shapes = jax.eval_shape(stages, staged, jnp.zeros(s, jnp.int32), state0,
                            jax.tree.map(lambda a: a[jnp.zeros(s, jnp.int32)], rows))[1]
    # Per-layer stats (stages, chunk's layers, ...) accumulate per round: (S, V, L/(S V)).
    stats0 = {k: jnp.zeros((s, v, *a.shape[1:]) if k.startswith(per_layer) else a.shape[1:],
                           a.dtype) for k, a in shapes.items()}
    # Each stage's m micro-batch slots: the first stage's hold micro-batches between
    # rounds, the last stage's the output.
    buf0 = _constrain_staged(jnp.zeros((s, *xs.shape), x.dtype), (None, *x_names))
    (_, buf, stats), _ = jax.lax.scan(tick, (state0, buf0, stats0), jnp.arange(plan.ticks))
    out = rules_lib.constrain(buf[s - 1], (None, *x_names))  # to every stage, once
    stats = {k: (a.reshape(-1, *a.shape[3:]) if k.startswith(per_layer) else a)
             for k, a in stats.items()}
    return rules_lib.constrain(_join_rows(out), x_names), stats


def _masked_sum(a: jax.Array, valid: jax.Array, rnd: jax.Array, virtual: int,
                keep_stages: bool) -> jax.Array:
    """A tick's stats (stages, ...) from the stages that held a micro-batch: summed over
    the stages, or (``keep_stages``: per-layer stats) kept per stage, in the slot of
    the round each stage ran (stages, virtual, ...)."""
    a = jnp.where(valid.reshape(-1, *([1] * (a.ndim - 1))), a, jnp.zeros_like(a))
    if not keep_stages:
        return jnp.sum(a, axis=0)
    if virtual == 1:
        return a[:, None]
    one_hot = jax.nn.one_hot(rnd, virtual, dtype=a.dtype)  # (stages, virtual)
    return one_hot.reshape(*one_hot.shape, *([1] * (a.ndim - 1))) * a[:, None]
