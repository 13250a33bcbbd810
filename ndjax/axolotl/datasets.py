"""An Axolotl config's datasets as ndjax's data.* fields: chat_template (ShareGPT keys,
the named templates ndjax ships, roles_to_train and train_on_eos too), alpaca, completion
and input_output datasets, from local files, save_to_disk folders or hub datasets in the
local cache, one kind per run (data.* holds one source and one set of fields). Under rl
(``preference``), Axolotl's preference dataset types as data.format=preference, KTO's
records as data.format=unpaired_preference, and GRPO's prompts as data.format=prompt."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from ndjax.axolotl import preference
from ndjax.axolotl.fields import Fields, Out, Unmapped, bad, reason, refusal, show
from ndjax.axolotl.run import steps_of
from ndjax.config import CHAT_ROLES, TRAIN_ON_EOS
from ndjax.data.chat_template import template_names
from ndjax.data.prompt_formats import ROLES as AXOLOTL_ROLES
from ndjax.runtime.errors import ConfigError

_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
_DATA_EXTS = (".jsonl", ".json", ".parquet")
# What Hugging Face datasets reads for ndjax (ndjax.data.hf_datasets): these files, and
# folders (save_to_disk or of data files).
_DATASET_EXTS = (".csv", ".arrow")
_NOTES = {"data.text_field": "datasets[].field", "data.messages_field": "datasets[].field_messages",
          "data.chat_template": "chat_template, chat_template_jinja ('': the tokenizer's own)",
          "data.roles_to_train": "datasets[].roles_to_train",
          "data.train_on_eos": "datasets[].train_on_eot, else datasets[].train_on_eos",
          "data.format": "datasets[].type",
          "data.role_field": "datasets[].message_property_mappings.role",
          "data.content_field": "datasets[].message_property_mappings.content"}
# Axolotl's dataset types ndjax reads, as data.format (ndjax.data.prompt_formats):
# alpaca is its instruct style (the alpaca:chat / :chatml / :phi styles are not mapped).
_FORMATS = {"chat_template": "chat", "alpaca": "alpaca", "alpaca_instruct": "alpaca",
            "completion": "completion", "input_output": "input_output"}


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What ndjax reads a dataset as: one kind per run (data.* holds one of each)."""
    source: str                           # data.source
    settings: tuple[tuple[str, Any], ...]  # its other data.* fields

    def describe(self) -> str:
        return ", ".join([f"data.source={self.source!r}"] +
                         [f"{p}={v!r}" for p, v in self.settings])


