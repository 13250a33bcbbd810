"""The training loop: data in, metrics out."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from ndjax import hf, summary
from ndjax.checkpoint import Checkpointer, Preemption
from ndjax.data.loader import dropped_overlong, make_loader
from ndjax.experiment import Experiment
from ndjax.flops import flops_per_token, peak_tflops
from ndjax.sinks import Sinks
from ndjax.train_step import Batch


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and train.on_nan is 'stop'."""


def _eval_batches(exp: Experiment) -> list[Batch]:
    """The first train.eval_steps batches of the validation split, on device. The same
    batches every time, so evaluations are comparable."""
    config = exp.config
    with make_loader(config, exp.model_cfg.vocab_size, "eval", rows=exp.local_rows,
                     prefetch=0) as held_out:
        return [exp.device_batch(held_out.batch(i)) for i in range(config.train.eval_steps)]


def evaluate(exp: Experiment, params: Any, batches: Sequence[Batch]) -> dict[str, float]:
    """Token-weighted mean loss over ``batches`` (the validation split) and its perplexity."""
    outs = jax.device_get([exp.compiled_eval(params, b) for b in batches])
    tokens = sum(float(o["tokens"]) for o in outs)
    loss = sum(float(o["loss"]) * float(o["tokens"]) for o in outs) / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "eval_tokens": tokens}


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


