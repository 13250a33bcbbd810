r"""Sample completions from a training run or a Hugging Face model directory.

    ndjax generate --workdir=runs/llama_fsdp_tp --prompt='import os' [--json]
    ndjax generate --hf_dir=DIR --chat --prompts_file=prompts.jsonl

How prompts are tokenized and where generation stops: docs/sampling.md.
"""

# From ``--workdir`` the run's saved config rebuilds model, mesh and rules (as
# ``ndjax export`` does) and restores the parameters of step N (default: the newest)
# onto the devices present; prompts are tokenized as its training data was
# (``data.tokenizer``, no BOS), and ``--chat`` renders each as one user message with
# the template training used (``data.chat_template``, else the tokenizer's). From
# ``--hf_dir``: the directory's ``config.json``, weights, ``tokenizer.json`` and chat
# template; prompts get the tokenizer's special tokens (BOS), as transformers adds
# them, by tokenizer.json as written (transformers rebuilds a qwen2 directory's from
# its vocabulary as a byte-level BPE). Generation stops at ``--max_new_tokens`` or an
# end-of-sequence token (``generation_config.json``, else ``config.json``, else the
# tokenizer's). Bad input is one line on stderr, exit code 2.

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from ndjax.runtime.cli import show_in_help
from ndjax.runtime.console import quiet_libraries, start_jax_quietly

start_jax_quietly()  # before jax: the CUDA plugin's lines on a machine without a GPU
import jax  # noqa: E402

from ndjax.config import default_config  # noqa: E402
from ndjax.data.chat_template import (  # noqa: E402
    ChatTemplate,
    TemplateRefused,
    is_template_name,
    load_chat_template,
    template_path,
    token_text,
)
from ndjax.data.loader import data_tokenizer  # noqa: E402
from ndjax.data.tokenizers import ByteTokenizer, HFTokenizer  # noqa: E402
from ndjax.experiment import Experiment  # noqa: E402
from ndjax.models.sampling import Generator, Sampling  # noqa: E402
from ndjax.runs import workdir as workdir_lib  # noqa: E402
from ndjax.runs.checkpoint import saved_step  # noqa: E402
from ndjax.runtime.errors import ConfigError  # noqa: E402


@dataclasses.dataclass
class Model:
    """What generation needs: parameters in their sharding, tokenizer, stop tokens, limits."""

    exp: Experiment
    params: Any
    tokenizer: ByteTokenizer | HFTokenizer
    eos_ids: tuple[int, ...]
    max_len: int
    max_len_what: str           # where max_len comes from, for errors
    bos_in_prompts: bool        # plain prompts get the tokenizer's special tokens
    tokenizer_dir: str | None   # where tokenizer_config.json / chat_template.jinja may be
    # data.chat_template: the Jinja file a run rendered its chat data with ("" = the
    # tokenizer's own), so that --chat prompts look like the conversations trained on.
    chat_template: str = ""
    chat_template_what: str = "data.chat_template"  # where it was set, for errors

    def generator(self, max_new_tokens: int, sampling: Sampling | None = None, seed: int = 0,
                  max_len: int | None = None) -> Generator:
        what = "--max_len" if max_len is not None else self.max_len_what
        return Generator(self.exp.graphdef, self.params, self.exp.model_cfg, self.exp.rules,
                         max_new_tokens=max_new_tokens, max_len=max_len or self.max_len,
                         sampling=sampling, eos_ids=self.eos_ids, pad_id=self.tokenizer.pad_id,
                         seed=seed, max_len_what=what)

    def encode(self, prompts: Sequence[str], chat: bool = False) -> list[list[int]]:
        if chat:
            ids = [self.tokenizer.encode(text) for text in
                   render_chat(self.tokenizer_dir, self.tokenizer.name, prompts,
                               self.chat_template, self.chat_template_what)]
        else:
            ids = [self.tokenizer.encode(p, add_special_tokens=self.bos_in_prompts)
                   for p in prompts]
        vocab = self.exp.model_cfg.vocab_size
        for i, p in enumerate(ids):
            if p and max(p) >= vocab:
                raise ConfigError(f"prompt {i + 1} holds token id {max(p)}, not below the "
                                  f"model's vocab_size={vocab}: the tokenizer "
                                  f"({self.tokenizer.name}) does not fit this model.")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        eos = set(self.eos_ids)
        return self.tokenizer.decode([t for t in ids if t not in eos])


