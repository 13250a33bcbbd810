"""The loop's periodic work, one small unit each: a ``Hook`` is called around every
step by ``ndjax.training.loop.Trainer`` and does its work when it is due.

A hook reads and changes the run only through the trainer it is given, as
``TrainerView`` describes it (its experiment, state, sinks, records, checkpointer,
``flush`` and ``stop``), so adding one (``Sample``, which prints a completion every N
steps) touches no other. This module knows the trainer only by that protocol: the
loop imports the hooks, never the other way round.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import numpy as np

from ndjax.hardware.flops import flops_per_token, peak_tflops
from ndjax.runtime.errors import ConfigError
from ndjax.training.stop_signals import StopSignals

if TYPE_CHECKING:
    from ndjax.experiment import Experiment
    from ndjax.runs.checkpoint import Checkpointer
    from ndjax.step.state import TrainState
    from ndjax.step.train_step import Batch
    from ndjax.training.sinks import Sinks


class TrainerView(Protocol):
    """What a hook may read and change of the run (``ndjax.training.loop.Trainer`` is one)."""

    exp: Experiment
    state: TrainState
    data: Any  # the batch iterator; get_state() is its position, saved with a checkpoint
    sinks: Sinks
    checkpointer: Checkpointer
    records: list[dict[str, Any]]  # what the run returns: metrics and eval records
    saved: int | None              # the newest checkpoint's step
    exported: str | None           # where the export went
    stop_reason: str               # set by stop(): the run ends after this step

    def flush(self) -> None:
        """Delivers every step's metrics read so far to the hooks, in step order."""

    def stop(self, reason: str) -> None:
        """Ends the run after the current step."""

    def restart_clock(self) -> None:
        """The next step_time counts from now."""


class NonFiniteError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and train.on_nan is 'stop'."""


def due(every: int, step: int) -> bool:
    """Every ``every`` steps; 0 never."""
    return bool(every) and step % every == 0


class Hook:
    """Called by the trainer, in the order of its hooks. Every method is optional.

    ``on_metrics`` gets a finished step's metrics as host values, always in step
    order, when the trainer reads them: every ``read_every`` steps (log.every), once
    the step after the due one has been dispatched (so reading never leaves the
    device idle); ``flush`` on the trainer delivers every held-back step now.
    """

    def start(self, trainer: TrainerView) -> None:
        """Before the first step (after the state is restored or initialised)."""

    def before_step(self, trainer: TrainerView, step: int) -> None:
        """With the step's batch ready, before the step is dispatched."""

    def after_step(self, trainer: TrainerView, step: int, outputs: Any) -> None:
        """After the step is dispatched; ``outputs``: its metrics, still on device."""

    def on_metrics(self, trainer: TrainerView, step: int, values: dict[str, Any]) -> None:
        """A finished step's metrics; a hook may add to ``values`` for those after it."""

    def end(self, trainer: TrainerView) -> None:
        """After the last step (or a stop), before the run's summary."""

    def close(self) -> None:
        """On every way out, an exception included."""


class NonFinite(Hook):
    """A NaN/Inf loss or gradient norm: stop (train.on_nan=stop; nothing is saved,
    since this runs before any later save of that step) or count the skipped update."""

    def __init__(self, on_nan: str):
        self.on_nan = on_nan
        self.last_good = self.skipped = 0

    def on_metrics(self, trainer: TrainerView, step: int, values: dict[str, Any]) -> None:
        if values.pop("finite"):
            self.last_good = step
        elif self.on_nan == "stop":
            raise NonFiniteError(
                f"loss {values['loss']} / grad norm {values['grad_norm']} at step {step} "
                f"(last good step {self.last_good}); nothing was saved. Lower train.lr or "
                "train.clip_norm, or set train.on_nan=skip to drop such updates.")
        else:
            self.skipped += 1
            trainer.sinks.message(f"step {step}: non-finite loss or gradient, update skipped")
        values["skipped_steps"] = self.skipped


