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

KTO's examples (``data.format=unpaired_preference``), as TRL 1.16's ``KTOTrainer``
prepares them (``_prepare_dataset``): records of a prompt, a completion
(``data.completion_field``) and a boolean label (``data.label_field``: desirable or
not), or preference pairs, which are unpaired as TRL's ``unpair_preference_dataset``
does (``unpaired``). Which of the two a corpus holds, its first record says (one with
chosen and rejected: pairs), as in TRL. An example is tokenized as a pair's sequence is,
its completion starting where its own prompt's ids stop being a prefix of its prompt +
completion ids. Its KL sequence (``kl_units``) is its prompt + the completion of the
example before it in its chunk of ``train.batch_size`` examples (TRL's rotation within
``per_device_train_batch_size``).
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
    ``rejected_field``), and of an unpaired one (``prompt_field``, ``completion_field``,
    ``label_field``)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    completion: str = "completion"
    label: str = "label"


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


def example(doc: Document, fields: Fields, eos_token: str,
            setting: str = "data.format='preference'") -> Example:
    """One record, checked, its prompt extracted and EOS added as TRL does; errors name
    the file and line (or row), and ``setting``, what read it so."""
    try:
        return _example(_record(doc), fields, eos_token)
    except (_BadRecord, chat._BadRecord) as e:  # only now find the line: it reads the file
        raise ConfigError(f"{doc.field}: {doc.where()}: {e} ({setting})") from None


def _record(doc: Document) -> dict:
    record = doc.content
    assert isinstance(record, dict), "chat corpora yield records"
    # Parquet rows carry every column the file has, null where a row lacks one.
    return {k: v for k, v in record.items() if v is not None}


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
    examples = [(doc, example(doc, fields, eos)) for doc in docs]
    out = []
    for prompt, chosen, rejected in _token_ids(
            [(doc, ex.prompt, (ex.chosen, ex.rejected)) for doc, ex in examples], tok, template):
        prompt_len = min(common_prefix_length(prompt, chosen),
                         common_prefix_length(prompt, rejected))
        out.append(Pair(chosen, rejected, prompt_len))
    return out


def _token_ids(items: Sequence[tuple[Document, str | list[dict], Sequence[str | list[dict]]]],
               tok: HFTokenizer, template: ChatTemplate | None) -> list[list[np.ndarray]]:
    """The ids of each ``(doc, prompt, completions)``'s prompt and of its prompt + each
    completion, as TRL tokenizes them: strings with the tokenizer's special tokens, lists
    of messages rendered by ``template`` (the prompt with the generation prompt). A
    record's prompt and completions are of one kind (checked); ``completions`` may be
    empty (``prompt_ids``)."""
    standard: list[str] = []
    rendered: list[str] = []
    kinds: list[tuple[bool, int]] = []
    for doc, prompt, completions in items:
        conversational = isinstance(prompt, list)
        kinds.append((conversational, 1 + len(completions)))
        if not conversational:
            standard += [prompt] + [prompt + c for c in completions]  # type: ignore[operator]
            continue
        assert template is not None, "conversational records need a chat template"
        try:
            rendered += [template.render(prompt, add_generation_prompt=True)] + [
                template.render(prompt + c) for c in completions]  # type: ignore[operator]
        except TemplateRefused as e:
            raise ConfigError(f"{doc.field}: {doc.where()}: the chat template "
                              f"({template.origin}) refused this record: {e}. Fix the record "
                              "or the template.") from None
    # TRL: tokenizer(text) for strings (its special tokens: BOS where the post-processor
    # adds one); apply_chat_template's ids (none added: the template writes them).
    with_special = iter([np.asarray(e.ids, np.int64) for e in
                         tok.tokenizer.encode_batch(standard, add_special_tokens=True)])
    without = iter([ids.astype(np.int64) for ids in tok.encode_batch(rendered)])
    return [[next(without if conversational else with_special) for _ in range(n)]
            for conversational, n in kinds]


def prompt_ids(items: Sequence[tuple[Document, str | list[dict]]], tok: HFTokenizer,
               template: ChatTemplate | None) -> list[np.ndarray]:
    """The ids of each ``(doc, prompt)``'s prompt alone, as TRL tokenizes prompts (its
    ``GRPOTrainer._tokenize_prompts`` too): a string with the tokenizer's special tokens,
    a list of messages rendered by ``template`` with the generation prompt, none added."""
    return [ids[0] for ids in _token_ids([(doc, prompt, ()) for doc, prompt in items], tok,
                                         template)]


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


