"""The training loop: data in, metrics, checkpoints and exports out.

``train`` builds the experiment and a ``Trainer`` with the hooks the config asks
for (ndjax.training.hooks: non-finite checks, logging, evaluation, profiling, SIGTERM and Ctrl-C,
checkpoints, export); the trainer only runs steps and calls its hooks.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import ml_collections

from ndjax.config import Settings
from ndjax.data.loader import data_tokenizer, dropped_overlong, open_loader
from ndjax.experiment import Experiment, Inputs
from ndjax.planning import auto as auto_layout
from ndjax.runs import hf
from ndjax.runs import workdir as workdir_lib
from ndjax.runs.checkpoint import Checkpointer, check_resume
from ndjax.runs.lock import claim
from ndjax.step.state import TrainState
from ndjax.step.train_step import Batch
from ndjax.training import grpo as grpo_lib
from ndjax.training import hooks as hooks_lib
from ndjax.training import sinks as sinks_lib
from ndjax.training import stop_signals, summary, trackers
from ndjax.training.hooks import NonFiniteError  # noqa: F401 -- train.py and tests catch it from here
from ndjax.training.sinks import Sinks


class Trainer:
    """Runs the compiled step from ``first_step`` to ``last_step`` on batches from
    ``data``, calling ``hooks`` around each step (see ndjax.training.hooks.Hook; what they see of
    the trainer is ndjax.training.hooks.TrainerView).

    Metrics stay on the device until a step is due for reading, every
    ``read_every`` steps (train.py: log.every) and at the last one; then every step
    since the last reading is read at once and delivered to the hooks in order, so
    the host waits for the device once per ``read_every`` steps, not once per step
    (a NaN check still sees every step and names the first bad one). A due step is
    read when the next step has been dispatched, so the device is never idle while
    the host reads. ``flush`` reads everything pending now.
    """

    def __init__(self, exp: Experiment, state: TrainState, data: Iterator[Batch], *,
                 checkpointer: Checkpointer, sinks: Any, hooks: Sequence[hooks_lib.Hook],
                 first_step: int, last_step: int, saved: int | None = None,
                 read_every: int = 1):
        self.exp, self.state, self.data = exp, state, data
        self.checkpointer, self.sinks, self.hooks = checkpointer, sinks, list(hooks)
        self.first_step, self.last_step = first_step, last_step
        self.read_every = read_every
        self.records: list[dict[str, Any]] = []
        self.saved = saved                 # the newest checkpoint's step
        self.exported: str | None = None   # where the export went
        self.stop_reason = ""              # set by stop(): the run ends after this step
        self._pending: list[tuple[int, dict[str, Any]]] = []  # dispatched, not yet read
        self.restart_clock()

    def stop(self, reason: str) -> None:
        """Ends the run after the current step (its hooks still run)."""
        self.stop_reason = reason

    def restart_clock(self) -> None:
        """The next step_time counts from now (e.g. not an evaluation before it)."""
        self._clock = time.perf_counter()

    def _push(self, step: int, metrics: dict[str, Any]) -> None:
        if self._pending and hooks_lib.due(self.read_every, self._pending[-1][0]):
            self.flush()
        self._pending.append((step, metrics))

    def flush(self) -> None:
        """Reads every pending step's metrics (one wait for the device) and delivers
        them to the hooks in step order: when a step is due, and before a save or an
        evaluation, so that a NaN stops the run before it is saved and records stay
        in step order. Each step's step_time is the mean over the steps read."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        values = hooks_lib.host_values_of([metrics for _, metrics in pending])
        now = time.perf_counter()
        each, self._clock = (now - self._clock) / len(pending), now
        for (step, _), step_values in zip(pending, values):
            step_values["step_time"] = each
            for hook in self.hooks:
                hook.on_metrics(self, step, step_values)

    def fit(self, step_fn: Any) -> list[dict[str, Any]]:
        for hook in self.hooks:
            hook.start(self)
        for step in range(self.first_step, self.last_step + 1):
            waited = time.perf_counter()
            batch = next(self.data)  # already on device, in the batch sharding
            waited = time.perf_counter() - waited  # how long this step waited for its data
            for hook in self.hooks:
                hook.before_step(self, step)
            self.state, metrics = step_fn(self.state, batch)
            self._push(step, {**metrics, "data_wait": waited})
            for hook in self.hooks:
                hook.after_step(self, step, metrics)
            if self.stop_reason:
                break
        self.flush()
        for hook in self.hooks:
            hook.end(self)
        return self.records


