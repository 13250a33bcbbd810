"""W&B and MLflow runs get what metrics.jsonl gets: real offline runs (W&B's offline
mode, MLflow's file store in tmp_path), read back and compared with metrics.jsonl
exactly; a resume continues the same runs; bad values are one line; a tracker that
fails warns once and training goes on. Nothing goes to the network."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
import warnings

import jax
import pytest
from conftest import tiny_config
from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2

from ndjax.config import Settings
from ndjax.runtime.errors import ConfigError
from ndjax.training import trackers
from ndjax.training.loop import train
from ndjax.training.sinks import Sinks

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off",
           "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true",
           "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true",
           "MLFLOW_ALLOW_FILE_STORE": "true"}


@pytest.fixture(scope="module", autouse=True)
def offline():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in OFFLINE.items():
            mp.setenv(key, value)
        for key in ("WANDB_DIR", "WANDB_RUN_ID", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
            mp.delenv(key, raising=False)
        yield


def tracked_config(tmp, steps):
    c = tiny_config(train=dict(steps=steps, eval_every=2, eval_steps=1))
    c.log.tensorboard = False
    c.log.wandb_project, c.log.wandb_mode, c.log.wandb_name = "ndjax-test", "offline", "tiny"
    c.log.mlflow_tracking_uri = f"file:{tmp / 'mlruns'}"
    c.log.mlflow_experiment, c.log.mlflow_run_name = "tiny", "tiny-run"
    return c


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Two steps, then a resume to three: the workdir, and each run's metrics.jsonl."""
    tmp = tmp_path_factory.mktemp("tracked")
    workdir = str(tmp / "run")
    train(tracked_config(tmp, 2), workdir, jax.devices()[:1], verbose=False)
    first = read_jsonl(workdir)
    train(tracked_config(tmp, 3), workdir, jax.devices()[:1], verbose=False)
    return tmp, workdir, first, read_jsonl(workdir)


