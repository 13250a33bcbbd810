"""Chat and instruction data: records -> conversations -> token ids and a mask of the
tokens the model learns (the assistant's).

A record (a JSON Lines object or a Parquet row) holds either ``messages``
(``data.messages_field``: a list of ``{role, content}``, roles system, user,
assistant or tool) or ``prompt`` and ``completion`` (``data.prompt_field``,
``data.completion_field``): strings, rendered as one user message and one
assistant message, or lists of messages (TRL's conversational form).

Each conversation is rendered with the tokenizer's chat template
(``chat_template``) and tokenized whole, without special tokens added, so the
ids equal transformers' ``apply_chat_template(messages, tokenize=True)``.

Which tokens are the assistant's (mask 1) is found without markers in the conversation:

- A template with ``{% generation %}`` blocks says so itself: the text rendered
  inside them (transformers' ``return_assistant_tokens_mask`` convention).
- Otherwise, by prefixes: assistant message ``i`` is the text between the
  rendering of ``messages[:i]`` with ``add_generation_prompt=True`` (everything up
  to and including the assistant's header) and the rendering of
  ``messages[:i+1]`` (the turn complete): the reply and its end-of-turn token
  (``<|eot_id|>``, ``<|im_end|>``, ``<end_of_turn>``, ``</s>``). Whitespace the
  template writes after a special token that ends the span (ChatML's newline after
  ``<|im_end|>``, Gemma's after ``<end_of_turn>``) belongs to the next turn's
  scaffolding and is left out. Both renderings must
  be prefixes of the whole conversation's; a template that rewrites earlier
  turns (e.g. drops their reasoning) is an error that asks for
  ``{% generation %}`` blocks.

  A conversation that opens with the assistant has no earlier messages to
  render, and templates do not render "no messages" as the start of a
  conversation (Qwen 2.5's reads ``messages[0]``, Llama 3's writes its BOS with the
  first message, ChatML's default system prompt comes with the first message).
  There, the text before the reply is what the template writes before a
  placeholder reply (``_PLACEHOLDER``) given as the first message, which must
  also be a prefix of the whole rendering.

A token is the assistant's when its character span (the tokenizer's offsets)
overlaps an assistant span, transformers' rule. Everything else (system, user
and prompt text, role headers, BOS) has mask 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ndjax.data.chat_template import ChatTemplate, TemplateRefused
from ndjax.data.sources import Document
from ndjax.data.tokenizers import HFTokenizer
from ndjax.runtime.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
# The content of a conversation's first message, when it is the assistant's, in the
# rendering that finds where that reply begins (letters only: trimmed, split or escaped,
# it stays itself).
_PLACEHOLDER = "ndjaxPlaceholderReplyQx7"
OVERLONG = ("drop", "truncate")


class _BadRecord(Exception):
    """A record that is not a conversation; ``conversation`` adds where it is."""


def conversation(doc: Document, messages_field: str, prompt_field: str,
                 completion_field: str) -> list[dict]:
    """The messages of one record, checked; errors name the file and line (or row)."""
    record = doc.content
    assert isinstance(record, dict), "chat corpora yield records"
    # Parquet rows carry every column the file has, null where a row lacks one.
    record = {k: v for k, v in record.items() if v is not None}
    try:
        return _conversation(record, messages_field, prompt_field, completion_field)
    except _BadRecord as e:  # only now find the line number: it reads the file
        raise ConfigError(f"{doc.field}: {doc.where()}: {e}") from None


def _conversation(record: dict, messages_field: str, prompt_field: str,
                  completion_field: str) -> list[dict]:
    if messages_field in record:
        return _messages(record[messages_field], messages_field)
    if prompt_field in record and completion_field in record:
        prompt, completion = record[prompt_field], record[completion_field]
        first = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                 else _messages(prompt, prompt_field, need_assistant=False))
        last = ([{"role": "assistant", "content": completion}] if isinstance(completion, str)
                else _messages(completion, completion_field))
        return _messages(first + last, f"{prompt_field}+{completion_field}")
    raise _BadRecord(
        f"no {messages_field!r} field and no {prompt_field!r} + {completion_field!r} "
        f"pair (found {sorted(record)}); set data.messages_field, or data.prompt_field and "
        "data.completion_field, to the record's keys.")


def _messages(value: object, name: str, need_assistant: bool = True) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _BadRecord(f"{name!r} is {type(value).__name__}, not a non-empty list of "
                         "{role, content} messages.")
    out = []
    for k, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            raise _BadRecord(f"{name!r} message {k} is not {{'role': str, 'content': "
                             f"str}} (got {_short(m)}).")
        if m["role"] not in ROLES:
            raise _BadRecord(f"{name!r} message {k} has role {m['role']!r}; use one of "
                             f"{', '.join(ROLES)} (rename e.g. human -> user, gpt -> assistant).")
        out.append({key: v for key, v in m.items() if v is not None})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise _BadRecord(f"{name!r} has no assistant message, so nothing to learn; "
                         "remove the record or add the reply.")
    return out


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def assistant_spans(template: ChatTemplate, messages: list[dict], special: Sequence[str]
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant's turns (see
    the module docstring). Raises TemplateRefused if the template rejects it."""
    if template.has_generation_blocks:
        return template.render_tracked(messages)
    full = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _before_reply(template, messages, i)
        upto = full if i == len(messages) - 1 else template.render(messages[:i + 1])
        if before is None or not (full.startswith(upto) and upto.startswith(before)):
            raise ConfigError(
                f"{template.origin}: rendering the conversation up to its assistant message {i} "
                "is not a prefix of rendering all of it (the template rewrites earlier turns), "
                "so the assistant's tokens cannot be found by prefixes; wrap each assistant "
                "reply in {% generation %}...{% endgeneration %} in a copy of the template and "
                "set data.chat_template to it.")
        start, end = len(before), len(upto)
        kept = full[start:end].rstrip()
        if kept.endswith(tuple(special)):  # trailing whitespace after the end-of-turn token
            end = start + len(kept)
        spans.append((start, end))
    return full, spans


