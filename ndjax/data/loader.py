"""data.* -> this process's batches: the one object the training loop consumes.

The loader is handed its own section of the config and nothing else: ``check``
takes ``DataSettings``, the batches' shape (``Batches``: train.batch_size, seq_len,
seed) and the model's vocabulary, runs the cheap checks (file names and sizes,
tokenizer against the vocabulary), loads the tokenizer and chat template once and
returns them as a ``DataInput``; ``Experiment.from_config`` calls it before anything
compiles. ``open_loader`` then reads and tokenizes the corpus (every process all of
it: an epoch's order is global) and returns a ``Loader`` of this process's rows of
every global batch: an iterator of batches (numpy, or on device after ``transform``),
prepared ahead by a thread, whose position is a small dict of ints (``get_state`` /
``set_state``). ``make_loader`` is both at once,
from a whole config (scripts and tests).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
from grain.experimental import ThreadPrefetchIterDataset

from ndjax.config import FILE_SOURCES, DataSettings, Settings, as_settings
from ndjax.data import chat, hf_datasets, preference, prompt_formats, prompts, sources
from ndjax.data.chat_template import ChatTemplate, load_chat_template
from ndjax.data.streams import (
    ChatRows,
    KTORows,
    PairRows,
    PromptRows,
    RowSource,
    TextRows,
    TokenRows,
)
from ndjax.data.synthetic import SyntheticSource
from ndjax.data.tokenizers import Additions, HFTokenizer, Tokenizer, load_tokenizer
from ndjax.runtime.errors import ConfigError

# 3: every seeded order is Grain's shuffle (2: ndjax's own; 1: each batch row read its
# own share of the corpus); a position saved by one names other rows in the others.
STATE_VERSION = 3
# The steps a loader's Grain pipeline holds (a MapDataset has a length): never reached.
_LAST_STEP = 2**62
_TOKENIZE_BATCH = 256  # documents per encode_batch call (the HF tokenizer threads over them)
# data.format's values that read preference records: pairs, and KTO's examples.
PREFERENCE_FORMATS = ("preference", "unpaired_preference")
# data.format's values that read TRL's records (data.source=chat): those and GRPO's prompts.
RECORD_FORMATS = PREFERENCE_FORMATS + ("prompt",)


@dataclasses.dataclass(frozen=True)
class Batches:
    """The shape of the global batches (train.*): what every row depends on."""

    batch_size: int
    seq_len: int
    seed: int
    # Steps one batch serves (GRPO's grpo.num_iterations: a step's prompts are sampled
    # once and trained on this many times): step s reads batch s // repeat.
    repeat: int = 1


@dataclasses.dataclass(frozen=True)
class DataInput:
    """All the loader reads, checked (``check``): its own section, the batches'
    shape, the model's vocabulary, and the tokenizer and chat template, loaded once
    (None where the source needs none)."""

    data: DataSettings
    batches: Batches
    vocab_size: int
    tokenizer: Tokenizer | None = None
    template: ChatTemplate | None = None


def _held_out(d: DataSettings) -> bool:
    """Whether the validation split is a share of data.files (data.eval_fraction)."""
    return d.eval_fraction > 0


def _files_field(split: str, d: DataSettings | None = None) -> str:
    return "data.files" if split == "train" or (d and _held_out(d)) else "data.eval_files"


def _files(d: DataSettings, split: str) -> str:
    return d.files if split == "train" or _held_out(d) else d.eval_files


def _corpus_split(d: DataSettings, split: str) -> str:
    """The split of the files to read: a held-out share is taken from the training one."""
    return "train" if _held_out(d) else split


def held_out(documents: list, fraction: float, seed: int, split: str) -> list:
    """``split``'s documents when a seeded ``fraction`` of them (at least one, rounded up,
    as datasets' train_test_split rounds its test share) is the validation split; the
    others train. The same documents for any process count."""
    if not fraction:
        return documents
    n = len(documents)
    k = min(math.ceil(fraction * n), n - 1)
    if k < 1:
        raise ConfigError(f"data.eval_fraction={fraction:g} of {n} document(s) holds out none "
                          "and leaves none: use more data or data.eval_files.")
    chosen = np.zeros(n, bool)
    chosen[np.random.default_rng([seed, 0x5E7A]).permutation(n)[:k]] = True
    keep = chosen if split == "eval" else ~chosen
    return [doc for doc, kept in zip(documents, keep) if kept]


def _check_source(d: DataSettings, eval_every: int) -> None:
    # Each field's type and allowed values: ndjax.config. Here: how they combine.
    if d.source in FILE_SOURCES:
        if not sources.split_patterns(d.files):
            raise ConfigError(f"data.source={d.source!r} reads data.files, which is empty: set "
                              "it to comma-separated paths or globs, e.g. "
                              "--config.data.files='corpus/*.txt'.")
        if eval_every and not sources.split_patterns(d.eval_files) and not _held_out(d):
            raise ConfigError(f"train.eval_every={eval_every} needs a validation split: set "
                              f"data.eval_files (paths or globs of {d.source} files, like "
                              "data.files), data.eval_fraction, or train.eval_every=0.")
        if _held_out(d) and sources.split_patterns(d.eval_files):
            raise ConfigError(f"data.eval_fraction={d.eval_fraction:g} holds out part of "
                              "data.files as the validation split, and data.eval_files names "
                              "another: keep one.")
        if _held_out(d) and d.source == "tokens":
            raise ConfigError(f"data.eval_fraction={d.eval_fraction:g} holds out documents, "
                              "which token files do not index: set data.eval_files instead.")
    elif sources.split_patterns(d.files) or sources.split_patterns(d.eval_files):
        raise ConfigError(f"data.source={d.source!r} reads no files, but data.files / "
                          "data.eval_files are set; did you mean data.source=text, jsonl, "
                          "parquet, tokens or chat?")
    if d.source == "tokens" and not d.packing:
        raise ConfigError("data.packing=False needs document boundaries, which pre-tokenized "
                          "files do not index; use data.packing=True with data.source=tokens.")
    if d.format in RECORD_FORMATS and d.source != "chat":
        raise ConfigError(f"data.format={d.format!r} reads records (JSON Lines, Parquet or "
                          f"Hugging Face datasets) of data.source=chat, not data.source="
                          f"{d.source!r}; set data.source=chat.")
    if d.source == "chat":
        if d.tokenizer == "byte":
            raise ConfigError("data.source='chat' needs the model's tokenizer: set data.tokenizer "
                              "to its tokenizer.json (the chat template is read from the "
                              "tokenizer_config.json beside it).")
    if d.source == "synthetic" and not d.packing:
        raise ConfigError("data.packing=False: the synthetic source only makes packed rows; "
                          "use data.packing=True or a text source.")


def data_tokenizer(data: Any) -> Tokenizer:
    """The tokenizer of a config's ``data`` section (a run's saved config.json may predate
    the fields added since, which then take their defaults)."""
    def get(field: str, default: Any = "") -> Any:
        return getattr(data, field, default) if not isinstance(data, Mapping) \
            else data.get(field, default)
    added = Additions(tuple(get("added_tokens", ())), tuple(get("added_special_tokens", ())))
    return load_tokenizer(get("tokenizer", "byte"), get("eos_token"), get("bos_token"),
                          get("pad_token"), added if added else None)


def _tokenizer(d: DataSettings, vocab_size: int) -> Tokenizer:
    tok = data_tokenizer(d)
    if tok.vocab_size > vocab_size:
        fit = -(-tok.vocab_size // 128) * 128
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than data.tokenizer={tok.name!r}, which "
            f"has {tok.vocab_size} ids; set model.vocab_size >= {tok.vocab_size} (e.g. {fit}, "
            "a multiple of 128 that tensor parallelism can split).")
    return tok


def _token_eos(files: list[sources.TokenFile], tok: Tokenizer, field: str) -> int:
    """The EOS id that separates documents: the sidecar's, which must agree with the
    tokenizer's (a file without a sidecar uses the tokenizer's)."""
    for f in files:
        if f.eos_id is not None and f.eos_id != tok.eos_id:
            raise ConfigError(
                f"{field}: {f.path} was written with EOS id {f.eos_id} (its sidecar), but "
                f"data.tokenizer={tok.name!r} has EOS id {tok.eos_id}; set data.tokenizer "
                "(and data.eos_token) to the tokenizer that wrote the file.")
    return tok.eos_id


def check(d: DataSettings, batches: Batches, vocab_size: int, eval_every: int = 0
          ) -> DataInput:
    """Every check of ``data.*`` that reads no file contents (sizes, names, footers);
    ``eval_every`` (train.eval_every) > 0: there is a validation split to check too.
    Returns what the loader is then opened with."""
    _check_source(d, eval_every)
    b = batches
    if d.format == "unpaired_preference" and d.source == "chat" and b.batch_size < 2:
        raise ConfigError(
            f"train.batch_size={b.batch_size}: data.format='unpaired_preference' gives each "
            "KTO example a KL partner from its chunk of train.batch_size examples, and with 1 "
            "that is the example itself, so KTO's KL term would equal its reward (TRL refuses "
            "per_device_train_batch_size 1 too); set train.batch_size >= 2.")
    if d.source == "synthetic":
        return DataInput(d, b, vocab_size)
    tok = _tokenizer(d, vocab_size)
    # Only conversations are rendered with a template (Axolotl's prompt formats write their
    # own text), so a base model's tokenizer without one reads alpaca data.
    template = (load_chat_template(d.tokenizer, d.chat_template)
                if d.source == "chat" and d.format == "chat" else
                _preference_template(d) if d.source == "chat" and d.format in RECORD_FORMATS
                else None)
    for split in ("train", "eval") if eval_every else ("train",):
        field = _files_field(split, d)
        if d.source == "tokens":
            files = sources.open_token_files(_files(d, split), field, d.token_dtype)
            _token_eos(files, tok, field)
            for f in files:
                if f.max_id is not None and f.max_id >= vocab_size:
                    raise ConfigError(
                        f"{field}: {f.path} holds token id {f.max_id} (its sidecar), not below "
                        f"model.vocab_size={vocab_size}; set model.vocab_size > {f.max_id}.")
            windows = sum((f.n_tokens - 1) // b.seq_len for f in files)
            if windows < b.batch_size:
                raise ConfigError(
                    f"{field}: {_names(tuple(f.path for f in files))} hold {windows} rows of "
                    f"train.seq_len={b.seq_len} (+1) tokens, shorter than one batch "
                    f"(train.batch_size={b.batch_size} rows); use more data or a smaller "
                    "batch_size/seq_len.")
        else:
            corpus = sources.open_corpus(d.source, _files(d, split), field, d.text_field,
                                         _corpus_split(d, split), columns=_chat_columns(d))
            if corpus.total == 0:
                raise ConfigError(f"{corpus.field}: the corpus ({_names(corpus.files)}) is "
                                  "empty; name files that hold data.")
    return DataInput(d, b, vocab_size, tok, template)


def _preference_template(d: DataSettings) -> ChatTemplate | None:
    """The chat template of preference (and prompt) data: only conversational records
    need one, so a tokenizer without one reads string records (``_pair_rows`` says it is
    missing when a record needs it); one data.chat_template names must load."""
    if d.chat_template:
        return load_chat_template(d.tokenizer, d.chat_template)
    try:
        return load_chat_template(d.tokenizer)
    except ConfigError:
        return None


def check_config(config: Settings | ml_collections.ConfigDict, vocab_size: int) -> DataInput:
    """``check`` from a whole config."""
    config = as_settings(config)
    t = config.train
    return check(config.data, Batches(t.batch_size, t.seq_len, t.seed), vocab_size,
                 t.eval_every)


def _chat_columns(d: DataSettings) -> tuple[str, ...]:
    """The columns a chat record is read from (Parquet reads no others). Prompt data's
    records keep every column (the reward functions may read any): ``check`` asks for
    its prompt's, and ``_prompt_corpus`` then reads them all."""
    if d.source != "chat":
        return ()
    if d.format == "prompt":
        return (d.prompt_field,)
    return {"alpaca": ("instruction", "input", "output"), "completion": (d.text_field,),
            "input_output": ("segments",),
            "preference": (d.prompt_field, d.chosen_field, d.rejected_field),
            "unpaired_preference": (d.prompt_field, d.completion_field, d.label_field,
                                    d.chosen_field, d.rejected_field)}.get(
        d.format, (d.messages_field, d.prompt_field, d.completion_field, "system"))


