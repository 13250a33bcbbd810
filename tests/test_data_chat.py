"""Chat data: the template's tokens as transformers makes them, the loss on the assistant's
tokens only, whole conversations per row, and bad input as one-line errors."""

import json
import re

import jax
import numpy as np
import pytest
from data_files import (
    CHATML_GENERATION_TEMPLATE,
    QWEN2_5_SYSTEM,
    conversations,
    data_config,
    write_chat_jsonl,
    write_chat_tokenizer,
)

from ndjax.data import chat, prompt_formats
from ndjax.data.chat_template import load_chat_template
from ndjax.data.loader import dropped_overlong, make_loader
from ndjax.data.packing import unpack
from ndjax.data.sources import Document
from ndjax.data.tokenizers import HFTokenizer
from ndjax.experiment import Experiment
from ndjax.runtime.errors import ConfigError

VOCAB = 384
SEQ = 112  # most test conversations fit a row of SEQ + 1 tokens, some do not
ROW = SEQ + 1
END = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "chatml_generation": "<|im_end|>",
       "qwen2_5": "<|im_end|>", "gemma3": "<end_of_turn>"}
TRIMS = ("llama3", "gemma3")  # templates that strip each message's content


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {name: str(write_chat_tokenizer(root / name, name)) for name in END}


def docs_of(chats, field="messages"):
    return [Document({field: c}, "chats.jsonl", i, "jsonl") for i, c in enumerate(chats)]


def encode(path, chats):
    return chat.encode(docs_of(chats), load_chat_template(path), HFTokenizer(path))


def runs(tok, ids, mask):
    """The decoded text of each maximal run of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [tok.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2])]


def hf_ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(out["input_ids"]) if not isinstance(out, list) else out


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path).rsplit("/", 1)[0])


def replies_masked(name, messages):
    """What the mask must cover: each reply as the template writes it (some trim it), and
    its end-of-turn token."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    return [(r.strip() if name in TRIMS else r) + END[name] for r in replies]


@pytest.mark.parametrize("name", sorted(END))
def test_ids_equal_transformers_and_mask_is_the_replies(tokenizers, name):
    path = tokenizers[name]
    hf = hf_tokenizer(path)
    chats = conversations(24)  # multi-turn ones, some with a system message
    tok = HFTokenizer(path)
    template = load_chat_template(path)
    for messages, (ids, mask) in zip(chats, encode(path, chats)):
        assert [int(i) for i in ids] == hf_ids(hf, messages)
        # Exactly the replies and their end-of-turn token: no header, no newline after
        # <|im_end|> or <end_of_turn>, nothing of the system or user turns.
        assert runs(tok, ids, mask) == replies_masked(name, messages)
        # The prompt before the last reply, as generation sees it.
        prompt = template.render(messages[:-1], add_generation_prompt=True)
        assert tok.encode(prompt) == hf_ids(hf, messages[:-1], add_generation_prompt=True)
        if name == "chatml_generation":  # transformers' own mask of {% generation %} blocks
            out = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
            assert list(mask) == list(out["assistant_masks"])


@pytest.mark.parametrize("name", ["llama3", "chatml", "qwen2_5"])
def test_a_conversation_may_open_with_the_assistant(tokenizers, name):
    # Nothing precedes the first reply, and templates cannot render "no messages" as they
    # render the first one: Qwen's reads messages[0] (refused: the record was an error),
    # Llama 3's writes its BOS with the first message (not a prefix: an error too).
    path = tokenizers[name]
    tok = HFTokenizer(path)
    chats = [[{"role": "assistant", "content": "hello, how can i help?"},
              {"role": "user", "content": "alpha beta?"},
              {"role": "assistant", "content": "gamma delta. "}],
             [{"role": "system", "content": "be brief"},
              {"role": "assistant", "content": "hello."}]]
    hf = hf_tokenizer(path)
    for messages, (ids, mask) in zip(chats, encode(path, chats)):
        assert [int(i) for i in ids] == hf_ids(hf, messages)
        assert runs(tok, ids, mask) == replies_masked(name, messages)


