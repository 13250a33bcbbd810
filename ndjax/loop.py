"""The training loop: data in, metrics out."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from ndjax.data.loader import make_loader
from ndjax.experiment import Experiment
from ndjax.train_step import Batch


class MetricsWriter:
    """Appends one JSON object per logged step to ``<workdir>/metrics.jsonl``."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "w")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _eval_batches(exp: Experiment) -> list[Batch]:
    """The first train.eval_steps batches of the validation split, on device. The same
    batches every time, so evaluations are comparable."""
    config = exp.config
    with make_loader(config, exp.model_cfg.vocab_size, "eval", prefetch=0) as held_out:
        return [exp.device_batch(held_out.batch(i)) for i in range(config.train.eval_steps)]


def evaluate(exp: Experiment, params: Any, batches: Sequence[Batch]) -> dict[str, float]:
    """Token-weighted mean loss over ``batches`` (the validation split) and its perplexity."""
    outs = jax.device_get([exp.compiled_eval(params, b) for b in batches])
    tokens = sum(float(o["tokens"]) for o in outs)
    loss = sum(float(o["loss"]) * float(o["tokens"]) for o in outs) / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "eval_tokens": tokens}


def train(config: ml_collections.ConfigDict, workdir: str,
          devices: Sequence[jax.Device] | None = None, verbose: bool = True
          ) -> list[dict[str, Any]]:
    """Builds the experiment from ``config``, trains, returns the logged metrics."""
    exp = Experiment.from_config(config, devices)  # every check before any compile
    t = config.train
    # This process reads and tokenizes its share now, before anything compiles
    # or is written, so bad data fails fast; a thread then prepares batches
    # ahead of the steps.
    data = make_loader(config, exp.model_cfg.vocab_size, transform=exp.device_batch)
    try:
        eval_batches = _eval_batches(exp) if t.eval_every else []
    except BaseException:
        data.close()
        raise
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    state = exp.init_state()
    step_fn = exp.compiled_step
    if t.eval_every:
        exp.compiled_eval  # noqa: B018 -- compile now, not inside the first timed step
    tokens_per_step = t.batch_size * t.seq_len

    writer = MetricsWriter(os.path.join(workdir, "metrics.jsonl"))
    logged: list[dict[str, Any]] = []
    last_time = time.perf_counter()
    pending = None

    def flush(item):
        nonlocal last_time
        step, metrics = item
        values = jax.device_get(metrics)  # waits for that step only
        now = time.perf_counter()
        elapsed, last_time = now - last_time, now
        if step % config.log.every and step != t.steps:
            return
        record = {"step": step, **{k: float(np.asarray(v)) for k, v in values.items()},
                  "step_time": elapsed, "tokens_per_sec": tokens_per_step / elapsed}
        writer.write(record)
        logged.append(record)
        if verbose:
            print(f"step {step}/{t.steps}  loss {record['loss']:.4f}  "
                  f"grad_norm {record['grad_norm']:.3f}  lr {record['lr']:.2e}  "
                  f"{record['tokens_per_sec']:.0f} tok/s", flush=True)

    try:
        for step in range(1, t.steps + 1):
            waited = time.perf_counter()
            batch = next(data)  # already on device, in the batch sharding
            waited = time.perf_counter() - waited  # how long this step waited for its data
            state, metrics = step_fn(state, batch)
            metrics = {**metrics, "data_wait": waited}
            # Read the previous step's metrics only now, after this step has
            # been dispatched, so the host never stalls the device.
            if pending is not None:
                flush(pending)
            pending = (step, metrics)
            if t.eval_every and step % t.eval_every == 0:
                flush(pending)  # keep metrics.jsonl in step order
                pending = None
                record = {"step": step, **evaluate(exp, state.params, eval_batches)}
                writer.write(record)
                logged.append(record)
                last_time = time.perf_counter()  # the next step_time excludes the evaluation
                if verbose:
                    print(f"step {step}/{t.steps}  eval loss {record['eval_loss']:.4f}  "
                          f"perplexity {record['eval_perplexity']:.2f}", flush=True)
        if pending is not None:
            flush(pending)
    finally:
        data.close()
        writer.close()
    return logged