def data(f: Fields, out: Out, steps: int | None, tokenizer: str | None, context: int) -> None:
    """The objective (rl), rows (sequence_len, sample_packing), the tokenizer (None:
    base_model was refused), and the training and validation files (datasets,
    test_datasets) with what to read in them. Each refused dataset is one problem, and
    the others are still read."""
    pref = preference.objective(f, out)
    seq_len = f.integer("sequence_len", 512, minimum=1)
    kto, sampled = pref.objective == "kto", pref.objective == "grpo"
    unit = "KTO example" if kto else "pair"
    if sampled:
        # TRL does not bound GRPO's prompts by sequence_len (Axolotl passes no max_length):
        # a row holds a prompt of up to sequence_len tokens and its completion.
        seq_len += out.overrides.get("grpo.max_completion_length") or 0
        out.set("train.seq_len", seq_len, f.note("sequence_len", "Axolotl's default 512") +
                " + trl.max_completion_length: a row holds a prompt of up to sequence_len "
                "tokens (longer ones are left out and counted) and its completion")
    elif pref.rl:
        # TRL's max_length (Axolotl's sequence_len) bounds each of a pair's two sequences;
        # ndjax's row holds both, so that every pair TRL keeps whole fits one row.
        seq_len *= 2
        out.set("train.seq_len", seq_len, f.note("sequence_len", "Axolotl's default 512") + (
            " x 2: a row holds a KTO example's two sequences (prompt + completion, and its "
            "KL sequence: the prompt + another example's completion), each up to "
            "sequence_len tokens as TRL's max_length allows" if kto else
            " x 2: a row holds a pair's two sequences (prompt + chosen, prompt + "
            "rejected), each up to sequence_len tokens as TRL's max_length allows"))
    else:
        out.set("train.seq_len", seq_len, f.note("sequence_len", "Axolotl's default"))
    chunk = _loss_chunk(seq_len, context)
    if chunk is not None:
        out.set("train.loss_chunk", chunk, "divides train.seq_len (ndjax's 1024 does not)")
    packing = bool(f.flag("sample_packing", False))
    if sampled:
        if packing:
            out.skip("sample_packing", True, "Axolotl refuses it with rl; ndjax's GRPO rows "
                     "hold one prompt and completion each")
    elif pref.rl:
        out.set("data.packing", False, ("" if packing else f.note("sample_packing", "false")
                                        + ": ") + f"one {unit} a row, as Axolotl trains "
                f"{'KTO examples' if kto else 'preference pairs'} (micro_batch_size counts "
                f"{'examples' if kto else 'pairs'})")
        if packing:
            out.skip("sample_packing", True, f"Axolotl does not pack {unit}s; ndjax keeps one "
                     f"{unit} a row, so that train.batch_size counts them as micro_batch_size "
                     "does")
    else:
        out.set("data.packing", packing, f.note("sample_packing", "false"))
    if tokenizer is not None:
        out.set("data.tokenizer", tokenizer, "base_model's (or tokenizer_config's) "
                "tokenizer.json")
    train = f.value("datasets")
    if kto:
        out.notes["train.batch_size"] += (
            ": KTO examples, each one's KL partner the example before it within chunks of "
            "train.batch_size examples (TRL's chunks are micro_batch_size's)")
    elif sampled:
        out.notes["train.batch_size"] += (": completions, grpo.num_generations of each "
                                          "prompt (TRL's count)")
    if pref.refused:  # nothing to read them for: rl is the problem
        for name in ("datasets", "test_datasets"):
            if f.value(name) is not None:
                out.skip(name, f.raw[name], "not read: rl is refused")
        return
    kind, files, refused = _datasets(f, out, "datasets", train, None, pref.objective) \
        if train is not None else (None, [], False)
    if train is None:
        out.problem("datasets is not set: list the local "
                    + ("preference" if pref.rl else "chat_template or completion") +
                    " files to train on.")
    elif kind is None and not refused:  # a refused one is a problem of its own
        out.problem("datasets: none of them is a dataset ndjax reads (each is listed as not "
                    "mapped); without one the run would train on ndjax's demo corpus.")
    if kind is not None:
        out.set("data.source", kind.source, "datasets[].type")
        out.set("data.files", ",".join(files), "datasets[].path")
        for path, value, *note in kind.settings:
            out.set(path, value, note[0] if note else _NOTES[path])
    if sampled:
        for key in ("excess_length_strategy", "train_on_inputs"):
            if f.has(key):
                out.skip(key, f.raw[key], "Axolotl reads no length strategy for GRPO's prompts "
                         "(it keeps them all); ndjax leaves out prompts longer than "
                         "train.seq_len - grpo.max_completion_length, counted"
                         if key == "excess_length_strategy" else
                         "GRPO learns its sampled completions only")
    elif kind is None or kind.source == "chat":
        strategy = f.text("excess_length_strategy", "drop")
        if strategy in ("drop", "truncate"):
            out.set("data.overlong", strategy, f.note("excess_length_strategy", "drop") + (
                f": a {unit} longer than train.seq_len + 1 tokens, both sequences together"
                if pref.rl else ""))
        elif pref.rl:
            out.problem(refusal("excess_length_strategy", strategy, "drop or truncate for "
                                f"{'KTO examples' if kto else 'preference pairs'}",
                                f"; ndjax drops a {unit} longer than train.seq_len (drop, "
                                "Axolotl's default) or cuts its completions' ends (truncate)"))
        else:
            out.skip("excess_length_strategy", strategy, "ndjax drops or truncates")
        if f.flag("train_on_inputs", False):
            out.skip("train_on_inputs", True, "ndjax's preference objectives learn the "
                     "completions" if pref.rl else "ndjax learns only the assistant's tokens")
        else:
            f.read.discard("train_on_inputs")  # listed as off
    if pref.rl:
        _no_evaluation(f, out, pref.objective)
        return
    tests = f.value("test_datasets")
    _, eval_files, _ = _datasets(f, out, "test_datasets", tests, kind) if tests \
        else (None, [], False)
    val = f.number("val_set_size", 0.0, maximum=1.0)
    held = False
    if val > 0 and eval_files:
        out.skip("val_set_size", f.raw["val_set_size"], "test_datasets is the validation set, "
                 "as in Axolotl")
    elif val > 0 and val < 1 and kind is not None:
        out.set("data.eval_fraction", float(val), "val_set_size: a seeded share of datasets "
                "held out")
        held = True
    elif val > 0:
        out.skip("val_set_size", f.raw["val_set_size"], "ndjax holds out a share below 1 of a "
                 "dataset it reads")
    every = out.attempt(steps_of, f, "eval_steps", steps)
    evals = f.integer("evals_per_epoch", None, minimum=0)
    if eval_files or held:
        if eval_files:
            out.set("data.eval_files", ",".join(eval_files), "test_datasets[].path")
        if every is None and not f.has("eval_steps"):  # a refused one is reported
            if steps is None:  # a length in epochs: Axolotl's default, once an epoch
                out.set("train.evals_per_epoch", evals or 1,
                        f.note("evals_per_epoch", "Axolotl's default: once an epoch"))
            else:
                out.skip("eval_steps", None, "unset: Axolotl evaluates once an epoch, which "
                         "ndjax counts only when num_epochs sets the length; set eval_steps "
                         "to evaluate")
        else:
            out.set("train.eval_every", every, "eval_steps")
    elif every is not None:
        out.skip("eval_steps", f.raw["eval_steps"], "no test_datasets or val_set_size to "
                 "evaluate on")
    if evals and (every is not None or steps is not None or not (eval_files or held)):
        out.skip("evals_per_epoch", evals, "eval_steps is set, and Axolotl reads it first"
                 if every is not None else "no test_datasets or val_set_size to evaluate on"
                 if not (eval_files or held) else
                 "ndjax counts evaluations per epoch only when num_epochs sets the length")


