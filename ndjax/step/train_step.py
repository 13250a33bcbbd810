"""The loss and the train step (pure functions; the Experiment jits them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from ndjax.models import lora, moe
from ndjax.parallel.rules import constrain
from ndjax.step.objectives import Batch, CrossEntropy, FeaturesFn, Objective, finish_metrics
from ndjax.step.state import TrainState

# StepOptions.reference's values: where a preference objective's reference model is.
# adapters_off: the policy with its LoRA adapters zeroed; held: parameters the step is
# given beside the state (the trainable part's starting values).
REFERENCES = ("none", "adapters_off", "held")


def reference_features(features: FeaturesFn, mode: str, params: Any, held: Any
                       ) -> FeaturesFn | None:
    """The reference model's features, no gradient: ``params`` (the parameters
    ``features`` takes) with the adapters off, or ``held`` in their place."""
    if mode == "none":
        return None
    if mode == "adapters_off":
        ref = lora.adapters_off(params)
    else:
        ref = held
    ref = jax.lax.stop_gradient(ref)
    return lambda *args, **kwargs: features(ref, *args, **kwargs)


def eval_step(features: FeaturesFn, objective: Objective, chunk: int, params: Any,
              batch: Batch, reference: FeaturesFn | None = None) -> dict[str, jax.Array]:
    """The train step's loss without the update: for the validation split."""
    total, tokens, aux = objective.loss_sum(features, params, batch, chunk,
                                            reference=reference)
    metrics = {k: v for k, v in finish_metrics(aux).items() if "/" in k}
    return {"loss": total / jnp.maximum(objective.weight(batch), 1.0), "tokens": tokens,
            **metrics}


@dataclasses.dataclass(frozen=True)
class StepOptions:
    skip_nonfinite: bool = False  # drop the update when loss or grad norm is NaN/Inf
    nan_at_step: int = -1         # debug: poison the loss at this logged step (1-based)
    loss_chunk: int = 1024        # sequence positions per chunk of the LM head + loss
    grad_accum: int = 1           # micro-batches per step (lax.scan inside the step)
    # What gradients are summed in (Precision.grad_accum): float32 whatever the
    # parameters' dtype, so grad_accum slices give the whole batch's update.
    grad_dtype: Any = jnp.float32
    # The MoE load-balancing loss's weight in the loss (model.router_aux_loss_coef).
    aux_loss_coef: float = 0.0
    # The router z-loss's weight in the loss (model.router_z_loss_coef).
    z_loss_coef: float = 0.0
    # DeepSeek V3's load-balancing bias: its step after each optimizer step
    # (model.score_bias_rate; ndjax.models.moe.update_score_bias); 0: it stays.
    score_bias_rate: float = 0.0
    # LoRA: only the adapters get gradients and updates (and the top-level parameters
    # ``saved``: model.lora.modules_to_save); the rest is frozen, passed through the step
    # untouched (ndjax.models.lora.split).
    adapters_only: bool = False
    saved: tuple[str, ...] = ()
    # LoRA's dropout (model.lora.dropout), its masks keyed by train.seed and the step
    # (lora.step_dropout); the host's permutation of the sequence (ring attention's
    # zigzag), so that a token's mask follows the token.
    lora_dropout: float = 0.0
    dropout_seed: int = 0
    seq_permutation: Any = dataclasses.field(default=None, compare=False)
    # The loss minimised (ndjax.step.objectives): next-token cross-entropy by default.
    objective: Objective = CrossEntropy()
    # Where the objective's reference model is (REFERENCES), if it needs one.
    reference: str = "none"


BATCH_NAMES = ("act_batch", "act_seq")


