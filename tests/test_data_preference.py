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


# ----- KTO: data.format=unpaired_preference -----------------------------------------


def unpaired_strings(n=14, seed=4):
    rng = np.random.default_rng(seed)
    out = [{"prompt": f"q{i} {say(rng)}?", "completion": f" {say(rng)}.",
            "label": bool(rng.integers(2))} for i in range(n)]
    out[0]["completion"] += "<|eot_id|>"  # already ends with EOS: none added
    out[1] = {"prompt": "alph", "completion": "a beta", "label": False}  # BPE merges
    out[2] = {"prompt": "", "completion": "café naïve", "label": True}  # no prompt text
    return out


def unpaired_messages(seed=5):
    pairs = conversational(False, seed=seed)
    return [{"prompt": p["prompt"], "completion": p["chosen" if i % 3 else "rejected"],
             "label": bool(i % 3)} for i, p in enumerate(pairs)]


def kto_examples(records, path, batch, tok=None):
    """Our KTO examples of ``records``: TRL's order, tokens and KL sequences."""
    tok = tok or HFTokenizer(path)
    eos = tok.id_to_token(tok.eos_id)
    examples = preference.unpaired(docs_of(records), preference.Fields(), eos)
    encoded = preference.encode_unpaired(examples, tok, load_chat_template(path))
    return encoded, preference.kl_units(encoded, batch)


def trl_kto(path, records, batch, max_length=None):
    """TRL 1.16's own KTOTrainer._prepare_dataset (prompt extraction, unpairing, EOS,
    tokenize_fn, the filter, the KL completions), run without a model."""
    import datasets
    from transformers import AutoTokenizer
    from trl.trainer.kto_trainer import KTOTrainer

    datasets.disable_progress_bars()
    hf = AutoTokenizer.from_pretrained(str(path).rsplit("/", 1)[0])
    args = types.SimpleNamespace(dataset_num_proc=None, max_length=max_length,
                                 per_device_train_batch_size=batch)
    trainer = types.SimpleNamespace(_tokenizer=hf, calculate_KL=True, desirable_weight=1.0,
                                    undesirable_weight=1.0)
    return KTOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list(records), hf, args,
                                       "train")


def assert_units_equal_trl(units, theirs):
    assert len(units) == len(theirs)
    for unit, row in zip(units, theirs):
        prompt = row["prompt_ids"]
        assert unit.ids.tolist() == prompt + row["completion_ids"]
        assert unit.kl_ids.tolist() == prompt + row["KL_completion_ids"]
        assert unit.desirable is row["label"]
        for (_, mask), completion in zip(unit.sequences(), (row["completion_ids"],
                                                            row["KL_completion_ids"])):
            assert mask.tolist() == [0] * len(prompt) + [1] * len(completion)


@pytest.mark.parametrize("case", ["unpaired_string", "unpaired_messages", "paired_string",
                                  "paired_messages_implicit"])
@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_kto_examples_equal_trl(tokenizers, name, case):
    records = {"unpaired_string": unpaired_strings(), "unpaired_messages": unpaired_messages(),
               "paired_string": string_records(), "paired_messages_implicit":
               conversational(True)}[case]
    path = tokenizers[name]
    encoded, units = kto_examples(records, path, batch=3)
    theirs = trl_kto(path, records, batch=3)
    assert len(units) == len(records) * (2 if case.startswith("paired") else 1)
    assert_units_equal_trl(units, theirs)
    if case.startswith("paired"):  # chosen (desirable) first, then rejected
        assert [u.desirable for u in units] == [True] * len(records) + [False] * len(records)


def test_kto_order_filter_and_partners_equal_trl(tokenizers):
    """Pairs unpaired in TRL's batches of 1000 records, and TRL's drop of an example whose
    prompt fills max_length before the KL rotation: ``can_fit`` with truncate at twice it."""
    path = tokenizers["chatml"]
    rng = np.random.default_rng(7)
    records = [{"prompt": W[i % 12], "chosen": f" {W[(i + 1) % 12]}", "rejected": " mu"}
               for i in range(1003)]
    records[5]["prompt"] = records[1001]["prompt"] = " ".join(rng.choice(W, 30))  # too long
    tok = HFTokenizer(path)
    examples = preference.unpaired(docs_of(records), preference.Fields(), "<|im_end|>")
    assert [e.desirable for e in examples] == ([True] * 1000 + [False] * 1000 + [True] * 3
                                               + [False] * 3)
    assert [e.doc.offset for e in examples[1998:2004]] == [998, 999, 1000, 1001, 1002, 1000]
    encoded = preference.encode_unpaired(examples, tok, None)
    long = max(e.prompt_len for e in encoded)
    kept = [e for e in encoded if preference.can_fit(e, 2 * 12, "truncate")]
    assert len(kept) == len(encoded) - 4 and long >= 12
    assert_units_equal_trl(preference.kl_units(kept, 5), trl_kto(path, records, 5, 12))


