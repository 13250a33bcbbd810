"""Chat and instruction data: records -> conversations -> token ids and a mask of the
tokens the model learns (by default the assistant's).

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

Other roles' turns (``data.roles_to_train``, Axolotl's setting: e.g. user too) are found
the same way, from what the template writes before a placeholder content in their place
to the rendering that ends with them: their content (the template's writing of it) and
their end-of-turn token, without the role header. A message the template does not write
on its own (Gemma's system prompt, folded into the first user turn) has no turn and is not
learned.

Each turn's end-of-turn token is the special token that ends its span, if one does;
``data.train_on_eos`` (Axolotl's) says which are learned: ``turn`` (default: those of
the learned turns), ``all`` (every turn's), ``last`` (only the last learned turn's) or
``none``.

A token is learned when its character span (the tokenizer's offsets) overlaps a
learned span, transformers' rule. Everything else (by default system, user and
prompt text, role headers, BOS) has mask 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Sequence

import numpy as np

from ndjax.config import CHAT_ROLES
from ndjax.data.chat_template import ChatTemplate, TemplateRefused
from ndjax.data.sources import Document
from ndjax.data.tokenizers import HFTokenizer
from ndjax.runtime.errors import ConfigError

ROLES = CHAT_ROLES
# A message's content in the rendering that finds where that content begins (a first
# reply, another role's turn: ``_before``; letters only: trimmed, split or escaped, it
# stays itself).
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


@dataclasses.dataclass(frozen=True)
class Turn:
    """Where one message's learnable text lies in the rendered conversation: its content
    from ``start``, its end-of-turn token from ``eot`` (``eot == end`` if it has none)."""
    role: str
    start: int
    eot: int
    end: int


def turns(template: ChatTemplate, messages: list[dict], special: Sequence[str],
          roles: Collection[str] = ("assistant",)) -> tuple[str, list[Turn]]:
    """The rendered conversation and the turns of the messages with a role in ``roles``,
    in order (see the module docstring). Raises TemplateRefused if the template rejects
    the conversation."""
    if template.has_generation_blocks:
        full, spans = template.render_tracked(messages)
        found = [_turn("assistant", full, s, e, special) for s, e in spans] \
            if "assistant" in roles else []
    else:
        full, found = template.render(messages), []
    for i, m in enumerate(messages):
        if m["role"] not in roles or (m["role"] == "assistant" and template.has_generation_blocks):
            continue
        before = _before(template, messages, i)
        if before is None and m["role"] == "assistant":
            raise ConfigError(_rewrites(template, i, m["role"]))
        if before is None:  # not rendered on its own (Gemma's system prompt)
            continue
        upto = full if i == len(messages) - 1 else template.render(messages[:i + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            raise ConfigError(_rewrites(template, i, m["role"]))
        start, end = len(before), len(upto)
        kept = full[start:end].rstrip()
        if kept.endswith(tuple(special)):  # trailing whitespace after the end-of-turn token
            end = start + len(kept)
        found.append(_turn(m["role"], full, start, end, special))
    return full, sorted(found, key=lambda t: t.start)


def _turn(role: str, full: str, start: int, end: int, special: Sequence[str]) -> Turn:
    """A turn whose text ends with its end-of-turn token, if a special token ends it
    (whitespace after it may follow: a {% generation %} block's)."""
    kept = full[start:end].rstrip()
    ending = max((t for t in special if t and kept.endswith(t)), key=len, default="")
    eot = start + len(kept) - len(ending) if ending else end
    return Turn(role, start, eot, end)


def _rewrites(template: ChatTemplate, i: int, role: str) -> str:
    fix = ("wrap each assistant reply in {% generation %}...{% endgeneration %} in a copy of "
           "the template and set data.chat_template to it" if role == "assistant" else
           f"leave {role} out of data.roles_to_train (and use data.train_on_eos other than "
           "all)")
    return (f"{template.origin}: rendering the conversation up to its {role} message {i} is "
            "not a prefix of rendering all of it (the template rewrites earlier turns), so "
            f"that turn's tokens cannot be found by prefixes; {fix}.")


def _before(template: ChatTemplate, messages: list[dict], i: int) -> str | None:
    """The rendering up to where message ``i``'s content begins (see the module
    docstring): for a reply after the first message, the rendering before it with the
    generation prompt; else what the template writes before a placeholder content. None
    if the template does not write the placeholder (a first reply it drops, a system
    prompt it folds into the next turn)."""
    if i > 0 and messages[i]["role"] == "assistant":
        return template.render(messages[:i], add_generation_prompt=True)
    probe = template.render(messages[:i] + [{**messages[i], "content": _PLACEHOLDER}])
    at = probe.find(_PLACEHOLDER)
    return probe[:at] if at >= 0 else None


def learned_spans(found: Sequence[Turn], roles: Collection[str], train_on_eos: str
                  ) -> list[tuple[int, int]]:
    """The character spans learned: the content of each turn of a role in ``roles``, and
    the end-of-turn tokens ``train_on_eos`` says (turn: those of the learned turns; all:
    every turn's; last: the last learned turn's; none)."""
    learned = [t for t in found if t.role in roles]
    last = learned[-1] if learned else None
    spans = []
    for t in found:
        if t.role in roles:
            spans.append((t.start, t.eot))
        if train_on_eos == "all" or (train_on_eos == "turn" and t.role in roles) \
                or (train_on_eos == "last" and t is last):
            spans.append((t.eot, t.end))
    return [(s, e) for s, e in spans if s < e]


def token_mask(offsets: np.ndarray, spans: Iterable[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose ``[start, end)`` character offsets overlap a span."""
    mask = np.zeros(len(offsets), np.uint8)
    for s, e in spans:
        mask |= ((offsets[:, 0] < e) & (offsets[:, 1] > s)).astype(np.uint8)
    return mask


def encode(docs: Sequence[Document], template: ChatTemplate, tok: HFTokenizer, *,
           messages_field: str = "messages", prompt_field: str = "prompt",
           completion_field: str = "completion", roles_to_train: Collection[str] = ("assistant",),
           train_on_eos: str = "turn") -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` per record: token ids of the rendered conversation and 1 on the
    tokens learned (``roles_to_train``' turns and the end-of-turn tokens
    ``train_on_eos`` says: ``learned_spans``)."""
    # The turns to find: the learned roles', or every role's when all end-of-turn tokens are.
    needed = ROLES if train_on_eos == "all" else tuple(roles_to_train)
    texts, all_spans = [], []
    for doc in docs:
        messages = conversation(doc, messages_field, prompt_field, completion_field)
        try:
            text, found = turns(template, messages, tok.special_tokens, needed)
            spans = learned_spans(found, roles_to_train, train_on_eos)
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
