"""Axolotl's per-dataset prompt formats (its ``type:``) -> token ids and a mask of the tokens
the model learns, token for token as Axolotl builds them (read at axolotl-ai-cloud/axolotl
067b021c: ``prompters.py``, ``prompt_tokenizers.py``, ``prompt_strategies/completion.py``,
``input_output.py``, ``chat_template.py``, ``utils/data/wrappers.py``).

- ``alpaca`` (``type: alpaca``, ``alpaca:chat``, ``alpaca:chatml``, ``alpaca:phi``; the
  ``alpaca_chat`` and ``alpaca_instruct`` modules are the chat and instruct styles): a fixed
  system prompt and the ``instruction`` (and ``input`` when not empty) form the prompt; the
  prompt and the ``output`` are tokenized *separately*, each with the tokenizer's special
  tokens (its post-processor: a BOS for Llama). The output's leading BOS is dropped and its
  EOS appended unless it already ends with one; an empty output adds nothing, not even the
  EOS. The prompt is not learned unless ``train_on_inputs``.
- ``completion``: the ``field`` text with special tokens and an EOS appended, all learned.
  Axolotl then cuts it into ``sequence_len`` pieces, each its own sample: ``chunks``.
- ``input_output``: ``segments`` of ``{text, label}``, each tokenized alone without special
  tokens (BOS, EOS and spaces are whatever the texts hold), learned where ``label`` is true.

ShareGPT-style conversations (``from``/``value``) take the chat path: ``chat_messages``
maps them to ``{role, content}`` as Axolotl's ``chat_template`` type does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from ndjax.data.tokenizers import HFTokenizer, token_dtype

FORMATS = ("alpaca", "completion", "input_output")
T = TypeVar("T")

# AlpacaPrompter's system prompts, and per prompt style (match_prompt_style) the formats of
# the system prompt, the turn with an input and the turn without.
SYSTEM = ("Below is an instruction that describes a task, paired with an input that provides "
          "further context. Write a response that appropriately completes the request.")
SYSTEM_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                   "appropriately completes the request.")
STYLES = {
    "instruct": ("{system}\n\n",
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": ("SYSTEM: {system}\n", "USER: {instruction}\n{input}\nASSISTANT:",
             "USER: {instruction}\nASSISTANT:"),
    "chatml": ("<|im_start|>system\n{system}<|im_end|>\n",
               "<|im_start|>user\n{instruction}\n{input}<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\n{instruction}<|im_end|>\n<|im_start|>assistant\n"),
    "phi": ("<|system|>\n{system}<|end|>\n", "<|user|>\n{instruction}<|end|>{input}<|assistant|>",
            "<|user|>\n{instruction}<|end|>\n<|assistant|>\n"),
}
# Axolotl's chat_template roles when a dataset gives none (``roles:`` replaces them all).
ROLES = {"human": "user", "user": "user", "assistant": "assistant", "gpt": "assistant",
         "system": "system", "tool": "tool"}
# The completion strategy truncates a text at this many times sequence_len.
COMPLETION_MAX = 64


class BadRecord(ValueError):
    """A record that does not fit its format; ``index`` is its place in ``encode``'s
    records, for the caller to name the file and line."""

    index: int | None = None


def alpaca_prompt(instruction: str, input: str = "", style: str = "instruct") -> str:
    """AlpacaPrompter.build_prompt without the output: the text before the response."""
    system, turn, turn_no_input = STYLES[style]
    if input:
        return system.format(system=SYSTEM) + turn.format(instruction=instruction, input=input)
    return system.format(system=SYSTEM_NO_INPUT) + turn_no_input.format(instruction=instruction)


def encode(records: Sequence[dict], fmt: str, tok: HFTokenizer, *, style: str = "instruct",
           field: str = "text", train_on_inputs: bool = False, sequence_len: int | None = None
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` per record in format ``fmt``: mask 1 on the tokens Axolotl keeps as
    labels. ``style``: alpaca's prompt style; ``field``: completion's text key;
    ``sequence_len``: Axolotl's, which truncates each tokenized piece as its tokenizer call
    does. None: no truncation, which changes only samples longer than sequence_len, not
    their first sequence_len tokens; but a completion keeps its tail past 64 x sequence_len."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: use one of {', '.join(FORMATS)}")
    if style not in STYLES:
        raise ValueError(f"alpaca style {style!r}: use one of {', '.join(STYLES)}")
    dtype = token_dtype(tok.vocab_size)
    if fmt == "alpaca":
        pairs = _each(records, lambda r: _alpaca(r, style))
        prompts = _tokenize(tok, [p for p, _ in pairs], sequence_len, add_eos=False)
        replies = _tokenize(tok, [o for _, o in pairs], sequence_len, strip_bos=True)
        return [_join([(p, train_on_inputs), (r, True)], dtype) for p, r in zip(prompts, replies)]
    if fmt == "completion":
        texts = _each(records, lambda r: _string(r, field))
        limit = None if sequence_len is None else COMPLETION_MAX * sequence_len
        return [_join([(ids, True)], dtype) for ids in _tokenize(tok, texts, limit)]
    segments = _each(records, _segments)
    flat = tok.tokenizer.encode_batch([t for s in segments for t, _ in s], add_special_tokens=False)
    pieces = iter(e.ids for e in flat)
    return [_join([(next(pieces), label or train_on_inputs) for _, label in s], dtype)
            for s in segments]


def chunks(ids: np.ndarray, mask: np.ndarray, sequence_len: int
           ) -> list[tuple[np.ndarray, np.ndarray]]:
    """A completion cut into the ``sequence_len`` pieces Axolotl trains as separate samples
    (only the first holds the BOS, only the last the EOS; an empty text gives none)."""
    return [(ids[i:i + sequence_len], mask[i:i + sequence_len])
            for i in range(0, len(ids), sequence_len)]


def chat_messages(record: dict, field_messages: str = "messages",
                  property_mappings: Mapping[str, str] | None = None,
                  roles: Mapping[str, Sequence[str]] | None = None,
                  field_system: str = "system") -> list[dict]:
    """A record's conversation as Axolotl's ``chat_template`` type reads it: each message's
    keys renamed by ``property_mappings`` (``{role: from, content: value}`` for ShareGPT),
    its role renamed by ``roles`` (``{user: [human]}``; default ``ROLES``), and the record's
    ``field_system`` string put first as a system message when the first is not one."""
    mapping = dict(property_mappings or {"role": "role", "content": "content"})
    rename = ROLES if not roles else {s: t for t, sources in roles.items() for s in sources}
    messages = record.get(field_messages)
    if isinstance(messages, str):  # Axolotl takes a conversation stored as JSON text too
        try:
            messages = json.loads(messages)
        except ValueError as e:
            raise BadRecord(f"{field_messages!r} is a string but not JSON: {e}") from None
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRecord(f"{field_messages!r} is not a list of message objects (got "
                        f"{type(messages).__name__}; the record's keys: {sorted(record)}).")
    out = []
    for k, m in enumerate(messages):
        # Keys nothing maps stay (tool_calls...); templates ignore those they do not use.
        turn = {key: v for key, v in m.items() if key not in mapping.values()}
        turn.update((target, m[source]) for target, source in mapping.items()
                    if m.get(source) is not None)
        for target in ("role", "content"):
            if target not in turn:
                raise BadRecord(f"{field_messages!r} message {k} has no "
                                f"{mapping.get(target, target)!r} (keys {sorted(m)}).")
        turn["role"] = rename.get(turn["role"], turn["role"])
        out.append(turn)
    if out and out[0]["role"] != "system" and record.get(field_system) is not None:
        out.insert(0, {"role": "system", "content": record[field_system]})
    return out


def _each(records: Sequence[dict], parse: Callable[[dict], T]) -> list[T]:
    out = []
    for k, record in enumerate(records):
        try:
            if not isinstance(record, dict):
                raise BadRecord(f"a {type(record).__name__}, not an object of named fields.")
            out.append(parse(record))
        except BadRecord as e:
            e.index = k
            raise
    return out


def _string(record: dict, key: str, optional: bool = False) -> str:
    value = record.get(key)
    if value is None and optional:
        return ""
    if value is None:
        raise BadRecord(f"no {key!r} field (keys {sorted(record)}).")
    if not isinstance(value, str):
        raise BadRecord(f"{key!r} is {type(value).__name__}, not a string.")
    return value


def _alpaca(record: dict, style: str) -> tuple[str, str]:
    # A ``system`` key is ignored, as by Axolotl's alpaca (alpaca_w_system reads it).
    prompt = alpaca_prompt(_string(record, "instruction"),
                           _string(record, "input", optional=True), style)
    return prompt, _string(record, "output")


def _segments(record: dict) -> list[tuple[str, bool]]:
    segments = record.get("segments")
    if not isinstance(segments, list):
        raise BadRecord(f"no 'segments' list (keys {sorted(record)}).")
    out = []
    for k, s in enumerate(segments):
        if not isinstance(s, dict) or not isinstance(s.get("text"), str) \
                or not isinstance(s.get("label"), bool):
            raise BadRecord(f"'segments' item {k} is not {{'text': str, 'label': bool}} "
                            f"(got {str(s)[:60]}).")
        out.append((s["text"], s["label"]))
    return out


def _tokenize(tok: HFTokenizer, texts: list[str], max_length: int | None, *,
              add_eos: bool = True, strip_bos: bool = False) -> list[list[int]]:
    """Axolotl's PromptTokenizingStrategy._tokenize over ``texts``: transformers'
    ``tokenizer(text, truncation=True, max_length=max_length)``, then its EOS and BOS rules."""
    raw = tok.tokenizer
    # transformers truncates before the post-processor, keeping room for its tokens.
    room = raw.post_processor.num_special_tokens_to_add(False) if raw.post_processor else 0
    out = []
    for text, enc in zip(texts, raw.encode_batch(texts, add_special_tokens=False)):
        if not text:  # no tokens at all, not even the post-processor's
            out.append([])
            continue
        if max_length is not None:
            enc.truncate(max_length - room)
        ids = raw.post_process(enc).ids
        if not ids:
            out.append([])
            continue
        if add_eos and ids[-1] != tok.eos_id and (max_length is None or len(ids) < max_length):
            ids.append(tok.eos_id)
        if strip_bos and ids[0] == tok.bos_id:
            ids = ids[1:]
        out.append(ids)
    return out


def _join(pieces: list[tuple[list[int], bool]], dtype: np.dtype
          ) -> tuple[np.ndarray, np.ndarray]:
    ids = np.asarray([i for p, _ in pieces for i in p], dtype)
    mask = np.asarray([int(learn) for p, learn in pieces for _ in p], np.uint8)
    return ids, mask