def test_qwen2_5_tool_calls_are_learned_and_tool_results_are_not(tokenizers):
    path = tokenizers["qwen2_5"]
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich"}}}
    messages = [{"role": "user", "content": "weather in zürich?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "12 C"},
                {"role": "assistant", "content": "sunny, 12 C."}]
    (ids, mask), = encode(path, [messages])
    assert [int(i) for i in ids] == hf_ids(hf_tokenizer(path), messages)
    assert runs(HFTokenizer(path), ids, mask) == [
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
        "<|im_end|>", "sunny, 12 C.<|im_end|>"]


def test_qwen2_5_and_gemma3_templates_write_their_formats(tokenizers):
    # The test templates are the format the models were tuned on (transformers renders the
    # same text, above): Qwen's default system prompt, Gemma's BOS, its system prompt in the
    # first user turn and its "model" role.
    chat = [{"role": "user", "content": "hi?"}, {"role": "assistant", "content": " yes. "},
            {"role": "user", "content": "and?"}, {"role": "assistant", "content": "no."}]
    system = [{"role": "system", "content": "be brief"}]
    qwen = load_chat_template(tokenizers["qwen2_5"])
    gemma = load_chat_template(tokenizers["gemma3"])
    turns = ("<|im_start|>user\nhi?<|im_end|>\n<|im_start|>assistant\n yes. <|im_end|>\n"
             "<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\nno.<|im_end|>\n")
    assert qwen.render(chat) == f"<|im_start|>system\n{QWEN2_5_SYSTEM}<|im_end|>\n" + turns
    assert qwen.render(system + chat) == "<|im_start|>system\nbe brief<|im_end|>\n" + turns
    assert qwen.render(chat[:1], True).endswith("hi?<|im_end|>\n<|im_start|>assistant\n")
    assert gemma.render(system + chat) == (
        "<bos><start_of_turn>user\nbe brief\n\nhi?<end_of_turn>\n"
        "<start_of_turn>model\nyes.<end_of_turn>\n<start_of_turn>user\nand?<end_of_turn>\n"
        "<start_of_turn>model\nno.<end_of_turn>\n")
    assert gemma.render(chat[:1], True) == ("<bos><start_of_turn>user\nhi?<end_of_turn>\n"
                                            "<start_of_turn>model\n")


def test_prefix_rule_equals_generation_blocks(tokenizers, tmp_path):
    # The same template without its {% generation %} tags: found by prefixes, the mask
    # is the one transformers derives from the tags.
    plain = re.sub(r"\{% (end)?generation %\}", "", CHATML_GENERATION_TEMPLATE)
    (tmp_path / "plain.jinja").write_text(plain)
    path = tokenizers["chatml_generation"]
    tagged = load_chat_template(path)
    untagged = load_chat_template(path, str(tmp_path / "plain.jinja"))
    assert tagged.has_generation_blocks and not untagged.has_generation_blocks
    tok = HFTokenizer(path)
    for doc in docs_of(conversations(12)):
        a = chat.encode([doc], tagged, tok)[0]
        b = chat.encode([doc], untagged, tok)[0]
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1], b[1])


def test_prompt_completion_is_a_user_then_assistant_message(tokenizers):
    path = tokenizers["llama3"]
    template, tok = load_chat_template(path), HFTokenizer(path)
    pair = Document({"prompt": "alpha beta?", "completion": "gamma."}, "p.jsonl", 0, "jsonl")
    listed = Document({"prompt": [{"role": "system", "content": "brief"},
                                  {"role": "user", "content": "alpha beta?"}],
                       "completion": [{"role": "assistant", "content": "gamma."}]},
                      "p.jsonl", 1, "jsonl")
    messages = [{"role": "user", "content": "alpha beta?"},
                {"role": "assistant", "content": "gamma."}]
    (ids, mask), (ids2, mask2) = chat.encode([pair, listed], template, tok)
    (ref, ref_mask), = chat.encode(docs_of([messages]), template, tok)
    np.testing.assert_array_equal(ids, ref)
    np.testing.assert_array_equal(mask, ref_mask)
    assert runs(tok, ids, mask) == runs(tok, ids2, mask2) == ["gamma.<|eot_id|>"]
    assert "brief" in tok.decode(ids2)


