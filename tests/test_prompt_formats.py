"""Axolotl's alpaca, completion and input_output formats: ndjax's ids equal Axolotl's
``input_ids`` and its mask is ``labels != -100``, and ShareGPT roles map as Axolotl maps them.

The reference (``Ref*`` below) is a transcription, into plain Python on transformers'
tokenizer, of Axolotl's code as read at axolotl-ai-cloud/axolotl commit
067b021c8b87a9e5e380b9173c704cf7340e30f5 (src/axolotl/prompters.py AlpacaPrompter,
prompt_tokenizers.py PromptTokenizingStrategy._tokenize and
InstructionPromptTokenizingStrategy, prompt_strategies/completion.py and input_output.py):
not Axolotl itself, which these tests do not install.
"""

import json
from collections import defaultdict

import numpy as np
import pytest
from data_files import write_chat_tokenizer
from tokenizers import Tokenizer, processors

from ndjax.data import chat, prompt_formats
from ndjax.data.chat_template import load_chat_template
from ndjax.data.sources import Document
from ndjax.data.tokenizers import HFTokenizer

IGNORE_INDEX = -100


# ----- the reference: Axolotl's code, transcribed -------------------------------------------

class RefAlpacaPrompter:
    system_prompt = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request."  # noqa: E501
    system_no_input_prompt = "Below is an instruction that describes a task. Write a response that appropriately completes the request."  # noqa: E501
    system_format = "{system}"

    def __init__(self, prompt_style="instruct"):
        self.prompt_style = prompt_style if prompt_style else "instruct"
        self.match_prompt_style()

    def match_prompt_style(self):
        if self.prompt_style == "instruct":
            self.turn_format = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"  # noqa: E501
            self.turn_no_input_format = "### Instruction:\n{instruction}\n\n### Response:\n"
            self.system_format = "{system}\n\n"
        elif self.prompt_style == "chat":
            self.turn_format = "USER: {instruction}\n{input}\nASSISTANT:"
            self.turn_no_input_format = "USER: {instruction}\nASSISTANT:"
            self.system_format = "SYSTEM: {system}\n"
        elif self.prompt_style == "chatml":
            self.turn_format = "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n"  # noqa: E501
            self.turn_no_input_format = "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"  # noqa: E501
            self.system_format = "<|im_start|>system\n{system}<|im_end|>\n"
        elif self.prompt_style == "phi":
            self.turn_format = "<|user|>\n{instruction}<|end|>{input}<|assistant|>"
            self.turn_no_input_format = "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"
            self.system_format = "<|system|>\n{system}<|end|>\n"

    def build_prompt(self, instruction, input=None, output=None):
        if input:
            res = (self.system_format.format(system=self.system_prompt)
                   if self.system_prompt else "") + self.turn_format.format(
                instruction=instruction, input=input)
        else:
            res = (self.system_format.format(system=self.system_no_input_prompt)
                   if self.system_no_input_prompt else "") + self.turn_no_input_format.format(
                instruction=instruction)
        if output:
            res = f"{res}{output}"
        yield res


class RefStrategy:
    def __init__(self, prompter, tokenizer, train_on_inputs=False, sequence_len=2048):
        self.prompter = prompter
        self.tokenizer = tokenizer
        self.train_on_inputs = train_on_inputs
        self.sequence_len = sequence_len
        self.max_length = sequence_len

    def _tokenize(self, prompt, add_eos_token=True, strip_bos_token=False):
        empty = {"input_ids": [], "attention_mask": []}
        if not prompt:
            return empty
        result = dict(self.tokenizer(prompt, truncation=True, max_length=self.max_length,
                                     padding=False, return_tensors=None))
        result = {k: list(v) for k, v in result.items()}
        if len(result["input_ids"]) == 0:
            return empty
        if (result["input_ids"][-1] != self.tokenizer.eos_token_id
                and len(result["input_ids"]) < self.max_length and add_eos_token):
            result["input_ids"].append(self.tokenizer.eos_token_id)
            result["attention_mask"].append(1)
        if result["input_ids"][0] == self.tokenizer.bos_token_id and strip_bos_token:
            result["input_ids"] = result["input_ids"][1:]
            result["attention_mask"] = result["attention_mask"][1:]
        result["labels"] = result["input_ids"].copy()
        return result


