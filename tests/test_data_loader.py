"""The loader: per-process shares, determinism, resume from state, the thread."""

import json
import threading
import types

import numpy as np
import pytest
from data_files import data_config, texts, write_jsonl, write_text

from ndjax.data import BATCH_FIELDS, sources
from ndjax.data.loader import make_loader
from ndjax.data.prepare import prepare
from ndjax.ops import attention
from ndjax.runtime.errors import ConfigError

VOCAB = 384


def config_for(kind, root, **kwargs):
    if kind == "text":
        write_text(root / "txt", texts(40))
        return data_config("text", str(root / "txt" / "*.txt"), **kwargs)
    if kind == "jsonl":
        return data_config("jsonl", str(write_jsonl(root / "c.jsonl", texts(40))), **kwargs)
    if kind == "tokens":
        prepare("jsonl", str(write_jsonl(root / "c.jsonl", texts(40))), str(root / "t.bin"),
                progress=False)
        return data_config("tokens", str(root / "t.bin"), **kwargs)
    return data_config(kind, **kwargs)


def assert_same(a, b):
    for k in BATCH_FIELDS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("processes", [2, 4])
@pytest.mark.parametrize("kind", ["text", "jsonl", "tokens", "synthetic"])
def test_each_process_builds_only_its_rows_and_they_match_one_process(
        tmp_path, monkeypatch, kind, processes):
    config = config_for(kind, tmp_path)
    reads: dict = {}
    share = sources.Corpus.share
    who = ["whole"]
    monkeypatch.setattr(sources.Corpus, "share", lambda self, lo, hi: (
        reads.setdefault(who[0], []).append((lo, hi)) or share(self, lo, hi)))
    with make_loader(config, VOCAB, prefetch=0) as whole:
        full = [whole.batch(step) for step in (0, 1, 5, 50)]
    for p in range(processes):
        who[0] = p
        with make_loader(config, VOCAB, process_index=p, process_count=processes,
                         prefetch=0) as part:
            rows = slice(p * 8 // processes, (p + 1) * 8 // processes)
            assert (part.start, part.count) == (rows.start, rows.stop - rows.start)
            for step, batch in zip((0, 1, 5, 50), full):
                assert_same(part.batch(step), {k: v[rows] for k, v in batch.items()})
    if kind in ("text", "jsonl"):
        # An epoch's order is global: every process reads the whole corpus, once.
        assert len(reads["whole"]) == 1 and reads["whole"][0][0] == 0
        assert all(reads[p] == reads["whole"] for p in range(processes))


@pytest.mark.parametrize("kind", ["text", "tokens", "synthetic"])
def test_resume_from_state_gives_the_batches_of_an_uninterrupted_run(tmp_path, kind):
    config = config_for(kind, tmp_path, seq_len=32)
    with make_loader(config, VOCAB) as run:  # with the prefetch thread
        uninterrupted = [next(run) for _ in range(40)]
        if kind == "text":  # past the end of the first epoch
            assert run.source.epoch_at(25 * 8) >= 1
        if kind == "tokens":
            assert run.source.n_windows < 25 * 8
    with make_loader(config, VOCAB) as first:
        for _ in range(25):
            next(first)
        state = json.loads(json.dumps(first.get_state()))  # it survives serialization
    assert state["rows"] == 25 * 8 and all(type(v) is int for v in state.values())
    # Restored by two processes instead of one: each gets its rows of the same batches.
    for p in range(2):
        with make_loader(config, VOCAB, process_index=p, process_count=2) as resumed:
            next(resumed)  # a position that set_state replaces
            resumed.set_state(state)
            for step in range(25, 40):
                assert_same(next(resumed), {k: v[p * 4:p * 4 + 4]
                                            for k, v in uninterrupted[step].items()})
            assert resumed.get_state()["rows"] == 40 * 8


def test_state_from_other_settings_is_refused(tmp_path):
    config = config_for("text", tmp_path)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        next(loader)
        state = loader.get_state()
        with pytest.raises(ConfigError, match="rows=12 is not a whole number of batches of 8"):
            loader.set_state({**state, "rows": 12})
    bigger = config_for("text", tmp_path, batch_size=16)
    with make_loader(bigger, VOCAB, prefetch=0) as loader:
        with pytest.raises(ConfigError, match=r"saved with batch_size=8 but this run has 16"):
            loader.set_state(state)
    with open(tmp_path / "txt" / "part00.txt", "a") as f:
        f.write("one more line\n")
    with make_loader(config, VOCAB, prefetch=0) as loader:
        with pytest.raises(ConfigError, match=r"the data files \(names or sizes\) changed"):
            loader.set_state(state)


def test_same_seed_same_batches_and_splits_differ():
    config = data_config("builtin", seq_len=32)
    with make_loader(config, VOCAB) as a, make_loader(config, VOCAB, prefetch=0) as b:
        for _ in range(3):
            assert_same(next(a), next(b))
    with make_loader(config, VOCAB, "eval", prefetch=0) as held_out:
        assert not np.array_equal(held_out.batch(0)["inputs"], a.batch(0)["inputs"])
    config.train.seed = 1
    with make_loader(config, VOCAB, prefetch=0) as other:
        assert not np.array_equal(other.batch(0)["inputs"], a.batch(0)["inputs"])


def test_closing_a_loader_with_a_full_queue_returns():
    before = set(threading.enumerate())
    with make_loader(data_config("synthetic"), VOCAB, prefetch=1) as loader:
        next(loader)
        assert set(threading.enumerate()) - before  # Grain's prefetch thread
    assert loader._batches is None and not set(threading.enumerate()) - before  # joined


# ----- a kernel's bound on documents per row (Kernel.max_runs, model.attn_max_docs) ------------


def short_docs_config(kind, root, **kwargs):
    """Documents of 2-9 bytes: rows of 48 tokens hold 6-20 of them."""
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("abcdefgh"), rng.integers(1, 9))) for _ in range(400)]
    path = write_jsonl(root / "short.jsonl", docs)
    if kind == "tokens":
        prepare("jsonl", str(path), str(root / "short.bin"), progress=False)
        return data_config("tokens", str(root / "short.bin"), seq_len=48, **kwargs)
    if kind == "synthetic":  # its documents average 96 tokens
        return data_config("synthetic", seq_len=1024, **kwargs)
    return data_config("jsonl", str(path), seq_len=48, **kwargs)