def _before_reply(template: ChatTemplate, messages: list[dict], i: int) -> str | None:
    """The rendering up to and including assistant message ``i``'s header (see the module
    docstring); None if the template drops the placeholder reply of a first message."""
    if i > 0:
        return template.render(messages[:i], add_generation_prompt=True)
    probe = template.render([{**messages[0], "content": _PLACEHOLDER}])
    at = probe.find(_PLACEHOLDER)
    return probe[:at] if at >= 0 else None


def token_mask(offsets: np.ndarray, spans: Iterable[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose ``[start, end)`` character offsets overlap a span."""
    mask = np.zeros(len(offsets), np.uint8)
    for s, e in spans:
        mask |= ((offsets[:, 0] < e) & (offsets[:, 1] > s)).astype(np.uint8)
    return mask


def encode(docs: Sequence[Document], template: ChatTemplate, tok: HFTokenizer, *,
           messages_field: str = "messages", prompt_field: str = "prompt",
           completion_field: str = "completion") -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` per record: token ids of the rendered conversation and 1 on the
    assistant's tokens."""
    texts, all_spans = [], []
    for doc in docs:
        messages = conversation(doc, messages_field, prompt_field, completion_field)
        try:
            text, spans = assistant_spans(template, messages, tok.special_tokens)
        except TemplateRefused as e:
            raise ConfigError(f"{doc.field}: {doc.where()}: the chat template ({template.origin}) "
                              f"refused this conversation: {e}. Fix the record or the "
                              "template.") from None
        texts.append(text)
        all_spans.append(spans)
    return [(ids, token_mask(offsets, spans))
            for (ids, offsets), spans in zip(tok.encode_offsets(texts), all_spans)]


def fit(ids: np.ndarray, mask: np.ndarray, max_len: int, overlong: str
        ) -> tuple[np.ndarray, np.ndarray] | None:
    """A conversation cut to fit ``max_len`` tokens, as ``data.overlong`` says, or None
    to drop it. A truncated one keeps its beginning; it is dropped too if nothing it
    still holds is learned (its first token is never a target)."""
    if len(ids) <= max_len:
        return ids, mask
    if overlong == "drop":
        return None
    ids, mask = ids[:max_len], mask[:max_len]
    return (ids, mask) if mask[1:].any() else None