def test_kl_partner_is_the_previous_in_its_chunk():
    examples = [preference.Unpaired(np.array([i, 100 + i, 200 + i]), 1, i % 2 == 0)
                for i in range(7)]
    units = preference.kl_units(examples, 3)
    assert [u.kl_ids.tolist() for u in units] == [
        [0, 102, 202], [1, 100, 200], [2, 101, 201],  # chunk 0..2: the first takes the last's
        [3, 105, 205], [4, 103, 203], [5, 104, 204],
        [6, 106, 206]]  # a last chunk of one: its own completion, as TRL's map gives it
    assert [u.desirable for u in units] == [e.desirable for e in examples]
    unit = units[1]
    assert preference.fit_unit(unit, 6, "drop") is unit
    assert preference.fit_unit(unit, 5, "drop") is None
    cut = preference.fit_unit(unit, 4, "truncate")  # both to 2: one completion token each
    assert (cut.ids.tolist(), cut.kl_ids.tolist(), cut.desirable) == ([1, 101], [1, 100], False)
    assert preference.fit_unit(unit, 3, "truncate") is None  # the prompt leaves none
    long = preference.Unpaired(np.arange(10), 4, True)
    assert preference.can_fit(long, 15, "drop") and not preference.can_fit(long, 14, "drop")
    assert preference.can_fit(long, 10, "truncate") and not preference.can_fit(long, 9,
                                                                               "truncate")


def kto_config(tmp_path, tokenizer, records, seq_len=SEQ, **data):
    return pair_config(tmp_path, tokenizer, records, seq_len=seq_len,
                       **{"format": "unpaired_preference", **data})


@pytest.mark.parametrize("packing", [True, False])
def test_kto_rows_hold_each_example_and_its_kl_sequence(tokenizers, tmp_path, packing):
    from ndjax.data import BATCH_FIELDS, KTO_FIELDS
    from ndjax.data.streams import KTORows

    path = tokenizers["llama3"]
    records = unpaired_strings(30) + unpaired_messages() + unpaired_messages(seed=6)
    config = kto_config(tmp_path, path, records, seq_len=256, packing=packing)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        source = loader.source
        assert isinstance(source, KTORows) and dropped_overlong(loader) == 0
        units = kto_examples(records, path, batch=4)[1]  # train.batch_size examples a chunk
        known = {(tuple(u.ids.tolist()), tuple(u.kl_ids.tolist())): u for u in units}
        assert len(known) == len(records)
        assert 0 < sum(u.desirable for u in units) < len(units)
        n = source.rows_per_epoch()
        assert (n < len(records)) == packing
        ends = np.cumsum([len(source.epoch(e)) for e in range(2)])  # packing: they differ
        for e in range(2):  # each epoch holds every example once
            rows = rows_of(source, ends[e])[ends[e] - len(source.epoch(e)):]
            seen = []
            for row in rows:
                found = pairs_in(row, known)  # its KL sequence right after it, in its row
                seg = row["segment_ids"]
                assert (row["desirable"][seg == 0] == 0).all()
                for s, key in zip(range(1, seg.max() + 1, 2), found):
                    at = (seg == s) | (seg == s + 1)
                    want = known.get(key) or known[(key[0], key[1][:-1])]
                    assert (row["desirable"][at] == int(want.desirable)).all()
                seen += found
            assert len(seen) == len(known)
        batch = loader.batch(0)
        assert tuple(batch) == BATCH_FIELDS + KTO_FIELDS == BATCH_FIELDS + ("desirable",)
        assert all(v.shape == (4, 256) and v.dtype == np.int32 for v in batch.values())
    with make_loader(pair_config(tmp_path, path, string_records()), VOCAB, prefetch=0) as pairs:
        assert set(pairs.batch(0)) == set(BATCH_FIELDS)  # DPO's batches: no desirable


