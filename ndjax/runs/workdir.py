"""A run's workdir holds everything that defines the run, so that resuming it,
exporting it or generating from it needs nothing else.

train.py writes, before the first step:
- ``config.json``: the config as run, with the model resolved in full (its family, every
  dim, ``rope_scaling``, ``rms_norm_eps``, the family's options), whether it came from
  a preset or from ``model.init_from``'s config.json;
- ``run/tokenizer/``: the tokenizer files of ``data.tokenizer`` (tokenizer.json and
  the files transformers keeps beside it);
- ``run/chat_template.jinja``: ``data.chat_template``'s file, where one was set;
- ``run/source/``: ``model.init_from``'s files other than the weights (config.json,
  generation_config.json, tokenizer files), which exports carry along.

``run_config`` reads a run back pointing at those copies, and ``for_resume`` resumes
it with them: moving or deleting the directories the run started from changes nothing.
"""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import warnings
from typing import Any

import ml_collections

from ndjax import config as config_lib
from ndjax.runtime.errors import ConfigError

RUN = "run"
TOKENIZER = os.path.join(RUN, "tokenizer")
CHAT_TEMPLATE = os.path.join(RUN, "chat_template.jinja")
SOURCE = os.path.join(RUN, "source")
# Beside a tokenizer.json or a Hugging Face checkpoint: what transformers reads with it.
_TOKENIZER_FILES = re.compile(r"(tokenizer|special_tokens_map|added_tokens|chat_template)"
                              r"[\w.-]*")
_SOURCE_FILES = re.compile(r"config\.json|generation_config\.json|"
                           + _TOKENIZER_FILES.pattern)


def resolved_model(model_cfg: Any) -> dict[str, Any]:
    """The model fields that define ``model_cfg`` (a ``DecoderConfig``) in full: the
    family, every dim, and the options the family has. rope_scaling {} means none and
    sliding_window 0 no window (None would mean the preset's)."""
    from ndjax.models import registry
    scaling = model_cfg.rope_scaling
    out = dict(family=model_cfg.family, vocab_size=model_cfg.vocab_size, dim=model_cfg.dim,
               n_layers=model_cfg.n_layers, n_heads=model_cfg.n_heads,
               n_kv_heads=model_cfg.n_kv_heads, ffn_dim=model_cfg.ffn_dim,
               head_dim=model_cfg.hd, rope_theta=float(model_cfg.rope_theta),
               rope_scaling={} if scaling is None else scaling.as_dict(),
               rms_norm_eps=float(model_cfg.rms_norm_eps),
               tie_embeddings=bool(model_cfg.tie_embeddings))
    family = registry.of(model_cfg)
    for field in registry.OPTION_FIELDS:
        value = getattr(model_cfg, field)
        if field == "sliding_window":
            value = value or 0
        out[field] = value if field in family.options or field in family.fixed else None
    return out


def _copy_files(src_dir: str, dst_dir: str, pattern: re.Pattern) -> None:
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if pattern.fullmatch(name) and os.path.isfile(path):
            shutil.copy(path, os.path.join(dst_dir, name))


def record(workdir: str, settings: config_lib.Settings, model_cfg: Any,
           data: config_lib.DataSettings | None = None) -> None:
    """Writes config.json (``settings``, as given) and the copies under run/ of the
    files the run uses, ``data`` (default ``settings.data``): a resume uses the copies
    themselves, which are then left as they are (process 0, before training)."""
    d, model = data or settings.data, settings.model
    if d.tokenizer != "byte" and os.path.abspath(d.tokenizer) != os.path.abspath(
            os.path.join(workdir, TOKENIZER, "tokenizer.json")):
        # Only tokenizer.json's own siblings: the run may point into a directory
        # that holds much else.
        _copy_files(os.path.dirname(os.path.abspath(d.tokenizer)),
                    os.path.join(workdir, TOKENIZER), _TOKENIZER_FILES)
        shutil.copy(d.tokenizer, os.path.join(workdir, TOKENIZER, "tokenizer.json"))
    if d.chat_template and os.path.isfile(d.chat_template) and os.path.abspath(
            d.chat_template) != os.path.abspath(os.path.join(workdir, CHAT_TEMPLATE)):
        os.makedirs(os.path.join(workdir, RUN), exist_ok=True)
        shutil.copy(d.chat_template, os.path.join(workdir, CHAT_TEMPLATE))
    if model.init_from and os.path.isdir(model.init_from):
        _copy_files(model.init_from, os.path.join(workdir, SOURCE), _SOURCE_FILES)
    saved = settings.to_dict()
    saved["model"].update(resolved_model(model_cfg))
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(saved, f, indent=2)


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The run's config, reading the copies in the workdir: the model from its
    resolved fields (weights come from the run's checkpoints, so no
    ``model.init_from``; but a LoRA's frozen base does), the tokenizer and chat
    template from run/."""
    config = config_lib.run_config(workdir)
    # (a run saved before workdirs kept their model still needs it)
    if _resolved(config) and config.model.lora.rank is None:
        config.model.init_from = None
    config.model.lora.init_from = None  # the checkpoints hold the adapters
    tokenizer = os.path.join(workdir, TOKENIZER, "tokenizer.json")
    if config.data.tokenizer != "byte" and os.path.isfile(tokenizer):
        config.data.tokenizer = tokenizer
    template = os.path.join(workdir, CHAT_TEMPLATE)
    if config.data.chat_template and os.path.isfile(template):
        config.data.chat_template = template
    return config


def source_dir(workdir: str) -> str | None:
    """The copy of ``model.init_from``'s non-weight files, if the run had one."""
    path = os.path.join(workdir, SOURCE)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def source_config(workdir: str) -> dict | None:
    """``model.init_from``'s config.json as the run saw it (token ids and other
    fields ndjax does not model, which an export keeps)."""
    path = source_dir(workdir)
    if path is None:
        return None
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def source(workdir: str) -> Any:
    """That copy as an ``hf.Checkpoint`` without tensors: what ``hf.export`` takes as
    its ``source`` (config.json fields and files to carry along)."""
    from ndjax.runs import hf
    config = source_config(workdir)
    return None if config is None else hf.Checkpoint(source_dir(workdir), config, {}, {})


def has_checkpoint(workdir: str) -> bool:
    """A complete checkpoint under <workdir>/checkpoints (orbax renames a save's
    temporary directory to the bare step number when it is complete)."""
    directory = os.path.join(workdir, "checkpoints")
    return os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory))