def chat_config(tmp_path, tokenizer_path, chats, **data):
    files = write_chat_jsonl(tmp_path / "chats.jsonl", chats)
    return data_config("chat", str(files), vocab_size=VOCAB, batch_size=4, seq_len=SEQ,
                       **{"tokenizer": tokenizer_path, **data})


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("name", ["chatml", "qwen2_5", "gemma3"])
def test_rows_hold_whole_conversations_with_their_masks(tokenizers, tmp_path, name, packing):
    path = tokenizers[name]
    # One surely too long (Gemma's terse turns fit every other one in a row).
    chats = conversations(40) + [[{"role": "user", "content": "alpha " * 120},
                                  {"role": "assistant", "content": "beta."}]]
    encoded = encode(path, chats)
    config = chat_config(tmp_path, path, chats, packing=packing)
    with make_loader(config, VOCAB, prefetch=0) as loader:
        kept = [e for e in encoded if len(e[0]) <= ROW]
        assert dropped_overlong(loader) == len(encoded) - len(kept) > 0
        by_ids = {tuple(int(i) for i in ids): mask for ids, mask in kept}
        seen, most = set(), 0
        n_rows = len(loader.source.epoch(0))
        for step in range(-(-n_rows // 4)):  # the first epoch, and a little more
            batch = loader.batch(step)
            for r in range(4):
                row = {k: v[r] for k, v in batch.items()}
                seg = row["segment_ids"]
                real = seg > 0
                assert real[:real.sum()].all()  # padding only at the end
                assert (row["loss_mask"][~real] == 0).all() and (row["positions"][~real] == 0).all()
                assert packing or seg.max() == 1
                most = max(most, seg.max())
                for s, conv in enumerate(unpack(row), start=1):
                    at = np.flatnonzero(seg == s)
                    np.testing.assert_array_equal(row["positions"][at], np.arange(len(at)))
                    # The conversation is whole: its tokens are inputs, but for the row's last
                    # one that may end on the last target.
                    key = tuple(int(i) for i in conv)
                    if key not in by_ids:
                        key += (int(row["targets"][at[-1]]),)
                    assert key in by_ids
                    seen.add(key)
                    # Learned: exactly the targets the conversation's mask marks.
                    want = np.append(by_ids[key][1:], 0)[:len(at)]
                    np.testing.assert_array_equal(row["loss_mask"][at], want)
        assert seen == set(by_ids)
        assert (most > 1) == packing  # packing puts several conversations in a row


def test_overlong_truncate_keeps_the_beginning_and_drop_counts(tokenizers, tmp_path):
    path = tokenizers["llama3"]
    long = [{"role": "user", "content": "alpha " * 40},
            {"role": "assistant", "content": "beta " * 150}]
    no_reply_left = [{"role": "user", "content": "gamma " * 200},
                     {"role": "assistant", "content": "delta"}]
    chats = [long, no_reply_left] + conversations(8)
    encoded = encode(path, chats)
    too_long = [len(ids) > ROW for ids, _ in encoded]
    assert too_long[:2] == [True, True]
    learnable = [m[1:ROW].any() for _, m in encoded]
    assert learnable[:2] == [True, False]
    for policy, dropped in (("drop", sum(too_long)),
                            ("truncate", sum(t and not n for t, n in zip(too_long, learnable)))):
        config = chat_config(tmp_path, path, chats, overlong=policy)
        config.train.batch_size = 1
        with make_loader(config, VOCAB, prefetch=0) as loader:
            assert dropped_overlong(loader) == loader.source.dropped == dropped
            convs = loader.source.convs
            assert len(convs) == len(chats) - dropped
            assert all(len(c[0]) <= ROW for c in convs)
            if policy == "truncate":  # the long one's first ROW tokens, masks and all
                first = encoded[0][0][:ROW]
                (ids, mask), = [c for c in convs if np.array_equal(c[0], first)]
                np.testing.assert_array_equal(mask, encoded[0][1][:ROW])


def test_everything_dropped_is_a_clear_error(tokenizers, tmp_path):
    long = [{"role": "user", "content": "alpha " * 300}, {"role": "assistant", "content": "b"}]
    config = chat_config(tmp_path, tokenizers["llama3"], [long] * 8)
    with pytest.raises(ConfigError, match=r"no conversation is kept: all 8 are longer than "
                                          r"train.seq_len=112 \+ 1 tokens .*overlong=truncate"):
        make_loader(config, VOCAB, prefetch=0)


def test_missing_template_fails_before_compiling(tmp_path):
    path = write_chat_tokenizer(tmp_path / "none", template="")
    config = chat_config(tmp_path, str(path), conversations(8))
    config.mesh.fsdp = 4
    devices = jax.devices()[:4]
    with pytest.raises(ConfigError) as e:
        Experiment.from_config(config, devices)
    assert "\n" not in str(e.value)
    assert re.search(r"data.tokenizer='.*tokenizer.json' has no chat template .* set "
                     r"data.chat_template to a Jinja template file", str(e.value))
    # data.chat_template supplies one.
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}<|eot_id|>"
                                      "{% endfor %}")
    config.data.chat_template = str(tmp_path / "t.jinja")
    Experiment.from_config(config, devices)