def test_kto_rows_from_pairs_parquet_and_held_out(tokenizers, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tokenizers["chatml"]
    records = conversational(False) + conversational(False, seed=3)
    config = kto_config(tmp_path, path, records, seq_len=256)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        units = kto_examples(records, path, batch=4)[1]
        assert [(u[0][0].tolist(), u[1][0].tolist()) for u in loader.source.pairs] == [
            (u.ids.tolist(), u.kl_ids.tolist()) for u in units]
        assert loader.source.desirable.tolist() == [True] * 16 + [False] * 16
    unpaired = unpaired_messages() + unpaired_messages(seed=8)
    pq.write_table(pa.Table.from_pylist(unpaired), tmp_path / "kto.parquet")  # a bool column
    config = kto_config(tmp_path, path, unpaired, seq_len=256)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        want = loader.source.pairs
    config.data.files = str(tmp_path / "kto.parquet")
    with make_loader(config, VOCAB, prefetch=0) as loader:
        assert [p[0][0].tolist() for p in loader.source.pairs] == [p[0][0].tolist() for p in want]
    config.data.eval_fraction = 0.25
    train, held = (make_loader(config, VOCAB, split=split, prefetch=0).source
                   for split in ("train", "eval"))
    assert (len(train.pairs), len(held.pairs)) == (12, 4)
    key = lambda p: tuple(p[0][0].tolist())  # noqa: E731
    assert sorted(map(key, train.pairs + held.pairs)) == sorted(map(key, want))


def test_overlong_kto_examples_are_dropped_or_truncated(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    long = {"prompt": "alpha", "completion": " beta" * 105, "label": True}  # 108 tokens
    no_room = {"prompt": "delta " * 70, "completion": " beta", "label": False}  # prompt: 72
    records = [long, no_room] + unpaired_strings(10)
    # no_room fits no row (its prompt twice is over 113 tokens): dropped before the KL
    # partners are assigned, so the chunk of 4 is long + the next 3. With drop, long's
    # unit (its partner's completion makes it 119) and that of the one after it (long's
    # completion its KL one) are dropped too; truncate cuts both to 113.
    for policy, dropped in (("drop", 3), ("truncate", 1)):
        with make_loader(kto_config(tmp_path, path, records, overlong=policy), VOCAB,
                         prefetch=0) as loader:
            assert dropped_overlong(loader) == loader.source.dropped == dropped
            lengths = [len(a[0]) + len(b[0]) for a, b in loader.source.pairs]
            assert len(lengths) == len(records) - dropped and max(lengths) <= SEQ + 1
            if policy == "truncate":
                assert sorted(lengths)[-2:] == [SEQ + 1, SEQ + 1]
    with pytest.raises(ConfigError, match=r"no KTO example is kept: all 2 are longer than "
                                          r"train.seq_len=112 \+ 1 tokens, the example and its "
                                          r"KL sequence together \(data.overlong='drop'\)"):
        make_loader(kto_config(tmp_path, path, [long, no_room]), VOCAB, prefetch=0)


@pytest.mark.parametrize("record, message", [
    ({"prompt": "x", "label": True},
     r"kto.jsonl:2: data.completion_field='completion' is missing \(found \['label', 'prompt'\]"),
    ({"prompt": "x", "completion": "y"}, r"kto.jsonl:2: data.label_field='label' is missing"),
    ({"completion": "y", "label": True}, r"kto.jsonl:2: data.prompt_field='prompt' is missing "
                                         r"\(TRL extracts an implicit prompt from preference"),
    ({"prompt": "x", "completion": "y", "label": 1},
     r"kto.jsonl:2: data.label_field='label' is int \(1\), not a boolean"),
    ({"prompt": "x", "completion": "y", "label": "true"},
     r"kto.jsonl:2: data.label_field='label' is str \('true'\), not a boolean"),
    ({"prompt": "x", "completion": [{"role": "assistant", "content": "y"}], "label": True},
     r"kto.jsonl:2: data.completion_field='completion' is a list of messages, the other a "
     r"string"),
    ({"prompt": "x", "completion": 3, "label": True},
     r"kto.jsonl:2: data.completion_field='completion' is int, not a string"),
])
def test_bad_kto_records_are_one_line_errors(tokenizers, tmp_path, record, message):
    files = tmp_path / "kto.jsonl"
    config = kto_config(tmp_path, tokenizers["llama3"], [unpaired_strings()[3], record])
    files.write_text("".join(json.dumps(r) + "\n" for r in [unpaired_strings()[3], record]))
    config.data.files = str(files)
    with pytest.raises(ConfigError, match=message) as e:
        make_loader(config, VOCAB, prefetch=0)
    assert "\n" not in str(e.value) and "data.format='unpaired_preference'" in str(e.value)


def test_kto_reads_as_its_first_record_says_and_needs_two_rows(tokenizers, tmp_path):
    from ndjax.data.streams import KTORows

    path = tokenizers["llama3"]
    config = kto_config(tmp_path, path, [string_records()[3], unpaired_strings()[3]])
    with pytest.raises(ConfigError, match=r"pairs.jsonl:2: data.chosen_field='chosen' is "
                                          r"missing .* read as preference pairs: the first "
                                          r"record has 'chosen' and 'rejected'"):
        make_loader(config, VOCAB, prefetch=0)
    config = kto_config(tmp_path, path, unpaired_strings())
    config.train.batch_size = 1
    with pytest.raises(ConfigError, match=r"train.batch_size=1: .* set train.batch_size >= 2"):
        make_loader(config, VOCAB, prefetch=0)
    units = kto_examples(unpaired_strings(), path, 2)[1]
    with pytest.raises(ConfigError, match=r"attn_max_docs=2: .* no room for a KTO example"):
        KTORows([u.sequences() for u in units], [u.desirable for u in units], 64, 1, 0, 0,
                max_runs=2)
    keys, labels = [], []
    records = [{**r, "good": not r["label"]} for r in unpaired_strings()]
    for data in ({}, {"label_field": "good"}):
        with make_loader(kto_config(tmp_path, path, records, **data), VOCAB,
                         prefetch=0) as loader:
            keys.append(loader.get_state()["corpus"])
            labels.append(loader.source.desirable.tolist())
    assert keys[0] != keys[1]
    assert labels == [[r["label"] for r in records], [r["good"] for r in records]]
