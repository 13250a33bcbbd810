"""A run's length in epochs (train.epochs, Axolotl's num_epochs): its steps counted from
the rows an epoch packs into, what is counted per epoch turned into steps, and the epoch
reached logged with every step."""

import json
import math

import pytest
from conftest import tiny_config

from ndjax.config import Settings
from ndjax.data.loader import make_loader
from ndjax.runtime.errors import ConfigError
from ndjax.step import state as state_lib
from ndjax.training import loop


def corpus(path, n=60):
    path.write_text("".join(json.dumps({"text": f"document {i} " * (3 + i % 5)}) + "\n"
                            for i in range(n)))
    return str(path)


def epoch_config(tmp_path, **train):
    c = tiny_config(mesh=dict(fsdp=8), model=dict(vocab_size=384),
                    train=dict(batch_size=8, seq_len=32, **train))
    c.data.source = "jsonl"
    c.data.files = corpus(tmp_path / "train.jsonl")
    c.data.eval_files = corpus(tmp_path / "eval.jsonl", 12)
    return c


def test_a_run_of_two_epochs_counts_its_steps_from_the_packed_rows(tmp_path):
    c = epoch_config(tmp_path, epochs=2.0, evals_per_epoch=2, warmup_ratio=0.25)
    c.checkpoint.saves_per_epoch = 1
    with make_loader(c, c.model.vocab_size, prefetch=0) as data:
        rows = data.rows_per_epoch()
    per_epoch = rows // 8
    assert per_epoch >= 2
    records = [r for r in loop.train(c, str(tmp_path / "run"), verbose=False) if "loss" in r]
    steps = math.ceil(2 * per_epoch)
    assert [r["step"] for r in records][-1] == steps
    last = records[-1]
    assert last["data/epoch"] == pytest.approx(steps * 8 / rows) and last["data/epoch"] >= 1.99
    # The resolved settings: evaluations and saves per epoch, warmup as a share of steps.
    s = Settings.parse(c).in_steps(rows)
    assert (s.train.steps, s.train.eval_every, s.checkpoint.every) == (
        steps, max(per_epoch // 2, 1), per_epoch)
    assert s.train.warmup_steps == c.train.warmup_steps  # the ratio is the schedule's
    lr = state_lib.make_schedule(s.train)
    warmup = math.ceil(0.25 * steps)
    assert float(lr(warmup)) == pytest.approx(c.train.lr) and float(lr(warmup - 1)) < c.train.lr
    evals = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
             if "eval_loss" in line]
    assert [e["step"] for e in evals] == list(range(s.train.eval_every, steps + 1,
                                                     s.train.eval_every))


@pytest.mark.parametrize("train, source, message", [
    (dict(evals_per_epoch=2), "jsonl", r"train.evals_per_epoch=2 counts per epoch, and "
     r"train.epochs is 0"),
    (dict(epochs=1.0), "synthetic", r"train.epochs=1 counts passes over a corpus"),
])
def test_epoch_fields_without_epochs_or_a_corpus_are_refused(tmp_path, train, source, message):
    c = epoch_config(tmp_path, **train)
    if source == "synthetic":
        c.data.source, c.data.files, c.data.eval_files = "synthetic", "", ""
    with pytest.raises(ConfigError, match=message):
        loop.train(c, str(tmp_path / "run"), verbose=False)
