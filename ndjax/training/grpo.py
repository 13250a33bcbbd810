"""GRPO's step: sample each prompt's group of completions with ndjax's own sampler, on the
training mesh and with the weights being trained (no copy to another engine), score
them with the configured reward functions, and take one optimizer step on them
(``ndjax.step.grpo``: TRL 1.16's GRPOTrainer loss).

Every process holds the step's prompts (``PromptRows``: train.batch_size /
num_generations a step), samples the same completions (one SPMD program over the mesh),
scores them all, and feeds the training rows its devices hold. A completion's draws
depend on the seed, the step and its place in the step (``sampling.Generator``), so a
step's rollouts are the same on any layout and after a resume.

Advantages are TRL's: the weighted sum of the rewards (a function's ``None`` counts as
missing), minus the group's mean, divided by the group's (or batch's) standard deviation
(Bessel-corrected) + 1e-4 unless ``grpo.scale_rewards=none``.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ndjax import rewards
from ndjax.models.sampling import Generator, Sampling

STD_EPS = 1e-4  # TRL's: advantages divided by std + 1e-4


def advantages(total: np.ndarray, group: int, scale: str) -> np.ndarray:
    """(n,) rewards (NaN: missing) -> (n,) advantages: minus the mean of each group of
    ``group`` consecutive completions, divided by the group's (``scale`` group) or the
    batch's (batch) Bessel-corrected standard deviation + 1e-4, or not (none); NaN -> 0."""
    by_group = total.reshape(-1, group)
    with _quiet():
        mean = np.nanmean(by_group, axis=1, keepdims=True)
        out = by_group - mean
        if scale == "group":
            out = out / (np.nanstd(by_group, axis=1, ddof=1, keepdims=True) + STD_EPS)
        elif scale == "batch":
            out = out / (np.nanstd(total, ddof=1) + STD_EPS)
    return np.nan_to_num(out.reshape(-1), nan=0.0).astype(np.float32)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """numpy's warnings about all-NaN groups, off: their advantages are 0 by design."""
    with np.errstate(all="ignore"), warnings.catch_warnings(action="ignore",
                                                            category=RuntimeWarning):
        yield


