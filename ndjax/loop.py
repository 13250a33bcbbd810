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

from ndjax.checkpoint import Checkpointer, Preemption
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


def _keep_metrics_until(path: str, step: int) -> None:
    """On resume, drop records of steps after the restored one: they are redone."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(lines)


def train(config: ml_collections.ConfigDict, workdir: str,
          devices: Sequence[jax.Device] | None = None, verbose: bool = True
          ) -> list[dict[str, Any]]:
    """Builds the experiment from ``config``, trains, returns the logged metrics.

    Resumes from ``<workdir>/checkpoints`` as ``checkpoint.resume`` says; on
    SIGTERM, saves after the current step and returns early.
    """
    exp = Experiment.from_config(config, devices)  # every check before any compile
    t = config.train
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    checkpointer = Checkpointer(workdir, config.checkpoint)
    resume_step = checkpointer.step_to_restore()
    if resume_step is not None:
        state, data_state = checkpointer.restore(resume_step, exp.abstract_state)
        first_step = int(data_state["next_step"])
        dropped = checkpointer.drop_newer_than(resume_step)
    else:
        state, first_step = exp.init_state(), 1
    if is_main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))
        _keep_metrics_until(os.path.join(workdir, "metrics.jsonl"), first_step - 1)

    source = SyntheticSource(exp.model_cfg.vocab_size, t.seq_len, t.seed)
    start, count = _host_rows(t.batch_size)
    step_fn = exp.compiled_step

    num_devices = exp.mesh.devices.size
    tokens_per_step = t.batch_size * t.seq_len
    flops_per_step = flops_per_token(exp.model_cfg, t.seq_len) * tokens_per_step
    peak = peak_tflops(exp.mesh.devices.flat[0].device_kind, config.log.peak_tflops)
    profiler = Profiler(config.log.profile_steps, os.path.join(workdir, "profile"))
    sinks = Sinks(workdir, t.steps, enabled=is_main, tensorboard=config.log.tensorboard,
                  verbose=verbose, append=resume_step is not None)
    if resume_step is not None:
        sinks.message(f"resumed from checkpoint step {resume_step}" + (
            f"; removed newer checkpoints {dropped}, this run replaces them" if dropped else ""))

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

    every = config.checkpoint.every
    preemption = Preemption()
    pending = None
    try:
        for step in range(first_step, t.steps + 1):
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
            stop = preemption.requested
            if stop or step == t.steps or (every and step % every == 0):
                flush(*pending)  # a NaN stop must come before the save
                pending = None
                checkpointer.save(step, state, {"next_step": step + 1})
            if stop:
                checkpointer.wait()
                sinks.message(f"SIGTERM: saved checkpoint step {step} in "
                              f"{checkpointer.directory}; exiting")
                break
        if pending is not None:
            flush(*pending)
    finally:
        preemption.close()
        checkpointer.close()
        sinks.close()
    return logged
