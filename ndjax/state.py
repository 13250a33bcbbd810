"""Train state and optimizer: AdamW with warmup + cosine/constant, clipping."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any      # nested dict of float32 arrays, paths as in the model
    opt_state: Any


def make_schedule(train: ml_collections.ConfigDict) -> optax.Schedule:
    warmup = max(int(train.warmup_steps), 0)
    if train.schedule == "constant":
        if warmup == 0:
            return optax.constant_schedule(train.lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, train.lr, warmup), optax.constant_schedule(train.lr)],
            [warmup])
    decay_steps = max(int(train.steps), warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=train.lr, warmup_steps=warmup, decay_steps=decay_steps,
        end_value=train.lr * train.min_lr_ratio)


def make_optimizer(train: ml_collections.ConfigDict, param_names: dict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW; no weight decay on norm scales (found by their logical names)."""
    decay_mask = jax.tree.map(lambda names: "norm" not in names, param_names,
                              is_leaf=lambda x: isinstance(x, tuple))
    parts = []
    if train.clip_norm and train.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train.clip_norm))
    parts.append(optax.adamw(schedule, b1=train.b1, b2=train.b2, eps=train.eps,
                             weight_decay=train.weight_decay, mask=decay_mask))
    return optax.chain(*parts)


def state_shardings(optimizer: optax.GradientTransformation, abstract_params: Any,
                    param_shardings: Any, replicated: Any) -> TrainState:
    """Shardings of the whole state: optimizer moments are laid out like their params.

    An optimizer-state leaf whose key path ends with a parameter's path (and has
    its shape) is that parameter's moment; anything else (step counts) is
    replicated. Matching by path keeps this free of any eager computation.
    """
    by_path = {}
    for (path, shape), sharding in zip(jax.tree_util.tree_flatten_with_path(abstract_params)[0],
                                       jax.tree.leaves(param_shardings)):
        by_path[path] = (shape.shape, sharding)

    def leaf_sharding(path, leaf):
        for start in range(len(path)):
            match = by_path.get(tuple(path[start:]))
            if match is not None and match[0] == leaf.shape:
                return match[1]
        return replicated

    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = jax.tree_util.tree_map_with_path(leaf_sharding, abstract_opt)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def zero_step() -> jax.Array:
    return jnp.zeros((), jnp.int32)
