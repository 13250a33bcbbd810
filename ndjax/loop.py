"""The training loop: data in, metrics out."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from ndjax.data.synthetic import SyntheticSource
from ndjax.experiment import Experiment
from ndjax.flops import flops_per_token, peak_tflops
from ndjax.sinks import Sinks


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and train.on_nan is 'stop'."""


def _host_rows(batch_size: int) -> tuple[int, int]:
    """This process's slice of the global batch rows."""
    per_process = batch_size // jax.process_count()
    return jax.process_index() * per_process, per_process


def device_memory() -> dict[str, int | None]:
    """Bytes in use / peak on this process's first device, where the backend says."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"mem_in_use_bytes": stats.get("bytes_in_use"),
            "mem_peak_bytes": stats.get("peak_bytes_in_use")}


class Profiler:
    """A jax.profiler trace of steps first..last (1-based, inclusive)."""

    def __init__(self, steps: Sequence[int], logdir: str):
        self.first, self.last = (tuple(steps) or (0, -1))
        self.logdir = logdir

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.logdir)

    def after(self, step: int, outputs: Any) -> None:
        if step == self.last:
            jax.block_until_ready(outputs)
            jax.profiler.stop_trace()


def train(config: ml_collections.ConfigDict, workdir: str,
          devices: Sequence[jax.Device] | None = None, verbose: bool = True
          ) -> list[dict[str, Any]]:
    """Builds the experiment from ``config``, trains, returns the logged metrics."""
    exp = Experiment.from_config(config, devices)  # every check before any compile
    t = config.train
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    source = SyntheticSource(exp.model_cfg.vocab_size, t.seq_len, t.seed)
    start, count = _host_rows(t.batch_size)
    state = exp.init_state()
    step_fn = exp.compiled_step

    num_devices = exp.mesh.devices.size
    tokens_per_step = t.batch_size * t.seq_len
    flops_per_step = flops_per_token(exp.model_cfg, t.seq_len) * tokens_per_step
    peak = peak_tflops(exp.mesh.devices.flat[0].device_kind, config.log.peak_tflops)
    profiler = Profiler(config.log.profile_steps, os.path.join(workdir, "profile"))
    sinks = Sinks(workdir, t.steps, enabled=is_main, tensorboard=config.log.tensorboard,
                  verbose=verbose)

    logged: list[dict[str, Any]] = []
    last_time = time.perf_counter()
    last_good, skipped = 0, 0

    def flush(step: int, metrics: dict[str, jax.Array]) -> None:
        nonlocal last_time, last_good, skipped
        values = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed, last_time = now - last_time, now
        if values.pop("finite"):
            last_good = step
        elif t.on_nan == "stop":
            raise NonFiniteError(
                f"loss {values['loss']} / grad norm {values['grad_norm']} at step {step} (last "
                f"good step {last_good}); nothing was saved. Lower train.lr or train.clip_norm, "
                "or set train.on_nan=skip to drop such updates.")
        else:
            skipped += 1
            sinks.message(f"step {step}: non-finite loss or gradient, update skipped")
        if step % config.log.every and step != t.steps:
            return
        tflops = flops_per_step / elapsed / num_devices / 1e12
        record = {"step": step, **values, "step_time": elapsed,
                  "tokens_per_sec": tokens_per_step / elapsed,
                  "tokens_per_sec_per_device": tokens_per_step / elapsed / num_devices,
                  "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
                  "skipped_steps": skipped, **device_memory()}
        sinks.write(record)
        logged.append(record)

    pending = None
    try:
        for step in range(1, t.steps + 1):
            batch = exp.device_batch(source.rows(step - 1, start, count))
            profiler.before(step)
            state, metrics = step_fn(state, batch)
            profiler.after(step, metrics)
            # Read the previous step's metrics only now, after this step has
            # been dispatched: the host waits for step-1 while step runs, so
            # logging never leaves the device idle.
            if pending is not None:
                flush(*pending)
            pending = (step, metrics)
        if pending is not None:
            flush(*pending)
    finally:
        sinks.close()
    return logged