class Rollouts:
    """Samples, scores and lays out one step's completions as training rows."""

    def __init__(self, exp: Any, source: Any):
        s = exp.settings
        g, t = s.grpo, s.train
        self.source, self.g, self.seq_len = source, g, t.seq_len
        self.tok, self.prompt_field = exp.data.tokenizer, s.data.prompt_field
        self.fns = rewards.load(g.reward_funcs)
        self.names = [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(self.fns)]
        self.weights = np.asarray(g.reward_weights or [1.0] * len(self.fns), np.float32)
        self.generator = Generator(
            exp.graphdef, None, exp.model_cfg, exp.rules,
            max_new_tokens=g.max_completion_length, max_len=t.seq_len + 1,
            sampling=Sampling(g.temperature, g.top_p, g.top_k), eos_ids=[self.tok.eos_id],
            pad_id=self.tok.pad_id, seed=t.seed, max_len_what="train.seq_len + 1")
        self.base_key = jax.random.key(t.seed)

    def sample(self, params: Any, step: int, prompts: list[list[int]]) -> list[list[int]]:
        """Each prompt's completion (up to and including its end token), drawn with the
        keys of ``step``: the same for a step whatever the layout."""
        self.generator.params = params
        self.generator.key = jax.random.fold_in(self.base_key, step)
        return self.generator.generate(prompts)

    def __call__(self, params: Any, step: int, batch: dict[str, np.ndarray]
                 ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The step's training rows (every row, host arrays) and its rollout metrics."""
        started = time.perf_counter()
        g = self.g.num_generations
        ids = [row[:n].tolist() for row, n in zip(batch["prompt_ids"], batch["prompt_len"])]
        index = [int(i) for i in batch["index"]]
        prompts = [p for p in ids for _ in range(g)]
        completions = self.sample(params, step, prompts)
        sampled = time.perf_counter() - started
        raw = [p for p in self.source.prompts(index) for _ in range(g)]
        records = [r for r in self.source.records(index) for _ in range(g)]
        conversational = bool(raw) and not isinstance(raw[0], str)
        # TRL's: the completion's text without its special tokens.
        texts = [self.tok.decode(c, skip_special_tokens=True) for c in completions]
        shown = ([[{"role": "assistant", "content": x}] for x in texts] if conversational
                 else texts)
        per_fn = rewards.call(self.fns, raw, shown, completions, records,
                              prompt_field=self.prompt_field)
        with _quiet():
            total = np.where(np.isnan(per_fn).all(axis=1), np.nan,
                             np.nansum(per_fn * self.weights, axis=1))
        adv = advantages(total, g, self.g.scale_rewards)
        rows = self.rows(prompts, completions, adv)
        lengths = np.array([len(c) for c in completions], np.float32)
        truncated = np.array([self.tok.eos_id not in c for c in completions])
        with _quiet():
            metrics = {
                "reward": float(np.nanmean(total)),
                "reward_std": float(np.nanmean(np.nanstd(total.reshape(-1, g), axis=1,
                                                         ddof=1))),
                "frac_reward_zero_std": float(np.mean(np.nanstd(
                    total.reshape(-1, g), axis=1) == 0)),
                "completions/mean_length": float(lengths.mean()),
                "completions/clipped_ratio": float(truncated.mean()),
                "rollout_time": time.perf_counter() - started,
                "rollout_tokens_per_sec": float(lengths.sum() / max(sampled, 1e-9)),
                **{f"rewards/{name}/mean": float(np.nanmean(per_fn[:, k]))
                   for k, name in enumerate(self.names)},
            }
        return rows, metrics

    def rows(self, prompts: list[list[int]], completions: list[list[int]], adv: np.ndarray
             ) -> dict[str, np.ndarray]:
        """One row per completion: prompt + completion, the completion's tokens learned
        (none of a truncated one under ``mask_truncated_completions``), its advantage on
        every position."""
        n, width = len(prompts), self.seq_len + 1
        tokens = np.full((n, width), self.tok.pad_id, np.int32)
        real = np.zeros((n, width), np.int32)
        learned = np.zeros((n, width), np.int32)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            seq = (p + c)[:width]
            tokens[i, :len(seq)], real[i, :len(seq)] = seq, 1
            skip = self.g.mask_truncated_completions and self.tok.eos_id not in c
            learned[i, len(p):len(seq)] = 0 if skip else 1
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
                "positions": np.where(real[:, :-1] > 0, np.arange(width - 1), 0).astype(np.int32),
                "segment_ids": real[:, :-1], "loss_mask": learned[:, 1:],
                "advantages": np.repeat(adv[:, None], width - 1, axis=1)}


def step_fn(exp: Any, source: Any, reference: Any = None
            ) -> Callable[[Any, dict[str, np.ndarray]], tuple[Any, dict[str, Any]]]:
    """(state, the step's prompts) -> (state, metrics): rollouts with the state's
    weights, then the compiled train step on them.

    With grpo.num_iterations = mu > 1 a batch of rollouts serves mu steps: it is sampled
    at the first (state.step a multiple of mu; the loader hands the same prompts to all
    mu), with the sampling policy's log-probabilities, and kept for the others. A run
    resumed inside such a group samples the group's rollouts again (the same draws,
    the weights then)."""
    rollouts = Rollouts(exp, source)
    train = exp.step_fn(reference)
    start, count = exp.local_rows
    mu = exp.settings.grpo.num_iterations
    kept: dict[str, Any] = {}

    def step(state: Any, prompts: dict[str, np.ndarray]) -> tuple[Any, dict[str, Any]]:
        at = int(state.step)
        group = at // mu
        if kept.get("group") != group:
            rows, metrics = rollouts(state.params, group * mu, prompts)
            batch = exp.device_batch({k: v[start:start + count] for k, v in rows.items()})
            if mu > 1:
                batch["old_logps"] = exp.compiled_token_logps(state.params, batch)
            kept.update(group=group, batch=batch, metrics=metrics)
            metrics = dict(metrics)
        else:  # the group's rollouts again: their metrics, no sampling time
            metrics = {**kept["metrics"], "rollout_time": 0.0}
        state, step_metrics = train(state, kept["batch"])
        return state, {**step_metrics, **metrics}

    return step