def micro_batches(batch: Batch, k: int) -> Batch:
    """(B, S) fields -> (k, B/k, S): micro-batch j holds rows j, j+k, j+2k, ...

    Strided rows keep every micro-batch spread over the data axes exactly as the
    batch is (each device's block of rows splits locally into k), so no rows move
    between devices. The loss is token-weighted over the whole batch, so which
    rows share a micro-batch does not change it.
    """
    def split(a):
        b, s = a.shape
        return constrain(jnp.moveaxis(a.reshape(b // k, k, s), 1, 0), (None, *BATCH_NAMES))
    return {name: split(a) for name, a in batch.items()}


def step_dropout(options: StepOptions, step: jax.Array, batch: Batch) -> lora.Dropout | None:
    """The LoRA dropout of the step that ``step`` (the state's counter) starts."""
    rows, seq_len = batch["inputs"].shape
    return lora.step_dropout(options.lora_dropout, options.dropout_seed, step, rows, seq_len,
                             options.seq_permutation)


def loss_and_grads(features: FeaturesFn, options: StepOptions, params: Any, batch: Batch,
                   grad_shardings: Any = None, dropout: lora.Dropout | None = None,
                   reference: FeaturesFn | None = None) -> tuple[jax.Array, jax.Array, Any]:
    """(mean loss, tokens, float32 gradients): ``loss_aux_and_grads`` without the
    metrics."""
    loss, tokens, grads, _ = loss_aux_and_grads(features, options, params, batch,
                                                grad_shardings, dropout, reference)
    return loss, tokens, grads


def router_loss(options: StepOptions, aux: dict[str, jax.Array]) -> jax.Array | float:
    """What the MoE router adds to the cross-entropy in the objective (0 for a dense
    model): ``aux_loss_coef`` x its load-balancing loss and ``z_loss_coef`` x its z-loss."""
    if "aux_loss" not in aux:
        return 0.0
    # A term weighted 0 is left out, not multiplied by 0: no gradient reaches the
    # router's statistics then (the 1F1B pipeline refuses one).
    return sum((coef * aux[name] for coef, name in ((options.aux_loss_coef, "aux_loss"),
                                                    (options.z_loss_coef, "router_z_loss"))
                if coef), 0.0)


def loss_aux_and_grads(features: FeaturesFn, options: StepOptions, params: Any, batch: Batch,
                       grad_shardings: Any = None, dropout: lora.Dropout | None = None,
                       reference: FeaturesFn | None = None
                       ) -> tuple[jax.Array, jax.Array, Any, dict[str, jax.Array]]:
    """(mean loss, tokens, float32 gradients, metrics: the router's and the
    objective's) over the whole batch, weighted as the objective says (the
    cross-entropy: every real token counts once, whichever row or micro-batch it sits
    in). The loss is ``options.objective``'s, with ``reference`` the reference model's
    features if it needs one; the gradients are those of it plus
    ``aux_loss_coef`` x the MoE's load-balancing loss (``aux_loss`` among the
    metrics) and ``z_loss_coef`` x its router z-loss (``router_z_loss``), which,
    like transformers' load-balancing loss, are formed per forward pass: under
    ``grad_accum`` per micro-batch, and the step's is their mean.

    With ``grad_accum`` = k the batch runs as k micro-batches in a ``lax.scan``,
    their gradients summed in float32 in ``grad_shardings`` (the parameters'
    layout), so activations are those of one micro-batch. Each micro-batch is
    differentiated with respect to float32 copies of the parameters, so that the
    gradient of a bfloat16 parameter reaches the sum unrounded (a gradient has its
    value's dtype); the model narrows the copies back exactly before it uses them
    (``layers.use_param``), so the forward pass and its all-gathers are unchanged.
    """
    tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
    denom = jnp.maximum(options.objective.weight(batch), 1.0)
    totals = options.objective.totals(batch)
    if dropout is not None:  # the token ids are split into micro-batches with the rows
        batch = {**batch, "token_ids": dropout.token_ids}

    k = options.grad_accum

    def scaled_loss(p, b):
        total, _, aux = options.objective.loss_sum(features, p, b, options.loss_chunk,
                                                   dropout, reference, totals)
        ratios = aux.pop("ratios", {})  # summed over micro-batches, then divided
        loss = total / denom
        objective = loss + router_loss(options, aux) / k
        return objective, (loss, {**jax.tree.map(lambda a: a / k, aux), "ratios": ratios})

    grad_fn = jax.grad(scaled_loss, has_aux=True)
    to_f32 = lambda g: jax.tree.map(lambda a: a.astype(options.grad_dtype), g)  # noqa: E731
    if k == 1:
        grads, (loss, aux) = grad_fn(params, batch)
        return loss, tokens, to_f32(grads), finish_metrics(aux)

    def place(g):
        if grad_shardings is None:
            return g
        return jax.tree.map(jax.lax.with_sharding_constraint, g, grad_shardings)

    def body(carry, micro):
        loss, acc, aux_sum = carry
        # With bfloat16 parameters this holds a float32 copy of them (sharded like them)
        # while a micro-batch runs, and its float32 gradient: 8 bytes per parameter
        # where bfloat16 gradients took 2. The layer scan reads the copy; where weights
        # are used outside it, XLA folds the widening into the model's narrowing.
        grads, (part, aux) = grad_fn(place(to_f32(params)), micro)
        acc = place(jax.tree.map(jnp.add, acc, grads))
        return (loss + part, acc, jax.tree.map(jnp.add, aux_sum, aux)), None

    zeros = place(jax.tree.map(lambda p: jnp.zeros(p.shape, options.grad_dtype), params))
    micro = micro_batches(batch, k)
    aux_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        lambda p, b: scaled_loss(p, b)[1][1], params, jax.tree.map(lambda a: a[0], micro)))
    (loss, grads, aux), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros, aux_zeros),
                                         micro)
    return loss, tokens, grads, finish_metrics(aux)


