"""Prompt data (data.format=prompt, GRPO's): TRL 1.16's prompt ids, every prompt once an
epoch, the records' columns kept, long prompts left out and counted, bad records as
one-line errors."""

import json
import types

import numpy as np
import pytest
from data_files import data_config, write_chat_tokenizer
from test_data_preference import bos_tokenizer, say

from ndjax.data import prompts
from ndjax.data.chat_template import load_chat_template
from ndjax.data.loader import dropped_overlong, make_loader
from ndjax.data.sources import Document
from ndjax.data.streams import PromptRows
from ndjax.data.tokenizers import HFTokenizer
from ndjax.runtime.errors import ConfigError

VOCAB = 384


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_tokenizers")
    return {name: bos_tokenizer(root / name, name) for name in ("llama3", "chatml")}


def string_records(n=10, seed=0):
    rng = np.random.default_rng(seed)
    out = [{"prompt": f"q{i} {say(rng)}?", "answer": str(i), "id": i} for i in range(n)]
    out[1]["prompt"] = "alph"  # no space after: BPE merges
    out[2]["prompt"] = "café naïve <|eot_id|> déjà vu"  # a special token's text inside
    return out


def message_records(n=8, seed=1):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = [{"role": "system", "content": f"be brief {say(rng)}"}] if i % 3 == 0 else []
        for _ in range(i % 2):  # multi-turn prompts too
            prompt += [{"role": "user", "content": f"{say(rng)}?"},
                       {"role": "assistant", "content": say(rng)}]
        prompt += [{"role": "user", "content": f"{say(rng)}?"}]
        out.append({"prompt": prompt, "solution": f"\\boxed{{{i}}}",
                    "meta": {"level": i % 3, "tags": ["a", "b"][: i % 3]}})
    return out


def trl_prompt_ids(path, prompt_list):
    """TRL 1.16's own GRPOTrainer._tokenize_prompts, run on a stand-in trainer (no model,
    no tools, the tokenizer's own template, no VLM)."""
    from transformers import AutoTokenizer
    from trl.trainer.grpo_trainer import GRPOTrainer

    hf = AutoTokenizer.from_pretrained(str(path).rsplit("/", 1)[0])
    trainer = types.SimpleNamespace(_is_vlm=False, environment_factories=None,
                                    processing_class=hf, tools=None, chat_template=None,
                                    chat_template_kwargs={})
    ids, images, fields = GRPOTrainer._tokenize_prompts(trainer, prompt_list)
    assert images is None and not fields
    return [list(x) for x in ids]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def prompt_config(tmp_path, tokenizer, records, seq_len=64, batch_size=4, **data):
    files = write_jsonl(tmp_path / "prompts.jsonl", records)
    return data_config("chat", files, vocab_size=VOCAB, batch_size=batch_size,
                       seq_len=seq_len, **{"tokenizer": tokenizer, "format": "prompt", **data})


@pytest.mark.parametrize("name", ["llama3", "chatml"])
def test_prompt_ids_equal_trl(tokenizers, tmp_path, name):
    path = tokenizers[name]
    strings, messages = string_records(), message_records()
    for records in (strings, messages):
        theirs = trl_prompt_ids(path, [r["prompt"] for r in records])
        docs = [Document(r, "p.jsonl", i, "jsonl") for i, r in enumerate(records)]
        ours = prompts.encode([prompts.read(d) for d in docs], HFTokenizer(path),
                              load_chat_template(path))
        assert [x.tolist() for x in ours] == theirs
        with make_loader(prompt_config(tmp_path, path, records, seq_len=128), VOCAB,
                         prefetch=0) as loader:
            source = loader.source
            assert isinstance(source, PromptRows) and source.dropped == 0
            assert [x.tolist() for x in source.ids] == theirs  # the kept list: record order
    bos = HFTokenizer(path).tokenizer.token_to_id("<|begin_of_text|>")
    assert all(x[0] == bos for x in trl_prompt_ids(path, [r["prompt"] for r in strings]))


