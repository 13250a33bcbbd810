"""Reading an Axolotl config: typed reads that remember what was read, the problems
found (all of them, reported together), and why the fields ndjax does not map are not
mapped."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

from ndjax.runtime.errors import ConfigError

UNSET = object()
T = TypeVar("T")
# Why common fields are not mapped, by exact name or prefix (first match wins).
REASONS = (
    (("rl_", "dpo_", "orpo_", "simpo_", "cpo_", "kto_", "rpo_alpha", "precompute_ref_log_probs",
      "max_prompt_len", "trl"),
     "a preference-training setting, read with rl: dpo, ipo, orpo, simpo, kto or grpo only"),
    (("vllm",), "ndjax samples GRPO's completions itself, on the training mesh with the "
     "weights it trains (no vLLM server)"),
    (("remove_unused_columns",), "ndjax reads the columns its data.format needs, and hands "
     "GRPO's reward functions every column"),
    (("peft_use_dora", "peft_layers_to_transform", "peft_layers_pattern",
      "lora_fan_in_fan_out", "lora_on_cpu", "loraplus_", "relora_", "lisa_", "peft_"),
     "ndjax's LoRA adapts the blocks' projections (model.lora) and nothing else"),
    (("lora_",), "ndjax's LoRA (model.lora) has no counterpart"),
    (("load_in_8bit", "load_in_4bit"), "ndjax quantizes only a LoRA's frozen base (with "
     "adapter: lora or qlora)"),
    (("bnb_",), "ndjax's quantized base is NF4 or int8 with a float32 scale per 64 values "
     "(model.lora.quantize), without double quantization"),
    (("gptq", "fp8"), "ndjax has no GPTQ or FP8 training"),
    (("flash_attention", "flash_attn", "sdp_attention", "xformers_attention", "flex_attention",
      "s2_attention", "sage_attention", "attn_implementation", "sample_packing_"),
     "ndjax picks its attention kernel and packing itself (model.attn_impl=auto)"),
    (("wandb_log_model", "wandb_watch"), "ndjax logs the settings and metrics to W&B, not "
     "models or gradients"),
    (("wandb_",), "ndjax sets W&B's project, entity, name, mode and run id (log.wandb_*)"),
    (("hf_mlflow_", "mlflow_"), "ndjax logs the settings and metrics to MLflow "
     "(log.mlflow_*), not artifacts"),
    (("comet_", "use_comet", "use_tensorboard", "trackio_", "use_trackio"),
     "ndjax logs to metrics.jsonl and TensorBoard in the workdir, and to W&B (wandb_project) "
     "and MLflow (use_mlflow)"),
    (("deepspeed", "fsdp", "ddp"), "ndjax shards over its own mesh (dp_shard_size -> mesh.fsdp); "
     "these options have no counterpart"),
    (("hub_", "push_"), "ndjax does not upload"),
    (("dataset_prepared_path", "dataset_processes", "dataset_num_proc", "shuffle_",
      "dataset_shard", "skip_prepare_dataset", "pretraining_dataset"),
     "ndjax reads and tokenizes its data files while it trains"),
    (("added_tokens_overrides", "tokenizer_", "resize_token", "mean_resizing", "shrink_"),
     "ndjax takes the tokenizer as it is, with the tokens and special_tokens it adds, "
     "and grows the vocabulary to exactly its size"),
    (("torch_compile", "liger_", "cut_cross_entropy", "unsloth_", "plugins"),
     "ndjax compiles with XLA and has its own kernels"),
    (("model_type", "base_model_config", "cls_model_config", "trust_remote_code"),
     "ndjax's family and model come from base_model's config.json"),
    (("chat_template",), "no dataset of type chat_template uses it"),
    (("save_strategy", "saves_per_epoch"),
     "ndjax saves every checkpoint.every steps (save_steps), at the end and on SIGTERM"),
    (("eval_strategy", "evals_per_epoch", "eval_batch_size"),
     "ndjax evaluates train.eval_steps batches every train.eval_every steps (eval_steps)"),
    (("batch_size",), "the global batch is micro_batch_size x gradient_accumulation_steps x "
     "the data-parallel GPUs"),
    (("resume_from_checkpoint", "auto_resume_from_checkpoints"),
     "ndjax resumes from the workdir's newest checkpoint by itself"),
    (("roles",), "ndjax reads the roles system, user, assistant and tool as they are"),
    (("tf32",), "ndjax has no TF32 switch: matmuls run in model.dtype"),
    (("float16",), "ndjax has no float16 training with loss scaling; parameters are "
     "float32 or bfloat16 (model.param_dtype)"),
    (("pad_to_sequence_len",), "ndjax's rows are always train.seq_len tokens"),
)


@dataclasses.dataclass(frozen=True)
class Unmapped:
    field: str
    value: Any
    reason: str

    def line(self) -> str:
        return f"{self.field}: {show(self.value)} ({self.reason})"


def show(value: Any) -> str:
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    except (TypeError, ValueError):  # YAML allows keys JSON does not
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def refusal(name: str, value: Any, what: str, fix: str = "") -> str:
    """The one line that names a field, its value and a fix."""
    return f"{name}: {show(value)} must be {what}{fix}."


def bad(name: str, value: Any, what: str, fix: str = "") -> NoReturn:
    raise ConfigError(refusal(name, value, what, fix))


class Fields:
    """One YAML mapping (the top level or a dataset entry): typed reads that remember
    which keys were read, so that every other key can be reported.

    A value of the wrong type or range is recorded in ``problems`` (shared with the
    mappings nested in this one and with ``Out``) and the read returns the default, so
    that the conversion goes on and reports every problem at once; a required key
    (no default) that is missing or bad raises ``ConfigError``, for the caller's
    ``Out.attempt`` to record."""

    def __init__(self, raw: Mapping[str, Any], prefix: str = "",
                 problems: list[str] | None = None):
        self.raw, self.prefix, self.read = raw, prefix, set()
        self.problems: list[str] = [] if problems is None else problems

    def child(self, raw: Mapping[str, Any], prefix: str) -> Fields:
        """A mapping nested in this one, its problems reported with this one's."""
        return Fields(raw, prefix, self.problems)

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def value(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.raw.get(key)  # `key:` with nothing after it is unset, as in Axolotl
        return default if value is None else value

    def integer(self, key: str, default: Any = UNSET, minimum: int = 0) -> Any:
        value = self._required(key, default)
        if value is not default and (not isinstance(value, int) or isinstance(value, bool)
                                     or value < minimum):
            return self._refuse(key, value, default, f"a whole number >= {minimum}",
                                f"; write it without quotes, e.g. {key}: {max(minimum, 1)}")
        return value

    def number(self, key: str, default: Any = UNSET, minimum: float = 0.0,
               maximum: float | None = None, below: float | None = None) -> Any:
        value = self._required(key, default)
        if value is default:
            return value
        number = value
        if isinstance(value, str):  # YAML reads 2e-5 (no dot) as a string; Axolotl takes it
            try:
                number = float(value)
            except ValueError:
                number = None
        ok = isinstance(number, int | float) and not isinstance(number, bool) \
            and math.isfinite(number) and number >= minimum \
            and (maximum is None or number <= maximum) and (below is None or number < below)
        if not ok:
            bound = (f" and <= {maximum:g}" if maximum is not None else "") + \
                (f" and < {below:g}" if below is not None else "")
            return self._refuse(key, value, default, f"a number >= {minimum:g}{bound}",
                                "; write it as a number, such as 2.0e-5 or 0.9")
        return float(number)

    def flag(self, key: str, default: Any = UNSET) -> Any:
        value = self._required(key, default)
        if value is not default and not isinstance(value, bool):
            return self._refuse(key, value, default, "true or false",
                                "; write it without quotes")
        return value

    def text(self, key: str, default: Any = UNSET) -> Any:
        value = self._required(key, default)
        if value is not default and (not isinstance(value, str) or not value):
            return self._refuse(key, value, default, "a non-empty string",
                                f"; write the text after {key}:")
        return value

    def _required(self, key: str, default: Any) -> Any:
        value = self.value(key, default)
        if value is UNSET:
            raise ConfigError(f"{self.prefix}{key} is not set; Axolotl needs it too.")
        return value

    def _refuse(self, key: str, value: Any, default: Any, what: str, fix: str) -> Any:
        """A bad value: recorded, and the default read in its place (the conversion
        writes nothing once a problem is recorded); raised where there is no default."""
        message = refusal(self.prefix + key, value, what, fix)
        if default is UNSET:
            raise ConfigError(message)
        self.problems.append(message)
        return default

    def note(self, key: str, unset: str) -> str:
        """Where a value came from, for the config file's comments."""
        return key if self.has(key) else f"{key} unset: {unset}"

    def rest(self) -> list[str]:
        return [k for k in self.raw if k not in self.read]


class Out:
    """What the conversion found: ndjax settings, each with a note saying where it came
    from, the Axolotl fields not mapped (one entry a field), and the problems (one line
    each) that keep it from writing a config."""

    def __init__(self) -> None:
        self.overrides: dict[str, Any] = {}
        self.notes: dict[str, str] = {}
        self.unmapped: dict[str, Unmapped] = {}
        self.problems: list[str] = []

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def attempt(self, fn: Callable[..., T], *args: Any, fallback: T | None = None) -> T | None:
        """``fn(*args)``, or ``fallback`` with its ConfigError recorded: one refused field
        stops only the part of the conversion that needs it."""
        try:
            return fn(*args)
        except ConfigError as e:
            self.problem(str(e))
            return fallback

    def set(self, path: str, value: Any, note: str) -> None:
        self.overrides[path] = value
        self.notes[path] = note

    def skip(self, field: str, value: Any, reason: str) -> None:
        self.unmapped.setdefault(field, Unmapped(field, value, reason))


def reason(key: str, value: Any) -> str:
    """Why a field the conversion did not read is not mapped."""
    if value in (None, False, "", [], {}):
        return "off, nothing to map"
    for names, why in REASONS:
        if key.startswith(names):
            return why
    return "ndjax has no counterpart"
