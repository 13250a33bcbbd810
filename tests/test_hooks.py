"""Each of the loop's hooks alone, against a stand-in trainer; then a hook of a test's
own added to a real run, touching nothing else."""

import json
import types

import numpy as np
import pytest
from conftest import tiny_config

from ndjax.training import hooks
from ndjax.training.loop import Trainer, train


class FakeSinks:
    def __init__(self):
        self.records, self.evals, self.messages = [], [], []

    def write(self, record):
        self.records.append(record)

    def write_eval(self, record):
        self.evals.append(record)

    def message(self, text):
        self.messages.append(text)


class FakeCheckpointer:
    directory = "/ckpt"

    def __init__(self):
        self.saved, self.waits = [], 0

    def save(self, step, state, data_state):
        self.saved.append((step, state, data_state))

    def wait(self):
        self.waits += 1


def fake_trainer(**kw):
    t = types.SimpleNamespace(sinks=FakeSinks(), checkpointer=FakeCheckpointer(), records=[],
                              state=types.SimpleNamespace(params="P"), stop_reason="",
                              saved=None, exported=None, flushes=0, clock_restarts=0,
                              data=types.SimpleNamespace(get_state=lambda: {"rows": 8}),
                              # Experiment.saved: what a checkpoint holds (all of it unless LoRA).
                              exp=types.SimpleNamespace(saved=lambda state: state))
    t.flush = lambda: setattr(t, "flushes", t.flushes + 1)
    t.restart_clock = lambda: setattr(t, "clock_restarts", t.clock_restarts + 1)
    t.stop = lambda reason: setattr(t, "stop_reason", reason)
    t.__dict__.update(kw)
    return t


def values(finite=True, **kw):
    return {"loss": 1.0, "grad_norm": 2.0, "lr": 1e-3, "finite": finite, "step_time": 0.5, **kw}


def test_due():
    assert [s for s in range(1, 11) if hooks.due(4, s)] == [4, 8]
    assert not any(hooks.due(0, s) for s in range(1, 11))


def test_non_finite_stops_or_counts():
    t = fake_trainer()
    stop = hooks.NonFinite("stop")
    stop.on_metrics(t, 1, v := values())
    assert v["skipped_steps"] == 0 and "finite" not in v
    with pytest.raises(hooks.NonFiniteError, match=r"at step 2 \(last good step 1\)"):
        stop.on_metrics(t, 2, values(finite=False, loss=float("nan")))
    skip = hooks.NonFinite("skip")
    skip.on_metrics(t, 1, values(finite=False))
    skip.on_metrics(t, 2, v := values(finite=False))
    assert v["skipped_steps"] == 2
    assert t.sinks.messages == [f"step {s}: non-finite loss or gradient, update skipped"
                                for s in (1, 2)]


def test_log_writes_every_n_steps_and_the_last():
    t = fake_trainer()
    log = hooks.Log(every=3, last_step=7, data_counts={"data/dropped_overlong": 2})
    log.devices, log.tokens_per_step, log.flops_per_step, log.peak = 2, 100, 1e12, 0.5
    for step in range(1, 8):
        log.on_metrics(t, step, values())
    assert [r["step"] for r in t.sinks.records] == [3, 6, 7]
    r = t.records[0]
    assert r["tokens_per_sec"] == 200 and r["tokens_per_sec_per_device"] == 100
    assert r["tflops_per_device"] == 1.0 and r["mfu"] == 2.0
    assert r["data/dropped_overlong"] == 2 and r["step_time"] == 0.5


def test_log_records_the_epoch_and_says_once_when_a_batch_is_mostly_padding():
    t = fake_trainer()
    log = hooks.Log(every=1, last_step=4, data_counts={}, epoch_after=lambda step: step / 4)
    log.devices, log.tokens_per_step, log.flops_per_step, log.peak = 1, 100, 1e12, None
    for step, fill in zip(range(1, 5), (0.9, 0.3, 0.2, 0.8)):
        log.on_metrics(t, step, values(**{"data/fill": fill}))
    assert [r["data/epoch"] for r in t.records] == [0.25, 0.5, 0.75, 1.0]
    assert [r["data/fill"] for r in t.records] == [0.9, 0.3, 0.2, 0.8]
    assert t.sinks.messages == [
        "data: step 2's batch is 30% tokens and 70% padding: pack short documents "
        "(data.packing=true), or use a smaller train.seq_len or batch_size."]
    # A source without epochs (synthetic) logs none.
    t2 = fake_trainer()
    quiet = hooks.Log(every=1, last_step=1, data_counts={}, epoch_after=lambda step: None)
    quiet.devices, quiet.tokens_per_step, quiet.flops_per_step, quiet.peak = 1, 100, 1e12, None
    quiet.on_metrics(t2, 1, values(**{"data/fill": 1.0}))
    assert "data/epoch" not in t2.records[0] and not t2.sinks.messages


