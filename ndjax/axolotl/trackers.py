"""Axolotl's experiment trackers as ndjax's log.wandb_* and log.mlflow_* settings.

As in Axolotl, W&B is on when wandb_project is set (use_wandb follows it), and MLflow
when use_mlflow or mlflow_experiment_name is; each field read but left off is listed as
not mapped with the reason."""

from __future__ import annotations

from typing import Any

from ndjax.axolotl.fields import Fields, Out, refusal
from ndjax.config import WANDB_MODES as LOG_WANDB_MODES

# W&B's modes: Axolotl sets $WANDB_MODE to one, and log.wandb_mode takes the same ('':
# W&B's default, which is no Axolotl value). Other values W&B refuses (a run id with a
# '/') fail ndjax's checks of the converted file.
WANDB_MODES = tuple(m for m in LOG_WANDB_MODES if m)
WANDB_FIELDS = {"wandb_entity": "log.wandb_entity", "wandb_name": "log.wandb_name",
                "wandb_run_id": "log.wandb_run_id", "wandb_mode": "log.wandb_mode"}
# Where Axolotl's MLflow goes without mlflow_tracking_uri (and $MLFLOW_TRACKING_URI):
# MLflow's directory in the working directory.
MLFLOW_DEFAULT_URI = "./mlruns"


def trackers(f: Fields, out: Out) -> None:
    """Maps the W&B and MLflow fields."""
    _wandb(f, out)
    _mlflow(f, out)


def _text(f: Fields, key: str) -> Any:
    """A string field; unset or '' (off in Axolotl) is None."""
    return None if f.value(key) in (None, "") else f.text(key, None)


def _skip_set(f: Fields, out: Out, keys: tuple[str, ...], reason: str) -> None:
    for key in keys:
        if f.value(key) not in (None, "", False):
            out.skip(key, f.raw[key], reason)


def _wandb(f: Fields, out: Out) -> None:
    project = _text(f, "wandb_project")
    if project is None:
        _skip_set(f, out, ("use_wandb", *WANDB_FIELDS), "W&B is off: Axolotl turns it on "
                  "with wandb_project")
        return
    use = f.flag("use_wandb", None)
    out.set("log.wandb_project", project, "wandb_project" + (
        f" (Axolotl turns W&B on with it, use_wandb: {str(use).lower()} or not)"
        if use is not None else ""))
    for key, path in WANDB_FIELDS.items():
        value = _text(f, key)
        if value is None:
            continue
        if key == "wandb_mode" and value not in WANDB_MODES:
            out.problem(refusal(key, value, "online, offline or disabled", "; W&B knows no "
                                "other mode"))
        else:
            out.set(path, value, key)


def _mlflow(f: Fields, out: Out) -> None:
    use = f.flag("use_mlflow", None)
    experiment = _text(f, "mlflow_experiment_name")
    if not use and experiment is None:
        _skip_set(f, out, ("mlflow_tracking_uri", "mlflow_run_name"), "MLflow is off: "
                  "Axolotl turns it on with use_mlflow or mlflow_experiment_name")
        return
    why = "use_mlflow" if use else "mlflow_experiment_name"
    uri = _text(f, "mlflow_tracking_uri")
    out.set("log.mlflow_tracking_uri", uri or MLFLOW_DEFAULT_URI,
            f"mlflow_tracking_uri ({why})" if uri else
            f"{why}, mlflow_tracking_uri unset: MLflow's default directory (where "
            "$MLFLOW_TRACKING_URI is set, Axolotl logs there: set this to it)")
    if experiment is not None:
        out.set("log.mlflow_experiment", experiment, "mlflow_experiment_name")
    name = _text(f, "mlflow_run_name")
    if name is not None:
        out.set("log.mlflow_run_name", name, "mlflow_run_name")