@pytest.mark.parametrize("record, message", [
    ({"messages": [{"role": "human", "content": "x"}]},
     r"chats.jsonl:2: 'messages' message 0 has role 'human'; use one of system, user"),
    ({"messages": [{"role": "user", "content": "x"}]},
     r"chats.jsonl:2: 'messages' has no assistant message"),
    ({"messages": [{"role": "user", "content": ["x"]}]},
     r"chats.jsonl:2: 'messages' message 0 is not \{'role': str, 'content': str\}"),
    ({"text": "x"}, r"chats.jsonl:2: no 'messages' field and no 'prompt' \+ 'completion' pair "
                    r"\(found \['text'\]\); set data.messages_field"),
    ({"messages": [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]},
     r"chats.jsonl:2: the chat template .* refused this conversation: roles must alternate"),
    ([1, 2], r"chats.jsonl:2: not a JSON object \(found list\)"),
])
def test_bad_records_name_file_and_line(tokenizers, tmp_path, record, message):
    (tmp_path / "t.jinja").write_text(
        "{% for m in messages %}{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]"
        "['role'] %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] }}<|eot_id|>{% endfor %}")
    good = conversations(1)[0]
    files = tmp_path / "chats.jsonl"
    files.write_text(json.dumps({"messages": good}) + "\n" + json.dumps(record) + "\n")
    config = data_config("chat", str(files), vocab_size=VOCAB, batch_size=1, seq_len=SEQ,
                         tokenizer=tokenizers["llama3"], chat_template=str(tmp_path / "t.jinja"))
    with pytest.raises(ConfigError, match=message):
        make_loader(config, VOCAB, prefetch=0)


@pytest.mark.parametrize("data, message", [
    (dict(overlong="split"),
     r"data.overlong='split': choose one of \('drop', 'truncate'\) \(drop leaves out"),
    (dict(tokenizer="byte"), r"data.source='chat' needs the model's tokenizer"),
    (dict(chat_template="missing.jinja"), r"data.chat_template='missing.jinja': no such file"),
    (dict(chat_template="chatml3"), r"data.chat_template='chatml3': no chat template of that "
                                    r"name; use one of chatml, gemma3, llama3, qwen3"),
    (dict(roles_to_train="assistant,gpt"), r"data.roles_to_train='assistant,gpt': 'gpt' is "
                                           r"not a role; list one or more of system, user"),
    (dict(train_on_eos="first"), r"data.train_on_eos='first': choose one of \('turn', 'all', "
                                 r"'last', 'none'\)"),
])
def test_bad_chat_settings(tokenizers, tmp_path, data, message):
    config = chat_config(tmp_path, tokenizers["llama3"], conversations(8), **data)
    with pytest.raises(ConfigError, match=message):
        make_loader(config, VOCAB, prefetch=0)