def _eval_batches(exp: Experiment) -> list[Batch]:
    """The first train.eval_steps batches of the validation split, on device. The same
    batches every time, so evaluations are comparable."""
    with open_loader(exp.data, "eval", rows=exp.local_rows, prefetch=0,
                     max_runs=exp.max_runs) as held_out:
        return [exp.device_batch(held_out.batch(i))
                for i in range(exp.settings.train.eval_steps)]


def default_hooks(exp: Experiment, workdir: str, data_counts: dict[str, int],
                  source: hf.Checkpoint | None, extra: Sequence[hooks_lib.Hook] = (),
                  epoch_after: Callable[[int], float | None] | None = None
                  ) -> list[hooks_lib.Hook]:
    """What train.py runs, in order: a NaN is caught before anything logs or saves
    the step; ``extra`` hooks, SIGTERM and Ctrl-C may stop the run before the checkpoint
    hook decides whether to save. ``epoch_after``: the data loader's epochs after a step."""
    s = exp.settings
    hooks: list[hooks_lib.Hook] = [
        hooks_lib.NonFinite(s.train.on_nan),
        hooks_lib.Log(s.log.every, s.train.steps, data_counts,
                      (s.train.batch_size, s.train.seq_len), s.log.peak_tflops, epoch_after),
        hooks_lib.Profile(s.log.profile_steps, os.path.join(workdir, "profile")),
    ]
    if s.train.eval_every:
        hooks.append(hooks_lib.Evaluate(s.train.eval_every, _eval_batches(exp)))
    if s.log.sample_every:
        # The data's tokenizer (checked with it), or for synthetic data data.tokenizer's.
        tokenizer = exp.data.tokenizer or data_tokenizer(s.data)
        hooks.append(hooks_lib.Sample(exp, s.log.sample_every, s.log.sample_prompt,
                                      s.log.sample_tokens, os.path.join(workdir, "samples.jsonl"),
                                      tokenizer, s.train.seq_len))
    hooks += [*extra, hooks_lib.StopOnSignal(),
              hooks_lib.Checkpoint(s.checkpoint.every, s.train.steps)]
    if s.export.hf_dir or s.export.adapter_dir:
        # The run's tokenizer: its ids and files describe what the weights learned.
        hooks.append(hooks_lib.Export(s.export.hf_dir, s.export.dtype,
                                      hf.shard_size(s.export.max_shard_size), source,
                                      adapter_dir=s.export.adapter_dir,
                                      base=s.model.init_from,
                                      tokenizer=hf.run_tokenizer(s.data)))
    return hooks


def _overlong(s: Settings) -> str:
    """What data.overlong left out, by the data's kind (the count goes before it)."""
    d, room = s.data, s.train.seq_len + 1
    if d.format == "prompt":
        return (f"prompts longer than the prompt budget, train.seq_len - "
                f"grpo.max_completion_length = {s.train.seq_len - s.grpo.max_completion_length}"
                " tokens")
    what = {"preference": "preference pairs", "unpaired_preference": "KTO examples"}.get(
        d.format)
    if what:
        return (f"{what} longer than train.seq_len + 1 = {room} tokens with their second "
                f"sequence (data.overlong={d.overlong})")
    return (f"conversations longer than train.seq_len + 1 = {room} tokens "
            f"(data.overlong={d.overlong})")


