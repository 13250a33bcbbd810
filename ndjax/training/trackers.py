"""Experiment trackers: a Weights & Biases run and an MLflow run that get what
metrics.jsonl gets.

``start`` opens, on process 0, one tracker per tool the log section turns on
(log.wandb_project, log.mlflow_tracking_uri): the settings, flattened ("train.lr"), as
the run's config or parameters, then every metrics record at its step (its numbers;
a ``null`` of metrics.jsonl, a NaN or an Inf, is left out). A tracker that fails (a
server down, a full disk) warns once and is dropped: training goes on, and
metrics.jsonl has every record. A run resumed from its workdir's checkpoint continues
the same tracker runs, by the ids kept in ``<workdir>/trackers.json``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import time
import urllib.parse
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

from ndjax.config import LogSettings, Settings
from ndjax.runtime.errors import ConfigError

RUN_IDS = "trackers.json"  # in the workdir: {"wandb": run id, "mlflow": run id}
# The longest parameter value every MLflow server takes (newer ones take 6000).
MLFLOW_PARAM_CHARS = 500
MLFLOW_PARAMS_PER_CALL = 100
# How a run ended, as each tool records it.
WANDB_EXIT_CODES = {"success": 0, "failed": 1, "killed": 130}
MLFLOW_STATUSES = {"success": "FINISHED", "failed": "FAILED", "killed": "KILLED"}


def check_installed(log: LogSettings) -> None:
    """A ConfigError where a tracker is on and its package is not installed (before
    anything is read or compiled)."""
    for field, value, module, package in (
            ("wandb_project", log.wandb_project, "wandb", "wandb"),
            ("mlflow_tracking_uri", log.mlflow_tracking_uri, "mlflow", "mlflow-skinny")):
        if value and importlib.util.find_spec(module) is None:
            raise ConfigError(f"log.{field}={value!r} needs the {module} package: pip install "
                              f"{package}, or set log.{field}=''.")


def flat_settings(settings: Settings) -> dict[str, Any]:
    """Every setting by its dotted name ("train.lr", "model.lora.rank")."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for key, inner in value.items():
                walk(f"{prefix}{key}.", inner)
        else:
            out[prefix[:-1]] = value

    walk("", settings.to_dict())
    return out


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics record's finite numbers, without its step."""
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value)}


class Tracker(Protocol):
    name: str  # as warnings name it

    def log(self, step: int, values: dict[str, float]) -> None:
        """One record's numbers at its step."""

    def finish(self, outcome: str) -> None:
        """Ends the run: outcome is success, failed or killed."""


def _read_ids(workdir: str) -> dict[str, str]:
    try:
        with open(os.path.join(workdir, RUN_IDS)) as f:
            ids = json.load(f)
    except (OSError, ValueError):
        return {}
    return ids if isinstance(ids, dict) else {}


def _store_id(workdir: str, tool: str, run_id: str) -> None:
    ids = {**_read_ids(workdir), tool: run_id}
    tmp = os.path.join(workdir, RUN_IDS + ".tmp")
    with open(tmp, "w") as f:
        json.dump(ids, f)
    os.replace(tmp, os.path.join(workdir, RUN_IDS))


class WandbTracker:
    """A W&B run in log.wandb_project, its files under ``<workdir>/wandb`` (or $WANDB_DIR)."""

    name = "W&B"

    def __init__(self, log: LogSettings, workdir: str, config: dict[str, Any],
                 resume_id: str | None):
        import wandb

        run_id = log.wandb_run_id or resume_id
        self.run = wandb.init(
            project=log.wandb_project, entity=log.wandb_entity or None,
            name=log.wandb_name or None, mode=log.wandb_mode or None, id=run_id,
            resume="allow" if run_id else None, config=config,
            dir=os.environ.get("WANDB_DIR") or workdir,
            reinit="create_new")  # beside any run of the program that calls train()
        _store_id(workdir, "wandb", self.run.id)

    def log(self, step: int, values: dict[str, float]) -> None:
        # A resumed W&B run refuses steps below its last; those were logged before the
        # resume (redone from the checkpoint, bit for bit).
        if step >= self.run.step:
            self.run.log(values, step=step)

    def finish(self, outcome: str) -> None:
        self.run.finish(exit_code=WANDB_EXIT_CODES[outcome])


class MlflowTracker:
    """An MLflow run at log.mlflow_tracking_uri, in log.mlflow_experiment."""

    name = "MLflow"

    def __init__(self, log: LogSettings, workdir: str, config: dict[str, Any],
                 resume_id: str | None):
        uri = log.mlflow_tracking_uri
        if urllib.parse.urlparse(uri).scheme in ("", "file"):
            # A local directory: MLflow 3 refuses its file store unless asked for it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        run = self._resumed(resume_id)
        if run is None:
            run = self.client.create_run(self._experiment(log.mlflow_experiment),
                                         run_name=log.mlflow_run_name or None)
        self.run_id = run.info.run_id
        _store_id(workdir, "mlflow", self.run_id)
        # A resumed run keeps its parameters: MLflow refuses to change one.
        params = [Param(key, str(value)[:MLFLOW_PARAM_CHARS]) for key, value in config.items()
                  if key not in run.data.params]
        for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i:i + MLFLOW_PARAMS_PER_CALL])

    def _resumed(self, run_id: str | None) -> Any:
        if not run_id:
            return None
        try:
            run = self.client.get_run(run_id)
        except Exception:  # not in this store (another tracking URI): a new run
            return None
        self.client.update_run(run_id, status="RUNNING")
        return run

    def _experiment(self, name: str) -> str:
        if not name:
            from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID
            return DEFAULT_EXPERIMENT_ID
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found else self.client.create_experiment(name)

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(value), now, step)
                                                    for key, value in values.items()])

    def finish(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, MLFLOW_STATUSES[outcome])


def _warn(name: str, what: str, error: Exception) -> None:
    """The one warning of a tracker that failed (its error on one line)."""
    text = " ".join(str(error).split())[:300]
    warnings.warn(f"{name}: {what} failed ({type(error).__name__}: {text}); training goes on "
                  f"without {name}, and metrics.jsonl has every record", stacklevel=3)


class Trackers:
    """The trackers that started; one that fails warns once and is dropped."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def _guard(self, tracker: Tracker, what: str, error: Exception) -> None:
        self.trackers.remove(tracker)
        _warn(tracker.name, what, error)

    def log(self, record: Mapping[str, Any]) -> None:
        values = numbers(record)
        for tracker in list(self.trackers):
            try:
                tracker.log(record["step"], values)
            except Exception as e:
                self._guard(tracker, "logging", e)

    def finish(self, outcome: str = "success") -> None:
        for tracker in list(self.trackers):
            try:
                tracker.finish(outcome)
            except Exception as e:
                self._guard(tracker, "finishing the run", e)
        self.trackers = []


def start(settings: Settings, workdir: str, resumed: bool) -> Trackers:
    """The trackers the log section turns on, started (call on process 0 only).
    ``resumed``: the run restored a checkpoint of this workdir, so each tracker continues
    the run whose id the workdir keeps; otherwise each starts a new one."""
    log, started = settings.log, []
    ids = _read_ids(workdir) if resumed else {}
    config = flat_settings(settings)
    for on, tool, kind in ((log.wandb_project, "wandb", WandbTracker),
                           (log.mlflow_tracking_uri, "mlflow", MlflowTracker)):
        if not on:
            continue
        try:
            started.append(kind(log, workdir, config, ids.get(tool)))
        except Exception as e:
            _warn(kind.name, "starting the run", e)
    return Trackers(started)