# ----- KTO: unpaired examples (data.format=unpaired_preference) ----------------------

UNPAIR_BATCH = 1000  # datasets' map batch (unpair_preference_dataset's): TRL's order


@dataclasses.dataclass(frozen=True)
class Labeled:
    """One KTO example before tokenizing: TRL's unpaired record after EOS (strings, or
    lists of messages), its label, and the record it came from."""

    prompt: str | list[dict]
    completion: str | list[dict]
    desirable: bool
    doc: Document


@dataclasses.dataclass(frozen=True)
class Unpaired:
    """One KTO example tokenized: ``ids`` is prompt + completion ids, the first
    ``prompt_len`` the prompt's (not learned)."""

    ids: np.ndarray
    prompt_len: int
    desirable: bool

    def learnable(self) -> bool:
        """Whether a completion token is a target (a sequence's first token never is)."""
        return len(self.ids) > max(self.prompt_len, 1)


@dataclasses.dataclass(frozen=True)
class KTOUnit:
    """An example and its KL sequence, laid out in a row as a pair is: ``ids`` (prompt +
    completion) then ``kl_ids`` (the same prompt + its KL partner's completion), both
    learned from ``prompt_len`` on."""

    ids: np.ndarray
    kl_ids: np.ndarray
    prompt_len: int
    desirable: bool

    def __len__(self) -> int:
        return len(self.ids) + len(self.kl_ids)

    def pair(self) -> Pair:
        return Pair(self.ids, self.kl_ids, self.prompt_len)

    def sequences(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """``((ids, mask), (ids, mask))`` of the example then its KL sequence; mask 1 on the
        completion."""
        return self.pair().sequences()


def is_paired(doc: Document, fields: Fields) -> bool:
    """Whether a record is a preference pair (it has chosen and rejected): TRL's test of
    a KTO dataset's first record, which decides how all of them are read."""
    record = _record(doc)
    return fields.chosen in record and fields.rejected in record


def is_conversational_unpaired(doc: Document, fields: Fields) -> bool:
    """Whether a KTO record (unpaired or paired) holds messages: it needs a chat
    template."""
    record = doc.content
    return isinstance(record, dict) and any(
        isinstance(record.get(k), list) for k in (fields.completion, fields.chosen))


def unpaired(docs: Sequence[Document], fields: Fields, eos_token: str,
             paired: bool | None = None) -> list[Labeled]:
    """KTO's examples of ``docs`` in TRL's dataset order. Unpaired records (the first
    record has no chosen and rejected): one example each, in order. Pairs: TRL's
    ``unpair_preference_dataset`` (a batched ``map``): for each batch of 1000 records,
    their chosen completions (desirable) in order, then their rejected ones; each record
    read as ``data.format=preference`` reads it (implicit prompt, EOS). ``paired``: which
    of the two (None: as ``docs[0]`` says)."""
    if not docs:
        return []
    if not (is_paired(docs[0], fields) if paired is None else paired):
        return [labeled(doc, fields, eos_token) for doc in docs]
    setting = ("data.format='unpaired_preference', read as preference pairs: the first "
               f"record has {fields.chosen!r} and {fields.rejected!r}")
    out: list[Labeled] = []
    for k in range(0, len(docs), UNPAIR_BATCH):
        batch = [(doc, example(doc, fields, eos_token, setting))
                 for doc in docs[k:k + UNPAIR_BATCH]]
        out += [Labeled(ex.prompt, ex.chosen, True, doc) for doc, ex in batch]
        out += [Labeled(ex.prompt, ex.rejected, False, doc) for doc, ex in batch]
    return out


def labeled(doc: Document, fields: Fields, eos_token: str) -> Labeled:
    """One unpaired record, checked, EOS added as TRL does; errors name the file and line
    (or row) and the field."""
    try:
        prompt, completion, desirable = _labeled(_record(doc), fields, eos_token)
    except (_BadRecord, chat._BadRecord) as e:
        raise ConfigError(f"{doc.field}: {doc.where()}: {e} "
                          "(data.format='unpaired_preference')") from None
    return Labeled(prompt, completion, desirable, doc)


def _labeled(record: dict, fields: Fields, eos_token: str
             ) -> tuple[str | list[dict], str | list[dict], bool]:
    names = {fields.prompt: "prompt_field", fields.completion: "completion_field",
             fields.label: "label_field"}
    for key, name in names.items():
        if key not in record:
            more = (" (TRL extracts an implicit prompt from preference pairs only)"
                    if name == "prompt_field" else "")
            raise _BadRecord(f"data.{name}={key!r} is missing{more} (found {sorted(record)}); "
                             "set data.prompt_field, data.completion_field and "
                             "data.label_field to the record's keys, or give every record a "
                             f"{fields.chosen!r} and {fields.rejected!r} completion instead.")
    label = record[fields.label]
    if not isinstance(label, (bool, np.bool_)):
        raise _BadRecord(f"data.label_field={fields.label!r} is {type(label).__name__} "
                         f"({_short(label)}), not a boolean (true: the completion is "
                         "desirable, false: undesirable).")
    prompt = _value(record[fields.prompt], fields.prompt, f"data.prompt_field={fields.prompt!r}")
    completion = _value(record[fields.completion], fields.completion,
                        f"data.completion_field={fields.completion!r}")
    if isinstance(prompt, list) != isinstance(completion, list):
        listed = (f"data.prompt_field={fields.prompt!r}" if isinstance(prompt, list) else
                  f"data.completion_field={fields.completion!r}")
        raise _BadRecord(f"{listed} is a list of messages, the other a string; a record's "
                         "prompt and completion are both strings or both lists of messages.")
    if isinstance(completion, str) and not completion.endswith(eos_token):  # TRL's add_eos
        completion += eos_token
    return prompt, completion, bool(label)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def encode_unpaired(examples: Sequence[Labeled], tok: HFTokenizer,
                    template: ChatTemplate | None) -> list[Unpaired]:
    """Each example's ids, as TRL's KTO ``tokenize_fn``: prompt and prompt + completion
    tokenized (as ``encode`` does), the completion from their common prefix's end."""
    ids = _token_ids([(e.doc, e.prompt, (e.completion,)) for e in examples], tok, template)
    return [Unpaired(full, common_prefix_length(prompt, full), e.desirable)
            for e, (prompt, full) in zip(examples, ids)]


def can_fit(ex: Unpaired, max_len: int, overlong: str) -> bool:
    """Whether ``ex`` fits ``max_len`` tokens with some KL partner (one of a single
    completion token), as ``data.overlong`` says: those that cannot are dropped before
    the partners are assigned, as TRL drops the examples whose prompt fills max_length
    (with ``truncate``, that is its rule for ``max_length = max_len // 2``)."""
    if overlong == "drop":
        return len(ex.ids) + ex.prompt_len + 1 <= max_len
    return ex.prompt_len < max_len // 2


def kl_units(examples: Sequence[Unpaired], chunk: int) -> list[KTOUnit]:
    """Each example with its KL sequence: its prompt + the completion of the example
    before it in its chunk of ``chunk`` consecutive examples (the chunk's first takes
    its last's). TRL's ``add_kl_completion_ids`` mapped in batches of
    ``per_device_train_batch_size``, then its collator's ``prompt_ids +
    KL_completion_ids``."""
    out = []
    for k in range(0, len(examples), chunk):
        block = examples[k:k + chunk]
        for i, ex in enumerate(block):
            partner = block[i - 1]
            kl = np.concatenate([ex.ids[:ex.prompt_len], partner.ids[partner.prompt_len:]])
            out.append(KTOUnit(ex.ids, kl, ex.prompt_len, ex.desirable))
    return out


def fit_unit(unit: KTOUnit, max_len: int, overlong: str) -> KTOUnit | None:
    """A unit whose two sequences together fit ``max_len`` tokens, as ``fit`` fits a
    pair, or None to drop it; also dropped where the example's own completion is left
    with no target."""
    whole = unit.pair()
    pair = fit(whole, max_len, overlong)
    if pair is None or len(pair.chosen) <= max(pair.prompt_len, 1):
        return None
    return unit if pair is whole else KTOUnit(pair.chosen, pair.rejected, pair.prompt_len,
                                              unit.desirable)