def for_generation(config: ml_collections.ConfigDict, n_devices: int
                   ) -> ml_collections.ConfigDict:
    """``config`` with the fields that only training reads set to values every mesh
    accepts, so that a decode mesh need not fit the training batch and the run's
    data files need not be present. Model, mesh and rules are kept, but pipeline stages
    (mesh.stage), whose devices join fsdp."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.data.update(source="synthetic", files="", eval_files="")
    c.export.hf_dir = c.export.adapter_dir = None  # a finished run has written them
    c.model.attn_impl = "dense"  # the KV-cache attention is its own; no ring checks
    # Any data-axis product divides the device count.
    c.train.update(batch_size=n_devices, grad_accum=1, seq_len=2 * n_devices,
                   loss_chunk=2 * n_devices, eval_every=0)
    stages = c.mesh.get("stage", 1)
    if stages > 1:  # decoding runs no pipeline: the stages' devices shard the weights
        c.mesh.stage, c.mesh.virtual_stages = 1, 1
        c.mesh.pipeline_schedule = "gpipe"
        c.mesh.fsdp = -1 if c.mesh.fsdp == -1 else c.mesh.fsdp * stages
    return c


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict[str, Any]) -> None:
    """``{"mesh.tensor": 2}`` (``--config.mesh.tensor=2``) applied to ``config``."""
    for path, value in overrides.items():
        *parents, leaf = path.split(".")
        node = config
        for key in parents:
            node = node[key]
        node[leaf] = value


def load(workdir: str | None = None, hf_dir: str | None = None, step: int | None = None,
         overrides: dict[str, Any] | None = None,
         devices: Sequence[jax.Device] | None = None) -> Model:
    """The model of a train.py run (``workdir``, checkpoint ``step``, default the newest)
    or of a Hugging Face directory, on ``devices`` (default: all)."""
    if bool(workdir) == bool(hf_dir):
        raise ConfigError("give exactly one of --workdir (a train.py run) and --hf_dir (a "
                          "Hugging Face model directory).")
    config = source_config(workdir, hf_dir)
    apply_overrides(config, overrides or {})
    n = len(jax.devices() if devices is None else devices)
    exp = Experiment.from_config(for_generation(config, n), devices)
    template = str(config.data.chat_template or "")
    template_what = ("--config.data.chat_template" if "data.chat_template" in (overrides or {})
                     else "the run's data.chat_template")
    if workdir:
        source = workdir_lib.source_dir(workdir)  # model.init_from's files, kept by the run
        tokenizer, eos = _run_tokenizer(config, source)
        return Model(exp, _restore(workdir, exp, step), tokenizer, eos,
                     max_len=int(config.train.seq_len), max_len_what="the run's train.seq_len",
                     bos_in_prompts=False, tokenizer_dir=_tokenizer_dir(config, source),
                     chat_template=template, chat_template_what=template_what)
    tokenizer = _hf_tokenizer(hf_dir)
    max_len = exp.checkpoint.config.get("max_position_embeddings")
    if not isinstance(max_len, int):
        raise ConfigError(f"--hf_dir={hf_dir!r}: config.json has no max_position_embeddings; "
                          "give --max_len.")
    params = exp.checkpoint_params()
    return Model(exp, params, tokenizer, eos_ids(hf_dir, tokenizer), max_len,
                 "max_position_embeddings of config.json", bos_in_prompts=True,
                 tokenizer_dir=hf_dir, chat_template=template,
                 chat_template_what="--config.data.chat_template")


def source_config(workdir: str | None, hf_dir: str | None) -> ml_collections.ConfigDict:
    """The run's saved config (reading the copies its workdir keeps: ndjax.runs.workdir), or
    the defaults with the model from ``hf_dir``."""
    if workdir:
        return workdir_lib.run_config(workdir)
    config = default_config()
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                  "head_dim", "rope_theta", "tie_embeddings"):
        config.model[field] = None
    config.model.init_from = hf_dir
    return config


def _restore(workdir: str, exp: Experiment, step: int | None) -> Any:
    with saved_step(workdir, exp.settings.checkpoint, step) as (checkpointer, step):
        return exp.with_base(checkpointer.restore_params(step, exp.abstract_saved_state))


def _run_tokenizer(config: ml_collections.ConfigDict, source: str | None
                   ) -> tuple[ByteTokenizer | HFTokenizer, tuple[int, ...]]:
    """The run's tokenizer; training ended every document with its EOS, so that stops
    generation (and so do the stop tokens of the checkpoint the run started from,
    whose files the run keeps in ``source``)."""
    tokenizer = data_tokenizer(config.data)
    extra = eos_ids(source, None) if source else ()
    return tokenizer, tuple(dict.fromkeys((tokenizer.eos_id, *extra)))


def _tokenizer_dir(config: ml_collections.ConfigDict, source: str | None) -> str | None:
    if config.data.tokenizer != "byte":
        return os.path.dirname(os.path.abspath(config.data.tokenizer))
    return source


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except ValueError as e:
        raise ConfigError(f"{path} is not JSON ({e}).") from None
    return data if isinstance(data, dict) else {}


def _hf_tokenizer(hf_dir: str) -> HFTokenizer:
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--hf_dir={hf_dir!r} has no tokenizer.json; copy the model's "
                          "tokenizer files into it.")
    config = _read_json(os.path.join(hf_dir, "tokenizer_config.json"))
    eos = token_text(config.get("eos_token")) or ""  # "": the tokenizer guesses
    return HFTokenizer(path, eos, field="--hf_dir tokenizer")


def eos_ids(directory: str, tokenizer: HFTokenizer | None) -> tuple[int, ...]:
    """The stop tokens of a Hugging Face directory: generation_config.json's, else
    config.json's, else the tokenizer's EOS (the order transformers reads them in)."""
    for name in ("generation_config.json", "config.json"):
        ids = _read_json(os.path.join(directory, name)).get("eos_token_id")
        if ids is not None:
            return tuple(ids) if isinstance(ids, list) else (int(ids),)
    return () if tokenizer is None else (tokenizer.eos_id,)


# ----- chat -------------------------------------------------------------------------


def run_chat_template(tokenizer_dir: str | None, tokenizer: str, template_file: str = "",
                      template_what: str = "data.chat_template") -> ChatTemplate:
    """The template training rendered conversations with: ``template_file``
    (``data.chat_template``) if set, else the tokenizer's own, found as training finds
    it (``ndjax.data.chat_template``), with the tokenizer's special tokens."""
    if template_file and not is_template_name(template_file) and \
            not os.path.isfile(template_file):
        # A run's config.json holds the path the run was given, as given: the file
        # may have moved or changed since, or be relative to another directory.
        raise ConfigError(f"--chat: {template_what}={template_file!r} is not a file (moved or "
                          "deleted since, or relative to another directory?); give "
                          "--config.data.chat_template=PATH of the template to prompt with.")
    if tokenizer_dir is None:
        if not template_file:
            raise ConfigError(f"--chat: the tokenizer ({tokenizer}) has no chat template "
                              "(chat_template.jinja or tokenizer_config.json's chat_template); "
                              "drop --chat, use a chat model's tokenizer, or give "
                              "--config.data.chat_template=FILE.")
        # A byte-level run has no tokenizer folder, so no named special tokens.
        with open(template_path(template_file, template_what), encoding="utf-8") as f:
            template = ChatTemplate(f.read(), f"{template_what}={template_file!r}", {})
        template.check()
        return template
    return load_chat_template(os.path.join(tokenizer_dir, "tokenizer.json"), template_file,
                              needed_by="--chat", fix="drop --chat, use a chat model's "
                              "tokenizer, or give --config.data.chat_template=FILE")