def test_every_prompt_once_an_epoch(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    records = string_records(10)
    with make_loader(prompt_config(tmp_path, path, records, seq_len=40), VOCAB,
                     prefetch=0) as loader:
        source = loader.source
        n = source.rows_per_epoch()
        assert n == len(source) == 10 and source.epoch_at(15) == 1.5
        steps = [loader.batch(s) for s in range(5)]  # 20 rows: two epochs, batches across
        index = np.concatenate([b["index"] for b in steps])
        assert sorted(index[:n]) == sorted(index[n:]) == list(range(n))
        assert index[:n].tolist() != index[n:].tolist()
        batch = steps[0]
        assert set(batch) == set(PromptRows.FIELDS)
        assert batch["prompt_ids"].shape == (4, 40) and batch["prompt_ids"].dtype == np.int32
        assert batch["prompt_len"].dtype == np.int32 and batch["index"].dtype == np.int64
        pad = HFTokenizer(path).pad_id
        for row, length, i in zip(batch["prompt_ids"], batch["prompt_len"], batch["index"]):
            assert row[:length].tolist() == source.ids[i].tolist()
            assert (row[length:] == pad).all()
        assert source.prompts(batch["index"]) == [records[i]["prompt"]
                                                  for i in batch["index"]]
        assert loader.epoch_after(5) == 2.0
        # the rows of a process's share are those rows of the whole batch
        np.testing.assert_array_equal(source.rows(3, 1, 2)["index"], steps[3]["index"][1:3])
        state = {**loader.get_state(), "rows": 8}
        loader.set_state(state)
        assert next(loader)["index"].tolist() == steps[2]["index"].tolist()
    again = make_loader(prompt_config(tmp_path, path, records, seq_len=40), VOCAB,
                        prefetch=1)
    with again:  # resumed with a prefetching loader: the same batch
        again.set_state(state)
        assert next(again)["index"].tolist() == steps[2]["index"].tolist()


def test_records_keep_their_columns(tokenizers, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tokenizers["chatml"]
    records = message_records()
    with make_loader(prompt_config(tmp_path, path, records, seq_len=128), VOCAB,
                     prefetch=0) as loader:
        source = loader.source
        assert source.records(range(len(records))) == records
        assert source.prompts([3, 0]) == [records[3]["prompt"], records[0]["prompt"]]
        want = [x.tolist() for x in source.ids]
    # Parquet: every column read (the reward functions may need any), as JSON Lines
    table = pa.Table.from_pylist([{**r, "meta": json.dumps(r["meta"])} for r in records])
    pq.write_table(table, tmp_path / "prompts.parquet")
    config = prompt_config(tmp_path, path, records, seq_len=128)
    config.data.files = str(tmp_path / "prompts.parquet")
    with make_loader(config, VOCAB, prefetch=0) as loader:
        got = loader.source.records(range(len(records)))
        assert [x.tolist() for x in loader.source.ids] == want
    assert [{**r, "meta": json.loads(r["meta"])} for r in got] == records
    # a Hugging Face dataset (a .csv file): every column too
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,answer,source\n" + "".join(
        f"{r['prompt']},{r['answer']},gsm{i}\n" for i, r in enumerate(string_records(5))))
    config = prompt_config(tmp_path, path, [], seq_len=64)
    config.data.files = str(csv)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        got = loader.source.records(range(5))
    assert [sorted(r) for r in got] == [["answer", "prompt", "source"]] * 5
    assert got[4]["source"] == "gsm4"


def test_long_prompts_are_dropped_and_counted(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    records = string_records(6) + [{"prompt": "delta " * 60, "answer": "x"}] * 2
    with make_loader(prompt_config(tmp_path, path, records, seq_len=32), VOCAB,
                     prefetch=0) as loader:
        assert dropped_overlong(loader) == loader.source.dropped == 2
        assert len(loader.source) == 6 and loader.source.lengths.max() <= 32
        assert all(r["answer"] != "x" for r in loader.source.records(range(6)))
    with pytest.raises(ConfigError, match=r"no prompt is kept: all 2 are longer than the "
                                          r"prompt budget of 32 tokens") as e:
        make_loader(prompt_config(tmp_path, path, records[-2:], seq_len=32), VOCAB,
                    prefetch=0)
    assert "\n" not in str(e.value)


def test_state_key_follows_the_prompt_field(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    records = [{**r, "question": r["prompt"]} for r in string_records()]
    keys = []
    for data in ({}, {"prompt_field": "question"}):
        with make_loader(prompt_config(tmp_path, path, records, **data), VOCAB,
                         prefetch=0) as loader:
            keys.append(loader.get_state()["corpus"])
    assert len(set(keys)) == 2


def test_string_prompts_need_no_chat_template(tmp_path):
    path = str(write_chat_tokenizer(tmp_path / "plain", template=""))
    with make_loader(prompt_config(tmp_path, path, string_records(4)), VOCAB,
                     prefetch=0) as loader:
        assert len(loader.source) == 4
    config = prompt_config(tmp_path, path, string_records(4) + message_records()[:1])
    with pytest.raises(ConfigError, match=r"has no chat template .* which data.format="
                                          r"'prompt' with prompts of messages needs"):
        make_loader(config, VOCAB, prefetch=0)


@pytest.mark.parametrize("record, message", [
    ({"question": "x", "answer": 1},
     r"prompts.jsonl:2: data.prompt_field='prompt' is missing \(found \['answer', "
     r"'question'\]\)"),
    ({"prompt": 3}, r"prompts.jsonl:2: data.prompt_field='prompt' is int \(3\), not a string"),
    ({"prompt": ""}, r"prompts.jsonl:2: data.prompt_field='prompt' is an empty string"),
    ({"prompt": []}, r"prompts.jsonl:2: 'prompt' is list, not a non-empty list"),
    ({"prompt": [{"role": "user", "content": 1}]},
     r"prompts.jsonl:2: 'prompt' message 0 is not \{'role': str, 'content': str\}"),
])
def test_bad_records_are_one_line_errors(tokenizers, tmp_path, record, message):
    config = prompt_config(tmp_path, tokenizers["llama3"], [string_records()[0], record])
    with pytest.raises(ConfigError, match=message) as e:
        make_loader(config, VOCAB, prefetch=0)
    assert "\n" not in str(e.value) and "data.format='prompt'" in str(e.value)


def test_prompt_format_needs_chat_records(tmp_path):
    config = data_config("jsonl", str(tmp_path / "x.jsonl"), format="prompt")
    with pytest.raises(ConfigError, match=r"data.format='prompt' reads records .* of "
                                          r"data.source=chat, not data.source='jsonl'"):
        make_loader(config, VOCAB, prefetch=0)
