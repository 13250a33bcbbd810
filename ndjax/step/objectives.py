"""The loss the train step minimises, as an object the step is given
(``StepOptions.objective``): how a batch's loss is summed from the model's features, and
what it is averaged over. Next-token cross-entropy (``CrossEntropy``, ``train`` and
``eval`` alike) and the preference losses (``ndjax.step.preference``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from ndjax.models import lora
from ndjax.models.decoder import HeadLoss
from ndjax.ops.cross_entropy import loss_sums
from ndjax.parallel.rules import Weight

Batch = dict[str, jax.Array]
# (params, inputs, positions, segment_ids[, dropout]) -> (final hidden states (b, s, dim),
# LM head (dim, vocab) as stored, rules.Weight, the MoE router's metrics: {} or
# aux_loss and the experts' loads); with ``head_loss=`` (decoder.HeadLoss), (its sums,
# the router's metrics). See Decoder.features.
FeaturesFn = Callable[[Any, jax.Array, jax.Array, jax.Array],
                      tuple[jax.Array, Weight, dict[str, jax.Array]]]


class Objective(Protocol):
    """What the step asks of a loss. The step divides ``loss_sum``'s total by
    ``weight`` of the whole batch (not of a micro-batch), so that grad_accum and the
    layouts leave the loss as one device's; the router's losses are added by the step.
    ``totals`` are other whole-batch figures ``loss_sum`` scales by (given to each
    micro-batch). Metrics under ``ratios`` are (numerator, denominator) sums: the step
    adds them over micro-batches and logs their quotient."""

    needs_reference: bool  # loss_sum compares with a reference model's features

    def loss_sum(self, features: FeaturesFn, params: Any, batch: Batch, chunk: int,
                 dropout: lora.Dropout | None = None, reference: FeaturesFn | None = None,
                 totals: dict[str, jax.Array] | None = None
                 ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """(the loss summed over the batch, the tokens it counted, metrics: the
        router's (``moe.aux_metrics``, {} for a dense model) and ``ratios``).
        ``reference``: (inputs, positions, segment_ids) -> the reference model's
        features, for an objective that ``needs_reference``."""
        ...

    def weight(self, batch: Batch) -> jax.Array:
        """What the summed loss is divided by: float32, the whole batch's."""
        ...

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        """Whole-batch figures ``loss_sum`` needs beside ``weight``."""
        ...


@dataclasses.dataclass(frozen=True)
class CrossEntropy:
    """Next-token cross-entropy, token-weighted: every token ``loss_mask`` keeps counts
    once, whichever row or micro-batch it sits in (the head applied chunk by chunk:
    ``ndjax.ops.cross_entropy``)."""

    needs_reference = False

    def loss_sum(self, features: FeaturesFn, params: Any, batch: Batch, chunk: int,
                 dropout: lora.Dropout | None = None, reference: FeaturesFn | None = None,
                 totals: dict[str, jax.Array] | None = None
                 ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """(summed next-token cross-entropy over the unmasked tokens, their count, the
        router's metrics). ``dropout``: LoRA's, for the tokens ``batch["token_ids"]``
        names."""
        args = [batch["inputs"], batch["positions"], batch["segment_ids"]]
        dropout = None if dropout is None else dataclasses.replace(
            dropout, token_ids=batch["token_ids"])
        # Through head_loss, so that the 1F1B pipeline can form it per micro-batch.
        head_loss = HeadLoss(lambda x, head, rows: loss_sums(x, head, *rows, chunk),
                             (batch["targets"], batch["loss_mask"]))
        (total, tokens), aux = features(params, *args, dropout, head_loss=head_loss)
        return total, tokens, aux

    def weight(self, batch: Batch) -> jax.Array:
        return jnp.sum(batch["loss_mask"].astype(jnp.float32))

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {}


def finish_metrics(aux: dict[str, Any]) -> dict[str, jax.Array]:
    """The metrics of ``loss_sum``'s third output, ``ratios`` divided out (0 where a
    denominator is 0: e.g. no pair in the batch). A ratio of four sums (num1, den1, num2,
    den2) is the difference of two quotients, NaN unless both denominators are > 0."""
    aux = dict(aux)
    for name, sums in aux.pop("ratios", {}).items():
        if len(sums) == 4:
            both = (sums[1] > 0) & (sums[3] > 0)
            aux[name] = jnp.where(both, _quotient(*sums[:2]) - _quotient(*sums[2:]), jnp.nan)
        else:
            aux[name] = _quotient(*sums)
    return aux


def _quotient(num: jax.Array, den: jax.Array) -> jax.Array:
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