def render_chat(tokenizer_dir: str | None, tokenizer: str, prompts: Sequence[str],
                template_file: str = "", template_what: str = "data.chat_template"
                ) -> list[str]:
    """Each prompt as one user message in the run's chat template (``chat_template``),
    ready for the assistant's answer (add_generation_prompt=True): the renderer training
    uses (``ndjax.data.chat_template``), so prompts look like the conversations trained
    on."""
    template = run_chat_template(tokenizer_dir, tokenizer, template_file, template_what)
    rendered = []
    for i, prompt in enumerate(prompts):
        try:
            rendered.append(template.render([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True))
        except TemplateRefused as e:
            raise ConfigError(f"--chat: the chat template ({template.origin}) refused prompt "
                              f"{i + 1}: {e}") from None
    return rendered


# ----- command line -----------------------------------------------------------------


def read_prompts(prompts: Sequence[str], prompts_file: str | None) -> list[str]:
    """``--prompt`` values, then the "prompt" field of each line of ``--prompts_file``."""
    out = list(prompts)
    if prompts_file:
        if not os.path.isfile(prompts_file):
            raise ConfigError(f"--prompts_file={prompts_file!r}: no such file.")
        with open(prompts_file) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                    raise ConfigError(f"{prompts_file}:{n}: not a JSON object with a string "
                                      "'prompt' field.")
                out.append(record["prompt"])
    if not out:
        raise ConfigError("no prompts: give --prompt (repeatable) or --prompts_file.")
    return out


def define_flags() -> dict[str, Any]:
    """The command line's flags, defined by main(), not on import (see
    ndjax/verbs/__init__.py)."""
    f = flags
    return dict(
        workdir=f.DEFINE_string("workdir", None, "The --workdir of a train.py run."),
        hf_dir=f.DEFINE_string("hf_dir", None, "A Hugging Face model directory (instead of "
                               "--workdir)."),
        step=f.DEFINE_integer("step", None, "Checkpoint step of --workdir; default: the "
                              "newest."),
        prompt=f.DEFINE_multi_string("prompt", [], "A prompt"),
        prompts_file=f.DEFINE_string("prompts_file", None, "JSON Lines, a 'prompt' field "
                                     "each."),
        chat=f.DEFINE_bool("chat", False, "Wrap each prompt in the run's chat template."),
        max_new_tokens=f.DEFINE_integer("max_new_tokens", 64, "Tokens to generate at most per "
                                        "prompt."),
        max_len=f.DEFINE_integer("max_len", None, "Prompt + new tokens must fit in this; "
                                 "default: the run's train.seq_len, or "
                                 "max_position_embeddings."),
        temperature=f.DEFINE_float("temperature", 0.0, "0: greedy; else sample at it."),
        top_p=f.DEFINE_float("top_p", 1.0, "Keep tokens up to this total probability "
                             "(1: off)."),
        top_k=f.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0: off)."),
        seed=f.DEFINE_integer("seed", 0, "Sampling seed."),
        batch_size=f.DEFINE_integer("batch_size", 8, "Prompts generated together."),
        json=f.DEFINE_bool("json", False, "One JSON line per prompt, with token counts."),
        # --config.a.b=value: fields of the run's config (or the defaults, with --hf_dir).
        config=_config_flag(),
    )