def _loss_chunk(seq_len: int, context: int) -> int | None:
    """A train.loss_chunk that fits, where ndjax's default (1024) does not: the chunk must
    divide seq_len and split over the context axis (ndjax.experiment._check_loss_chunk)."""
    if seq_len <= 1024 or (seq_len % 1024 == 0 and 1024 % context == 0):
        return None
    fits = [c for c in range(1024, 0, -1) if seq_len % c == 0 and c % context == 0]
    return fits[0] if fits else seq_len


def _datasets(f: Fields, out: Out, name: str, entries: Any, kind: _Kind | None,
              objective: str | None = None) -> tuple[_Kind | None, list[str], bool]:
    """The files of the entries ndjax reads as ``kind`` (None: as the first one), and
    whether any entry was refused (each is recorded as a problem). ``objective``: a
    preference objective's (rl's) dataset types, else the SFT ones."""
    if not isinstance(entries, list):
        out.problem(refusal(name, entries, "a list of datasets, each with path: and type:"))
        return kind, [], True
    files, refused = [], False
    for i, entry in enumerate(entries):
        where = f"{name}[{i}]"
        got = out.attempt(_dataset, f, where, entry, objective)
        if got is None:
            refused = True
            continue
        if isinstance(got, Unmapped):
            out.skip(got.field, got.value, got.reason)
            continue
        this, path, skipped, root_keys = got
        if kind is not None and this != kind:
            out.skip(where, entry, f"ndjax reads one kind of dataset per run, and this is not "
                     f"the first one's ({kind.describe()})")
            continue
        kind = this
        files.append(path)
        f.read.update(root_keys)  # the top-level chat template this dataset uses
        for u in skipped:
            out.skip(u.field, u.value, u.reason)
    return kind, files, refused