def device_memory() -> dict[str, int | None]:
    """Bytes in use / peak on this process's first device, where the backend says."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {"mem_in_use_bytes": stats.get("bytes_in_use"),
            "mem_peak_bytes": stats.get("peak_bytes_in_use")}


class Log(Hook):
    """A metrics record every ``every`` steps (and the last): the step's values, its
    time, throughput, TFLOP/s and MFU (6 x parameters + attention FLOPs per token,
    ndjax.hardware.flops, over the device's peak), data counts and device memory."""

    # Below this share of real tokens in a batch, the run is told once (most of each step
    # computes padding).
    MOSTLY_PADDING = 0.5

    def __init__(self, every: int, last_step: int, data_counts: dict[str, int],
                 batch: tuple[int, int] = (0, 0), peak: float | None = None,
                 epoch_after: Callable[[int], float | None] | None = None):
        """``batch``: (train.batch_size, train.seq_len); ``peak``: log.peak_tflops (None:
        the device's from ndjax.hardware.flops' table); ``epoch_after``: the corpus's
        epochs done after a step (the loader's), logged as data/epoch."""
        self.every, self.last_step, self.data_counts = every, last_step, data_counts
        self.batch, self.peak_setting, self.epoch_after = batch, peak, epoch_after
        self.told_padding = False

    def start(self, trainer: TrainerView) -> None:
        exp, (batch_size, seq_len) = trainer.exp, self.batch
        self.devices = exp.mesh.devices.size
        self.tokens_per_step = batch_size * seq_len
        self.flops_per_step = flops_per_token(exp.model_cfg, seq_len) * self.tokens_per_step
        self.peak = peak_tflops(exp.mesh.devices.flat[0].device_kind, self.peak_setting)

    def on_metrics(self, trainer: TrainerView, step: int, values: dict[str, Any]) -> None:
        if not due(self.every, step) and step != self.last_step:
            return
        elapsed = values.pop("step_time")
        tflops = self.flops_per_step / elapsed / self.devices / 1e12
        record = {"step": step, **values, "step_time": elapsed,
                  "tokens_per_sec": self.tokens_per_step / elapsed,
                  "tokens_per_sec_per_device": self.tokens_per_step / elapsed / self.devices,
                  "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None,
                  "skipped_steps": values.get("skipped_steps", 0), **self.data_counts,
                  **device_memory()}
        epoch = None if self.epoch_after is None else self.epoch_after(step)
        if epoch is not None:
            record["data/epoch"] = epoch
        fill = record.get("data/fill")
        if fill is not None and fill < self.MOSTLY_PADDING and not self.told_padding:
            self.told_padding = True
            trainer.sinks.message(
                f"data: step {step}'s batch is {100 * fill:.0f}% tokens and "
                f"{100 - 100 * fill:.0f}% padding: pack short documents (data.packing=true), "
                "or use a smaller train.seq_len or batch_size.")
        trainer.sinks.write(record)
        trainer.records.append(record)


def evaluate(exp: Any, params: Any, batches: Sequence[Batch]) -> dict[str, float]:
    """Token-weighted mean loss over ``batches`` (the validation split) and its perplexity."""
    outs = jax.device_get([exp.compiled_eval(params, b) for b in batches])
    tokens = sum(float(o["tokens"]) for o in outs)
    loss = sum(float(o["loss"]) * float(o["tokens"]) for o in outs) / max(tokens, 1.0)
    return {"eval_loss": loss, "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "eval_tokens": tokens}


class Evaluate(Hook):
    """The loss on the validation split (the same batches every time) every ``every`` steps."""

    def __init__(self, every: int, batches: Sequence[Batch]):
        self.every, self.batches = every, batches

    def after_step(self, trainer: TrainerView, step: int, outputs: Any) -> None:
        if not due(self.every, step):
            return
        trainer.flush()  # records stay in step order
        record = {"step": step, **evaluate(trainer.exp, trainer.state.params, self.batches)}
        trainer.sinks.write_eval(record)
        trainer.records.append(record)
        trainer.restart_clock()  # the next step's time excludes the evaluation


class Profile(Hook):
    """A jax.profiler trace of steps first..last (1-based, inclusive)."""

    def __init__(self, steps: Sequence[int], logdir: str):
        self.first, self.last = (tuple(steps) or (0, -1))
        self.logdir = logdir
        self.tracing = False

    def before_step(self, trainer: TrainerView, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.logdir)
            self.tracing = True

    def after_step(self, trainer: TrainerView, step: int, outputs: Any) -> None:
        if step == self.last:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()


class StopOnSignal(Hook):
    """SIGTERM (SLURM, Kubernetes, spot VMs) or Ctrl-C stops the run after the current
    step, or with several processes after the step they agree on, the first that the
    furthest of them has not gone past (ndjax.training.stop_signals); the checkpoint hook
    after this one saves it. A second signal exits at once."""

    def __init__(self):
        self.signals = StopSignals()

    def after_step(self, trainer: TrainerView, step: int, outputs: Any) -> None:
        reason = self.signals.should_stop(step)
        if reason:
            trainer.stop(reason)

    def close(self) -> None:
        self.signals.close()


class Checkpoint(Hook):
    """Saves every ``every`` steps, at the last step and when the run stops early."""

    def __init__(self, every: int, last_step: int):
        self.every, self.last_step = every, last_step

    def after_step(self, trainer: TrainerView, step: int, outputs: Any) -> None:
        if not (trainer.stop_reason or step == self.last_step or due(self.every, step)):
            return
        trainer.flush()  # a NaN stops the run before the state is saved
        trainer.checkpointer.save(step, trainer.exp.saved(trainer.state),
                                  trainer.data.get_state())
        trainer.saved = step
        if trainer.stop_reason:
            trainer.checkpointer.wait()
            trainer.sinks.message(f"{trainer.stop_reason}: saved checkpoint step {step} in "
                                  f"{trainer.checkpointer.directory}; exiting")

    def end(self, trainer: TrainerView) -> None:
        trainer.checkpointer.wait()  # the path the summary prints is complete


class Export(Hook):
    """At the end, the parameters as a Hugging Face directory (export.hf_dir; under LoRA
    with the adapters merged) and a LoRA's adapters in PEFT's format (export.adapter_dir,
    for the base ``base`` names). A run stopped early exports when it is resumed and
    finishes."""

    def __init__(self, hf_dir: str | None, dtype: str, shard_bytes: int, source: Any,
                 adapter_dir: str | None = None, base: str | None = None, **kw: Any):
        self.hf_dir, self.dtype, self.shard_bytes, self.source = hf_dir, dtype, shard_bytes, source
        self.adapter_dir, self.base, self.kw = adapter_dir, base, kw

    def end(self, trainer: TrainerView) -> None:
        if trainer.stop_reason:
            return
        from ndjax.runs import hf
        params = trainer.exp.in_layer_order(trainer.state.params)
        if self.adapter_dir:
            hf.export_adapter(params, trainer.exp.model_cfg, self.adapter_dir, self.base)
            trainer.sinks.message(f"exported LoRA adapters (PEFT) to {self.adapter_dir}")
        if self.hf_dir:
            hf.export(params, trainer.exp.model_cfg, self.hf_dir, self.dtype,
                      source=self.source, shard_bytes=self.shard_bytes, **self.kw)
            trainer.sinks.message(f"exported Hugging Face checkpoint to {self.hf_dir}")
        trainer.exported = self.hf_dir or self.adapter_dir


class Sample(Hook):
    """Every ``every`` steps, the greedy completion of ``prompt`` from the current
    parameters (ndjax.models.sampling on the training mesh), printed and appended to
    ``path`` (JSON Lines: step, prompt, completion). The prompt is tokenized as the
    training data was (no BOS) and checked against train.seq_len when the hook is
    made, before anything compiles; the decode programs compile at the first sample."""

    def __init__(self, exp: Any, every: int, prompt: str, max_new_tokens: int, path: str,
                 tokenizer: Any, seq_len: int):
        """``exp``: the model and its layout; ``tokenizer``: the training data's;
        ``seq_len``: train.seq_len."""
        from ndjax.models.sampling import Generator
        self.every, self.prompt, self.path = every, prompt, path
        self.tokenizer = tokenizer
        self.ids = self.tokenizer.encode(prompt)
        graphdef, cfg = exp.layer_order_model  # after_step passes the layers in order
        self.generator = Generator(
            graphdef, None, cfg, exp.rules, max_new_tokens=max_new_tokens,
            max_len=seq_len, eos_ids=(self.tokenizer.eos_id,),
            pad_id=self.tokenizer.pad_id, max_len_what="train.seq_len")
        if len(self.ids) + max_new_tokens > seq_len:
            raise ConfigError(
                f"log.sample_prompt has {len(self.ids)} tokens; with log.sample_tokens="
                f"{max_new_tokens} that is {len(self.ids) + max_new_tokens}, more than "
                f"train.seq_len={seq_len}, the longest sequence the model trains on. "
                "Shorten the prompt or lower log.sample_tokens.")

    def after_step(self, trainer: TrainerView, step: int, outputs: Any) -> None:
        if not due(self.every, step):
            return
        trainer.flush()
        self.generator.params = trainer.exp.in_layer_order(trainer.state.params)
        new = self.generator.generate([self.ids])[0]
        eos = self.tokenizer.eos_id
        text = self.tokenizer.decode([i for i in new if i != eos])
        if jax.process_index() == 0:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": step, "prompt": self.prompt, "completion": text,
                                    "tokens": new}) + "\n")
        trainer.sinks.message(f"step {step} sample: {self.prompt!r} -> {text!r}")
        trainer.restart_clock()  # the next step's time excludes the sampling


def host_values_of(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Several steps' metrics as Python scalars, in one ``device_get``: one wait for
    the newest of them, their copies started together."""
    return [{k: np.asarray(v).item() for k, v in step.items()}
            for step in jax.device_get(list(steps))]