@pytest.mark.parametrize("kind", ["jsonl", "tokens", "synthetic"])
def test_every_batch_keeps_within_the_kernels_bound(tmp_path, kind):
    """The defect: rows held more documents than model.attn_max_docs, and cuDNN's check
    in the loader thread (Experiment.device_batch) stopped the run at that batch."""
    config, bound = short_docs_config(kind, tmp_path), 4
    with make_loader(config, VOCAB, prefetch=0) as free:
        assert attention.runs_per_row(free.batch(0)["segment_ids"]).max() > bound
    cudnn = types.SimpleNamespace(attn_max_docs=bound)

    def checked(batch):  # what device_batch does before the batch goes to the devices
        attention.KERNELS["cudnn"].check_batch(batch["segment_ids"], cudnn)
        return batch

    with make_loader(config, VOCAB, transform=checked, max_runs=bound) as bounded:
        batches = [next(bounded) for _ in range(30)]  # the loader thread's batches
    assert max(attention.runs_per_row(b["segment_ids"]).max() for b in batches) == bound
    if kind == "tokens":  # an epoch of split windows learns what the windows learned
        whole, split = free.source, bounded.source

        def learned(source, n):
            b = source.rows(0, 0, n)
            keep = b["loss_mask"] > 0
            return sorted(zip(b["inputs"][keep].tolist(), b["targets"][keep].tolist()))

        assert split.n_rows > whole.n_windows
        assert learned(split, split.n_rows) == learned(whole, whole.n_windows)


@pytest.mark.parametrize("kind", ["jsonl", "tokens", "synthetic"])
def test_resume_within_a_bound_gives_the_batches_of_an_uninterrupted_run(tmp_path, kind):
    config = short_docs_config(kind, tmp_path)
    with make_loader(config, VOCAB, max_runs=3) as run:
        uninterrupted = [next(run) for _ in range(40)]
        if kind == "jsonl":  # past the end of the first epoch
            assert run.source.epoch_at(25 * 8) >= 1
    with make_loader(config, VOCAB, max_runs=3) as first:
        for _ in range(25):
            next(first)
        state = first.get_state()
    for p in range(2):
        with make_loader(config, VOCAB, process_index=p, process_count=2,
                         max_runs=3) as resumed:
            resumed.set_state(state)
            for step in range(25, 40):
                assert_same(next(resumed), {k: v[p * 4:p * 4 + 4]
                                            for k, v in uninterrupted[step].items()})


def test_eval_fraction_holds_out_a_seeded_share_of_the_documents(tmp_path):
    # Axolotl's val_set_size: the validation split is a seeded share of data.files
    # (rounded up), the training split the rest, no document in both, the same for any
    # process count.
    from ndjax.data.loader import held_out
    docs = list(range(40))
    train, held = held_out(docs, 0.1, 3, "train"), held_out(docs, 0.1, 3, "eval")
    assert len(held) == 4 and sorted(train + held) == docs and not set(train) & set(held)
    assert held != docs[-4:] and held_out(docs, 0.1, 4, "eval") != held  # seeded
    config = config_for("jsonl", tmp_path, seq_len=32)
    config.data.eval_fraction = 0.25
    with make_loader(config, VOCAB, prefetch=0) as train_rows, \
            make_loader(config, VOCAB, "eval", prefetch=0) as eval_rows:
        assert train_rows.source.stream.total > eval_rows.source.stream.total > 0
    config.data.eval_files = config.data.files
    with pytest.raises(ConfigError, match=r"data.eval_fraction=0.25 holds out part of "
                                          r"data.files .* keep one"):
        make_loader(config, VOCAB, prefetch=0)