def _dataset(root: Fields, where: str, entry: Any, objective: str | None = None
             ) -> Unmapped | tuple[_Kind, str, list[Unmapped], tuple[str, ...]]:
    """One entry: (its kind, its files, the keys not mapped, the top-level keys it uses),
    or why ndjax cannot read it."""
    if not isinstance(entry, Mapping):
        bad(where, entry, "a mapping with path: and type:")
    d = root.child(entry, f"{where}.")
    path, kind = d.text("path"), d.value("type")
    if objective == "grpo":
        return _prompts(root, d, where, entry, path, kind)
    if objective == "kto":
        return _examples(root, d, where, entry, path, kind)
    if objective is not None:
        return _pairs(root, d, where, entry, path, kind, objective)
    if kind not in _FORMATS:
        return Unmapped(where, dict(entry), "ndjax reads datasets of type "
                        f"{', '.join(_FORMATS)}; convert this one's rows")
    files = _local_files(where, path)
    if isinstance(files, Unmapped):
        return files
    skipped: list[Unmapped] = []
    root_keys: tuple[str, ...] = ()
    if d.value("split") not in (None, "train"):
        skipped.append(Unmapped(f"{where}.split", entry["split"], "ndjax reads every row"))
    d.read.add("ds_type")  # the files' extensions say it
    if kind != "chat_template":
        settings: tuple[tuple[str, Any], ...] = (("data.format", _FORMATS[kind]),)
        if kind == "completion":
            settings += (("data.text_field", d.text("field", "text")),)
        this = _Kind("chat", settings)
    else:
        messages = d.text("field_messages", "messages")
        mapping = d.value("message_property_mappings", {})
        if not isinstance(mapping, Mapping):
            bad(f"{where}.message_property_mappings", mapping, "a mapping such as {role: "
                 "from, content: value}")
        mapping = dict(mapping)
        mapping.setdefault("role", d.value("message_field_role", "role"))
        mapping.setdefault("content", d.value("message_field_content", "content"))
        extra = {k: v for k, v in mapping.items() if k not in ("role", "content")}
        if extra:
            skipped.append(Unmapped(f"{where}.message_property_mappings", extra,
                                    "ndjax maps each message's role and content keys only"))
        learning = _learning(d, where, skipped)
        template, root_keys = _template(root, d, where, skipped)
        this = _Kind("chat", (("data.messages_field", messages),
                              ("data.chat_template", template),
                              ("data.role_field", str(mapping["role"])),
                              ("data.content_field", str(mapping["content"]))) + learning)
    skipped += [Unmapped(f"{where}.{k}", entry[k], reason(str(k), entry[k])) for k in d.rest()]
    return this, files, skipped, root_keys


# Axolotl's preference strategies that render their own prompt strings (chatml.intel,
# llama3.ultra, zephyr.nectar, a user-defined format, ...): ndjax has no such transform.
_RENDERED = ("chatml", "llama3", "zephyr", "user_defined")
_PAIR_NOTES = {"data.chosen_field": "datasets[].field_chosen",
               "data.rejected_field": "datasets[].field_rejected"}