def read_jsonl(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_ids(workdir):
    with open(os.path.join(workdir, trackers.RUN_IDS)) as f:
        return json.load(f)


def expected(records):
    """{(step, key): value} of every number in metrics.jsonl's records."""
    return {(r["step"], k): v for r in records for k, v in trackers.numbers(r).items()}


def wandb_records(path):
    """The records of W&B's transaction log (a .wandb file): a 7-byte header, then
    LevelDB-log chunks (crc32 u32, length u16, kind u8) in 32 KiB blocks."""
    with open(path, "rb") as f:
        data, pos, parts = f.read(), 7, b""
    assert data[:4] == b":W&B", data[:7]
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header: padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _finished(path):
    return any(r.WhichOneof("record_type") == "exit" for r in wandb_records(path))


def wandb_logged(workdir, run_id, wait_s=60):
    """What the offline W&B run files of ``run_id`` hold: ({(step, key): value}, the
    config of each file, the number of files). W&B's service process writes them; a
    finished run's file ends with its exit record, waited for up to ``wait_s`` (once, a
    loaded machine read a file that held no history yet)."""
    pattern = os.path.join(workdir, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")
    deadline = time.monotonic() + wait_s
    while not ((files := sorted(glob.glob(pattern))) and all(map(_finished, files))) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    logged, configs = {}, []
    for path in files:
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                logged.update({(record.history.step.num, k): v for k, v in items.items()
                               if not k.startswith("_")})
            elif record.WhichOneof("record_type") == "run":
                configs.append({u.key: json.loads(u.value_json)
                                for u in record.run.config.update})
    return logged, configs, len(files)


def test_wandb_run_has_every_record_and_the_config_and_a_resume_continues_it(resumed_run):
    _, workdir, first, records = resumed_run
    run_id = run_ids(workdir)["wandb"]
    logged, configs, files = wandb_logged(workdir, run_id)
    assert files == 2  # the first run and its resume: one W&B run id
    assert logged == expected(records)  # loss, eval_loss, ... at each step, exactly
    assert sorted(step for step, key in logged if key == "loss") == [1, 2, 3]
    assert {r["step"] for r in records if "eval_loss" in r} == {2}
    assert any(r.get("mfu", 0) is None for r in records)  # a null is left out, as asserted
    for config in configs:
        assert config["train.lr"] == 0.01 and config["log.wandb_project"] == "ndjax-test"
        assert config["model.dim"] == 64
    assert [c["train.steps"] for c in configs] == [2, 3]
    assert first == records[:len(first)]


def test_mlflow_run_has_every_record_and_a_resume_continues_it(resumed_run):
    tmp, workdir, _, records = resumed_run
    client = MlflowClient(tracking_uri=f"file:{tmp / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.run_id == run_ids(workdir)["mlflow"]
    assert (run.info.run_name, run.info.status) == ("tiny-run", "FINISHED")
    logged = {(m.step, key): m.value for key in run.data.metrics
              for m in client.get_metric_history(run.info.run_id, key)}
    assert logged == expected(records)
    assert sorted(step for step, key in logged if key == "loss") == [1, 2, 3]
    assert all(len(client.get_metric_history(run.info.run_id, key)) == len(records) - 1
               for key in ("loss", "grad_norm"))  # each step once (one record is the eval)
    # The first run's parameters stay (MLflow changes none): train.steps of the first.
    assert run.data.params["train.steps"] == "2" and run.data.params["train.lr"] == "0.01"


def test_a_new_run_in_the_workdir_starts_new_tracker_runs(tmp_path):
    settings = Settings.parse(tracked_config(tmp_path, 2))
    ids = []
    for _ in range(2):
        with Sinks(str(tmp_path), 2, verbose=False, tensorboard=False, settings=settings) as s:
            s.write({"step": 1, "loss": 1.5, "mfu": None, "grad": float("nan")})
        ids.append(run_ids(tmp_path))
    assert ids[0]["wandb"] != ids[1]["wandb"] and ids[0]["mlflow"] != ids[1]["mlflow"]
    logged, _, _ = wandb_logged(str(tmp_path), ids[1]["wandb"])
    assert logged == {(1, "loss"): 1.5}  # None and NaN left out


def test_an_error_ends_the_runs_as_failed_and_other_processes_track_nothing(tmp_path):
    settings = Settings.parse(tracked_config(tmp_path, 2))
    with Sinks(str(tmp_path / "other"), 2, enabled=False, settings=settings):
        pass
    assert not os.path.exists(tmp_path / "other")
    with pytest.raises(RuntimeError, match="boom"):
        with Sinks(str(tmp_path), 2, verbose=False, tensorboard=False, settings=settings):
            raise RuntimeError("boom")
    run_id = run_ids(tmp_path)["mlflow"]
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    assert client.get_run(run_id).info.status == "FAILED"


class Failing:
    name = "Broken"

    def __init__(self):
        self.calls = 0

    def log(self, step, values):
        self.calls += 1
        raise ConnectionError("server\ndown")

    def finish(self, outcome):
        raise AssertionError("a dropped tracker is not finished")


def test_a_tracker_that_fails_warns_once_and_is_dropped():
    broken = Failing()
    group = trackers.Trackers([broken])
    with pytest.warns(UserWarning) as caught:
        group.log({"step": 1, "loss": 2.0})
        group.log({"step": 2, "loss": 1.0})
        group.finish()
    assert broken.calls == 1 and len(caught) == 1
    assert str(caught[0].message) == (
        "Broken: logging failed (ConnectionError: server down); training goes on without "
        "Broken, and metrics.jsonl has every record")


def test_a_tracker_that_cannot_start_warns_and_the_run_goes_on(tmp_path):
    (tmp_path / "a-file").write_text("")
    c = tiny_config()
    c.log.mlflow_tracking_uri = str(tmp_path / "a-file" / "mlruns")  # not a directory
    with pytest.warns(UserWarning, match=r"^MLflow: starting the run failed \(.*training goes "
                      "on without MLflow"):
        started = trackers.start(Settings.parse(c), str(tmp_path), resumed=False)
    assert started.trackers == []


@pytest.mark.parametrize("field, value, message", [
    ("wandb_mode", "dryrun", "log.wandb_mode='dryrun': choose one of ('', 'online', "
     "'offline', 'disabled') ('': W&B's default, $WANDB_MODE or online)."),
    ("wandb_run_id", "team/run", "log.wandb_run_id='team/run': a W&B run id has no spaces at "
     "either end and none of \":;,#?/'\"; e.g. --config.log.wandb_run_id=llama-sft-1."),
    ("mlflow_tracking_uri", 5, "log.mlflow_tracking_uri=5 must be a string."),
])
def test_bad_values_are_one_line(field, value, message):
    config = tiny_config().to_dict()
    config["log"][field] = value
    with pytest.raises(ConfigError) as e:
        Settings.parse(config)
    assert str(e.value) == message


@pytest.mark.parametrize("field, value, module, package", [
    ("wandb_project", "p", "wandb", "wandb"),
    ("mlflow_tracking_uri", "./mlruns", "mlflow", "mlflow-skinny")])
def test_a_tracker_not_installed_is_one_line_before_anything_is_built(
        monkeypatch, tmp_path, field, value, module, package):
    real = trackers.importlib.util.find_spec
    monkeypatch.setattr(trackers.importlib.util, "find_spec",
                        lambda name: None if name in ("wandb", "mlflow") else real(name))
    c = tiny_config()
    c.log[field] = value
    with pytest.raises(ConfigError) as e, warnings.catch_warnings():
        warnings.simplefilter("error")
        train(c, str(tmp_path / "run"), verbose=False)
    assert str(e.value) == (f"log.{field}={value!r} needs the {module} package: pip install "
                            f"{package}, or set log.{field}=''.")
    assert not os.path.exists(tmp_path / "run")  # nothing written