class RefAlpacaStrategy(RefStrategy):  # InstructionPromptTokenizingStrategy + Alpaca's fields
    def parse_instruction_fields(self, prompt):
        return (prompt["instruction"], prompt["input"] if "input" in prompt else "",
                prompt["output"])

    def tokenize_prompt(self, prompt):
        instruction, input, response = self.parse_instruction_fields(prompt)
        user_prompt = next(iter(self.prompter.build_prompt(instruction, input)))
        tokenized_prompt = self._tokenize(user_prompt, add_eos_token=False)
        if not self.train_on_inputs:
            tokenized_prompt["labels"] = [IGNORE_INDEX] * len(tokenized_prompt["input_ids"])
        tokenized_res_prompt = self._tokenize(response, strip_bos_token=True, add_eos_token=True)
        tokenized_prompt["input_ids"] += tokenized_res_prompt["input_ids"]
        tokenized_prompt["attention_mask"] += tokenized_res_prompt["attention_mask"]
        tokenized_prompt["labels"] += tokenized_res_prompt["input_ids"]
        return tokenized_prompt


class RefCompletionPrompter:
    def build_prompt(self, instruction, input=None, output=None):
        yield instruction


class RefCompletionStrategy(RefStrategy):
    field = "text"

    def __init__(self, *args, max_length=None, **kwargs):
        super().__init__(*args, **kwargs)
        if max_length is not None:
            self.max_length = max_length

    def tokenize_prompt(self, prompt):  # batched: a dict of columns
        res = defaultdict(lambda: [])
        feature_names = list(prompt.keys())
        for row in zip(*prompt.values()):
            prompt_row = dict(zip(feature_names, row))
            full_prompt = next(iter(self.prompter.build_prompt(prompt_row[self.field])))
            tokenized_full_prompt = self._tokenize(full_prompt)
            for key, val in tokenized_full_prompt.items():
                for i in range(0, len(val), self.sequence_len):
                    res[key].append(val[i:i + self.sequence_len])
        return dict(res)


def ref_completion(tokenizer, sequence_len, field="text"):  # completion.load
    strat = RefCompletionStrategy(RefCompletionPrompter(), tokenizer, False, sequence_len,
                                  max_length=sequence_len * 64)
    strat.field = field
    return strat


class RefInputOutputStrategy(RefStrategy):
    def tokenize_prompt(self, prompt):
        input_ids, labels = [], []
        for segment in prompt["segments"]:
            label, text = segment["label"], segment["text"]
            tokenized_output = self.tokenizer(text, add_special_tokens=False,
                                              return_tensors=None)["input_ids"]
            input_ids += tokenized_output
            if label or self.train_on_inputs:
                labels += tokenized_output
            else:
                labels += [IGNORE_INDEX] * len(tokenized_output)
        return {"input_ids": input_ids, "labels": labels, "attention_mask": [1] * len(input_ids)}


# ----- tokenizers and records ----------------------------------------------------------------

# name: (data_files chat tokenizer, post-processor template, eos_token): Llama 3's BOS before
# every text; Qwen's none, and <|im_end|> its EOS; a BOS and an EOS around every text.
TOKENIZERS = {"llama3": ("llama3", "<|begin_of_text|> $A", "<|eot_id|>"),
              "qwen": ("qwen2_5", None, "<|im_end|>"),
              "bos_eos": ("llama3", "<|begin_of_text|> $A <|end_of_text|>", "<|end_of_text|>")}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompt_tokenizers")
    out = {}
    for name, (base, template, eos) in TOKENIZERS.items():
        path = write_chat_tokenizer(root / name, base)
        if template:
            tok = Tokenizer.from_file(str(path))
            special = [t for t in ("<|begin_of_text|>", "<|end_of_text|>") if t in template]
            tok.post_processor = processors.TemplateProcessing(
                single=template, special_tokens=[(t, tok.token_to_id(t)) for t in special])
            tok.save(str(path))
        config_path = path.parent / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["eos_token"] = eos
        config_path.write_text(json.dumps(config))
        out[name] = str(path)
    return out