def _pairs(root: Fields, d: Fields, where: str, entry: Mapping, path: str, kind: Any,
           objective: str) -> Unmapped | tuple[_Kind, str, list[Unmapped], tuple[str, ...]]:
    """A preference run's dataset (Axolotl's strategies of its DPO trainers, ORPO's for
    rl: orpo) as data.format=preference: the records' prompt, chosen and rejected
    fields, strings (TRL's standard records) or messages (conversational, rendered with
    the chat template). Axolotl renders its chat_template types to strings itself; ndjax
    renders them as TRL does a conversational record (docs/from-axolotl.md)."""
    if isinstance(kind, Mapping):
        name = "user_defined.default"  # Axolotl's reading of a type given as a mapping
    elif kind is None or isinstance(kind, str) and kind:
        name = kind if kind is None or "." in kind else f"{kind}.default"
    else:
        bad(f"{where}.type", kind, "one of Axolotl's preference dataset types, such as "
            "chat_template.default")
    orpo = objective == "orpo"
    skipped: list[Unmapped] = []
    if name in (None, "passthrough.default"):
        prompt = ("prompt", "the records' prompt, chosen and rejected as they are (TRL's "
                            "standard or conversational records)")
        chosen, rejected = "chosen", "rejected"
    elif name == "chat_template.default" and not orpo:
        prompt = (d.text("field_messages", "messages"), "datasets[].field_messages: the "
                  "prompt's messages")
        chosen, rejected = d.text("field_chosen", "chosen"), d.text("field_rejected", "rejected")
    elif name == "chat_template.argilla_chat" and not orpo or \
            name == "chat_template.argilla" and orpo:
        # No prompt field: TRL's implicit prompt, the conversations' common first
        # messages (Axolotl takes chosen's all but the last).
        prompt = ("", f"none ({name}): the prompt is the messages chosen and rejected "
                      "begin with, TRL's implicit prompt")
        chosen, rejected = (d.text("field_chosen", "chosen"), d.text("field_rejected",
                                                                     "rejected")) \
            if not orpo else ("chosen", "rejected")
    else:
        raise ConfigError(_pair_type_refusal(where, kind, name, objective))
    keys = _plain_messages(d, where) if name not in (None, "passthrough.default") else ()
    files = _local_files(where, path)
    if isinstance(files, Unmapped):
        return files
    if d.value("split") not in (None, "train"):
        skipped.append(Unmapped(f"{where}.split", entry["split"], "ndjax reads every row"))
    d.read.add("ds_type")  # the files' extensions say it
    for key in ("roles_to_train", "train_on_eos", "train_on_eot"):
        if d.value(key) is not None:
            skipped.append(Unmapped(f"{where}.{key}", entry[key], "a preference objective "
                                    "learns each pair's completions"))
    template, root_keys = _template(root, d, where, skipped)
    settings = (("data.format", "preference", f"datasets[].type {name or 'unset'} "
                 f"(rl: {objective}): preference pairs" + "".join(
                     f"; datasets[].{k}: the messages' role and content keys, ndjax's"
                     for k in keys)),
                ("data.prompt_field", *prompt),
                ("data.chosen_field", chosen, _PAIR_NOTES["data.chosen_field"]
                 if d.has("field_chosen") else "the records' chosen"),
                ("data.rejected_field", rejected, _PAIR_NOTES["data.rejected_field"]
                 if d.has("field_rejected") else "the records' rejected"),
                ("data.chat_template", template))
    skipped += [Unmapped(f"{where}.{k}", entry[k], reason(str(k), entry[k])) for k in d.rest()]
    return _Kind("chat", settings), files, skipped, root_keys


def _records(root: Fields, d: Fields, where: str, entry: Mapping, path: str,
             settings: tuple[tuple[str, Any, str], ...]
             ) -> Unmapped | tuple[_Kind, str, list[Unmapped], tuple[str, ...]]:
    """A dataset of records read as they are (no type), with ``settings`` and the chat
    template (for records of messages)."""
    files = _local_files(where, path)
    if isinstance(files, Unmapped):
        return files
    skipped: list[Unmapped] = []
    if d.value("split") not in (None, "train"):
        skipped.append(Unmapped(f"{where}.split", entry["split"], "ndjax reads every row"))
    d.read.add("ds_type")  # the files' extensions say it
    template, root_keys = _template(root, d, where, skipped)
    settings += (("data.chat_template", template, _NOTES["data.chat_template"]),)
    skipped += [Unmapped(f"{where}.{k}", entry[k], reason(str(k), entry[k])) for k in d.rest()]
    return _Kind("chat", settings), files, skipped, root_keys