def _names(files: tuple[str, ...]) -> str:
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return ", ".join(sorted(files)[:3]) + more


def process_rows(batch_size: int, process_index: int | None = None,
                 process_count: int | None = None) -> tuple[int, int]:
    """This process's rows of every global batch: ``(start, count)``."""
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if batch_size % count:
        raise ConfigError(f"train.batch_size={batch_size} is not divisible by the "
                          f"{count} processes; use a multiple of {count}.")
    per_process = batch_size // count
    return index * per_process, per_process


def _text_rows(inp: DataInput, split: str, max_runs: int | None) -> tuple[TextRows, int]:
    """Reads and tokenizes the whole corpus; checks it fills a row."""
    d, t, tok = inp.data, inp.batches, inp.tokenizer
    field = _files_field(split, d)
    corpus = sources.open_corpus(d.source, _files(d, split), field, d.text_field,
                                 _corpus_split(d, split), seed=t.seed)
    documents = corpus.share(0, corpus.total)
    if _held_out(d):  # the share held out is chosen over the whole list
        documents = iter(held_out(list(documents), d.eval_fraction, t.seed, split))
    docs = _tokenize(documents, tok)
    need = t.seq_len + 1 if d.packing else 1
    tokens = sum(len(x) + 1 for x in docs)
    if tokens < need:
        raise ConfigError(
            f"{corpus.field}: the corpus ({_names(corpus.files)}) is shorter than one row: "
            f"{tokens} tokens in "
            f"{len(docs)} document(s), fewer than train.seq_len={t.seq_len} + 1. Use more "
            "data or a smaller seq_len.")
    rows = TextRows(docs, t.seq_len, t.batch_size, t.seed, tok.eos_id, tok.pad_id,
                    packing=d.packing, max_runs=max_runs)
    return rows, corpus.fingerprint()