def test_parquet_conversations_match_jsonl(tokenizers, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    chats = conversations(16)
    pq.write_table(pa.table({"messages": chats}), tmp_path / "c.parquet", row_group_size=5)
    path = tokenizers["chatml"]
    jsonl = chat_config(tmp_path, path, chats)
    parquet = chat_config(tmp_path, path, chats)
    parquet.data.files = str(tmp_path / "c.parquet")
    with make_loader(jsonl, VOCAB, prefetch=0) as a, make_loader(parquet, VOCAB, prefetch=0) as b:
        got = lambda loader: sorted(tuple(int(i) for i in c[0])  # noqa: E731
                                    for c in loader.source.convs)
        assert got(a) == got(b)


def test_sft_config_passes_the_checks(tokenizers, tmp_path):
    """configs/llama3_sft.py with its placeholders pointed at a tiny Hugging Face
    directory (holding the chat tokenizer) and chat files: every check passes."""
    import importlib.util
    import os
    import shutil

    from conftest import tiny_config

    from ndjax.runs import hf

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("sft", os.path.join(root, "configs",
                                                                      "llama3_sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    assert config.model.init_from == module.CHECKPOINT
    assert config.data.tokenizer == f"{module.CHECKPOINT}/tokenizer.json"
    assert config.data.source == "chat" and config.export.hf_dir and config.train.lr <= 1e-4

    source = tiny_config(model=dict(vocab_size=VOCAB))
    exp = Experiment.from_config(source, jax.devices()[:1])
    zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), exp.param_shapes)
    hf.export(zeros, exp.model_cfg, str(tmp_path / "hf"), "float32")  # nothing compiled
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(os.path.dirname(tokenizers["llama3"]), name), tmp_path / "hf")
    config.model.init_from = str(tmp_path / "hf")
    config.data.tokenizer = str(tmp_path / "hf" / "tokenizer.json")
    config.data.files = str(write_chat_jsonl(tmp_path / "train.jsonl", conversations(40)))
    config.data.eval_files = str(write_chat_jsonl(tmp_path / "eval.jsonl", conversations(8, 1)))
    config.export.hf_dir = str(tmp_path / "tuned")
    exp = Experiment.from_config(config)
    assert exp.model_cfg.vocab_size == VOCAB  # from the directory's config.json
    assert dict(exp.mesh.shape) == {"stage": 1, "replica": 1, "fsdp": 4, "expert": 1,
                                    "context": 1, "tensor": 2}


def _loaded_samples(config):
    """The (ids, mask) of every sample the loader keeps, sorted (rows of whole samples
    with their masks: test_rows_hold_whole_conversations_with_their_masks)."""
    with make_loader(config, VOCAB, prefetch=0) as loader:
        return sorted((tuple(ids.tolist()), tuple(mask.tolist()))
                      for ids, mask in loader.source.convs)


@pytest.mark.parametrize("fmt, records", [
    ("alpaca", [{"instruction": f"Name a colour {i}.", "input": "" if i % 2 else "warm",
                 "output": f"red {i}"} for i in range(9)]),
    ("input_output", [{"segments": [{"text": f"<|begin_of_text|>Q{i}: ", "label": False},
                                    {"text": f"A {i}<|end_of_text|>", "label": True}]}
                      for i in range(9)]),
])
def test_axolotl_formats_are_read_through_the_loader(tokenizers, tmp_path, fmt, records):
    # The loader's samples are prompt_formats.encode's (checked against Axolotl's code in
    # tests/test_prompt_formats.py).
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = data_config("chat", str(path), vocab_size=VOCAB, batch_size=4, seq_len=512,
                         tokenizer=tokenizers["llama3"], format=fmt)
    tok = HFTokenizer(tokenizers["llama3"])
    want = sorted((tuple(ids.tolist()), tuple(mask.tolist()))
                  for ids, mask in prompt_formats.encode(records, fmt, tok))
    assert _loaded_samples(config) == want


def test_sharegpt_keys_and_roles_read_as_messages(tokenizers, tmp_path):
    chats = conversations(6)
    sharegpt = [[{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                  "value": m["content"]} for m in c] for c in chats]
    plain = chat_config(tmp_path / "plain", tokenizers["llama3"], chats)
    mapped = chat_config(tmp_path / "mapped", tokenizers["llama3"], sharegpt,
                         role_field="from", content_field="value")
    assert _loaded_samples(mapped) == _loaded_samples(plain)


def test_a_bad_alpaca_record_names_file_and_line(tokenizers, tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n"
                    + json.dumps({"instruction": "a"}) + "\n")
    config = data_config("chat", str(path), vocab_size=VOCAB, batch_size=1, seq_len=512,
                         tokenizer=tokenizers["llama3"], format="alpaca")
    with pytest.raises(ConfigError, match=r"records.jsonl:2: .*'output'.*data.format='alpaca'"):
        make_loader(config, VOCAB, prefetch=0)


# ----- roles_to_train and train_on_eos --------------------------------------------------