def _type_name(where: str, kind: Any) -> str | None:
    """Axolotl's name of a preference dataset's ``type`` (None: unset)."""
    if isinstance(kind, Mapping):
        return "user_defined.default"  # Axolotl's reading of a type given as a mapping
    if kind is None or isinstance(kind, str) and kind:
        return kind if kind is None or "." in kind else f"{kind}.default"
    bad(f"{where}.type", kind, "unset (records read as they are)")


def _examples(root: Fields, d: Fields, where: str, entry: Mapping, path: str, kind: Any
              ) -> Unmapped | tuple[_Kind, str, list[Unmapped], tuple[str, ...]]:
    """An rl: kto dataset as data.format=unpaired_preference: records of prompt,
    completion and label as they are (no type, or passthrough), strings or messages;
    pairs of chosen and rejected are unpaired as TRL does (the first record decides).
    Axolotl's KTO strategies render their own prompt strings: refused."""
    name = _type_name(where, kind)
    if name not in (None, "passthrough.default"):
        family = name.split(".")[0]
        ours = ("leave type unset and give records of prompt, completion and label (strings, "
                "or prompt and completion as lists of messages, rendered with chat_template) "
                "as TRL's KTOTrainer reads them")
        if family in _RENDERED:
            raise ConfigError(f"{where}.type: {show(kind)} renders Axolotl's own {family} "
                              f"prompt strings, which ndjax has no transform for; {ours}.")
        raise ConfigError(f"{where}.type: {show(kind)} is not a KTO dataset type ndjax reads "
                          f"(Axolotl's are chatml.*, llama3.* and user_defined.*); {ours}.")
    note = (f"datasets[].type {name or 'unset'} (rl: kto): KTO's examples, records of "
            "prompt, completion and label as they are, or pairs of chosen and rejected "
            "unpaired as TRL does")
    return _records(root, d, where, entry, path, (
        ("data.format", "unpaired_preference", note),
        ("data.prompt_field", "prompt", "the records' prompt"),
        ("data.completion_field", "completion", "the records' completion"),
        ("data.label_field", "label", "the records' label (true: desirable)")))


def _prompts(root: Fields, d: Fields, where: str, entry: Mapping, path: str, kind: Any
             ) -> Unmapped | tuple[_Kind, str, list[Unmapped], tuple[str, ...]]:
    """An rl: grpo dataset as data.format=prompt: records that hold a prompt (a string
    or messages) and the columns the reward functions read, as they are. Axolotl's GRPO
    types are Python transforms (module.function) ndjax cannot run: refused."""
    name = _type_name(where, kind)
    if name not in (None, "passthrough.default"):
        raise ConfigError(
            f"{where}.type: {show(kind)} is a transform Axolotl runs on each record, which "
            "ndjax cannot run; run it once yourself, save its records (each with a prompt, "
            "a string or messages, and the columns your reward functions read) as JSON "
            "Lines, and list that file with no type.")
    return _records(root, d, where, entry, path, (
        ("data.format", "prompt", f"datasets[].type {name or 'unset'} (rl: grpo): records "
                                  "of a prompt and the columns the reward functions read, "
                                  "as they are"),
        ("data.prompt_field", "prompt", "the records' prompt (a string, or messages rendered "
                                        "with the chat template and its generation prompt)")))