def _chat_rows(inp: DataInput, split: str, max_runs: int | None) -> tuple[ChatRows, int]:
    """Renders, tokenizes and fits every conversation; checks one is kept."""
    d, t, tok, template = inp.data, inp.batches, inp.tokenizer, inp.template
    corpus = sources.open_corpus(d.source, _files(d, split), _files_field(split, d),
                                 d.text_field, _corpus_split(d, split), seed=t.seed,
                                 columns=_chat_columns(d))
    docs = held_out(list(corpus.share(0, corpus.total)), d.eval_fraction, t.seed, split)
    encoded = [pair for k in range(0, len(docs), _TOKENIZE_BATCH)
               for pair in _encode(docs[k:k + _TOKENIZE_BATCH], d, tok, template, t.seq_len)]
    fitted = [chat.fit(ids, mask, t.seq_len + 1, d.overlong) for ids, mask in encoded
              if mask[1:].any()]  # nothing to learn (Axolotl drops such samples too)
    convs = [c for c in fitted if c is not None]
    if not convs:
        raise ConfigError(
            f"{corpus.field}: no conversation is kept: all {len(fitted)} are longer than "
            f"train.seq_len={t.seq_len} + 1 tokens (data.overlong={d.overlong!r}). Use a larger "
            "seq_len or data.overlong=truncate.")
    rows = ChatRows(convs, t.seq_len, t.batch_size, t.seed, tok.pad_id, packing=d.packing,
                    dropped=len(fitted) - len(convs), max_runs=max_runs)
    # The rendering decides the tokens, so a changed template or policy changes the batches.
    rendering = template.text if template is not None else d.format
    key = (f"{corpus.fingerprint()}:{rendering}:{d.role_field}:{d.content_field}:"
           f"{d.overlong}:{d.packing}")
    # Settings added since: in the key only when not their defaults, so that the batches
    # of runs that never set them keep their key.
    if (d.trained_roles, d.train_on_eos) != (("assistant",), "turn"):
        key += f":{d.roles_to_train}:{d.train_on_eos}"
    if d.added_tokens or d.added_special_tokens:
        key += f":{d.added_tokens}:{d.added_special_tokens}"
    return rows, zlib.crc32(key.encode())