class StepLog:
    """Per-step metrics: checks each step's finiteness, times it, writes a record
    every ``log.every`` steps.

    A step's metrics are read only when the next step has been dispatched
    (``push`` holds one step back), so the host waits for step i-1 while step i
    runs and logging never leaves the device idle.
    """

    def __init__(self, exp: Experiment, sinks: Sinks, data_counts: dict[str, int]):
        config, t = exp.config, exp.config.train
        self.sinks, self.data_counts = sinks, data_counts
        self.on_nan, self.every, self.steps = t.on_nan, config.log.every, t.steps
        self.devices = exp.mesh.devices.size
        self.tokens_per_step = t.batch_size * t.seq_len
        self.flops_per_step = flops_per_token(exp.model_cfg, t.seq_len) * self.tokens_per_step
        self.peak = peak_tflops(exp.mesh.devices.flat[0].device_kind, config.log.peak_tflops)
        self.records: list[dict[str, Any]] = []
        self.pending: tuple[int, dict[str, Any]] | None = None
        self.last_good = self.skipped = 0
        self.restart_clock()

    def restart_clock(self) -> None:
        """The next step_time counts from now (e.g. not the evaluation before it)."""
        self.last_time = time.perf_counter()

    def push(self, step: int, metrics: dict[str, Any]) -> None:
        """This step's (not yet read) metrics; reads and logs the previous step's."""
        self.flush()
        self.pending = (step, metrics)

    def flush(self) -> None:
        """Reads and logs the held-back step, if any (before a save or an evaluation,
        so that a NaN stops the run before it is saved and records stay in order)."""
        if self.pending is not None:
            step, metrics = self.pending
            self.pending = None
            self._log(step, metrics)

    def write_eval(self, record: dict[str, Any]) -> None:
        self.sinks.write_eval(record)
        self.records.append(record)
        self.restart_clock()

    def _log(self, step: int, metrics: dict[str, Any]) -> None:
        values = {k: np.asarray(v).item() for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        elapsed, self.last_time = now - self.last_time, now
        if values.pop("finite"):
            self.last_good = step
        elif self.on_nan == "stop":
            raise NonFiniteError(
                f"loss {values['loss']} / grad norm {values['grad_norm']} at step {step} "
                f"(last good step {self.last_good}); nothing was saved. Lower train.lr or "
                "train.clip_norm, or set train.on_nan=skip to drop such updates.")
        else:
            self.skipped += 1
            self.sinks.message(f"step {step}: non-finite loss or gradient, update skipped")
        if step % self.every and step != self.steps:
            return
        tflops = self.flops_per_step / elapsed / self.devices / 1e12
        record = {"step": step, **values, "step_time": elapsed,
                  "tokens_per_sec": self.tokens_per_step / elapsed,
                  "tokens_per_sec_per_device": self.tokens_per_step / elapsed / self.devices,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                  "skipped_steps": self.skipped, **self.data_counts, **device_memory()}
        self.sinks.write(record)
        self.records.append(record)


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
    started = time.perf_counter()
    exp = Experiment.from_config(config, devices)  # every check before any compile
    t = config.train
    is_main = jax.process_index() == 0
    # This process reads and tokenizes its share now, before anything compiles
    # or is written, so bad data fails fast; a thread then prepares batches
    # (already on the devices) ahead of the steps.
    # Whatever was opened (the loader's thread, the checkpoint manager's threads,
    # event files) is closed on every way out, a ConfigError from checkpoint.resume
    # included: a thread left running at interpreter shutdown prints a traceback
    # after the one-line error.
    with contextlib.ExitStack() as cleanup:
        data = make_loader(config, exp.model_cfg.vocab_size, rows=exp.local_rows,
                           transform=exp.device_batch)
        cleanup.callback(data.close)
        # Chat conversations too long for a row (data.overlong), over all processes;
        # known once the shares are read, logged with every step.
        data_counts = ({"data/dropped_overlong": dropped_overlong(data)}
                       if config.data.source == "chat" else {})
        eval_batches = _eval_batches(exp) if t.eval_every else []
        os.makedirs(workdir, exist_ok=True)
        checkpointer = Checkpointer(workdir, config.checkpoint)
        cleanup.callback(checkpointer.close)
        resume_step = checkpointer.step_to_restore()
        if resume_step is not None:
            state, data_state = checkpointer.restore(resume_step, exp.abstract_state)
            data.set_state(data_state)  # the next batch is the one after the saved step
            first_step = data_state["rows"] // t.batch_size + 1
            dropped = checkpointer.drop_newer_than(resume_step)
        else:
            state, first_step = exp.init_state(), 1
        if is_main:
            with open(os.path.join(workdir, "config.json"), "w") as f:
                f.write(config.to_json_best_effort(indent=2))
            _keep_metrics_until(os.path.join(workdir, "metrics.jsonl"), first_step - 1)

        sinks = Sinks(workdir, t.steps, enabled=is_main, tensorboard=config.log.tensorboard,
                      verbose=verbose, append=resume_step is not None)
        cleanup.callback(sinks.close)
        for line in summary.startup(exp, workdir, resume_step):
            sinks.message(line)
        if data_counts.get("data/dropped_overlong"):
            sinks.message(f"data: left out {data_counts['data/dropped_overlong']} conversations "
                          f"longer than train.seq_len + 1 = {t.seq_len + 1} tokens "
                          f"(data.overlong={config.data.overlong})")

        # No steps left (steps=0: import -> export, or a finished run): nothing to compile.
        step_fn = None
        if first_step <= t.steps:
            compile_start = time.perf_counter()
            step_fn = exp.compiled_step
            if t.eval_every:
                exp.compiled_eval  # noqa: B018 -- compile now, not inside the first timed step
            sinks.message(summary.compiled(exp, time.perf_counter() - compile_start))

        profiler = Profiler(config.log.profile_steps, os.path.join(workdir, "profile"))
        if resume_step is not None:
            replaced = f"; removed newer checkpoints {dropped}, this run replaces them"
            sinks.message(f"resumed from checkpoint step {resume_step}"
                          + (replaced if dropped else ""))

        log = StepLog(exp, sinks, data_counts)
        every = config.checkpoint.every
        preemption = Preemption()
        cleanup.callback(preemption.close)
        saved = resume_step
        for step in range(first_step, t.steps + 1):
            waited = time.perf_counter()
            batch = next(data)  # already on device, in the batch sharding
            waited = time.perf_counter() - waited  # how long this step waited for its data
            profiler.before(step)
            state, metrics = step_fn(state, batch)
            profiler.after(step, metrics)
            log.push(step, {**metrics, "data_wait": waited})
            if t.eval_every and step % t.eval_every == 0:
                log.flush()
                log.write_eval({"step": step, **evaluate(exp, state.params, eval_batches)})
            stop = preemption.should_stop(step)
            if stop or step == t.steps or (every and step % every == 0):
                log.flush()
                checkpointer.save(step, state, data.get_state())
                saved = step
            if stop:
                checkpointer.wait()
                sinks.message(f"SIGTERM: saved checkpoint step {step} in "
                              f"{checkpointer.directory}; exiting")
                break
        log.flush()
        # A preempted run exports when it is resumed and finishes.
        if config.export.hf_dir and not preemption.requested:
            hf.export(state.params, exp.model_cfg, config.export.hf_dir, config.export.dtype,
                      source=exp.checkpoint,
                      shard_bytes=hf.shard_size(config.export.max_shard_size))
            sinks.message(f"exported Hugging Face checkpoint to {config.export.hf_dir}")
        checkpointer.wait()  # the path printed below is complete
        for line in summary.end(
                log.records, time.perf_counter() - started, workdir,
                None if saved is None else os.path.join(checkpointer.directory, str(saved)),
                config.export.hf_dir if config.export.hf_dir and not preemption.requested
                else None):
            sinks.message(line)
        return log.records
