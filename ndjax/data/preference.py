"""Preference data (``data.format=preference``): records of a prompt, a chosen and a
rejected completion -> the token ids of both sequences, as TRL 1.16's ``DPOTrainer``
tokenizes them (``_prepare_dataset``), and where their completions start.

A record (a JSON Lines object, a Parquet or ``datasets`` row) holds
``data.chosen_field`` and ``data.rejected_field``, and may hold ``data.prompt_field``:
all strings (standard) or all lists of ``{role, content}`` messages (conversational).

- Implicit prompt: a record without a prompt is split into one by TRL's
  ``extract_prompt``: the longest common prefix of chosen and rejected (of messages;
  of characters, moved back by one where the character before the split is a space).
  Its quirks are kept, so that the tokens stay TRL's: where neither differs within
  the shorter, the split is one before its end.
- Standard records: TRL appends the EOS token's text to chosen and rejected unless
  they end with it, and tokenizes the prompt and prompt + completion with the
  tokenizer's special tokens (a BOS where its post-processor adds one).
- Conversational records: the prompt is rendered with the chat template and its
  generation prompt, prompt + completion without, and both tokenized without special
  tokens (transformers' ``apply_chat_template(..., tokenize=True)``).

The completion starts where the prompt's ids stop being a prefix of both prompt +
completion ids (TRL's ``common_prefix_length``; usually the prompt's end, but BPE
merges across the boundary move tokens into the completion): each sequence is its
prompt + completion ids, learned (mask 1) from there on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ndjax.data import chat
from ndjax.data.chat_template import ChatTemplate, TemplateRefused
from ndjax.data.sources import Document
from ndjax.data.tokenizers import HFTokenizer
from ndjax.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Fields:
    """The keys of a preference record (``data.prompt_field``, ``chosen_field``,
    ``rejected_field``)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"


