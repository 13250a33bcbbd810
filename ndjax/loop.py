"""The training loop: data in, metrics out."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from ndjax.data.synthetic import SyntheticSource
from ndjax.experiment import Experiment


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


def _host_rows(batch_size: int) -> tuple[int, int]:
    """This process's slice of the global batch rows."""
    per_process = batch_size // jax.process_count()
    return jax.process_index() * per_process, per_process


def train(config: ml_collections.ConfigDict, workdir: str,
          devices: Sequence[jax.Device] | None = None, verbose: bool = True
          ) -> list[dict[str, Any]]:
    """Builds the experiment from ``config``, trains, returns the logged metrics."""
    exp = Experiment.from_config(config, devices)  # every check before any compile
    t = config.train
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))

    source = SyntheticSource(exp.model_cfg.vocab_size, t.seq_len, t.seed)
    start, count = _host_rows(t.batch_size)
    state = exp.init_state()
    step_fn = exp.compiled_step
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
            batch = exp.device_batch(source.rows(step - 1, start, count))
            state, metrics = step_fn(state, batch)
            # Read the previous step's metrics only now, after this step has
            # been dispatched, so the host never stalls the device.
            if pending is not None:
                flush(pending)
            pending = (step, metrics)
        if pending is not None:
            flush(pending)
    finally:
        writer.close()
    return logged