def _warn(line: str) -> None:
    # Something was wrong and was handled: a warning, one line in train.py
    # (ndjax.runtime.console.one_line_warnings), a UserWarning for a program calling train().
    warnings.warn(line, stacklevel=2)


def _silent(line: str) -> None:
    pass


def _keep_metrics_until(path: str, step: int) -> None:
    """On resume, drop records of steps after the restored one: they are redone. A line
    that is not a record (torn by a crash or a full disk mid-write) is dropped with a
    warning: metrics are for people, and never stop a resume."""
    if not os.path.exists(path):
        return
    records = sinks_lib.read_records(path)
    with open(path, "w") as f:
        f.writelines(line for record, line in records if record["step"] <= step)


def train(config: ml_collections.ConfigDict, workdir: str,
          devices: Sequence[jax.Device] | None = None, verbose: bool = True,
          extra_hooks: Sequence[hooks_lib.Hook] = ()) -> list[dict[str, Any]]:
    """Builds the experiment from ``config``, trains, returns the logged metrics.
    ``extra_hooks`` join the default ones (``default_hooks``).

    Resumes from ``<workdir>/checkpoints`` as ``checkpoint.resume`` says; on
    SIGTERM, saves after the current step and returns early; on Ctrl-C, saves after
    the current step and raises ``stop_signals.Interrupted`` (a KeyboardInterrupt).
    """
    started = time.perf_counter()
    as_given = Settings.parse(config)
    trackers.check_installed(as_given.log)  # W&B or MLflow on and not installed: one line
    # mesh.auto: the planner's best layout for these devices, recorded as the run's config.
    auto_note = None
    if as_given.mesh.auto:
        config, auto_note = auto_layout.resolve(config, devices)
        as_given = Settings.parse(config)
    # A run resumed from its checkpoints needs nothing outside its workdir: the model
    # it trains is the one it saved, whatever became of model.init_from, and its
    # tokenizer and chat template are the copies it made of data.tokenizer's files.
    exp = Experiment.from_config(workdir_lib.for_resume(config, workdir), devices)
    s = exp.settings
    is_main = jax.process_index() == 0
    # Whatever is opened (the loader's thread, the checkpoint manager's threads, event
    # files, signal handlers) is closed on every way out, a ConfigError included: a
    # thread left running at interpreter shutdown prints a traceback after the
    # one-line error. The workdir's lock goes last, once everything that writes there
    # (checkpoint saves in flight, event files, a profile) is done: ``held`` unwinds
    # after ``cleanup``.
    with contextlib.ExitStack() as held, contextlib.ExitStack() as cleanup:
        # This process reads and tokenizes the corpus now, before anything compiles
        # or is written, so bad data fails fast; a thread then prepares batches
        # (already on the devices) ahead of the steps.
        grpo = s.train.objective == "grpo"
        # GRPO's data is the step's prompts, all of them on every process (each samples
        # the whole step's completions: one SPMD program), on the host.
        data = open_loader(exp.data, rows=(0, exp.data.batches.batch_size) if grpo
                           else exp.local_rows, transform=None if grpo else exp.device_batch,
                           max_runs=exp.max_runs)
        cleanup.callback(data.close)
        epoch_note = None
        if s.train.epochs:
            # A length in epochs is known once the data is packed: the experiment is built
            # again on its steps (nothing has compiled; the inputs are not checked twice).
            rows = data.rows_per_epoch()
            exp = Experiment.from_config(s.in_steps(rows), devices,
                                         inputs=Inputs(exp.checkpoint, exp.data))
            s = exp.settings
            epoch_note = (f"data: an epoch is {rows} rows; train.epochs={s.train.epochs:g} is "
                          f"{s.train.steps} steps of {s.train.batch_size} rows")
        # Chat conversations too long for a row (data.overlong), over all processes;
        # known once the shares are read, logged with every step.
        data_counts = ({"data/dropped_overlong": dropped_overlong(data)}
                       if s.data.source == "chat" else {})
        # The hooks too (the validation batches, a sample prompt's length) before
        # anything is written.
        source = exp.checkpoint or workdir_lib.source(workdir)
        hooks = default_hooks(exp, workdir, data_counts, source, extra_hooks, data.epoch_after)
        for hook in hooks:
            cleanup.callback(hook.close)
        check_resume(workdir, s.checkpoint)  # nothing is created for a step not there
        # Before anything is written there: an unwritable workdir, or one another run
        # holds, is one line (and no run deletes another's checkpoint in flight).
        lock = claim(workdir)
        if lock is not None:
            held.callback(lock.release)
        checkpointer = Checkpointer(workdir, s.checkpoint)
        cleanup.callback(checkpointer.close)
        resumed = checkpointer.resume(exp.abstract_saved_state,
                                      warn=_warn if is_main else _silent)
        resume_step = None if resumed is None else resumed[0]
        if resumed is not None:
            resume_step, state, data_state = resumed
            # Checkpoints hold the layers in order; the state, in the layout's.
            state = exp.in_storage_order(state.replace(params=exp.with_base(state.params)))
            data.set_state(data_state)  # the next batch is the one after the saved step
            first_step = data_state["rows"] // exp.data.batches.batch_size + 1
            # Moved aside, not deleted, until this run has saved: a crash before then
            # loses nothing.
            superseded = checkpointer.supersede_newer_than(resume_step)
        else:
            state, first_step = exp.init_state(), 1
        if is_main:
            workdir_lib.record(workdir, as_given, exp.model_cfg, data=s.data)
            _keep_metrics_until(os.path.join(workdir, "metrics.jsonl"), first_step - 1)

        # Its exit ends the trackers' runs (W&B, MLflow) as this run ends, an error included.
        sinks = cleanup.enter_context(Sinks(
            workdir, s.train.steps, enabled=is_main, tensorboard=s.log.tensorboard,
            verbose=verbose, append=resume_step is not None, settings=s))
        for line in summary.startup(exp, workdir, resume_step):
            sinks.message(line)
        if auto_note:
            sinks.message(auto_note)
        if epoch_note:
            sinks.message(epoch_note)
        if data_counts.get("data/dropped_overlong"):
            sinks.message(f"data: left out {data_counts['data/dropped_overlong']} "
                          + _overlong(s))

        # No steps left (steps=0: import -> export, or a finished run): nothing to compile.
        step_fn = None
        if first_step <= s.train.steps:
            compile_start = time.perf_counter()
            # Only the train step: the eval step compiles at the first evaluation, if
            # the run gets there (its time is outside every step_time: Evaluate
            # restarts the clock), so a run stopped early, or a short trial, never
            # waits for it.
            # A preference objective's reference model, where the step is given it: step
            # 0's trainable parameters (copied before the first step donates them).
            reference = exp.held_reference(state if resume_step is None else None)
            step_fn = (grpo_lib.step_fn(exp, data.source, reference) if grpo
                       else exp.step_fn(reference))
            sinks.message(summary.compiled(exp, time.perf_counter() - compile_start))
        if resume_step is not None:
            replaced = (f"; moved newer checkpoints {superseded} aside as <step>.superseded in "
                        f"{checkpointer.directory}: this run replaces them, and deletes them "
                        "once it has saved a checkpoint")
            sinks.message(f"resumed from checkpoint step {resume_step}"
                          + (replaced if superseded else ""))

        trainer = Trainer(exp, state, data, checkpointer=checkpointer, sinks=sinks, hooks=hooks,
                          first_step=first_step, last_step=s.train.steps, saved=resume_step,
                          read_every=s.log.every)
        records = trainer.fit(step_fn)
        for line in summary.end(
                records, time.perf_counter() - started, workdir,
                None if trainer.saved is None
                else os.path.join(checkpointer.directory, str(trainer.saved)),
                trainer.exported):
            sinks.message(line)
        if trainer.stop_reason == stop_signals.CTRL_C:
            raise stop_signals.Interrupted
        return records