def _pair_type_refusal(where: str, kind: Any, name: str, objective: str) -> str:
    """The one line refusing a preference dataset's type, with what to use instead."""
    field = f"{where}.type: {show(kind)}"
    ours = ("chat_template.argilla (chosen and rejected conversations) or no type (records "
            "of prompt, chosen and rejected)" if objective == "orpo" else
            "chat_template.default (records of messages, chosen and rejected), "
            "chat_template.argilla_chat (chosen and rejected conversations) or no type "
            "(records of prompt, chosen and rejected)")
    family = name.split(".")[0]
    if family in _RENDERED:
        return (f"{field} renders Axolotl's own {family} prompt strings, which ndjax has no "
                f"transform for; use type {ours}, with chat_template set to the template, "
                "or convert the records to prompt, chosen and rejected strings.")
    if name == "chat_template.argilla":
        return (f"{field} is rl: orpo's type; for rl: {objective}, chosen and rejected "
                "conversations are type chat_template.argilla_chat.")
    if objective == "orpo" and name.startswith("chat_template."):
        return (f"{field} is a type of Axolotl's DPO trainers, not of rl: orpo; use type "
                f"{ours}.")
    return (f"{field} is not a preference dataset type ndjax reads for rl: {objective}; use "
            f"type {ours}.")


def _plain_messages(d: Fields, where: str) -> tuple[str, ...]:
    """ndjax's preference records are messages with role and content keys (the data's
    data.role_field / content_field are for chat data): other keys are refused. Returns
    the fields that name those keys."""
    mapping = d.value("message_property_mappings", {})
    if not isinstance(mapping, Mapping):
        bad(f"{where}.message_property_mappings", mapping, "a mapping such as {role: role, "
            "content: content}")
    mapping = {**mapping}
    mapping.setdefault("role", d.value("message_field_role", "role"))
    mapping.setdefault("content", d.value("message_field_content", "content"))
    if mapping != {"role": "role", "content": "content"}:
        bad(f"{where}.message_property_mappings", mapping, "{role: role, content: content} "
            "for preference pairs", "; ndjax reads their messages' role and content keys "
            "as they are: rename the records' keys")
    return tuple(k for k in ("message_property_mappings", "message_field_role",
                             "message_field_content") if d.has(k))


def _no_evaluation(f: Fields, out: Out, objective: str | None) -> None:
    """A preference (or GRPO) run's validation fields, listed: ndjax does not evaluate
    them yet (train.eval_every)."""
    why = "ndjax does not evaluate " + ("GRPO" if objective == "grpo" else
                                        "preference objectives") + " on a validation split yet"
    tests = f.value("test_datasets")
    if tests:
        out.skip("test_datasets", tests, why)
    if f.number("val_set_size", 0.0, maximum=1.0) > 0:
        out.skip("val_set_size", f.raw["val_set_size"], why + "; every record trains")
    for key in ("eval_steps", "evals_per_epoch"):
        if f.value(key) is not None:
            out.skip(key, f.raw[key], why)


def _local_files(where: str, path: str) -> str | Unmapped:
    """``path`` as data.files: a JSON Lines, Parquet, CSV or Arrow file, a folder
    (save_to_disk, or of data files: Hugging Face datasets reads it), or a hub id, read
    from the local cache (ndjax's check of the converted file says if it is not there)."""
    if "," in path:
        return Unmapped(f"{where}.path", path, "ndjax's data.files splits paths at commas")
    if os.path.isdir(path):
        return path
    if not os.path.isfile(path):
        if _HUB_ID.fullmatch(path) and not path.endswith(_DATA_EXTS + _DATASET_EXTS):
            return path
        raise ConfigError(f"{where}.path: {path!r} is not a file or directory (relative paths "
                          "are read from the directory you run in).")
    if not path.endswith(_DATA_EXTS + _DATASET_EXTS):
        return Unmapped(f"{where}.path", path, "ndjax reads JSON Lines, Parquet, CSV and Arrow "
                        "files, save_to_disk folders and hub datasets")
    if path.endswith(".json") and _json_array(path):
        return Unmapped(f"{where}.path", path, "a JSON array; ndjax reads JSON Lines (one "
                        "record a line): convert it, e.g. jq -c '.[]'")
    return path