def _pair_rows(inp: DataInput, split: str, max_runs: int | None) -> tuple[PairRows, int]:
    """Tokenizes every preference pair (``preference``) and fits it to a row; checks one
    is kept."""
    d, t, tok, template = inp.data, inp.batches, inp.tokenizer, inp.template
    corpus = sources.open_corpus(d.source, _files(d, split), _files_field(split, d),
                                 d.text_field, _corpus_split(d, split), seed=t.seed,
                                 columns=_chat_columns(d))
    docs = held_out(list(corpus.share(0, corpus.total)), d.eval_fraction, t.seed, split)
    fields = preference.Fields(d.prompt_field, d.chosen_field, d.rejected_field)
    if template is None and any(preference.is_conversational(doc, fields) for doc in docs):
        # check() found none (or one that does not load): say why, now that one is needed.
        template = load_chat_template(
            d.tokenizer, needed_by="data.format='preference' with records of messages",
            fix="set data.chat_template to a template name or a Jinja template file")
    assert isinstance(tok, HFTokenizer), "data.source='chat' refuses the byte tokenizer"
    encoded = [pair for k in range(0, len(docs), _TOKENIZE_BATCH)
               for pair in preference.encode(docs[k:k + _TOKENIZE_BATCH], tok, template, fields)]
    fitted = [preference.fit(p, t.seq_len + 1, d.overlong) for p in encoded
              if p.learnable()]  # nothing to learn: left out, as chat data does
    pairs = [p for p in fitted if p is not None]
    if not fitted:
        raise ConfigError(f"{corpus.field}: no preference pair has a completion token to "
                          f"learn (all {len(encoded)} records' completions are empty).")
    if not pairs:
        fix = ("Use a larger seq_len or data.overlong=truncate." if d.overlong == "drop" else
               "Their prompts leave no room for a completion token: use a larger seq_len.")
        raise ConfigError(
            f"{corpus.field}: no preference pair is kept: all {len(fitted)} are longer than "
            f"train.seq_len={t.seq_len} + 1 tokens, chosen and rejected together "
            f"(data.overlong={d.overlong!r}). {fix}")
    rows = PairRows([p.sequences() for p in pairs], t.seq_len, t.batch_size, t.seed,
                    tok.pad_id, packing=d.packing, dropped=len(fitted) - len(pairs),
                    max_runs=max_runs)
    # What decides the tokens: the template, the fields, the EOS appended, the policies.
    key = (f"{corpus.fingerprint()}:{template.text if template is not None else ''}:"
           f"{d.format}:{d.prompt_field}:{d.chosen_field}:{d.rejected_field}:{tok.eos_id}:"
           f"{d.overlong}:{d.packing}:{d.added_tokens}:{d.added_special_tokens}")
    return rows, zlib.crc32(key.encode())


def _prompt_corpus(d: DataSettings, split: str, seed: int
                   ) -> sources.Corpus | hf_datasets.DatasetCorpus:
    """The corpus of prompt records, read with every column: a Hugging Face dataset's rows
    hold all its columns when none are chosen, and Parquet files are read with the
    columns of any of them (a row of a file without one has none)."""
    spec, field = _files(d, split), _files_field(split, d)
    every = hf_datasets.is_dataset_spec(sources.split_patterns(spec))
    corpus = sources.open_corpus(d.source, spec, field, d.text_field,
                                 _corpus_split(d, split), seed=seed,
                                 columns=() if every else _chat_columns(d))
    if isinstance(corpus, sources.Corpus) and corpus.kind == "parquet":
        import pyarrow.parquet as pq  # read the corpus already: pyarrow is there

        names = dict.fromkeys(n for f in corpus.files for n in pq.read_schema(f).names)
        corpus = dataclasses.replace(corpus, columns=tuple(names))
    return corpus


def _prompt_rows(inp: DataInput, split: str, max_runs: int | None) -> tuple[PromptRows, int]:
    """GRPO's prompts (``data.format=prompt``, ``prompts``): every record read with all its
    columns, its prompt tokenized as TRL's GRPOTrainer does; those longer than
    ``Batches.seq_len`` (the prompt budget) left out and counted; checks one is kept.
    ``Batches.batch_size`` is the prompts of a step. ``max_runs`` does not apply: a row
    is one prompt."""
    d, t, tok, template = inp.data, inp.batches, inp.tokenizer, inp.template
    corpus = _prompt_corpus(d, split, t.seed)
    docs = held_out(list(corpus.share(0, corpus.total)), d.eval_fraction, t.seed, split)
    read = [prompts.read(doc, d.prompt_field) for doc in docs]
    if template is None and any(p.conversational for p in read):
        # check() found none (or one that does not load): say why, now that one is needed.
        template = load_chat_template(
            d.tokenizer, needed_by="data.format='prompt' with prompts of messages",
            fix="set data.chat_template to a template name or a Jinja template file")
    assert isinstance(tok, HFTokenizer), "data.source='chat' refuses the byte tokenizer"
    ids = [x for k in range(0, len(read), _TOKENIZE_BATCH)
           for x in prompts.encode(read[k:k + _TOKENIZE_BATCH], tok, template)]
    kept, dropped = prompts.fit(ids, t.seq_len)
    if not kept:
        raise ConfigError(
            f"{corpus.field}: no prompt is kept: all {len(ids)} are longer than the prompt "
            f"budget of {t.seq_len} tokens (train.seq_len less the completion's tokens). Use "
            "a larger train.seq_len, fewer completion tokens or shorter prompts.")
    rows = PromptRows([ids[i] for i in kept], [read[i].record for i in kept],
                      [read[i].prompt for i in kept], t.seq_len, t.batch_size, t.seed,
                      tok.pad_id, dropped=dropped, repeat=t.repeat)
    # What decides the prompts and their ids: the template, the field, the tokens added.
    key = (f"{corpus.fingerprint()}:{template.text if template is not None else ''}:"
           f"{d.format}:{d.prompt_field}:{d.added_tokens}:{d.added_special_tokens}")
    return rows, zlib.crc32(key.encode())


def _kto_rows(inp: DataInput, split: str, max_runs: int | None) -> tuple[KTORows, int]:
    """KTO's examples (``data.format=unpaired_preference``: unpaired records, or pairs
    unpaired as TRL does), tokenized (``preference``), each given its KL sequence and fit
    to a row; checks one is kept.

    The order is TRL's dataset order (the records', pairs unpaired per 1000 records);
    examples with nothing to learn, and those that fit no row whatever their KL partner
    (``preference.can_fit``), are left out before the partners are assigned in chunks of
    train.batch_size examples (TRL's per_device_train_batch_size, on one device); the
    units (example + KL sequence) are then fit as pairs are (``data.overlong``)."""
    d, t, tok, template = inp.data, inp.batches, inp.tokenizer, inp.template
    corpus = sources.open_corpus(d.source, _files(d, split), _files_field(split, d),
                                 d.text_field, _corpus_split(d, split), seed=t.seed,
                                 columns=_chat_columns(d))
    every = list(corpus.share(0, corpus.total))
    fields = preference.Fields(d.prompt_field, d.chosen_field, d.rejected_field,
                               d.completion_field, d.label_field)
    # The corpus's first record says how all are read, as TRL's first record does.
    paired = bool(every) and preference.is_paired(every[0], fields)
    docs = held_out(every, d.eval_fraction, t.seed, split)
    if template is None and any(preference.is_conversational_unpaired(doc, fields)
                                for doc in docs):
        template = load_chat_template(
            d.tokenizer, needed_by="data.format='unpaired_preference' with records of messages",
            fix="set data.chat_template to a template name or a Jinja template file")
    assert isinstance(tok, HFTokenizer), "data.source='chat' refuses the byte tokenizer"
    examples = preference.unpaired(docs, fields, tok.id_to_token(tok.eos_id) or "", paired)
    encoded = [ex for k in range(0, len(examples), _TOKENIZE_BATCH)
               for ex in preference.encode_unpaired(examples[k:k + _TOKENIZE_BATCH], tok,
                                                    template)]
    learnable = [ex for ex in encoded if ex.learnable()]  # nothing to learn: left out
    if not learnable:
        raise ConfigError(f"{corpus.field}: no KTO example has a completion token to learn "
                          f"(all {len(encoded)} examples' completions are empty).")
    width = t.seq_len + 1
    fitting = [ex for ex in learnable if preference.can_fit(ex, width, d.overlong)]
    units = [preference.fit_unit(u, width, d.overlong)
             for u in preference.kl_units(fitting, t.batch_size)]
    kept = [u for u in units if u is not None]
    if not kept:
        fix = ("Use a larger seq_len or data.overlong=truncate." if d.overlong == "drop" else
               "Their prompts leave no room for a completion token: use a larger seq_len.")
        raise ConfigError(
            f"{corpus.field}: no KTO example is kept: all {len(learnable)} are longer than "
            f"train.seq_len={t.seq_len} + 1 tokens, the example and its KL sequence together "
            f"(data.overlong={d.overlong!r}). {fix}")
    rows = KTORows([u.sequences() for u in kept], [u.desirable for u in kept], t.seq_len,
                   t.batch_size, t.seed, tok.pad_id, packing=d.packing,
                   dropped=len(learnable) - len(kept), max_runs=max_runs)
    # What decides the tokens: the template, the fields, the EOS appended, the policies
    # (train.batch_size, which picks the KL partners, is in the loader's state already).
    key = (f"{corpus.fingerprint()}:{template.text if template is not None else ''}:"
           f"{d.format}:{d.prompt_field}:{d.completion_field}:{d.label_field}:"
           f"{d.chosen_field}:{d.rejected_field}:{tok.eos_id}:{d.overlong}:{d.packing}:"
           f"{d.added_tokens}:{d.added_special_tokens}")
    return rows, zlib.crc32(key.encode())


