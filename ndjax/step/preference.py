"""Preference objectives on paired rows: DPO (sigmoid, conservative with label
smoothing), IPO, ORPO, SimPO and KTO, each equal to TRL 1.16's trainer of that name
(``DPOTrainer``, ``ORPOTrainer``, ``CPOTrainer(loss_type="simpo")``, ``KTOTrainer``).

A pair is two consecutive segments of one row (``ndjax.data.preference``): segment
``2k+1`` the prompt and the chosen completion, ``2k+2`` the prompt and the rejected
one; ``loss_mask`` is 1 where the target is a completion token. KTO's unit is an
example (segment ``2k+1``, ``desirable`` or not) and its KL sequence (``2k+2``: the
prompt with another example's completion). Everything below is a
function of per-sequence sums of per-token log-probabilities
(``ops.cross_entropy.token_log_probs``), so packing and every layout leave the loss as
one device's, and the loss is a mean over the whole batch's pairs (``weight``).
Metrics are TRL's (rewards/*, logps/*, logits/*) as (numerator, denominator) sums the
step adds over micro-batches before dividing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ndjax.models import lora
from ndjax.ops.cross_entropy import token_log_probs
from ndjax.step.objectives import Batch, FeaturesFn


def _slots(seg: jax.Array) -> tuple[jax.Array, int]:
    """(each token's pair slot (b, s), the number of slots): slot ``r * P + k`` is row r's
    pair k (P: the most pairs a row can hold); padding (segment 0) gets slot ``n``, past
    the last."""
    b, s = seg.shape
    per_row = s // 2 + 1
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    n = b * per_row
    return jnp.where(seg > 0, rows * per_row + (seg - 1) // 2, n), n


def _pairs(batch: Batch, values: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums of (b, s) ``values`` per pair and side: {name: (pair slots, 2)}, side 0 the
    chosen sequence, 1 the rejected (``_slots``); slots with no pair sum to 0."""
    seg = batch["segment_ids"]
    slot, n = _slots(seg)
    ids = jnp.where(seg > 0, slot * 2 + (seg - 1) % 2, 2 * n).reshape(-1)
    return {k: jax.ops.segment_sum(v.reshape(-1).astype(jnp.float32), ids,
                                   num_segments=2 * n + 1)[:2 * n].reshape(-1, 2)
            for k, v in values.items()}


def count_pairs(batch: Batch) -> jax.Array:
    """Pairs in ``batch``: chosen sequences' first tokens (odd segment ids at position 0)."""
    seg = batch["segment_ids"]
    return jnp.sum(((seg % 2 == 1) & (batch["positions"] == 0)).astype(jnp.float32))


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


@dataclasses.dataclass(frozen=True)
class Preference:
    """One of the preference losses (``kind``: dpo, ipo, orpo, simpo, kto) with TRL's
    settings (config's ``preference`` section). ``needs_reference``: dpo, ipo and kto
    compare the policy with a reference model, whose features the step passes."""

    kind: str
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    @property
    def needs_reference(self) -> bool:
        return self.kind in ("dpo", "ipo", "kto")

    def weight(self, batch: Batch) -> jax.Array:
        return count_pairs(batch)

    def totals(self, batch: Batch) -> dict[str, jax.Array]:
        """Whole-batch counts a micro-batch's loss is scaled by: pairs, and the tokens the
        chosen side's cross-entropy is averaged over (ORPO: prompt and completion;
        SimPO: completion), as TRL averages it over the batch."""
        seg, mask = batch["segment_ids"], batch["loss_mask"].astype(jnp.float32)
        chosen = (seg % 2 == 1).astype(jnp.float32)
        if self.kind == "orpo":
            length = _pairs(batch, {"n": (seg > 0).astype(jnp.float32)})["n"][:, 0]
            nll_tokens = jnp.sum(jnp.maximum(length - 1, 0))
        else:
            nll_tokens = jnp.sum(mask * chosen)
        return {"pairs": count_pairs(batch), "nll_tokens": nll_tokens}

    def loss_sum(self, features: FeaturesFn, params: Any, batch: Batch, chunk: int,
                 dropout: lora.Dropout | None = None, reference: FeaturesFn | None = None,
                 totals: dict[str, jax.Array] | None = None
                 ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """(the pairs' losses summed, the completion tokens, metrics: the router's and
        ``ratios``). ``reference``: the reference model's features (dpo, ipo, kto)."""
        args = [batch["inputs"], batch["positions"], batch["segment_ids"]]
        x, head, aux = features(params, *args, *(
            [] if dropout is None else [dataclasses.replace(dropout,
                                                            token_ids=batch["token_ids"])]))
        logps, mean_logits = token_log_probs(x, head, batch["targets"], chunk)
        seg = batch["segment_ids"]
        mask = batch["loss_mask"].astype(jnp.float32)
        values = {"logps": logps * mask, "tokens": mask, "mean_logits": mean_logits * mask,
                  "length": (seg > 0).astype(jnp.float32)}
        if self.needs_reference:
            rx, rhead, _ = reference(*args)
            ref_logps, _ = token_log_probs(jax.lax.stop_gradient(rx), rhead, batch["targets"],
                                           chunk)
            values["ref_logps"] = jax.lax.stop_gradient(ref_logps) * mask
        if self.kind == "kto":  # which examples are desirable
            values["desirable"] = batch["desirable"].astype(jnp.float32) * values["length"]
        sums = _pairs(batch, values)
        if self.kind == "orpo":  # the chosen sequence's every target, prompt included
            in_seq = self._in_sequence(batch, sums["length"])
            sums.update(_pairs(batch, {"nll_sum": logps * in_seq, "nll_tokens": in_seq}))
        totals = totals if totals is not None else self.totals(batch)
        real = (sums["length"][:, 0] > 0).astype(jnp.float32)  # a pair in this slot
        loss, ratios = getattr(self, f"_{self.kind}")(sums, real, totals)
        if self.kind != "kto":
            ratios.update(self._logit_metrics(sums))
        return loss, jnp.sum(mask), {**aux, "ratios": ratios}

    @staticmethod
    def _in_sequence(batch: Batch, length: jax.Array) -> jax.Array:
        """1 where a chosen sequence's target is its own next token (every position but
        its last). A chosen sequence always lies whole in the row's inputs."""
        seg, pos = batch["segment_ids"], batch["positions"]
        slot, n = _slots(seg)
        chosen_length = length[:, 0][jnp.minimum(slot, n - 1)]
        return ((seg % 2 == 1) & (pos < chosen_length - 1)).astype(jnp.float32)

    def _smoothed(self, z: jax.Array) -> jax.Array:
        eps = self.label_smoothing
        return -(1 - eps) * jax.nn.log_sigmoid(z) - eps * jax.nn.log_sigmoid(-z)

    def _rewards(self, chosen: jax.Array, rejected: jax.Array, real: jax.Array
                 ) -> dict[str, tuple[jax.Array, jax.Array]]:
        """TRL's reward metrics of per-pair rewards, means over the batch's pairs."""
        n = jnp.sum(real)
        return {"rewards/chosen": (jnp.sum(chosen * real), n),
                "rewards/rejected": (jnp.sum(rejected * real), n),
                "rewards/accuracies": (jnp.sum((chosen > rejected) * real), n),
                "rewards/margins": (jnp.sum((chosen - rejected) * real), n)}

    def _dpo_ratios(self, sums, real):
        ratios = sums["logps"] - sums["ref_logps"]
        rewards = self._rewards(self.beta * ratios[:, 0], self.beta * ratios[:, 1], real)
        n = jnp.sum(real)
        rewards["logps/chosen"] = (jnp.sum(sums["logps"][:, 0] * real), n)
        rewards["logps/rejected"] = (jnp.sum(sums["logps"][:, 1] * real), n)
        return ratios, rewards

    def _dpo(self, sums, real, totals):
        """TRL's sigmoid loss: -log sigmoid(beta x the margin of the log-ratios); with
        label smoothing eps the conservative form (cDPO)."""
        ratios, metrics = self._dpo_ratios(sums, real)
        losses = self._smoothed(self.beta * (ratios[:, 0] - ratios[:, 1]))
        return jnp.sum(losses * real), metrics

    def _ipo(self, sums, real, totals):
        """IPO: (the margin of the length-averaged log-ratios - 1 / (2 beta))^2."""
        ratios, metrics = self._dpo_ratios(sums, real)
        avg = ratios / jnp.maximum(sums["tokens"], 1.0)
        losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * self.beta)) ** 2
        return jnp.sum(losses * real), metrics

    def _averaged(self, sums, real):
        """Length-averaged completion log-probs (ORPO's and SimPO's), and their metrics."""
        avg = sums["logps"] / jnp.maximum(sums["tokens"], 1.0)
        metrics = self._rewards(self.beta * avg[:, 0], self.beta * avg[:, 1], real)
        n = jnp.sum(real)
        metrics["logps/chosen"] = (jnp.sum(avg[:, 0] * real), n)
        metrics["logps/rejected"] = (jnp.sum(avg[:, 1] * real), n)
        return avg, metrics

    def _nll(self, nll_sum, totals):
        """The chosen side's cross-entropy summed here, as a share of the batch's loss
        sum: its whole-batch token mean times the pairs the loss is divided by."""
        return -nll_sum * totals["pairs"] / jnp.maximum(totals["nll_tokens"], 1.0)

    def _orpo(self, sums, real, totals):
        """ORPO: the chosen sequences' cross-entropy (prompt and completion) minus
        beta x log sigmoid(the log odds ratio of the averaged log-probs)."""
        avg, metrics = self._averaged(sums, real)
        log_odds = (avg[:, 0] - avg[:, 1]) - (_log1mexp(avg[:, 0]) - _log1mexp(avg[:, 1]))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll_sum = jnp.sum(sums["nll_sum"][:, 0])
        n = jnp.sum(real)
        metrics["nll_loss"] = (-nll_sum, jnp.sum(sums["nll_tokens"][:, 0]))
        metrics["log_odds_ratio"] = (jnp.sum(ratio * real), n)
        metrics["log_odds_chosen"] = (jnp.sum(log_odds * real), n)
        return self._nll(nll_sum, totals) - self.beta * jnp.sum(ratio * real), metrics

    def _simpo(self, sums, real, totals):
        """SimPO (TRL's CPOTrainer): the smoothed sigmoid loss of beta x (the margin of
        averaged log-probs - gamma / beta), plus cpo_alpha x the chosen completions'
        cross-entropy."""
        avg, metrics = self._averaged(sums, real)
        logits = avg[:, 0] - avg[:, 1] - self.simpo_gamma / self.beta
        losses = jnp.sum(self._smoothed(self.beta * logits) * real)
        nll_sum = jnp.sum(sums["logps"][:, 0])
        metrics["nll_loss"] = (-nll_sum, jnp.sum(sums["tokens"][:, 0]))
        if self.cpo_alpha:
            losses = losses + self.cpo_alpha * self._nll(nll_sum, totals)
        return losses, metrics

    def _kto(self, sums, real, totals):
        """KTO: 1 - sigmoid(beta (r - kl)) for a desirable example, 1 - sigmoid(beta
        (kl - r)) for an undesirable one, r its log-ratio to the reference, weighted; kl
        the batch's mean log-ratio on the KL sequences (no gradient, at least 0), as TRL
        takes it per micro-batch over every device."""
        ratios = sums["logps"] - sums["ref_logps"]
        n = jnp.sum(real)
        kl_ratio = jax.lax.stop_gradient(ratios[:, 1])
        kl = jnp.maximum(jnp.sum(kl_ratio * real) / jnp.maximum(n, 1.0), 0.0)
        good = (sums["desirable"][:, 0] > 0).astype(jnp.float32) * real
        bad = real - good
        r = ratios[:, 0]
        losses = (good * self.desirable_weight * (1 - jax.nn.sigmoid(self.beta * (r - kl)))
                  + bad * self.undesirable_weight * (1 - jax.nn.sigmoid(self.beta * (kl - r))))
        n_good, n_bad = jnp.sum(good), jnp.sum(bad)
        chosen = (jnp.sum(self.beta * r * good), n_good)
        rejected = (jnp.sum(self.beta * r * bad), n_bad)
        metrics = {
            "kl": (kl * n, n),
            "rewards/chosen": chosen,
            "rewards/rejected": rejected,
            # A difference of the two means, undefined (NaN) without both kinds.
            "rewards/margins": (*chosen, *rejected),
            "logps/chosen": (jnp.sum(sums["logps"][:, 0] * good), n_good),
            "logps/rejected": (jnp.sum(sums["logps"][:, 0] * bad), n_bad),
            "logits/chosen": (jnp.sum(sums["mean_logits"][:, 0] * good),
                              jnp.sum(sums["tokens"][:, 0] * good)),
            "logits/rejected": (jnp.sum(sums["mean_logits"][:, 0] * bad),
                                jnp.sum(sums["tokens"][:, 0] * bad)),
        }
        return jnp.sum(losses), metrics

    @staticmethod
    def _logit_metrics(sums) -> dict[str, tuple[jax.Array, jax.Array]]:
        """logits/chosen, logits/rejected: the vocabulary-mean logit over the completion
        tokens of each side, token-weighted over the batch (TRL's DPOTrainer)."""
        return {"logits/chosen": (jnp.sum(sums["mean_logits"][:, 0]),
                                  jnp.sum(sums["tokens"][:, 0])),
                "logits/rejected": (jnp.sum(sums["mean_logits"][:, 1]),
                                    jnp.sum(sums["tokens"][:, 1]))}