def chatml_reference(tok, messages, roles, eos):
    """A hand-written ChatML renderer (ndjax's chatml template's format): each piece of
    each turn tokenized on its own and marked by the rule itself: the content of a turn of
    a role in ``roles``, the <|im_end|> that ``eos`` says (turn: of those turns; all: of
    every turn; last: of the last of those turns; none); never the header or the newline."""
    learned = [i for i, m in enumerate(messages) if m["role"] in roles]
    ids, mask = [], []
    for i, m in enumerate(messages):
        eot = eos == "all" or (eos == "turn" and i in learned) or (
            eos == "last" and learned and i == learned[-1])
        for text, learn in ((f"<|im_start|>{m['role']}\n", False),
                            (m["content"], m["role"] in roles), ("<|im_end|>", eot),
                            ("\n", False)):
            piece = tok.encode(text)
            ids += piece
            mask += [int(bool(learn))] * len(piece)
    return ids, mask


@pytest.mark.parametrize("eos", ["turn", "all", "last", "none"])
@pytest.mark.parametrize("roles", [("assistant",), ("user", "assistant"), ("user",),
                                   ("system", "user", "assistant")])
def test_roles_and_end_of_turn_tokens_match_a_plain_chatml_reference(tokenizers, roles, eos):
    path = tokenizers["chatml"]
    tok = HFTokenizer(path)
    template = load_chat_template(path, "chatml")
    chats = conversations(24)
    got = chat.encode(docs_of(chats), template, tok, roles_to_train=roles, train_on_eos=eos)
    for messages, (ids, mask) in zip(chats, got):
        want_ids, want_mask = chatml_reference(tok, messages, roles, eos)
        assert [int(i) for i in ids] == want_ids
        assert [int(x) for x in mask] == want_mask, (roles, eos, messages)


def test_the_default_is_the_assistants_turns_and_their_end_of_turn_tokens(tokenizers):
    path = tokenizers["llama3"]
    template, tok = load_chat_template(path), HFTokenizer(path)
    docs = docs_of(conversations(12))
    for (a, m), (b, n) in zip(chat.encode(docs, template, tok),
                              chat.encode(docs, template, tok, roles_to_train=("assistant",),
                                          train_on_eos="turn")):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(m, n)


@pytest.mark.parametrize("name", ["llama3", "gemma3"])
def test_user_turns_are_their_trimmed_content_and_end_of_turn_token(tokenizers, name):
    # Llama 3 and Gemma write each content trimmed; Gemma folds the system prompt into the
    # first user turn, so it has no turn of its own and is never learned.
    path = tokenizers[name]
    tok = HFTokenizer(path)
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": " alpha beta? "},
                {"role": "assistant", "content": "gamma."},
                {"role": "user", "content": "delta\n"}, {"role": "assistant", "content": "eta"}]
    (ids, mask), = chat.encode(docs_of([messages]), load_chat_template(path), tok,
                               roles_to_train=("system", "user", "assistant"),
                               train_on_eos="last")
    end = END[name]
    system = [] if name == "gemma3" else ["be brief"]
    assert runs(tok, ids, mask) == system + ["alpha beta?", "gamma.", "delta", "eta" + end]


def test_qwen3_learns_its_replies_from_generation_blocks_and_user_turns_by_prefixes(tokenizers):
    path = tokenizers["chatml"]
    tok = HFTokenizer(path)
    messages = [{"role": "user", "content": "alpha?"},
                {"role": "assistant", "content": "<think>beta</think>gamma."},
                {"role": "user", "content": "delta?"}, {"role": "assistant", "content": "eta"}]
    template = load_chat_template(path, "qwen3")
    (ids, mask), = chat.encode(docs_of([messages]), template, tok,
                               roles_to_train=("user", "assistant"), train_on_eos="none")
    # The earlier reply's reasoning is dropped (the template rewrites earlier turns); the
    # last reply's (empty) think block is the assistant's.
    assert runs(tok, ids, mask) == ["alpha?", "gamma.", "delta?",
                                    "<think>\n\n</think>\n\neta"]
    (ids, mask), = chat.encode(docs_of([messages]), template, tok)
    assert runs(tok, ids, mask) == ["gamma.<|im_end|>", "<think>\n\n</think>\n\neta<|im_end|>"]


def test_a_named_template_and_the_new_settings_load(tokenizers, tmp_path):
    config = chat_config(tmp_path, tokenizers["chatml"], conversations(8),
                         chat_template="chatml", roles_to_train="user, assistant",
                         train_on_eos="last")
    with make_loader(config, VOCAB, prefetch=0) as loader:
        assert loader.source.convs