def _is_schedule_state(x: Any) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def schedule_counts_at(opt_state: Any, step: jax.Array) -> Any:
    """``opt_state`` with the count of every ``scale_by_schedule`` set to ``step``.

    Only the count's value changes, never the tree (checkpoints keep restoring).
    """
    def at(x):
        if _is_schedule_state(x):
            return x._replace(count=jnp.asarray(step, x.count.dtype))
        return x
    return jax.tree.map(at, opt_state, is_leaf=_is_schedule_state)


def keep_unless_schedule(keep: Callable[[jax.Array, jax.Array], jax.Array],
                         new: Any, old: Any) -> Any:
    """``keep(new, old)`` on every leaf of the optimizer state but the schedules'
    counts, which take their new value.

    A skipped step must not hold the lr schedule back, or every later step
    applies the lr of a step earlier than the one logged. Adam's count, on the
    other hand, is kept with its moments: it counts the gradients averaged into
    them, and its bias correction 1 - b**count is exact only if a skipped
    gradient does not count (as in PyTorch's GradScaler, which skips
    ``optimizer.step()`` altogether). Advancing it too would scale the first
    updates after an early skip down, e.g. by (1 - 0.9**2) / (1 - 0.9**3) ~ 0.7
    on the first moment at step 3.
    """
    def pick(n, o):
        if _is_schedule_state(n):
            return n
        return jax.tree.map(keep, n, o)
    return jax.tree.map(pick, new, old, is_leaf=_is_schedule_state)


def _unless_stepped(updates: Any) -> Any:
    """The optimizer's updates with those of ``lora.STEPPED`` parameters zeroed: they
    take no gradient, but AdamW's weight decay would still move them."""
    flat = traverse_util.flatten_dict(updates)
    if not any(k[-1] in lora.STEPPED for k in flat):
        return updates
    return traverse_util.unflatten_dict({k: jnp.zeros_like(v) if k[-1] in lora.STEPPED else v
                                         for k, v in flat.items()})


def train_step(features: FeaturesFn, optimizer: optax.GradientTransformation,
               schedule: optax.Schedule, options: StepOptions, grad_shardings: Any,
               state: TrainState, batch: Batch, reference: Any = None
               ) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step. Under LoRA (``options.adapters_only``) the gradient is taken
    with respect to the adapters alone, so the frozen base's weight gradients are never
    formed, and the optimizer sees (and holds state for) the adapters only.
    ``reference``: the reference model's trainable part, when ``options.reference`` is
    held (a preference objective's)."""
    trainable, frozen = lora.split(state.params, options.adapters_only, options.saved)
    if frozen:
        grad_shardings = lora.trainable(grad_shardings, True, options.saved)
        base_features = features

        def features(p, *args, **kwargs):
            return base_features(lora.merge(frozen, p), *args, **kwargs)
    loss, tokens, grads, aux = loss_aux_and_grads(
        features, options, trainable, batch, grad_shardings,
        step_dropout(options, state.step, batch),
        reference_features(features, options.reference, trainable, reference))
    if options.nan_at_step >= 0:
        poison = jnp.where(state.step + 1 == options.nan_at_step, jnp.nan, 1.0)
        loss = loss * poison
        grads = jax.tree.map(lambda g: g * poison, grads)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # The lr applied is the lr logged: schedule(state.step), whatever the
    # schedule's own count says (a checkpoint written before skipped steps
    # advanced it may hold a count that lags state.step).
    old_opt_state = schedule_counts_at(state.opt_state, state.step)
    updates, opt_state = optimizer.update(grads, old_opt_state, trainable)
    updates = _unless_stepped(updates)
    params = optax.apply_updates(trainable, updates)
    if options.skip_nonfinite:
        # Keep the old parameters and Adam's state (moments and their count),
        # so the skipped gradient leaves no trace; the step counter and the
        # schedule's count still advance, so the lr and the data stay in step
        # with an uninterrupted run (see keep_unless_schedule).
        keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
        params = jax.tree.map(keep, params, trainable)
        opt_state = keep_unless_schedule(keep, opt_state, old_opt_state)
    params = lora.merge(frozen, params)
    counts = aux.pop(moe.EXPERT_COUNTS, None)
    if counts is not None and options.score_bias_rate:
        # A skipped step (skip_nonfinite) leaves the bias too.
        rate = options.score_bias_rate * (finite if options.skip_nonfinite else 1.0)
        params = moe.update_score_bias(params, counts, rate)
    metrics = {
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": schedule(state.step),
        "tokens": tokens,
        # Real tokens / slots of the batch (padding has segment id 0): packing's fill.
        "data/fill": jnp.mean((batch["segment_ids"] > 0).astype(jnp.float32)),
        "finite": finite,
        # MoE: aux_loss, router_z_loss, expert_load_min, expert_load_max; a preference
        # objective's rewards/*, logps/*, logits/*.
        **aux,
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics
