"""Checkpoints with orbax: async saves, exact resume, restore onto any mesh.

A checkpoint holds the whole TrainState (parameters, optimizer state, step)
and the data loader's position, under ``<workdir>/checkpoints/<step>/``. Every
process writes its own shards. Orbax writes into a temporary directory and
renames it when complete, so a save cut short (even by kill -9) is never
picked up by a restore.

Restoring targets the *current* experiment's shardings, so a checkpoint saved
on one layout (or device count) resumes on another.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from ndjax.config import CheckpointSettings
from ndjax.runs import checkpoint_faults as faults
from ndjax.runtime.errors import ConfigError
from ndjax.step.state import TrainState

# <step>.superseded, and .superseded.<n> for a step moved aside more than once.
_SUPERSEDED = re.compile(rf"\d+{re.escape(faults.SUPERSEDED_SUFFIX)}(\.\d+)?")


def _key_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


class Checkpointer:
    def __init__(self, workdir: str, cfg: CheckpointSettings, read_only: bool = False):
        """``read_only``: for tools that read a run (export, generate), possibly while it
        trains: nothing is created or deleted, not even an interrupted save's temporary
        directory, which the run itself may still be writing."""
        self.cfg, self.read_only = cfg, read_only
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep if cfg.keep > 0 else None,
            enable_async_checkpointing=cfg.async_save, create=not read_only,
            # (orbax's own read_only option logs three warnings; this reader never
            # saves or deletes, so not creating and not cleaning up is enough.)
            cleanup_tmp_directories=not read_only)
        # Handlers named up front so that a fresh process can read metadata
        # (for the model-mismatch check) before it restores anything.
        self.manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "data": ocp.JsonCheckpointHandler()})
        self._saving: int | None = None  # the step of the newest save started
        self._failed = False             # a SaveError was raised: close() adds nothing
        self._superseded_dropped = False  # _drop_superseded ran
        faults.quiet_failed_saves()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_to_restore(self) -> int | None:
        """The step ``checkpoint.resume`` asks for: auto = newest, never = none."""
        return requested_step(str(self.cfg.resume), self.steps(), self.directory)

    def supersede_newer_than(self, step: int) -> list[int]:
        """Moves the checkpoints after ``step`` aside to ``<step>.superseded`` (resuming
        from an older one starts a new timeline, whose saves take those step numbers):
        orbax no longer lists them, so a restart after a crash resumes this timeline,
        not the old one. They are deleted once this run has a complete checkpoint of
        its own (``wait``); until then they are recoverable by renaming them back."""
        newer = [s for s in self.steps() if s > step]
        # Newest first: a run killed in between leaves the old timeline's steps up to
        # some point, each of them whole.
        for s in reversed(newer):
            faults.move_aside(self.directory, s, faults.SUPERSEDED_SUFFIX)
        if newer:
            self.manager.reload()  # they are no steps of the manager's any more
        return newer

    def _drop_superseded(self) -> None:
        """Deletes the checkpoints moved aside by ``supersede_newer_than``, this run's
        and any left by an earlier run that stopped before it saved; called once a save
        of this run is complete. Process 0 only, as it alone renames."""
        if self._superseded_dropped or self.read_only:
            return
        self._superseded_dropped = True
        if jax.process_index() != 0:
            return
        for name in os.listdir(self.directory):
            if _SUPERSEDED.fullmatch(name):
                # A deletion cut short leaves the rest under the same name, which no
                # restore reads and the next run's first save deletes.
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def check_compatible(self, step: int, abstract_state: TrainState) -> None:
        """ConfigError naming the first array whose shape differs from the checkpoint's."""
        saved = {_key_str(p): tuple(m.shape) for p, m in
                 jax.tree_util.tree_flatten_with_path(self.manager.item_metadata(step)["state"])[0]}
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
            name = _key_str(path)
            if name not in saved:
                raise ConfigError(
                    f"checkpoint step {step} in {self.directory} has no {name!r}: it was written "
                    "by a different model or optimizer. Use another --workdir or "
                    "--config.checkpoint.resume=never.")
            if saved[name] != tuple(leaf.shape):
                raise ConfigError(
                    f"checkpoint step {step} has {name} of shape {saved[name]}, but this "
                    f"config's model needs {tuple(leaf.shape)}: the model dims differ from "
                    "the checkpoint's. Use the same model.* settings, another --workdir, or "
                    "--config.checkpoint.resume=never.")

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict]:
        self.check_compatible(step, abstract_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["data"])

    def _read(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict]:
        """Reads ``step`` completely (every array on its devices) or raises. Through the
        item handlers, not the manager, whose restore ends in a barrier of all
        processes: a process whose read failed would leave the others waiting there
        instead of agreeing with them (ndjax.runs.checkpoint_faults.all_read)."""
        self.check_compatible(step, abstract_state)
        path = epath.Path(self.directory) / str(step)
        state = ocp.StandardCheckpointHandler().restore(
            path / "state", args=ocp.args.StandardRestore(abstract_state))
        data = ocp.JsonCheckpointHandler().restore(path / "data", args=ocp.args.JsonRestore())
        return jax.block_until_ready(state), dict(data)

    def resume(self, abstract_state: TrainState, warn: Callable[[str], None]
               ) -> tuple[int, TrainState, dict] | None:
        """The (step, state, data position) ``checkpoint.resume`` asks for, or None.

        With resume=auto and on_unreadable=fallback, a checkpoint that does not read
        on some process is moved aside to ``<step>.unreadable`` (never deleted) and
        the next older one is tried; ``warn`` gets one line for each moved. An
        unreadable checkpoint named by resume=<step>, or any with on_unreadable=stop,
        is a one-line ConfigError. A model mismatch is a ConfigError, not unreadable.
        """
        first = self.step_to_restore()
        if first is None:
            return None
        explicit = str(self.cfg.resume) != "auto"
        moved: list[tuple[int, str, str]] = []
        for step in [first] if explicit else sorted(self.steps(), reverse=True):
            error, result = None, None
            try:
                result = self._read(step, abstract_state)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 -- any failure to read is "unreadable"
                error = faults.first_line(e)
            failed = faults.all_read(step, error)
            if not failed:
                assert result is not None
                for bad, why, where in moved:
                    warn(f"checkpoint step {bad} in {self.directory} does not read ({why}); "
                         f"moved it to {where} and resumed from step {step}.")
                return step, *result
            where = f" on process {failed[0][0]}" if jax.process_count() > 1 else ""
            why = f"{failed[0][1]}{where}"
            if explicit:
                raise ConfigError(
                    f"checkpoint.resume={step}: checkpoint step {step} in {self.directory} "
                    f"does not read ({why}). Resume from another step (there are "
                    f"{self.steps()}) or use checkpoint.resume=auto to fall back to the "
                    "newest one that reads.")
            if self.cfg.on_unreadable == "stop":
                raise ConfigError(
                    f"checkpoint step {step} in {self.directory} does not read ({why}); "
                    "checkpoint.on_unreadable=stop. Move it aside (mv "
                    f"{os.path.join(self.directory, str(step))} "
                    f"{os.path.join(self.directory, str(step))}{faults.QUARANTINE_SUFFIX}) or "
                    "set --config.checkpoint.on_unreadable=fallback to resume from the "
                    "newest one that reads.")
            moved.append((step, why, faults.move_aside(self.directory, step)))
            self.manager.reload()  # it is no step of the manager's any more
        raise ConfigError(
            f"no checkpoint in {self.directory} reads: moved "
            f"{', '.join(f'step {s} to {w}' for s, _, w in moved)} ({moved[0][1]}). "
            "Run again to start from scratch, or restore a copy of the checkpoints.")

    def restore_params(self, step: int, abstract_state: TrainState) -> Any:
        """Only the parameters (generation): the optimizer state stays on disk, so the
        devices hold the model and nothing more."""
        self.check_compatible(step, abstract_state)
        item = {"params": abstract_state.params}
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(
            sharding=s.sharding, dtype=s.dtype, global_shape=s.shape), item)
        # The "state" item of the step, as the manager lays it out.
        path = os.path.join(self.directory, str(step), "state")
        with ocp.PyTreeCheckpointer() as checkpointer:
            return checkpointer.restore(path, args=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True))["params"]

    def save(self, step: int, state: TrainState, data_state: dict[str, Any]) -> None:
        """Starts a save; with async on, it returns once the arrays are copied off
        the devices, so the next (donating) step can run while files are written.

        A save that fails raises SaveError: here (a synchronous save, or the previous
        async one, whose end orbax awaits before it starts the next) or at ``wait``.
        The run stops there; the checkpoints before it are intact (orbax only renames
        a save's temporary directory to its step once every file is written, and
        prunes old ones only after that).
        """
        self.wait()  # orbax's save waits for the previous one anyway; its error is its own
        self._saving = step
        try:
            self.manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)),
                force=True)
        except Exception as e:
            raise self._save_failed(step, e) from e

    def wait(self) -> None:
        """Waits for the save in flight; SaveError if it failed. Once a save of this run
        is complete, the checkpoints it supersedes are deleted."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(self._saving, e) from e
        if self._saving is not None:
            self._drop_superseded()

    def _save_failed(self, step: int | None, e: BaseException) -> faults.SaveError:
        self._failed = True
        complete = sorted(int(n) for n in os.listdir(self.directory) if n.isdigit())
        kept = (f"the checkpoints before it are intact (newest: step {complete[-1]}) and a "
                "rerun resumes from it" if complete else "there is no earlier checkpoint")
        return faults.SaveError(
            f"checkpoint step {step} could not be saved in {self.directory}: "
            f"{faults.os_error(e)}. Training stopped; {kept}. Free space (or raise the "
            "quota or file-size limit) and run again.")

    def close(self) -> None:
        """Waits for the save in flight (SaveError if it failed and was not reported
        yet: a failed save is never lost), then closes the manager."""
        self._finish_tmp_cleanup()
        reported = self._failed
        try:
            self.wait()
            self.manager.close()
        except Exception:
            if not reported:
                raise

    def _finish_tmp_cleanup(self) -> None:
        """Waits for orbax's deletion of interrupted saves' temporary directories.

        The manager starts it in a thread of its own when it is created and awaits it
        only before its first save, not in close(). A run that ends before saving (a
        refused checkpoint.resume, a model mismatch) would exit with the thread still
        running, and at interpreter shutdown it can no longer schedule its file
        operations: a RuntimeError traceback after the run's one-line error.
        """
        # Private API (orbax 0.12): there is no public way to await it. An orbax that
        # renames it makes this wait for nothing and brings the race back, which
        # tests/test_checkpoint.py::test_refused_resume_is_one_line_every_time catches.
        finish = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if finish is None:
            return
        try:
            finish()
        except Exception:  # noqa: BLE001 -- the next manager retries the cleanup
            # The error that ended the run (if any) is the one to report, not this one;
            # a failure that matters resurfaces at the next run's first save.
            pass


def requested_step(resume: str, steps: list[int], directory: str) -> int | None:
    """The step of ``checkpoint.resume`` among the complete ``steps`` of ``directory``:
    auto = the newest, never = none, a number = that one or a ConfigError."""
    if resume == "never":
        return None
    if resume == "auto":
        return steps[-1] if steps else None
    if not resume.isdigit():
        raise ConfigError(f"checkpoint.resume={resume!r}: use 'auto', 'never' or a step "
                          "number.")
    if int(resume) not in steps:
        raise ConfigError(f"checkpoint.resume={resume}: no complete checkpoint of that step "
                          f"in {directory}; there are {steps or 'none'}.")
    return int(resume)


def check_resume(workdir: str, cfg: CheckpointSettings) -> None:
    """Refuses a ``checkpoint.resume`` step that is not there before a checkpoint manager
    exists (creating one makes directories and starts cleanup threads). Orbax names a
    complete save by its bare step number, an interrupted one with a suffix."""
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    names = os.listdir(directory) if os.path.isdir(directory) else []
    requested_step(str(cfg.resume), sorted(int(n) for n in names if n.isdigit()), directory)


@contextlib.contextmanager
def saved_step(workdir: str, config: CheckpointSettings, step: int | None = None
               ) -> Iterator[tuple[Checkpointer, int]]:
    """The checkpoints of a train.py ``workdir`` (``config``: its checkpoint group) and
    the step to read: ``step``, or the newest if None. A one-line ConfigError naming
    ``--workdir`` or ``--step`` when there is no such checkpoint (for the CLIs that
    read a run: ``ndjax export``, ``ndjax generate``)."""
    if not os.path.isdir(os.path.join(workdir, "checkpoints")):
        raise ConfigError(f"--workdir={workdir!r} has no checkpoints; train.py saves one at the "
                          "end of a run and every checkpoint.every steps.")
    checkpointer = Checkpointer(workdir, config, read_only=True)
    try:
        steps = checkpointer.steps()
        if not steps:
            raise ConfigError(f"--workdir={workdir!r}: no complete checkpoint in "
                              f"{checkpointer.directory} (a save that was interrupted leaves "
                              "none); train on, or use another --workdir.")
        if step is not None and step not in steps:
            raise ConfigError(f"--step={step}: no complete checkpoint of that step in "
                              f"{checkpointer.directory}; there are {steps}.")
        yield checkpointer, steps[-1] if step is None else step
    finally:
        checkpointer.close()
