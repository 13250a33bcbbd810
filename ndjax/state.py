"""Train state and optimizer: AdamW with warmup + cosine/constant, clipping."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import struct

# train.opt_state_dtype: the dtype AdamW's moments are stored in (computed in float32).
OPT_STATE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@struct.dataclass
class TrainState:
    step: jax.Array
    params: Any      # nested dict of arrays (model.param_dtype), paths as in the model
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


def _cast_floats(tree: Any, dtype: Any) -> Any:
    """Floating-point arrays of ``tree`` cast to ``dtype``; counters and anything
    that is not an array (optax's placeholders in ``tree_map_params``) kept."""
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x
    return jax.tree.map(cast, tree)


def store_moments_as(inner: optax.GradientTransformation, dtype: Any
                     ) -> optax.GradientTransformation:
    """``inner`` (e.g. scale_by_adam) with its floating-point state stored in ``dtype``.

    The update upcasts the stored state to float32, runs ``inner`` in float32 and
    rounds the new state back: only storage is narrow, never the arithmetic. The
    state keeps ``inner``'s tree structure (and so its checkpoint paths, and the
    parameter-shaped subtrees that ``optax.tree_map_params`` looks for).
    """
    def init(params):
        return _cast_floats(inner.init(params), dtype)

    def update(updates, state, params=None):
        updates, state = inner.update(updates, _cast_floats(state, jnp.float32), params)
        return updates, _cast_floats(state, dtype)

    return optax.GradientTransformation(init, update)


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` fed float32 gradients and parameters, so that clipping's global
    norm, the moments' arithmetic and weight decay are float32 whatever the
    parameter dtype. Its updates come out float32; ``optax.apply_updates`` rounds
    parameter + update to the parameter dtype.

    A wrapper rather than a first element of the chain: a stateless element
    would still add an entry to the optimizer state and renumber the paths of
    every checkpoint written before it.
    """
    def update(updates, state, params=None):
        return inner.update(_cast_floats(updates, jnp.float32), state,
                            None if params is None else _cast_floats(params, jnp.float32))

    return optax.GradientTransformation(inner.init, update)


def make_optimizer(train: ml_collections.ConfigDict, param_names: dict,
                   schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW, moments stored in ``train.opt_state_dtype``; no weight decay on norm
    scales (found by their logical names)."""
    decay_mask = jax.tree.map(lambda names: "norm" not in names, param_names,
                              is_leaf=lambda x: isinstance(x, tuple))
    parts = []
    if train.clip_norm and train.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train.clip_norm))
    # optax.adamw's own chain, with its moments' storage dtype set (same state tree).
    moments = OPT_STATE_DTYPES[train.opt_state_dtype]
    parts.append(optax.chain(
        store_moments_as(optax.scale_by_adam(b1=train.b1, b2=train.b2, eps=train.eps), moments),
        optax.add_decayed_weights(train.weight_decay, decay_mask),
        optax.scale_by_learning_rate(schedule)))
    return in_float32(optax.chain(*parts))


def state_shardings(optimizer: optax.GradientTransformation, abstract_params: Any,
                    param_shardings: Any, replicated: Any) -> TrainState:
    """Shardings of the whole state: optimizer moments are laid out like their params.

    ``optax.tree_map_params`` finds the parameter-shaped subtrees of the
    optimizer state (the moments) by initialising the optimizer on a
    placeholder; everything else (step counts) is replicated. Both inits are
    abstract (the placeholder is an empty pytree), so nothing runs on a device.
    """
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        lambda params: jax.eval_shape(optimizer.init, params),
        lambda _, sharding: sharding, abstract_opt, param_shardings,
        transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)


def zero_step() -> jax.Array:
    return jnp.zeros((), jnp.int32)
