"""The loss and the train step (pure functions; the Experiment jits them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from ndjax.state import TrainState

Batch = dict[str, jax.Array]
# (params, inputs, positions, segment_ids) -> float32 logits (b, s, vocab)
ApplyFn = Callable[[Any, jax.Array, jax.Array, jax.Array], jax.Array]


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-token cross-entropy. A one-hot contraction rather than a gather keeps
    a vocab-sharded logits tensor sharded (the partitioner turns it into a local
    masked sum plus an all-reduce)."""
    logits = logits.astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.sum(logits * jax.nn.one_hot(targets, logits.shape[-1],
                                                   dtype=logits.dtype), axis=-1)
    return logz - target_logit


def loss_fn(apply: ApplyFn, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy over the unmasked tokens of the global batch.

    Token-weighted: every real token counts once, whichever row it sits in.
    """
    logits = apply(params, batch["inputs"], batch["positions"], batch["segment_ids"])
    mask = batch["loss_mask"].astype(jnp.float32)
    tokens = jnp.sum(mask)
    loss = jnp.sum(cross_entropy(logits, batch["targets"]) * mask) / jnp.maximum(tokens, 1.0)
    return loss, tokens


def eval_step(apply: ApplyFn, params: Any, batch: Batch) -> dict[str, jax.Array]:
    """The train step's loss without the update: for the validation split."""
    loss, tokens = loss_fn(apply, params, batch)
    return {"loss": loss, "tokens": tokens}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    skip_nonfinite: bool = False  # drop the update when loss or grad norm is NaN/Inf
    nan_at_step: int = -1         # debug: poison the loss at this logged step (1-based)


def train_step(apply: ApplyFn, optimizer: optax.GradientTransformation,
               schedule: optax.Schedule, options: StepOptions, state: TrainState,
               batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_of(params):
        loss, tokens = loss_fn(apply, params, batch)
        if options.nan_at_step >= 0:
            loss = loss * jnp.where(state.step + 1 == options.nan_at_step, jnp.nan, 1.0)
        return loss, tokens

    (loss, tokens), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
    # Summed in float32 whatever the parameter (and so gradient) dtype.
    grad_norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if options.skip_nonfinite:
        # Keep the old parameters and moments; the step counter still advances
        # so the schedule and the data stay in step with an uninterrupted run.
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, params, state.params)
        opt_state = jax.tree.map(keep, opt_state, state.opt_state)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": schedule(state.step),
        "tokens": tokens,
        "finite": finite,
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
