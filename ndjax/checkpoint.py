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
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp

from ndjax.config import CheckpointSettings
from ndjax.errors import ConfigError
from ndjax.state import TrainState


def _key_str(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                    for k in path)


class Checkpointer:
    def __init__(self, workdir: str, cfg: CheckpointSettings, read_only: bool = False):
        """``read_only``: for tools that read a run (export, generate), possibly while it
        trains: nothing is created or deleted, not even an interrupted save's temporary
        directory, which the run itself may still be writing."""
        self.cfg = cfg
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

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_to_restore(self) -> int | None:
        """The step ``checkpoint.resume`` asks for: auto = newest, never = none."""
        return requested_step(str(self.cfg.resume), self.steps(), self.directory)

    def drop_newer_than(self, step: int) -> list[int]:
        """Deletes checkpoints after ``step`` (resuming from an older one starts a
        new timeline; its saves will take those step numbers)."""
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            self.manager.delete(s)
        return newer

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
        the devices, so the next (donating) step can run while files are written."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self._finish_tmp_cleanup()
        self.manager.wait_until_finished()
        self.manager.close()

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
    read a run: ``ndjax.export``, ``ndjax.generate``)."""
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