def both(path):
    from transformers import AutoTokenizer

    return HFTokenizer(path), AutoTokenizer.from_pretrained(path.rsplit("/", 1)[0])


ALPACA = [
    {"instruction": "name three greek letters", "input": "alpha beta", "output": "gamma delta."},
    {"instruction": "say hello", "output": "hello there\n"},  # no input key
    {"instruction": "say hello", "input": "", "output": " hello"},  # empty input
    {"instruction": "traduis: déjà vu ✓", "input": "café naïve — 日本語",
     "output": "already seen ✓ 🙂"},
    {"instruction": "braces {input} {0}", "input": "{instruction}", "output": "{}"},
    {"instruction": "a system key", "input": "x", "output": "y", "system": "ignored"},
    {"instruction": "ends with its end token", "output": "done<|eot_id|>"},
    {"instruction": "ends with the other", "output": "done<|end_of_text|>"},
    {"instruction": "starts with a BOS", "output": "<|begin_of_text|>text"},
    {"instruction": "empty output", "input": "theta", "output": ""},
    {"instruction": "  spaces  ", "input": "\n", "output": "  \n "},
]


def check(ours, ref_input_ids, ref_labels):
    ids, mask = ours
    assert ids.tolist() == list(ref_input_ids)
    assert mask.tolist() == [int(label != IGNORE_INDEX) for label in ref_labels]


# ----- alpaca --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("style", ["instruct", "chat", "chatml", "phi"])
def test_alpaca_equals_axolotl(tokenizers, name, style):
    tok, hf = both(tokenizers[name])
    ref = RefAlpacaStrategy(RefAlpacaPrompter(style), hf, False, 2048)
    ours = prompt_formats.encode(ALPACA, "alpaca", tok, style=style, sequence_len=2048)
    for record, got in zip(ALPACA, ours):
        want = ref.tokenize_prompt(dict(record))
        check(got, want["input_ids"], want["labels"])
    # without a sequence_len (no truncation) the same, as none of these is long
    assert all((a[0] == b[0]).all() and (a[1] == b[1]).all() for a, b in zip(
        ours, prompt_formats.encode(ALPACA, "alpaca", tok, style=style)))


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_alpaca_bos_and_eos(tokenizers, name):
    """The rules spelled out: one BOS (the prompt's), the reply learned with one EOS after it;
    an empty reply adds nothing."""
    tok, _ = both(tokenizers[name])
    ids, mask = prompt_formats.encode(ALPACA[:1], "alpaca", tok)[0]
    prompt = tok.encode(prompt_formats.alpaca_prompt("name three greek letters", "alpha beta"),
                        add_special_tokens=True)
    reply = tok.encode("gamma delta.")
    assert ids.tolist() == prompt + reply + [tok.eos_id]
    assert mask.tolist() == [0] * len(prompt) + [1] * (len(reply) + 1)
    assert (ids == tok.eos_id).sum() == (2 if name == "bos_eos" else 1)  # bos_eos: the prompt's
    if tok.bos_id is not None:
        assert ids[0] == tok.bos_id and (ids == tok.bos_id).sum() == 1
    ids, mask = prompt_formats.encode([ALPACA[9]], "alpaca", tok)[0]
    assert not mask.any()


def test_alpaca_train_on_inputs_and_truncation(tokenizers):
    tok, hf = both(tokenizers["llama3"])
    records = ALPACA + [{"instruction": "long " * 40, "input": "in " * 30, "output": "out " * 50}]
    for train_on_inputs in (False, True):
        for sequence_len in (8, 24, 64):
            ref = RefAlpacaStrategy(RefAlpacaPrompter(), hf, train_on_inputs, sequence_len)
            ours = prompt_formats.encode(records, "alpaca", tok, train_on_inputs=train_on_inputs,
                                         sequence_len=sequence_len)
            for record, got in zip(records, ours):
                want = ref.tokenize_prompt(dict(record))
                check(got, want["input_ids"], want["labels"])


# ----- completion ----------------------------------------------------------------------------

TEXTS = ["alpha beta gamma", "café ✓ 日本語 🙂", "", "ends<|eot_id|>", "  leading spaces\n\n",
         " ".join(["omega psi chi"] * 120)]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("sequence_len", [4, 16, 2048])