@dataclasses.dataclass(frozen=True)
class Pair:
    """The two token sequences of one preference pair: ``chosen`` and ``rejected`` are
    prompt + completion ids; both begin with the same ``prompt_len`` ids, which are not
    learned."""

    chosen: np.ndarray
    rejected: np.ndarray
    prompt_len: int

    def __len__(self) -> int:
        return len(self.chosen) + len(self.rejected)

    def sequences(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """``((ids, mask), (ids, mask))`` of chosen then rejected; mask 1 on the completion."""
        return tuple((ids, (np.arange(len(ids)) >= self.prompt_len).astype(np.uint8))
                     for ids in (self.chosen, self.rejected))  # type: ignore[return-value]

    def learnable(self) -> bool:
        """Whether a completion token of either sequence is a target (a sequence's first
        token never is)."""
        first = max(self.prompt_len, 1)
        return len(self.chosen) > first or len(self.rejected) > first


@dataclasses.dataclass(frozen=True)
class Example:
    """One record after TRL's prompt extraction and EOS: strings, or lists of messages."""

    prompt: str | list[dict]
    chosen: str | list[dict]
    rejected: str | list[dict]

    @property
    def conversational(self) -> bool:
        return isinstance(self.chosen, list)


class _BadRecord(Exception):
    """A record that is not a preference pair; ``example`` adds where it is."""


def is_conversational(doc: Document, fields: Fields) -> bool:
    """Whether a record's chosen completion is a list (of messages): it needs a chat
    template."""
    return isinstance(doc.content, dict) and isinstance(doc.content.get(fields.chosen), list)


def example(doc: Document, fields: Fields, eos_token: str) -> Example:
    """One record, checked, its prompt extracted and EOS added as TRL does; errors name
    the file and line (or row)."""
    record = doc.content
    assert isinstance(record, dict), "chat corpora yield records"
    # Parquet rows carry every column the file has, null where a row lacks one.
    record = {k: v for k, v in record.items() if v is not None}
    try:
        return _example(record, fields, eos_token)
    except (_BadRecord, chat._BadRecord) as e:  # only now find the line: it reads the file
        raise ConfigError(f"{doc.field}: {doc.where()}: {e} (data.format='preference')"
                          ) from None


def _example(record: dict, fields: Fields, eos_token: str) -> Example:
    for key, name in ((fields.chosen, "chosen_field"), (fields.rejected, "rejected_field")):
        if key not in record:
            raise _BadRecord(f"data.{name}={key!r} is missing (found {sorted(record)}); set "
                             "data.prompt_field, data.chosen_field and data.rejected_field "
                             "to the record's keys.")
    names = {fields.prompt: "prompt_field", fields.chosen: "chosen_field",
             fields.rejected: "rejected_field"}
    values = {k: _value(record[k], k, f"data.{names[k]}={k!r}") for k in names if k in record}
    kinds = {k: isinstance(v, list) for k, v in values.items()}
    if len(set(kinds.values())) > 1:
        listed = [f"data.{names[k]}={k!r}" for k, is_list in kinds.items() if is_list]
        are = "is a list" if len(listed) == 1 else "are lists"
        raise _BadRecord(f"{' and '.join(listed)} {are} of messages, the others strings; a "
                         "record's prompt, chosen and rejected are all strings or all lists of "
                         "messages.")
    chosen, rejected = values[fields.chosen], values[fields.rejected]
    if fields.prompt in values:
        prompt = values[fields.prompt]
    else:
        if not chosen or not rejected:
            raise _BadRecord(f"without data.prompt_field={fields.prompt!r}, the prompt is the "
                             "common beginning of chosen and rejected, and one is empty; add "
                             "the prompt to the record.")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if isinstance(chosen, str):  # standard data: TRL's add_eos
        chosen = chosen if chosen.endswith(eos_token) else chosen + eos_token
        rejected = rejected if rejected.endswith(eos_token) else rejected + eos_token
    return Example(prompt, chosen, rejected)


def _value(value: object, key: str, setting: str) -> str | list[dict]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return chat._messages(value, key, need_assistant=False)
    raise _BadRecord(f"{setting} is {type(value).__name__}, not a string or a non-empty list "
                     "of {role, content} messages.")


def extract_prompt(chosen: str | list, rejected: str | list
                   ) -> tuple[str | list, str | list, str | list]:
    """TRL's ``extract_prompt`` (``trl/data_utils.py``), quirks and all: ``(prompt,
    chosen, rejected)`` split at the first place chosen and rejected differ (moved back
    one where the character before is a space), or one before the end of the shorter
    where they do not differ. Both must be non-empty."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            # idx 0 reads chosen[-1], as TRL does: the split then moves to its last item.
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if differ.size else n


def encode(docs: Sequence[Document], tok: HFTokenizer, template: ChatTemplate | None,
           fields: Fields = Fields()) -> list[Pair]:
    """The pair of each record (see the module docstring). ``template`` renders
    conversational records (None: there are none)."""
    eos = tok.id_to_token(tok.eos_id) or ""
    standard: list[str] = []       # prompt, prompt + chosen, prompt + rejected of each
    rendered: list[str] = []
    kinds: list[bool] = []
    for doc in docs:
        ex = example(doc, fields, eos)
        kinds.append(ex.conversational)
        if not ex.conversational:
            standard += [ex.prompt, ex.prompt + ex.chosen, ex.prompt + ex.rejected]
            continue
        assert template is not None, "conversational records need a chat template"
        try:
            rendered += [template.render(ex.prompt, add_generation_prompt=True),
                         template.render(ex.prompt + ex.chosen),
                         template.render(ex.prompt + ex.rejected)]
        except TemplateRefused as e:
            raise ConfigError(f"{doc.field}: {doc.where()}: the chat template "
                              f"({template.origin}) refused this record: {e}. Fix the record "
                              "or the template.") from None
    # TRL: tokenizer(text) for strings (its special tokens: BOS where the post-processor
    # adds one); apply_chat_template's ids (none added: the template writes them).
    with_special = iter([np.asarray(e.ids, np.int64) for e in
                         tok.tokenizer.encode_batch(standard, add_special_tokens=True)])
    without = iter([ids.astype(np.int64) for ids in tok.encode_batch(rendered)])
    out = []
    for conversational in kinds:
        ids = without if conversational else with_special
        prompt, chosen, rejected = next(ids), next(ids), next(ids)
        prompt_len = min(common_prefix_length(prompt, chosen),
                         common_prefix_length(prompt, rejected))
        out.append(Pair(chosen, rejected, prompt_len))
    return out


def fit(pair: Pair, max_len: int, overlong: str) -> Pair | None:
    """A pair whose two sequences together fit ``max_len`` tokens, as ``data.overlong``
    says, or None to drop it. ``truncate`` cuts the completions' ends (TRL's
    ``keep_start``): each sequence to the longest common length ``m`` that fits, as TRL's
    ``max_length=m`` would; dropped if that leaves either no completion token, or
    nothing learned."""
    if len(pair) > max_len:
        if overlong == "drop":
            return None
        short = min(len(pair.chosen), len(pair.rejected))
        m = max_len - short if 2 * short <= max_len else max_len // 2
        if m <= pair.prompt_len:  # the prompt alone fills it (TRL drops these too)
            return None
        pair = Pair(pair.chosen[:m], pair.rejected[:m], pair.prompt_len)
    return pair if pair.learnable() else None