def _config_flag() -> flags.FlagHolder:
    """--config, documented in a line: its default is only there to give the overrides
    their fields and types (the config used is the run's), and absl would print all of
    it, some 80 lines, under --help."""
    holder = config_flags.DEFINE_config_dict(
        "config", default_config(), "--config.a.b=value changes field a.b of the run's "
        "config (with --hf_dir, of the defaults: ndjax/config.py), e.g. --config.mesh.tensor=2.")
    flags.FLAGS[holder.name].default_as_str = None  # absl's help prints no "(default: ...)"
    return holder


FLAGS: dict[str, Any] = {}


def _fail(message: object) -> None:
    print(f"ndjax generate: error: {' '.join(str(message).split())}", file=sys.stderr,
          flush=True)
    sys.exit(2)


_BAD_OVERRIDE = (AttributeError, KeyError, TypeError, ValueError)


def _bad_override(e: BaseException) -> None:
    while isinstance(e, BaseException) and e.args:  # config_flags nests the message
        e = e.args[0]
    _fail(f"bad --config override: {e}")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's parser, with a bad flag or ``--config.x=...`` override as one line."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _fail(e)
    except _BAD_OVERRIDE as e:
        _bad_override(e)
    return []


def run(argv: list[str]) -> None:
    """The program, on the parsed flags."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    quiet_libraries("ndjax generate")
    a = {k: v.value for k, v in FLAGS.items() if k != "config"}
    try:
        if bool(a["workdir"]) == bool(a["hf_dir"]):
            raise ConfigError("give exactly one of --workdir (a train.py run) and --hf_dir (a "
                              "Hugging Face model directory).")
        if a["batch_size"] < 1:
            raise ConfigError(f"--batch_size={a['batch_size']} must be >= 1.")
        prompts = read_prompts(a["prompt"], a["prompts_file"])
        overrides = config_flags.get_override_values(flags.FLAGS["config"])
        config = source_config(a["workdir"], a["hf_dir"])
        apply_overrides(config, overrides)
        # Before JAX creates its backends, as train.py does (CPU hosts only).
        jax.config.update("jax_num_cpu_devices", int(config.runtime.cpu_devices))
        model = load(a["workdir"], a["hf_dir"], a["step"], overrides)
        sampling = Sampling(a["temperature"], a["top_p"], a["top_k"])
        generator = model.generator(a["max_new_tokens"], sampling, a["seed"], a["max_len"])
        ids = model.encode(prompts, a["chat"])
        completions = generator(ids, a["batch_size"])
    except ConfigError as e:
        _fail(e)
    if jax.process_index() != 0:
        return
    for i, (prompt, p, c) in enumerate(zip(prompts, ids, completions)):
        text = model.decode(c)
        if a["json"]:
            print(json.dumps(dict(prompt=prompt, completion=text, prompt_tokens=len(p),
                                  completion_tokens=len(c))), flush=True)
        else:
            print(f"--- prompt {i + 1} of {len(prompts)} ({len(p)} tokens) -> {len(c)} new "
                  f"tokens ---\n{text}", flush=True)


def main() -> None:
    """``ndjax generate``."""
    try:
        # config_flags applies --config.* overrides as soon as the flag is defined.
        FLAGS.update(define_flags())
    except _BAD_OVERRIDE as e:
        _bad_override(e)
    show_in_help(FLAGS.values())
    app.run(run, flags_parser=parse_flags)


if __name__ == "__main__":
    main()