def test_completion_equals_axolotl(tokenizers, name, sequence_len):
    """Axolotl's batched rows, cut into sequence_len pieces: ``chunks`` of ndjax's record.
    At sequence_len 4 the long text passes 64 x 4 tokens, and is truncated there."""
    tok, hf = both(tokenizers[name])
    records = [{"content": t, "other": 1} for t in TEXTS]
    want = ref_completion(hf, sequence_len, "content").tokenize_prompt(
        {"content": TEXTS, "other": [1] * len(TEXTS)})
    ours = prompt_formats.encode(records, "completion", tok, field="content",
                                 sequence_len=sequence_len)
    pieces = [c for ids, mask in ours for c in prompt_formats.chunks(ids, mask, sequence_len)]
    assert len(pieces) == len(want["input_ids"])
    for got, ids, labels in zip(pieces, want["input_ids"], want["labels"]):
        check(got, ids, labels)
    assert ours[2][0].size == 0 and prompt_formats.chunks(*ours[2], sequence_len) == []


def test_completion_default_field_and_no_truncation(tokenizers):
    tok, hf = both(tokenizers["llama3"])
    ours = prompt_formats.encode([{"text": t} for t in TEXTS], "completion", tok)
    whole = ref_completion(hf, 10**6).tokenize_prompt({"text": TEXTS})
    nonempty = [o for o, t in zip(ours, TEXTS) if t]
    for got, ids, labels in zip(nonempty, whole["input_ids"], whole["labels"], strict=True):
        check(got, ids, labels)
        assert got[0][0] == tok.bos_id and got[0][-1] == tok.eos_id


# ----- input_output --------------------------------------------------------------------------

SEGMENTS = [
    [{"label": True, "text": "<|begin_of_text|>Hello\n"}, {"label": True, "text": "hi there!. "},
     {"label": False, "text": "goodbye "}, {"label": True, "text": "farewell<|eot_id|>"}],
    [{"label": False, "text": "prompt: café "}, {"label": True, "text": "réponse ✓ 🙂"}],
    [{"label": False, "text": ""}, {"label": True, "text": "x"}, {"label": False, "text": "y"}],
    [{"label": False, "text": "nothing learned"}],
    [],
]


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("train_on_inputs", [False, True])
def test_input_output_equals_axolotl(tokenizers, name, train_on_inputs):
    tok, hf = both(tokenizers[name])
    ref = RefInputOutputStrategy(None, hf, train_on_inputs, 2048)
    records = [{"segments": s} for s in SEGMENTS]
    ours = prompt_formats.encode(records, "input_output", tok, train_on_inputs=train_on_inputs)
    for record, got in zip(records, ours):
        want = ref.tokenize_prompt(record)
        check(got, want["input_ids"], want["labels"])
    # no BOS or EOS but the texts' own; each segment alone (no merge across the seam)
    ids, mask = ours[2]
    assert ids.tolist() == tok.encode("x") + tok.encode("y")
    assert mask.tolist() == [1] * len(tok.encode("x")) + [int(train_on_inputs)]


# ----- bad records ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, record, words", [
    ("alpaca", {"input": "a", "output": "b"}, "no 'instruction' field"),
    ("alpaca", {"instruction": "a", "input": "b"}, "no 'output' field"),
    ("alpaca", {"instruction": "a", "output": None}, "no 'output' field"),
    ("alpaca", {"instruction": "a", "output": 3}, "'output' is int"),
    ("alpaca", {"instruction": ["a"], "output": "b"}, "'instruction' is list"),
    ("alpaca", {"instruction": "a", "input": 1.5, "output": "b"}, "'input' is float"),
    ("completion", {"content": "a"}, "no 'text' field"),
    ("input_output", {"text": "a"}, "no 'segments' list"),
    ("input_output", {"segments": [{"text": "a"}]}, "item 0"),
    ("input_output", {"segments": [{"text": "a", "label": True}, {"text": "b", "label": "false"}]},
     "item 1"),
])
def test_bad_records_name_the_key(tokenizers, fmt, record, words):
    """The error names the key; ``index`` says which record, for the caller to name its line."""
    tok, _ = both(tokenizers["qwen"])
    good = {"alpaca": ALPACA[0], "completion": {"text": "t"},
            "input_output": {"segments": SEGMENTS[0]}}[fmt]
    with pytest.raises(prompt_formats.BadRecord, match=words.replace("'", ".")) as e:
        prompt_formats.encode([good, good, record], fmt, tok)
    assert e.value.index == 2
    with pytest.raises(prompt_formats.BadRecord, match="a list, not an object") as e:
        prompt_formats.encode([good, ["text"]], fmt, tok)
    assert e.value.index == 1


