"""Metrics, TensorBoard, plots, profiles and the NaN guard."""

import functools
import json
import os
import struct
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from conftest import tiny_config
from helpers import host_batches, run_steps

from ndjax.experiment import Experiment
from ndjax.step.state import make_optimizer
from ndjax.step.train_step import loss_and_grads
from ndjax.training.loop import NonFiniteError, train
from ndjax.verbs.plot import plot

FIELDS = {"step": int, "loss": float, "grad_norm": float, "lr": float, "tokens": float,
          "step_time": float, "tokens_per_sec": float, "tokens_per_sec_per_device": float,
          "tflops_per_device": float, "skipped_steps": int}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    config = tiny_config(mesh=dict(fsdp=4, tensor=2))
    config.log.profile_steps = (2, 3)
    config.log.peak_tflops = 0.5  # a CPU has no known peak; this one is made up for the test
    train(config, workdir, verbose=False)
    return workdir


def read_jsonl(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_metrics_fields_and_types(run_dir):
    records = read_jsonl(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key, kind in FIELDS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["mfu"] == pytest.approx(r["tflops_per_device"] / 0.5)
        assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_sec_per_device"] * 8)
        assert "mem_in_use_bytes" in r and "mem_peak_bytes" in r
    assert json.load(open(os.path.join(run_dir, "config.json")))["mesh"]["fsdp"] == 4


def tfrecords(path):
    """Minimal TFRecord reader: (length u64, crc u32, data, crc u32) records."""
    with open(path, "rb") as f:
        data = f.read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        yield data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4


def test_tensorboard_events_read_back(run_dir):
    from tensorboardX.proto import event_pb2

    tb = os.path.join(run_dir, "tb")
    (name,) = os.listdir(tb)
    scalars = {}
    for record in tfrecords(os.path.join(tb, name)):
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    losses = {r["step"]: r["loss"] for r in read_jsonl(run_dir)}
    assert scalars["loss"] == pytest.approx(losses)
    assert set(scalars) >= {"grad_norm", "lr", "tokens_per_sec", "tflops_per_device"}


def test_tensorboard_sink_leaves_pytorch_unimported(tmp_path):
    """tensorboardX's writer imports torch where it is installed (here: the test extra),
    ~1.6 s before a run's first step (issue 33, defect 8); the sink writes the same
    events without it, and the process can still import torch afterwards."""
    code = ("import sys\n"
            "from ndjax.training.sinks import Sinks\n"
            f"sinks = Sinks({str(tmp_path)!r}, 1, verbose=False)\n"
            "sinks.write({'step': 1, 'loss': 2.5})\n"
            "sinks.close()\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "import torch, tensorboardX.writer\n"
            "print(tensorboardX.writer.numpy_compatible.__name__, torch.ones(1).item())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ndarray", "1.0"]
    (name,) = os.listdir(tmp_path / "tb")
    assert len(list(tfrecords(os.path.join(tmp_path, "tb", name)))) == 2  # header, the loss


def test_profile_written(run_dir):
    found = [f for _, _, files in os.walk(os.path.join(run_dir, "profile")) for f in files]
    assert any(f.endswith(".xplane.pb") for f in found), found


def test_plot_two_runs(run_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    with open(other / "metrics.jsonl", "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 5.0 - step, "tokens_per_sec": 100.0,
                                "mfu": 0.4, "eval_loss": 4.5 if step == 3 else None}) + "\n")
    out = plot([run_dir, str(other)], str(tmp_path / "cmp.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The CLI: default output next to the first run.
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    subprocess.run([sys.executable, "-m", "ndjax", "plot", f"--workdir={run_dir}",
                    f"--workdir={other}"], check=True, env=env, capture_output=True)
    assert os.path.getsize(os.path.join(run_dir, "plot.png")) > 1000


def test_nan_stop_raises_and_names_the_steps(tmp_path):
    config = tiny_config(mesh=dict(fsdp=8), train=dict(steps=4))
    config.debug.nan_at_step = 3
    with pytest.raises(NonFiniteError, match=r"at step 3 \(last good step 2\)"):
        train(config, str(tmp_path), verbose=False)
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1, 2]


def test_nan_stop_names_the_first_bad_step_when_read_every_few_steps(tmp_path):
    """log.every=4: steps 1-4 are read together after step 5 is dispatched; the NaN at
    step 3 (and the NaN parameters' steps after it) stop the run naming step 3."""
    config = tiny_config(train=dict(steps=6))
    config.log.every = 4
    config.debug.nan_at_step = 3
    with pytest.raises(NonFiniteError, match=r"at step 3 \(last good step 2\)"):
        train(config, str(tmp_path), jax.devices()[:1], verbose=False)
    assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints")
                                                               .iterdir())


def test_nan_skip_drops_the_update():
    config = tiny_config(mesh=dict(fsdp=8), train=dict(on_nan="skip"))
    config.debug.nan_at_step = 2
    exp = Experiment.from_config(config)
    init = jax.device_get(exp.init_state())
    _, after_1 = run_steps(exp, init, steps=1)
    losses, after_2 = run_steps(exp, init, steps=2)
    assert np.isfinite(losses[0]) and np.isnan(losses[1])
    jax.tree.map(np.testing.assert_array_equal, after_2, after_1)  # step 2 changed nothing


def test_nan_skip_counts_in_metrics(tmp_path):
    config = tiny_config(mesh=dict(fsdp=8), train=dict(on_nan="skip"))
    config.debug.nan_at_step = 2
    records = train(config, str(tmp_path), verbose=False)
    assert [r["skipped_steps"] for r in records] == [0, 1, 1]
    assert records[0]["mfu"] is None  # no known peak for a CPU: null, not a made-up number
    written = read_jsonl(tmp_path)
    assert written[1]["loss"] is None and np.isfinite(written[2]["loss"])


def test_nan_skip_keeps_the_schedule_in_step():
    # Linear warmup: the lr changes every step, so a schedule that a skipped
    # step left one step behind applies a visibly different lr (half, here).
    config = tiny_config(train=dict(on_nan="skip", warmup_steps=4))
    config.debug.nan_at_step = 2
    exp = Experiment.from_config(config, jax.devices()[:1])
    batches = [exp.device_batch(b) for b in host_batches(config, 3)]
    state = exp.init_state()
    for batch in batches[:2]:
        state, _ = exp.compiled_step(state, batch)
    before = jax.device_get(state)  # the step donates its input state
    after, metrics = exp.compiled_step(state, batches[2])
    lr = float(metrics["lr"])
    assert lr == pytest.approx(float(exp.schedule(2))) and lr > 0

    # Step 3 by hand: the same gradients through the same optimizer, but with
    # the logged lr as a constant, from the state the skipped step left.
    grads = jax.jit(functools.partial(loss_and_grads, exp.features, exp.step_options))(
        before.params, batches[2])[2]
    optimizer = make_optimizer(config.train, exp.param_names, optax.constant_schedule(lr))
    updates, _ = optimizer.update(grads, before.opt_state, before.params)
    expected = optax.apply_updates(before.params, updates)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(after.params), expected)

    # The skipped update did not count as one of Adam's (its moments were kept,
    # so its bias correction must not assume one more gradient averaged in);
    # the schedule's count follows the step counter.
    counted = (optax.ScaleByAdamState, optax.ScaleByScheduleState)
    counts = {type(s).__name__: int(s.count) for s in jax.tree.leaves(
        before.opt_state, is_leaf=lambda x: isinstance(x, counted)) if isinstance(s, counted)}
    assert counts == {"ScaleByAdamState": 1, "ScaleByScheduleState": 2}
