"""Prompt data (``data.format=prompt``): records of a prompt and whatever columns the
reward functions read (an ``answer``, a ``solution``...), for GRPO: the prompts are
completed by ndjax's own sampler and the completions scored (``ndjax.rewards``).

A record (a JSON Lines object, a Parquet or ``datasets`` row) holds ``data.prompt_field``:
a string (standard) or a non-empty list of ``{role, content}`` messages
(conversational). Its other columns are kept as read, and passed to the reward
functions by name, one value per completion, as TRL's ``GRPOTrainer`` passes its
dataset's columns.

Prompts are tokenized as TRL 1.16's ``GRPOTrainer._tokenize_prompts`` does (the same
rules as preference data's prompts, ``preference.prompt_ids``): a string with the
tokenizer's special tokens (a BOS where its post-processor adds one), a list of messages
rendered by the chat template with its generation prompt and tokenized with none added
(transformers' ``apply_chat_template(add_generation_prompt=True, tokenize=True)``).

Prompts longer than the prompt budget (``fit``) are left out and counted; the rows
(``streams.PromptRows``) hold the kept ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ndjax.data import chat, preference
from ndjax.data.chat_template import ChatTemplate
from ndjax.data.sources import Document
from ndjax.data.tokenizers import HFTokenizer
from ndjax.runtime.errors import ConfigError

SETTING = "data.format='prompt'"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One record read: its prompt (a string, or a list of messages) and the whole record
    (every column, as read: the prompt's too)."""

    prompt: str | list[dict]
    record: dict
    doc: Document

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def read(doc: Document, prompt_field: str = "prompt") -> Prompt:
    """One record, checked: its prompt is a non-empty string or a non-empty list of
    ``{role, content}`` messages. Errors are one line naming the file and line (or row)
    and the field."""
    record = doc.content
    assert isinstance(record, dict), "chat corpora yield records"
    setting = f"data.prompt_field={prompt_field!r}"
    try:
        # Parquet rows carry every column the file has, null where a row lacks one.
        value = record.get(prompt_field)
        if value is None:
            present = sorted(k for k, v in record.items() if v is not None)
            raise preference._BadRecord(
                f"{setting} is missing (found {present}); set data.prompt_field to the key "
                "that holds the prompt.")
        if isinstance(value, str):
            if not value:
                raise preference._BadRecord(f"{setting} is an empty string; a prompt needs "
                                            "text to complete.")
            prompt: str | list[dict] = value
        elif isinstance(value, list):
            prompt = chat._messages(value, prompt_field, need_assistant=False)
        else:
            raise preference._BadRecord(
                f"{setting} is {type(value).__name__} ({preference._short(value)}), not a "
                "string or a non-empty list of {role, content} messages.")
    except (preference._BadRecord, chat._BadRecord) as e:
        raise ConfigError(f"{doc.field}: {doc.where()}: {e} ({SETTING})") from None
    return Prompt(prompt, record, doc)


def encode(prompts: Sequence[Prompt], tok: HFTokenizer, template: ChatTemplate | None
           ) -> list[np.ndarray]:
    """Each prompt's ids, as TRL's ``_tokenize_prompts`` (see the module docstring).
    ``template`` renders conversational prompts (None: there are none)."""
    return preference.prompt_ids([(p.doc, p.prompt) for p in prompts], tok, template)


def fit(ids: Sequence[np.ndarray], max_len: int) -> tuple[list[int], int]:
    """The indices of the prompts of at most ``max_len`` tokens (the prompt budget:
    train.seq_len less the completion's), and how many are longer (left out)."""
    kept = [i for i, x in enumerate(ids) if len(x) <= max_len]
    return kept, len(ids) - len(kept)