def _json_array(path: str) -> bool:
    with open(path, "rb") as fh:
        return fh.read(4096).lstrip()[:1] == b"["


def _learning(d: Fields, where: str, skipped: list[Unmapped]) -> tuple[tuple[str, Any], ...]:
    """data.roles_to_train and data.train_on_eos where a dataset sets other than their
    defaults (Axolotl's too: ["assistant"], turn). Roles are read with Axolotl's names
    (human: user, gpt: assistant); the end-of-turn tokens' setting is train_on_eot, else
    train_on_eos, as Axolotl reads it."""
    out: list[tuple[str, Any]] = []
    roles = d.value("roles_to_train")
    if roles is not None:
        named = [AXOLOTL_ROLES.get(r, r) for r in roles] if isinstance(roles, list) and \
            all(isinstance(r, str) for r in roles) else []
        if named and all(r in CHAT_ROLES for r in named):
            if named != ["assistant"]:
                out.append(("data.roles_to_train", ",".join(dict.fromkeys(named))))
        else:
            skipped.append(Unmapped(f"{where}.roles_to_train", roles, "ndjax learns the "
                                    f"turns of a non-empty list of {', '.join(CHAT_ROLES)}"))
    eos, eot = d.value("train_on_eos"), d.value("train_on_eot")
    value = eot if eot is not None else eos
    if eos is not None and eot is not None and eos != eot:
        skipped.append(Unmapped(f"{where}.train_on_eos", eos, f"train_on_eot ({eot!r}) is "
                                "the end-of-turn tokens' setting, as in Axolotl"))
    if value is not None and value not in TRAIN_ON_EOS:
        skipped.append(Unmapped(f"{where}.train_on_eot" if eot is not None else
                                f"{where}.train_on_eos", value,
                                f"ndjax learns end-of-turn tokens {', '.join(TRAIN_ON_EOS)}"))
    elif value not in (None, "turn"):
        out.append(("data.train_on_eos", value))
    return tuple(out)


def _template(root: Fields, d: Fields, where: str, skipped: list[Unmapped]
              ) -> tuple[str, tuple[str, ...]]:
    """data.chat_template for a dataset (its own chat_template, else the top level's, as
    in Axolotl) and the top-level keys that gave it. The top level's are only marked read
    once the dataset is taken, so that they are reported if none is."""
    keys = ("chat_template", "chat_template_jinja")
    if d.has("chat_template") or d.has("chat_template_jinja"):
        name, jinja, prefix, used = d.value(keys[0]), d.value(keys[1]), f"{where}.", ()
    else:
        name, jinja, prefix, used = root.raw.get(keys[0]), root.raw.get(keys[1]), "", keys
    if jinja is not None and name in (None, "jinja"):
        if isinstance(jinja, str) and os.path.isfile(jinja):
            return jinja, used
        skipped.append(Unmapped(f"{prefix}chat_template_jinja", jinja, "ndjax's "
                                "data.chat_template takes a file: save the template as a .jinja "
                                "file and set chat_template_jinja to its path"))
        return "", used
    if jinja is not None:  # Axolotl reads it only with chat_template: jinja (or none)
        skipped.append(Unmapped(f"{prefix}chat_template_jinja", jinja, f"unused: chat_template "
                                f"is {name!r}, and Axolotl reads this only with jinja"))
    if name is None or name == "tokenizer_default" or \
            str(name).startswith("tokenizer_default_fallback_"):
        return "", used
    if name in template_names():  # the same format under the same name
        return str(name), used
    skipped.append(Unmapped(f"{prefix}chat_template", name, "ndjax ships "
                            f"{', '.join(template_names())} and renders others with the "
                            "tokenizer's own; to keep this one, save it as a .jinja file and "
                            "set chat_template: jinja, chat_template_jinja: FILE"))
    return "", used
