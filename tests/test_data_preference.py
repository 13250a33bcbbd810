"""Preference data (data.format=preference): TRL 1.16's tokens and completion masks, each
pair as two consecutive segments of one row, and bad input as one-line errors."""

import json
import types

import numpy as np
import pytest
from data_files import data_config, write_chat_tokenizer

from ndjax.data import preference
from ndjax.data.chat_template import load_chat_template
from ndjax.data.loader import dropped_overlong, make_loader
from ndjax.data.sources import Document
from ndjax.data.streams import PairRows
from ndjax.data.tokenizers import HFTokenizer
from ndjax.ops.attention import runs_per_row
from ndjax.runtime.errors import ConfigError

VOCAB = 384
SEQ = 112
BOS = "<|begin_of_text|>"
W = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def bos_tokenizer(folder, template):
    """The chat test tokenizer, with a post-processor that adds BOS (as Llama 3's does)."""
    from tokenizers import Tokenizer, processors

    path = write_chat_tokenizer(folder, template)
    tok = Tokenizer.from_file(str(path))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tok.token_to_id(BOS))])
    tok.save(str(path))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": BOS}))
    return str(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference_tokenizers")
    return {name: bos_tokenizer(root / name, name) for name in ("llama3", "chatml")}


def say(rng, low=2, high=7):
    return " ".join(rng.choice(W, rng.integers(low, high)))


def string_records(n=12, seed=0):
    rng = np.random.default_rng(seed)
    out = [{"prompt": f"q{i} {say(rng)}?", "chosen": f" {say(rng)}.", "rejected": f" {say(rng)}"}
           for i in range(n)]
    out[0]["chosen"] += "<|eot_id|>"  # already ends with EOS: none added
    out[1] = {"prompt": "alph", "chosen": "a beta", "rejected": "a gamma"}  # BPE merges
    out[2] = {"prompt": "", "chosen": "café naïve", "rejected": "déjà vu"}  # no prompt text
    return out


def implicit_strings():
    return [{"chosen": "alpha beta gamma", "rejected": "alpha beta delta"},  # back one space
            {"chosen": "alphabeta", "rejected": "alphagamma"},
            {"chosen": "alpha beta", "rejected": "alpha beta gamma"},  # no place they differ
            {"chosen": "alpha ", "rejected": "beta"},  # differ at 0: TRL reads chosen[-1]
            {"chosen": "kappa mu nu.", "rejected": "kappa lambda."}]


def conversational(implicit, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        prompt = [{"role": "system", "content": f"be brief {say(rng)}"}] if i % 3 == 0 else []
        for _ in range(1 + i % 2):  # multi-turn prompts too
            prompt += [{"role": "user", "content": f"{say(rng)}?"},
                       {"role": "assistant", "content": say(rng)}]
        prompt += [{"role": "user", "content": f"{say(rng)}?"}]
        chosen = [{"role": "assistant", "content": say(rng) + "."}]
        rejected = [{"role": "assistant", "content": say(rng)}]
        out.append({"chosen": prompt + chosen, "rejected": prompt + rejected} if implicit
                   else {"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def docs_of(records, path="pairs.jsonl"):
    return [Document(r, path, i, "jsonl") for i, r in enumerate(records)]


def trl_tokenized(path, records):
    """TRL 1.16's own DPOTrainer._prepare_dataset (prompt extraction, EOS, tokenize_fn, the
    filter), run without a model: it reads only the tokenizer's EOS from the trainer."""
    pytest.importorskip("trl", minversion="1.16")
    import datasets
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DPOTrainer

    datasets.disable_progress_bars()
    hf = AutoTokenizer.from_pretrained(str(path).rsplit("/", 1)[0])
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=None,
                                 truncation_mode="keep_start")
    trainer = types.SimpleNamespace(_tokenizer=hf)
    return DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records), hf, args,
                                       "train")


@pytest.mark.parametrize("case", ["string", "string_implicit", "conversational",
                                  "conversational_implicit"])
@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_sequences_and_masks_equal_trl(tokenizers, name, case):
    records = {"string": string_records(), "string_implicit": implicit_strings(),
               "conversational": conversational(False),
               "conversational_implicit": conversational(True)}[case]
    path = tokenizers[name]
    tok = HFTokenizer(path)
    assert tok.encode("alpha", add_special_tokens=True)[0] == tok.tokenizer.token_to_id(BOS)
    ours = preference.encode(docs_of(records), tok, load_chat_template(path))
    theirs = trl_tokenized(path, records)
    assert len(ours) == len(theirs) == len(records)
    for pair, row in zip(ours, theirs):
        prompt = row["prompt_ids"]
        for (ids, mask), completion in zip(pair.sequences(), (row["chosen_ids"],
                                                              row["rejected_ids"])):
            assert ids.tolist() == prompt + completion
            assert mask.tolist() == [0] * len(prompt) + [1] * len(completion)
    if case == "string":  # the BPE merge moved "alph" into the completion, as TRL does
        merged = ours[1]
        assert merged.prompt_len < len(tok.encode("alph", add_special_tokens=True))


def test_extract_prompt_is_trls():
    pytest.importorskip("trl", minversion="1.16")
    from trl.data_utils import extract_prompt

    for r in implicit_strings() + conversational(True):
        want = extract_prompt(r)
        assert preference.extract_prompt(r["chosen"], r["rejected"]) == (
            want["prompt"], want["chosen"], want["rejected"])


# ----- rows ------------------------------------------------------------------------


def pair_config(tmp_path, tokenizer, records, seq_len=SEQ, **data):
    files = tmp_path / "pairs.jsonl"
    files.write_text("".join(json.dumps(r) + "\n" for r in records))
    return data_config("chat", str(files), vocab_size=VOCAB, batch_size=4, seq_len=seq_len,
                       **{"tokenizer": tokenizer, "format": "preference", **data})


def rows_of(source, n_rows, batch=4):
    """The first ``n_rows`` rows of the stream, one dict each."""
    return [{k: v[r] for k, v in source.rows(step, 0, batch).items()}
            for step in range(-(-n_rows // batch)) for r in range(batch)][:n_rows]


def pairs_in(row, known):
    """The pairs of one row, checked: segment 2k+1 is a pair's chosen sequence, 2k+2 its
    rejected one, each whole (the row's last token may be a target only), its positions
    from 0, and exactly its completion targets learned."""
    seg = row["segment_ids"]
    real = seg > 0
    assert real[:real.sum()].all() and seg[0] == 1  # starts a pair; padding only at the end
    assert (row["loss_mask"][~real] == 0).all() and (row["positions"][~real] == 0).all()
    assert seg.max() % 2 == 0  # every chosen sequence has its rejected one after it
    found = []
    for s in range(1, seg.max() + 1, 2):
        seqs = []
        for part in (s, s + 1):
            at = np.flatnonzero(seg == part)
            np.testing.assert_array_equal(row["positions"][at], np.arange(len(at)))
            seqs.append((tuple(row["inputs"][at].tolist()), at))
        key = (seqs[0][0], seqs[1][0])
        if key not in known and seqs[1][1][-1] == len(seg) - 1:  # its last token: a target
            key = (key[0], key[1] + (int(row["targets"][-1]),))
        assert key in known, "a pair the corpus does not hold, or not whole"
        for (_, at), (_, mask) in zip(seqs, known[key].sequences()):
            np.testing.assert_array_equal(row["loss_mask"][at], np.append(mask[1:], 0)[:len(at)])
        found.append(key)
    return found


@pytest.mark.parametrize("packing", [True, False])
def test_rows_hold_each_pair_once_an_epoch(tokenizers, tmp_path, packing):
    path = tokenizers["llama3"]
    records = string_records(30) + conversational(False) + conversational(True, seed=2)
    config = pair_config(tmp_path, path, records, seq_len=256, packing=packing)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        source = loader.source
        assert isinstance(source, PairRows) and dropped_overlong(loader) == 0
        pairs = preference.encode(docs_of(records), HFTokenizer(path), load_chat_template(path))
        known = {(tuple(p.chosen.tolist()), tuple(p.rejected.tolist())): p for p in pairs}
        n = source.rows_per_epoch()
        assert n == len(source.epoch(0)) and (n < len(records)) == packing
        for e in range(2):  # each epoch holds every pair once, in its own order
            rows = rows_of(source, n * (e + 1))[n * e:]
            seen = [k for row in rows for k in pairs_in(row, known)]
            assert sorted(seen) == sorted(known)
        assert source.epoch(0) != source.epoch(1)
        assert loader.epoch_after(-(-n // 4)) >= 1.0
        batch = loader.batch(0)
        assert set(batch) == {"inputs", "targets", "positions", "segment_ids", "loss_mask"}
        assert all(v.shape == (4, 256) for v in batch.values())


def numbered_pairs(rng, n, low, high):
    """Pairs of distinct tokens, a prompt of 1-3 shared by both sequences."""
    out, at = [], 100
    for _ in range(n):
        p, c, r = rng.integers(1, 4), rng.integers(low, high), rng.integers(low, high)
        prompt = np.arange(at, at + p)
        chosen = np.concatenate([prompt, np.arange(at + p, at + p + c)])
        rejected = np.concatenate([prompt, np.arange(at + p + c, at + p + c + r)])
        at += p + c + r
        out.append(preference.Pair(chosen, rejected, int(p)))
    return out


@pytest.mark.parametrize("bound", [3, 5, 6])
def test_max_runs_bounds_the_pairs_of_a_row(bound):
    pairs = numbered_pairs(np.random.default_rng(0), 60, 1, 4)
    known = {(tuple(p.chosen.tolist()), tuple(p.rejected.tolist())): p for p in pairs}
    rows = PairRows([p.sequences() for p in pairs], 48, 1, 3, 0, max_runs=bound)
    bins = rows.epoch(0)
    assert max(len(b) for b in bins) == (bound - 1) // 2
    epoch = rows_of(rows, len(bins), batch=1)
    assert max(runs_per_row(r["segment_ids"][None])[0] for r in epoch) <= bound
    assert sorted(k for r in epoch for k in pairs_in(r, known)) == sorted(known)
    unbounded = PairRows([p.sequences() for p in pairs], 48, 1, 3, 0)
    assert max(len(b) for b in unbounded.epoch(0)) > (bound - 1) // 2
    with pytest.raises(ConfigError, match=r"model.attn_max_docs=2: .* set model.attn_max_docs "
                                          r">= 3"):
        PairRows([p.sequences() for p in pairs], 48, 1, 3, 0, max_runs=2)


def test_fit_drops_or_cuts_the_completions():
    pair = preference.Pair(np.arange(10), np.concatenate([np.arange(4), np.arange(50, 54)]), 4)
    assert preference.fit(pair, 18, "drop") is pair
    assert preference.fit(pair, 17, "drop") is None
    cut = preference.fit(pair, 17, "truncate")  # the longer one cut to 17 - 8 = 9
    assert cut.chosen.tolist() == list(range(9)) and np.array_equal(cut.rejected, pair.rejected)
    cut = preference.fit(pair, 14, "truncate")  # both to 7
    assert cut.chosen.tolist() == list(range(7)) and cut.rejected.tolist() == [0, 1, 2, 3, 50,
                                                                               51, 52]
    cut = preference.fit(pair, 11, "truncate")  # both to 5: one completion token each
    assert (len(cut.chosen), len(cut.rejected), cut.prompt_len) == (5, 5, 4)
    assert preference.fit(pair, 9, "truncate") is None  # the prompt leaves none
    assert preference.fit(preference.Pair(np.arange(4), np.arange(4), 4), 99, "drop") is None


def test_overlong_pairs_are_dropped_or_truncated(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    long = {"prompt": "alpha", "chosen": " beta" * 80, "rejected": " gamma" * 30}
    no_room = {"prompt": "delta " * 70, "chosen": " beta", "rejected": " gamma"}
    records = [long, no_room] + string_records(10)
    for policy, dropped in (("drop", 2), ("truncate", 1)):
        config = pair_config(tmp_path, path, records, overlong=policy)
        with make_loader(config, VOCAB, prefetch=0) as loader:
            assert dropped_overlong(loader) == loader.source.dropped == dropped
            lengths = [len(c[0]) + len(r[0]) for c, r in loader.source.pairs]
            assert len(lengths) == len(records) - dropped and max(lengths) <= SEQ + 1
            if policy == "truncate":  # the long one: its rejected whole, its chosen cut
                assert max(lengths) == SEQ + 1
    config = pair_config(tmp_path, path, [long, no_room], overlong="drop")
    with pytest.raises(ConfigError, match=r"no preference pair is kept: all 2 are longer than "
                                          r"train.seq_len=112 \+ 1 tokens, chosen and rejected "
                                          r"together \(data.overlong='drop'\)"):
        make_loader(config, VOCAB, prefetch=0)


def test_state_key_follows_the_preference_fields(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    records = [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"],
                "good": r["chosen"], "bad": r["rejected"]} for r in string_records()]
    keys = []
    for data in ({}, {"chosen_field": "good", "rejected_field": "bad"}, {"overlong": "truncate"}):
        with make_loader(pair_config(tmp_path, path, records, **data), VOCAB,
                         prefetch=0) as loader:
            keys.append(loader.get_state()["corpus"])
    assert len(set(keys)) == 3
    with make_loader(pair_config(tmp_path, path, records, format="chat",
                                 completion_field="chosen"), VOCAB, prefetch=0) as loader:
        assert loader.get_state()["corpus"] not in keys


def test_parquet_and_held_out_pairs(tokenizers, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tokenizers["chatml"]
    records = conversational(False) + conversational(False, seed=3)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")
    config = pair_config(tmp_path, path, records, seq_len=256)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        want = loader.source.pairs
    config.data.files = str(tmp_path / "pairs.parquet")
    with make_loader(config, VOCAB, prefetch=0) as loader:
        got = loader.source.pairs
    assert [[s[0].tolist() for s in p] for p in got] == [[s[0].tolist() for s in p] for p in want]
    config.data.eval_fraction = 0.25  # a held-out share: the same pairs, split
    train, held = (make_loader(config, VOCAB, split=split, prefetch=0).source.pairs
                   for split in ("train", "eval"))
    assert (len(train), len(held)) == (12, 4)
    key = lambda p: tuple(p[0][0].tolist())  # noqa: E731
    assert sorted(map(key, train + held)) == sorted(map(key, want))


def test_string_pairs_need_no_chat_template(tmp_path):
    path = str(write_chat_tokenizer(tmp_path / "plain", template=""))
    records = string_records(6)
    with make_loader(pair_config(tmp_path, path, records), VOCAB, prefetch=0) as loader:
        assert len(loader.source.pairs) == 6
    config = pair_config(tmp_path, path, records + conversational(False)[:1])
    with pytest.raises(ConfigError, match=r"has no chat template .* which data.format="
                                          r"'preference' with records of messages needs"):
        make_loader(config, VOCAB, prefetch=0)


@pytest.mark.parametrize("record, message", [
    ({"prompt": "x", "rejected": "y"},
     r"pairs.jsonl:2: data.chosen_field='chosen' is missing \(found \['prompt', 'rejected'\]\)"),
    ({"prompt": "x", "chosen": "y", "rejected": 3},
     r"pairs.jsonl:2: data.rejected_field='rejected' is int, not a string or a non-empty list"),
    ({"prompt": "x", "chosen": [{"role": "assistant", "content": "y"}], "rejected": "z"},
     r"pairs.jsonl:2: data.chosen_field='chosen' is a list of messages, the others strings"),
    ({"chosen": [{"role": "assistant", "content": 1}], "rejected": []},
     r"pairs.jsonl:2: 'chosen' message 0 is not \{'role': str, 'content': str\}"),
    ({"chosen": "", "rejected": "y"}, r"pairs.jsonl:2: without data.prompt_field='prompt'"),
])
def test_bad_records_are_one_line_errors(tokenizers, tmp_path, record, message):
    config = pair_config(tmp_path, tokenizers["llama3"], [string_records()[0], record])
    with pytest.raises(ConfigError, match=message) as e:
        make_loader(config, VOCAB, prefetch=0)
    assert "\n" not in str(e.value)


def test_preference_needs_chat_records(tmp_path):
    config = data_config("jsonl", str(tmp_path / "x.jsonl"), format="preference")
    with pytest.raises(ConfigError, match=r"data.format='preference' reads records .* of "
                                          r"data.source=chat, not data.source='jsonl'"):
        make_loader(config, VOCAB, prefetch=0)
