"""Small corpora written by the tests: text, JSON Lines, Parquet, token files, a tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import tiny_config

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi "
         "rho sigma tau upsilon phi chi psi omega").split()


def texts(n: int = 24, seed: int = 0) -> list[str]:
    """``n`` distinct ASCII documents of a few lines each (~60-250 bytes)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lines = [" ".join(rng.choice(WORDS, rng.integers(3, 9))) for _ in range(rng.integers(1, 5))]
        out.append(f"doc {i}: " + "\n".join(lines))
    return out


def write_text(folder: Path, docs: list[str], per_file: int = 5) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(0, len(docs), per_file):
        p = folder / f"part{k // per_file:02d}.txt"
        p.write_text("\n".join(docs[k:k + per_file]) + "\n")
        paths.append(p)
    return paths


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def write_parquet(path: Path, docs: list[str], column: str = "text") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({column: docs, "id": list(range(len(docs)))}), path,
                   row_group_size=5)  # several row groups: shares cut across them
    return path


def write_tokenizer(path: Path, docs: list[str], vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer.json trained on ``docs`` (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return path


def data_config(source: str, files: str = "", *, vocab_size: int = 384, batch_size: int = 8,
                seq_len: int = 16, **data):
    c = tiny_config(model=dict(vocab_size=vocab_size),
                    train=dict(batch_size=batch_size, seq_len=seq_len))
    c.data.source = source
    c.data.files = files
    c.data.update(data)
    return c


# ----- chat data ----------------------------------------------------------------

CHAT_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<pad>"]
# Meta's Llama 3 Instruct template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
    "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# ChatML as Qwen2 writes it: a default system prompt when the chat has none.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML with transformers' {% generation %} blocks around each reply.
CHATML_GENERATION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
    "{% endif %}{{ '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML as Qwen 2.5 Instruct writes it (written here from the format): Qwen's own default
# system prompt when the chat has none, tool results as user turns in <tool_response> tags,
# the assistant's tool calls as <tool_call> JSON after its text.
QWEN2_5_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QWEN2_5_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\n" + QWEN2_5_SYSTEM + "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant' and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'assistant' %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for call in message.tool_calls %}\n"
    "            {%- if call.function is defined %}{%- set call = call.function %}{%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}\n"
    "            {{- call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == 'tool' %}\n"
    "        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}\n"
    "        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n")
# Gemma 3 (written here from the format): BOS, the system prompt folded into the first user
# turn, the assistant called "model", every message trimmed, roles that must alternate.
GEMMA_SPECIAL = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"]
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = '' -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}\n"
    "    {%- endif -%}\n"
    "    {%- if message['role'] == 'assistant' -%}\n"
    "        {%- set role = 'model' -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}\n"
    "    {{- message['content'] | trim -}}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{ '<start_of_turn>model\\n' }}\n"
    "{%- endif -%}\n")
# name: (template, bos_token, eos_token)
CHAT_TEMPLATES = {"llama3": (LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>"),
                  "chatml": (CHATML_TEMPLATE, None, "<|im_end|>"),
                  "chatml_generation": (CHATML_GENERATION_TEMPLATE, None, "<|im_end|>"),
                  "qwen2_5": (QWEN2_5_TEMPLATE, None, "<|im_end|>"),
                  "gemma3": (GEMMA3_TEMPLATE, "<bos>", "<eos>")}


def conversations(n: int = 24, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations of 1-3 exchanges, some with a system prompt, one non-ASCII."""
    rng = np.random.default_rng(seed)
    say = lambda: " ".join(rng.choice(WORDS, rng.integers(2, 7)))  # noqa: E731
    out = []
    for i in range(n):
        chat = [{"role": "system", "content": f"be brief {say()}"}] if i % 3 == 0 else []
        for _ in range(rng.integers(1, 4)):
            chat += [{"role": "user", "content": f"{say()}?"},
                     {"role": "assistant", "content": say() + ("." if i % 2 else "\n")}]
        out.append(chat)
    if n > 1:
        out[1][-1]["content"] = "café naïve ✓ — déjà vu"
    return out


def write_chat_tokenizer(folder: Path, template: str = "llama3", vocab_size: int = 360) -> Path:
    """A byte-level BPE tokenizer.json with Llama 3 and ChatML special tokens (and Gemma's
    for a Gemma template), trained on the chat texts, and a tokenizer_config.json with the
    named chat template ("" or None: none). Returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Gemma's tokens only where a Gemma template uses them: the other tokenizers keep the
    # vocabulary (and the ids) they had.
    special = CHAT_SPECIAL + (GEMMA_SPECIAL if (template or "").startswith("gemma") else [])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    texts = [m["content"] for c in conversations(64) for m in c] + ["user assistant system"]
    tok.train_from_iterator(texts, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    if template:
        text, bos, eos = CHAT_TEMPLATES[template]
        config.update(chat_template=text, eos_token=eos, **({"bos_token": bos} if bos else {}))
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return folder / "tokenizer.json"


def write_chat_jsonl(path: Path, chats: list[list[dict]], field: str = "messages") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(chats)))
    return path


def chat_overrides(folder: Path, template: str = "llama3", n: int = 64) -> dict:
    """Config overrides (``{"group.key": value}``) that train ``tiny_config`` on ``n``
    conversations: the chat tokenizer, its vocabulary, rows that hold most of them (some
    are longer, and dropped)."""
    tokenizer = write_chat_tokenizer(folder / "tokenizer", template)
    files = write_chat_jsonl(folder / "chats.jsonl", conversations(n))
    return {"data.source": "chat", "data.files": str(files), "data.tokenizer": str(tokenizer),
            "model.vocab_size": 384, "train.seq_len": 96}
