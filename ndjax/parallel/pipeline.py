"""Pipeline parallelism over the mesh's ``stage`` axis, as one SPMD program.

The decoder's layers are cut into ``stages`` contiguous runs. Their stacked parameters'
leading axis (logical name ``layers``) is split over ``stage`` by the rule table, so
stage s holds layers s*L/S .. (s+1)*L/S - 1 and no weight moves. The batch is cut into
micro-batches. At each tick every stage runs its layers on the micro-batch in front
of it: one function vmapped over the stage axis with ``spmd_axis_name="stage"``, which
XLA partitions onto the stages' devices. Then the residual stream moves one stage on,
a collective permute between neighbours.

The embedding, the final norm, the LM head and the loss run outside the pipeline on
every stage's devices (replicated over ``stage``), as MaxText's pipeline runs them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
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
    def ticks(self) -> int:
        return self.microbatches + self.stages - 1

    @property
    def bubble(self) -> float:
        """The share of stage-ticks with no micro-batch to run: (S - 1) / (M + S - 1)."""
        return (self.stages - 1) / self.ticks


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
    summed over micro-batches: those under ``per_layer`` keys (L, ...) in layer order).

    ``params``: the stacked layers' parameters, leading axis L = stages x L/stages.
    ``per_row``: arrays with the batch as leading axis (rotary tables, segment ids), cut
    into micro-batches as ``x`` is. ``x_names``: ``x``'s logical axes.
    """
    s, m = plan.stages, plan.microbatches
    staged = jax.tree.map(lambda a: a.reshape(s, a.shape[0] // s, *a.shape[1:]), params)
    xs = rules_lib.constrain(_split_rows(x, m), (None, *x_names))
    rows = jax.tree.map(lambda a: _split_rows(a, m), per_row)
    stage_ids = jnp.arange(s)
    stages = jax.vmap(stage_fn, spmd_axis_name="stage")

    def inputs_at(t, state):
        """Stage 0 takes micro-batch t; stage i > 0 what stage i - 1 gave at tick t - 1."""
        first = xs[jnp.minimum(t, m - 1)]
        shifted = jnp.roll(state, 1, axis=0)  # a collective permute over ``stage``
        at_first = (stage_ids == 0).reshape(s, *([1] * (state.ndim - 1)))
        return _constrain_staged(jnp.where(at_first, first[None], shifted), x_names)

    def tick(carry, t):
        state, out, stats = carry
        mb = t - stage_ids                       # the micro-batch at each stage
        valid = (mb >= 0) & (mb < m)
        consts = jax.tree.map(lambda a: a[jnp.clip(mb, 0, m - 1)], rows)
        h, st = stages(staged, inputs_at(t, state), consts)
        h = _constrain_staged(h, x_names)
        # The last stage's output is micro-batch t - (s - 1)'s. Ticks before s - 1 write
        # the bubble's zeros to slot 0, which tick s - 1 overwrites.
        out = out.at[jnp.clip(t - (s - 1), 0, m - 1)].set(h[s - 1])
        stats = {k: v + _masked_sum(st[k], valid, k.startswith(per_layer))
                 for k, v in stats.items()}
        return (h, out, stats), None

    state0 = _constrain_staged(jnp.zeros((s, *xs.shape[1:]), x.dtype), x_names)
    shapes = jax.eval_shape(stages, staged, state0,
                            jax.tree.map(lambda a: a[jnp.zeros(s, jnp.int32)], rows))[1]
    stats0 = {k: jnp.zeros(v.shape if k.startswith(per_layer) else v.shape[1:], v.dtype)
              for k, v in shapes.items()}
    (_, out, stats), _ = jax.lax.scan(tick, (state0, jnp.zeros_like(xs), stats0),
                                      jnp.arange(plan.ticks))
    stats = {k: (v.reshape(-1, *v.shape[2:]) if k.startswith(per_layer) else v)
             for k, v in stats.items()}
    return rules_lib.constrain(_join_rows(out), x_names), stats


def _masked_sum(v: jax.Array, valid: jax.Array, keep_stages: bool) -> jax.Array:
    """A tick's stats (stages, ...) from the stages that held a micro-batch: summed over
    the stages, or (``keep_stages``: per-layer stats) kept per stage."""
    v = jnp.where(valid.reshape(-1, *([1] * (v.ndim - 1))), v, jnp.zeros_like(v))
    return v if keep_stages else jnp.sum(v, axis=0)