def for_resume(config: ml_collections.ConfigDict, workdir: str) -> ml_collections.ConfigDict:
    """A run resumed from its checkpoints takes its model from the workdir, not from
    ``model.init_from`` (whose weights only step 0 needs, and which may be gone), and
    its tokenizer and chat template from the copies under run/ (see ``_run_copies``).
    The config is returned unchanged when there is nothing to resume."""
    if (str(config.checkpoint.resume) == "never" or not has_checkpoint(workdir)
            or not os.path.isfile(os.path.join(workdir, "config.json"))):
        return config
    saved = config_lib.run_config(workdir)
    config = _run_copies(ml_collections.ConfigDict(config.to_dict()), saved, workdir)
    _resume_adapters(config, saved, workdir)
    if config.model.init_from is None or not _resolved(saved):
        return config
    if saved.model.init_from != config.model.init_from:
        raise ConfigError(
            f"model.init_from={config.model.init_from!r}, but the run in {workdir!r} started "
            f"from {saved.model.init_from!r}; resume it with the same model.init_from, or use "
            "another --workdir (or checkpoint.resume=never).")
    for field in resolved_model_fields():
        config.model[field] = saved.model[field]
    if config.model.lora.rank is None:  # LoRA's checkpoints hold the adapters, not the base
        config.model.init_from = None
    return config


def _resume_adapters(config: ml_collections.ConfigDict, saved: ml_collections.ConfigDict,
                     workdir: str) -> None:
    """model.lora.init_from, like a full run's model.init_from, only starts step 0: the
    checkpoints hold the adapters, so a resume drops it (the directory may be gone), after
    checking that it names what the run started from."""
    given, started = config.model.lora.init_from, saved.model.lora.init_from
    if given is not None and given != started:
        raise ConfigError(
            f"model.lora.init_from={given!r}, but the run in {workdir!r} started from "
            f"{started!r}; resume it with the same model.lora.init_from, or use another "
            "--workdir (or checkpoint.resume=never).")
    config.model.lora.init_from = None


def _run_copies(config: ml_collections.ConfigDict, saved: ml_collections.ConfigDict,
                workdir: str) -> ml_collections.ConfigDict:
    """``data.tokenizer`` and ``data.chat_template``, where the config names the file
    the run started with, become the run's copies: its checkpoints learned that
    tokenizer's ids, and its data position counts rows tokenized with it, so a resume
    goes on with them whether the original is gone or has changed since (a warning
    then: the changed file is not used; a fresh run is how to train with it). A config
    naming another file is left as it is."""
    d = config.data
    for field, copy in (("tokenizer", os.path.join(workdir, TOKENIZER, "tokenizer.json")),
                        ("chat_template", os.path.join(workdir, CHAT_TEMPLATE))):
        given = d[field]
        if (not given or given == "byte" or given != saved.data[field]
                or not os.path.isfile(copy) or os.path.abspath(given) == os.path.abspath(copy)):
            continue
        if os.path.isfile(given) and not filecmp.cmp(given, copy, shallow=False):
            warnings.warn(
                f"data.{field}={given!r} has changed since the run in {workdir!r} started; "
                f"resuming with the run's copy, {copy}, which its checkpoints were trained "
                f"with. To train with the new file, start a fresh run (another --workdir).",
                stacklevel=3)
        d[field] = copy
    return config


def _resolved(config: ml_collections.ConfigDict) -> bool:
    """Whether a saved config holds its model in full."""
    from ndjax.config import MODEL_DIMS
    return all(config.model[f] is not None for f in (*MODEL_DIMS, "rope_scaling"))


def resolved_model_fields() -> tuple[str, ...]:
    """What ``resolved_model`` writes: the dims a config may set, the rope scaling, the
    family and its options."""
    from ndjax.config import MODEL_DIMS
    from ndjax.models.registry import OPTION_FIELDS
    return (*MODEL_DIMS, "rope_scaling", "family", *OPTION_FIELDS)