def _encode(docs: list[sources.Document], d: DataSettings, tok: Tokenizer,
            template: ChatTemplate | None, seq_len: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` of each record as ``data.format`` reads it: a conversation with the
    chat template, else one of Axolotl's prompt formats (a completion cut into seq_len
    pieces, as Axolotl does)."""
    if d.format == "chat":
        if (d.role_field, d.content_field) != ("role", "content"):
            docs = [_mapped_messages(doc, d) for doc in docs]
        return chat.encode(docs, template, tok, messages_field=d.messages_field,
                           prompt_field=d.prompt_field, completion_field=d.completion_field,
                           roles_to_train=d.trained_roles, train_on_eos=d.train_on_eos)
    records = [{k: v for k, v in doc.content.items() if v is not None} for doc in docs]
    try:
        encoded = prompt_formats.encode(records, d.format, tok, field=d.text_field)
    except prompt_formats.BadRecord as e:
        doc = docs[e.index]
        raise ConfigError(f"{doc.field}: {doc.where()}: {e} (data.format={d.format!r})"
                          ) from None
    if d.format == "completion":
        return [piece for ids, mask in encoded for piece in prompt_formats.chunks(ids, mask,
                                                                                  seq_len)]
    return encoded


def _mapped_messages(doc: sources.Document, d: DataSettings) -> sources.Document:
    """A record's messages with their keys renamed (``data.role_field``,
    ``data.content_field``: ShareGPT's from / value) and Axolotl's role names read."""
    record = {k: v for k, v in doc.content.items() if v is not None}
    if d.messages_field not in record:
        return doc  # a prompt / completion pair: chat.encode says what is missing
    try:
        messages = prompt_formats.chat_messages(
            record, d.messages_field, {"role": d.role_field, "content": d.content_field})
    except prompt_formats.BadRecord as e:
        raise ConfigError(f"{doc.field}: {doc.where()}: {e}") from None
    return dataclasses.replace(doc, content={**record, d.messages_field: messages})


def _tokenize(documents: Iterator[sources.Document], tok: Tokenizer) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    batch: list[str | bytes] = []

    def flush() -> None:
        out.extend(x for x in tok.encode_batch(batch) if len(x))  # empty documents add nothing
        batch.clear()

    for doc in documents:
        batch.append(doc.content if tok.takes_bytes else doc.text())
        if len(batch) == _TOKENIZE_BATCH:
            flush()
    flush()
    return out


def make_loader(config: Settings | ml_collections.ConfigDict, vocab_size: int,
                split: str = "train", **kwargs: Any) -> Loader:
    """``check`` then ``open_loader``, from a whole config (scripts and tests; the
    training loop opens the ``DataInput`` its experiment checked)."""
    return open_loader(check_config(config, vocab_size), split, **kwargs)


def open_loader(inp: DataInput, split: str = "train", *,
                rows: tuple[int, int] | None = None,
                process_index: int | None = None, process_count: int | None = None,
                prefetch: int | None = None,
                transform: Callable[[dict[str, np.ndarray]], Any] | None = None,
                max_runs: int | None = None) -> Loader:
    """This process's loader for ``split`` ('train' or 'eval'); reads the corpus now.

    ``max_runs`` (``Experiment.max_runs``: the attention kernel's bound, e.g. cuDNN's
    model.attn_max_docs) is the most runs of equal segment ids a row may hold, the
    padding at its end counted as one: the packers close a row rather than exceed
    it. None: no bound, and the rows of before.

    ``rows`` is ``(start, count)`` of the global batch rows this process feeds
    (``Experiment.local_rows``); without it, the batch is split evenly by
    ``process_index`` / ``process_count``, which default to JAX's (tests pass
    them to simulate many hosts in one). ``transform`` (e.g. ``Experiment.device_batch``)
    runs on each batch in the loader thread, so the host-to-device copy is off
    the step's path too.
    """
    d, t, vocab_size = inp.data, inp.batches, inp.vocab_size
    if max_runs is not None and max_runs < 2:
        raise ValueError(f"max_runs={max_runs}: a row needs room for a document and the "
                         "padding after it")  # model.attn_max_docs >= 2 (ndjax.config)
    start, count = rows or process_rows(t.batch_size, process_index, process_count)
    fingerprint = 0
    if d.source == "synthetic":
        source: RowSource = SyntheticSource(vocab_size, t.seq_len, t.seed,
                                            split=int(split != "train"), max_runs=max_runs)
    elif d.source == "tokens":
        field = _files_field(split)
        files = sources.open_token_files(_files(d, split), field, d.token_dtype)
        tok = inp.tokenizer
        eos = _token_eos(files, tok, field)
        source = TokenRows(files, t.seq_len, t.batch_size, t.seed, eos, vocab_size, field,
                           max_runs=max_runs, pad_id=tok.pad_id)
        fingerprint = sources.Corpus("tokens", tuple(f.path for f in files),
                                     tuple(f.n_tokens for f in files), field, "").fingerprint()
    else:
        make_rows = (_text_rows if d.source != "chat" else
                     _pair_rows if d.format == "preference" else
                     _kto_rows if d.format == "unpaired_preference" else
                     _prompt_rows if d.format == "prompt" else _chat_rows)
        source, fingerprint = make_rows(inp, split, max_runs)
        if _held_out(d):  # which documents train depends on the share held out
            fingerprint = zlib.crc32(f"{fingerprint}:{d.eval_fraction}".encode())
    state_key = {"batch_size": t.batch_size, "seq_len": t.seq_len, "seed": t.seed,
                 "corpus": fingerprint}
    if t.repeat != 1:  # (only then: the keys saved before it existed still match)
        state_key["repeat"] = t.repeat
    return Loader(source, start, count, state_key,
                  d.prefetch if prefetch is None else prefetch, transform)


def dropped_overlong(loader: Loader) -> int:
    """Conversations left out for length (``data.overlong``): every process reads the
    whole corpus, so each counts them all."""
    return int(getattr(loader.source, "dropped", 0))


class Loader:
    """This process's rows of each global batch, in order, prepared ahead by a thread
    (Grain's ``ThreadPrefetchIterDataset`` over the steps' batches, ``_pipeline``).

    ``get_state()`` is the position: ``rows``, the number of global rows consumed
    (batches x train.batch_size), and what the batches depend on. Batches are a
    pure function of (data, seed, step), so ``set_state`` only moves the
    position, and the next batch is the one an uninterrupted run would have
    seen, whatever the number of processes now. Changing train.batch_size,
    seq_len, seed or the files between save and restore is refused: they change the
    rows of the stream, or where a step's rows start in it.
    """

    def __init__(self, source: RowSource, start: int, count: int, state_key: dict[str, int],
                 prefetch: int = 2,
                 transform: Callable[[dict[str, np.ndarray]], Any] | None = None):
        self.source, self.start, self.count = source, start, count
        self.state_key, self.prefetch, self.transform = dict(state_key), prefetch, transform
        self.batch_size = state_key["batch_size"]
        self._step = 0
        self._batches: grain.DatasetIterator | None = None
        if prefetch:
            self._start()

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """This process's rows of the batch of ``step`` (random access, no thread)."""
        return self.source.rows(step, self.start, self.count)

    def epoch_after(self, step: int) -> float | None:
        """Epochs of the corpus done once step ``step`` (1-based, as logged) has run: None
        for a source without epochs (synthetic)."""
        epoch_at = getattr(self.source, "epoch_at", None)
        return None if epoch_at is None else float(epoch_at(step * self.batch_size))

    def rows_per_epoch(self) -> int | None:
        """Rows of the corpus's first epoch, after packing: what train.epochs counts in
        (``Settings.in_steps``); None for a source without epochs (synthetic)."""
        rows = getattr(self.source, "rows_per_epoch", None)
        return None if rows is None else int(rows())

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Any:
        """The next batch: numpy rows, or what ``transform`` makes of them."""
        batch = self._take() if self.prefetch else self._make(self._step)
        self._step += 1
        return batch

    def _make(self, step: int) -> Any:
        batch = self.batch(step)
        return batch if self.transform is None else self.transform(batch)

    # ----- position --------------------------------------------------------------

    def get_state(self) -> dict[str, int]:
        return {"version": STATE_VERSION, "rows": self._step * self.batch_size,
                **self.state_key}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"data loader state has version {state.get('version')!r}; this ndjax reads "
                f"version {STATE_VERSION}, whose batches are other rows (version 3: the "
                "corpus's documents and rows in Grain's seeded shuffles), so the saved position "
                "names other data. Resume with the ndjax that saved it, or start afresh in another "
                "--workdir (or checkpoint.resume=never).")
        for key, now in self.state_key.items():
            if state.get(key) != now:
                field = {"corpus": "data files (names or sizes)"}.get(key, f"train.{key}")
                raise ConfigError(
                    f"data loader state was saved with {key}={state.get(key)!r} but this run "
                    f"has {now!r}: the {field} changed, so the saved position does not name "
                    "the same batches. Restore with the settings it was saved with.")
        rows = int(state["rows"])
        if rows < 0 or rows % self.batch_size:
            raise ConfigError(f"data loader state rows={rows} is not a whole number of "
                              f"batches of {self.batch_size}.")
        self.close()
        self._step = rows // self.batch_size
        if self.prefetch:
            self._start()

    # ----- the prefetch thread ---------------------------------------------------

    def _pipeline(self, step: int) -> grain.DatasetIterator:
        """Grain's iterator of the batches from ``step`` on: the steps, mapped to their
        batches (a random-access ``MapDataset``), read in order with no thread of their
        own, and one thread keeping ``prefetch`` of them ready."""
        steps = grain.MapDataset.range(step, _LAST_STEP).map(self._make)
        in_order = steps.to_iter_dataset(grain.ReadOptions(num_threads=0,
                                                           prefetch_buffer_size=0))
        return ThreadPrefetchIterDataset(in_order, prefetch_buffer_size=self.prefetch).__iter__()

    def _start(self) -> None:
        """Starts preparing batches from the current step (before the first is asked for,
        so it is ready when the model has compiled)."""
        self._batches = self._pipeline(self._step)
        self._batches.start_prefetch()

    def _take(self) -> Any:
        if self._batches is None:
            self._start()
        try:
            return next(self._batches)
        except BaseException:  # a batch failed (Grain has stopped its thread), or Ctrl-C
            self.close()
            raise

    def close(self) -> None:
        """Stops the thread and waits for it (no batch is prepared after this)."""
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