def test_unknown_format_or_style(tokenizers):
    tok, _ = both(tokenizers["qwen"])
    with pytest.raises(ValueError, match="alpaca, completion, input_output"):
        prompt_formats.encode([], "sharegpt", tok)
    with pytest.raises(ValueError, match="instruct, chat, chatml, phi"):
        prompt_formats.encode([], "alpaca", tok, style="vicuna")


# ----- ShareGPT -> chat ----------------------------------------------------------------------

SHAREGPT = {"conversations": [{"from": "human", "value": "hi?"},
                              {"from": "gpt", "value": "hello.", "weight": 1},
                              {"from": "human", "value": "café?"},
                              {"from": "gpt", "value": "✓"}],
            "system": "be brief"}
MAPPING = {"role": "from", "content": "value"}


def test_sharegpt_maps_to_chat_messages():
    """Axolotl's chat_template with field_messages: conversations and
    message_property_mappings {role: from, content: value}: human -> user, gpt -> assistant,
    the record's system field first; keys nothing maps stay."""
    got = prompt_formats.chat_messages(SHAREGPT, "conversations", MAPPING)
    assert got == [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": "hi?"},
                   {"role": "assistant", "content": "hello.", "weight": 1},
                   {"role": "user", "content": "café?"},
                   {"role": "assistant", "content": "✓"}]
    # a system message already first: the field is not added; JSON text is read
    record = {"conversations": json.dumps([{"from": "system", "value": "s"},
                                           {"from": "gpt", "value": "a"}]), "system": "x"}
    assert prompt_formats.chat_messages(record, "conversations", MAPPING) == [
        {"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
    # roles: replaces the defaults; a role it does not name passes as it is
    roles = {"user": ["asker"], "assistant": ["bot"]}
    record = {"messages": [{"role": "asker", "content": "q"}, {"role": "bot", "content": "a"},
                           {"role": "human", "content": "q2"}]}
    assert [m["role"] for m in prompt_formats.chat_messages(record, roles=roles)] == [
        "user", "assistant", "human"]
    # default mapping and roles: role/content as they are, gpt still -> assistant
    record = {"messages": [{"role": "user", "content": "q"}, {"role": "gpt", "content": "a"}]}
    assert prompt_formats.chat_messages(record) == [{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}]


def test_sharegpt_bad_records():
    with pytest.raises(prompt_formats.BadRecord, match="message 1 has no 'value'"):
        prompt_formats.chat_messages({"conversations": [{"from": "human", "value": "q"},
                                                        {"from": "gpt"}]},
                                     "conversations", MAPPING)
    with pytest.raises(prompt_formats.BadRecord, match="not a list of message objects .got None"):
        prompt_formats.chat_messages({"messages": []}, "conversations", MAPPING)
    with pytest.raises(prompt_formats.BadRecord, match="not JSON"):
        prompt_formats.chat_messages({"conversations": "[{"}, "conversations", MAPPING)


def test_sharegpt_through_the_chat_path(tokenizers):
    """The mapped conversation is what ndjax's chat source encodes: the same ids and mask as
    the conversation written with role/content."""
    path = tokenizers["llama3"]
    messages = prompt_formats.chat_messages(SHAREGPT, "conversations", MAPPING)
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    docs = [Document({"messages": m}, "chats.jsonl", 0, "jsonl") for m in (messages, plain)]
    (ids, mask), (ids2, mask2) = chat.encode(docs, load_chat_template(path), HFTokenizer(path))
    assert ids.tolist() == ids2.tolist() and mask.tolist() == mask2.tolist() and mask.any()
    assert np.array_equal(ids, ids2)
