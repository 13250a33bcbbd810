"""GRPO's loss on rows of sampled completions, as TRL 1.16's ``GRPOTrainer`` computes it
(``_compute_loss``) for its ``loss_type``s dapo, grpo, bnpo and dr_grpo.

A row is one prompt and one of its completions (``ndjax.training.grpo`` samples and
scores them); ``loss_mask`` is 1 where the target is a completion token, and the batch's
``advantages`` field holds each row's advantage on its every position (float32). Per
completion token, with the log-probability ``logp`` of the policy at temperature T (the
logits divided by T, as TRL's), the probability ratio ``r = exp(logp - old)`` and
advantage ``A``:

    loss_t = -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t,
    kl_t = r (exp(ref - logp) - (ref - logp) - 1)     (k3, TRL's bias-corrected form)

``old`` is the sampling policy's log-probability: the batch's ``old_logps`` where given,
else ``logp`` itself without gradient (one gradient step per batch of rollouts: r = 1
with its gradient, TRL's on-policy case). ``ref`` is the reference model's (the batch's
``ref_logps``, else the step's reference features), needed only when beta > 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ndjax.models import lora
from ndjax.ops.cross_entropy import token_log_probs
from ndjax.step.objectives import Batch, FeaturesFn


@dataclasses.dataclass(frozen=True)
class GRPO:
    """GRPO's loss (TRL's settings, config section ``grpo``); ``weight``: what the
    summed per-token losses are divided by, per ``loss_type``."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 256

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def weight(self, batch: Batch) -> jax.Array:
        """dapo, bnpo: the batch's completion tokens; grpo: its rows (each row's loss is
        its token mean); dr_grpo: rows x max_completion_length."""
        rows = jnp.asarray(batch["inputs"].shape[0], jnp.float32)
        if self.loss_type == "grpo":
            return rows
        if self.loss_type == "dr_grpo":
            return rows * self.max_completion_length
        return jnp.sum(batch["loss_mask"].astype(jnp.float32))

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}

    def token_logps(self, features: FeaturesFn, params: Any, batch: Batch, chunk: int,
                    dropout: lora.Dropout | None = None) -> tuple[jax.Array, dict]:
        """(per-token log-probabilities at the sampling temperature, the router's metrics)."""
        args = [batch["inputs"], batch["positions"], batch["segment_ids"]]
        if dropout is not None:
            args.append(dataclasses.replace(dropout, token_ids=batch["token_ids"]))
        x, head, aux = features(params, *args)
        if self.temperature != 1.0:
            x = x / jnp.asarray(self.temperature, x.dtype)
        return token_log_probs(x, head, batch["targets"], chunk)[0], aux

    def loss_sum(self, features: FeaturesFn, params: Any, batch: Batch, chunk: int,
                 dropout: lora.Dropout | None = None, reference: FeaturesFn | None = None,
                 totals: dict[str, jax.Array] | None = None
                 ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        logps, aux = self.token_logps(features, params, batch, chunk, dropout)
        mask = batch["loss_mask"].astype(jnp.float32)
        old = batch["old_logps"] if "old_logps" in batch else jax.lax.stop_gradient(logps)
        ratio = jnp.exp(logps - old)
        adv = batch["advantages"]
        low, high = 1 - self.epsilon, 1 + self.epsilon_high
        per_token = -jnp.minimum(ratio * adv, jnp.clip(ratio, low, high) * adv)
        tokens = jnp.sum(mask)
        metrics: dict[str, tuple[jax.Array, jax.Array]] = {}
        if self.beta > 0:
            if "ref_logps" in batch:
                ref = batch["ref_logps"]
            else:
                ref = jax.lax.stop_gradient(
                    self.token_logps(lambda p, *a: reference(*a), None, batch, chunk)[0])
            d = ref - logps
            kl = (jnp.exp(d) - d - 1) * ratio
            per_token = per_token + self.beta * kl
            metrics["kl"] = (jnp.sum(jax.lax.stop_gradient(kl) * mask), tokens)
        if self.loss_type == "grpo":  # each completion's token mean
            per_row = jnp.sum(per_token * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1)
            total = jnp.sum(per_row)
        else:
            total = jnp.sum(per_token * mask)
        r = jax.lax.stop_gradient(ratio)
        low_clip = ((r < low) & (adv < 0)).astype(jnp.float32) * mask
        high_clip = ((r > high) & (adv > 0)).astype(jnp.float32) * mask
        metrics["clip_ratio/low_mean"] = (jnp.sum(low_clip), tokens)
        metrics["clip_ratio/high_mean"] = (jnp.sum(high_clip), tokens)
        metrics["clip_ratio/region_mean"] = (jnp.sum(low_clip + high_clip), tokens)
        return total, tokens, {**aux, "ratios": metrics}