def test_evaluate_when_due_flushes_first_and_restarts_the_clock(monkeypatch):
    t = fake_trainer(exp="EXP")
    calls = []
    monkeypatch.setattr(hooks, "evaluate",
                        lambda exp, params, batches: calls.append((exp, params, batches))
                        or {"eval_loss": 1.5})
    ev = hooks.Evaluate(every=2, batches=["b"])
    for step in range(1, 5):
        ev.after_step(t, step, None)
    assert calls == [("EXP", "P", ["b"])] * 2
    assert t.sinks.evals == [{"step": 2, "eval_loss": 1.5}, {"step": 4, "eval_loss": 1.5}]
    assert t.flushes == 2 and t.clock_restarts == 2


def test_profile_traces_the_window(monkeypatch):
    calls = []
    monkeypatch.setattr(hooks.jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
    monkeypatch.setattr(hooks.jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
    p = hooks.Profile((2, 3), "/prof")
    t = fake_trainer()
    for step in range(1, 5):
        p.before_step(t, step)
        p.after_step(t, step, np.zeros(1))
    p.close()  # nothing left open: no second stop
    assert calls == [("start", "/prof"), ("stop",)]
    p = hooks.Profile((2, 9), "/prof")
    p.before_step(t, 2)
    p.close()  # a run that ends (or fails) inside the window still stops the trace
    assert calls[-1] == ("stop",)


def test_checkpoint_every_n_at_the_last_step_and_on_stop():
    t = fake_trainer()
    ck = hooks.Checkpoint(every=3, last_step=10)
    for step in range(1, 5):
        ck.after_step(t, step, None)
    assert [s for s, *_ in t.checkpointer.saved] == [3]
    t.stop("SIGTERM")
    ck.after_step(t, 5, None)
    assert [s for s, *_ in t.checkpointer.saved] == [3, 5] and t.saved == 5
    assert t.checkpointer.saved[-1][1:] == (t.state, {"rows": 8})
    assert t.sinks.messages == ["SIGTERM: saved checkpoint step 5 in /ckpt; exiting"]
    ck2 = hooks.Checkpoint(every=0, last_step=10)
    t2 = fake_trainer()
    ck2.after_step(t2, 10, None)
    assert [s for s, *_ in t2.checkpointer.saved] == [10] and t2.flushes == 1


def test_sigterm_asks_the_trainer_to_stop():
    t = fake_trainer()
    h = hooks.StopOnSignal()
    try:
        h.after_step(t, 1, None)
        assert t.stop_reason == ""
        h.signals.requested = "SIGTERM"
        h.after_step(t, 2, None)
        assert t.stop_reason == "SIGTERM"
    finally:
        h.close()


def test_export_only_when_the_run_finished(monkeypatch):
    from ndjax.runs import hf
    calls = []
    monkeypatch.setattr(hf, "export", lambda *a, **kw: calls.append((a, kw)))
    # The state's parameters in layer order (a circular pipeline stores them otherwise).
    exp = types.SimpleNamespace(model_cfg="CFG", in_layer_order=lambda p: ("in order", p))
    h = hooks.Export("/out", "bfloat16", 123, source="SRC")
    t = fake_trainer(exp=exp, stop_reason="SIGTERM")
    h.end(t)
    assert calls == [] and t.exported is None
    t = fake_trainer(exp=exp)
    h.end(t)
    assert calls == [((("in order", "P"), "CFG", "/out", "bfloat16"),
                      dict(source="SRC", shard_bytes=123))]
    assert t.exported == "/out"


class Recorder(hooks.Hook):
    """A hook of the test's own: sees every step's metrics, in order, and asks to stop."""

    def __init__(self, stop_at):
        self.stop_at, self.seen, self.ended = stop_at, [], False

    def on_metrics(self, trainer, step, values):
        self.seen.append((step, values["loss"]))

    def after_step(self, trainer, step, outputs):
        if step == self.stop_at:
            trainer.stop("recorder")

    def end(self, trainer):
        self.ended = True


def test_a_new_hook_joins_a_real_run(tmp_path, cpu_devices):
    recorder = Recorder(stop_at=2)
    records = train(tiny_config(mesh=dict(fsdp=8), train=dict(steps=3)), str(tmp_path),
                    cpu_devices, verbose=False, extra_hooks=[recorder])
    assert [s for s, _ in recorder.seen] == [1, 2] and recorder.ended
    assert [r["step"] for r in records] == [1, 2]
    assert [r["loss"] for r in records] == [loss for _, loss in recorder.seen]
    # The checkpoint hook saved the step the run stopped at.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["2"]


def test_trainer_delivers_metrics_one_step_late_and_in_order():
    order = []

    class Spy(hooks.Hook):
        def after_step(self, trainer, step, outputs):
            order.append(("after", step))

        def on_metrics(self, trainer, step, values):
            order.append(("metrics", step))

    steps = iter(range(100))
    trainer = Trainer(None, 0, steps, checkpointer=None, sinks=None, hooks=[Spy()],
                      first_step=1, last_step=3)
    trainer.fit(lambda state, batch: (state, {"loss": np.float32(batch)}))
    assert order == [("after", 1), ("metrics", 1), ("after", 2), ("metrics", 2), ("after", 3),
                     ("metrics", 3)]


@pytest.mark.parametrize("mesh", [dict(fsdp=8), dict(stage=2, virtual_stages=2, fsdp=4)],
                         ids=["fsdp", "circular_pipeline"])
def test_sample_hook_writes_what_generate_gives_for_that_checkpoint(tmp_path, cpu_devices,
                                                                     mesh):
    """On the training mesh; the circular pipeline's state holds its layers out of order,
    and the hook decodes them in order."""
    from ndjax.verbs import generate
    c = tiny_config(mesh=mesh, model=dict(vocab_size=264, n_layers=4), train=dict(steps=4))
    c.log.update(sample_every=2, sample_prompt="import os", sample_tokens=6)
    train(c, str(tmp_path), cpu_devices, verbose=False)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [(2, "import os"), (4, "import os")]
    model = generate.load(workdir=str(tmp_path), devices=cpu_devices)  # step 4's parameters
    expected = model.generator(6)(model.encode(["import os"]))[0]
    assert samples[-1]["tokens"] == expected
    assert samples[-1]["completion"] == model.decode(expected)


def test_a_sample_prompt_too_long_fails_before_anything_is_written(tmp_path, cpu_devices):
    from ndjax.runtime.errors import ConfigError
    c = tiny_config(mesh=dict(fsdp=8), model=dict(vocab_size=264))
    c.log.update(sample_every=2, sample_prompt="x" * 30, sample_tokens=6)
    with pytest.raises(ConfigError, match=r"log.sample_prompt has 30 tokens; with "
                                          r"log.sample_tokens=6 that is 36, more than "
                                          r"train.seq_len=32"):
        train(c, str(tmp_path / "run"), cpu_devices, verbose=False)
    assert not (tmp_path / "run").exists()


def test_trainer_reads_the_device_once_per_read_every_steps(monkeypatch):
    """log.every=3: one device_get for steps 1-3, one for 4-6, one for the last (7);
    every step still reaches the hooks, in order, once the next step is dispatched."""
    order, reads = [], []
    real_get = hooks.jax.device_get
    monkeypatch.setattr(hooks.jax, "device_get",
                        lambda x: reads.append(len(x)) or real_get(x))

    class Spy(hooks.Hook):
        def after_step(self, trainer, step, outputs):
            order.append(("after", step))

        def on_metrics(self, trainer, step, values):
            order.append(("metrics", step, values["loss"]))

    trainer = Trainer(None, 0, iter(range(100)), checkpointer=None, sinks=None, hooks=[Spy()],
                      first_step=1, last_step=7, read_every=3)
    trainer.fit(lambda state, batch: (state, {"loss": np.float32(batch)}))
    assert reads == [3, 3, 1]
    metrics = lambda *steps: [("metrics", s, float(s - 1)) for s in steps]  # noqa: E731
    assert order == [("after", 1), ("after", 2), ("after", 3), *metrics(1, 2, 3),
                     ("after", 4), ("after", 5), ("after", 6), *metrics(4, 5, 6),
                     ("after", 7), *metrics(7)]


def test_flush_reads_every_pending_step_at_once():
    """A save or an evaluation between reads (flush) delivers all the steps so far."""
    seen = []

    class Spy(hooks.Hook):
        def after_step(self, trainer, step, outputs):
            if step == 2:
                trainer.flush()

        def on_metrics(self, trainer, step, values):
            seen.append(step)

    trainer = Trainer(None, 0, iter(range(100)), checkpointer=None, sinks=None, hooks=[Spy()],
                      first_step=1, last_step=4, read_every=4)
    trainer.fit(lambda state, batch: (state, {"loss": np.float32(batch)}))
    assert seen == [1, 2, 3, 4]


def test_the_eval_step_compiles_only_when_an_evaluation_runs(tmp_path, cpu_devices):
    """eval_every beyond the run's steps: the run never evaluates, so never compiles
    the eval step (it used to be compiled before step 1)."""
    seen = {}

    class Look(hooks.Hook):
        def end(self, trainer):
            seen["compiled"] = "compiled_eval" in vars(trainer.exp)

    c = tiny_config(train=dict(steps=2, eval_every=5))
    train(c, str(tmp_path), cpu_devices[:1], verbose=False, extra_hooks=[Look()])
    assert seen == {"compiled": False}
