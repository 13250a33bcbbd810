"""The mesh, batch, optimiser, schedule, precision, checkpoints and model of an Axolotl
config. Fields Axolotl leaves unset get Axolotl's defaults (HF Trainer's), not ndjax's.
A refused value is recorded in ``out.problems`` and the conversion goes on with a
stand-in, so that every problem is reported at once (nothing is written then)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from typing import NamedTuple

from ndjax.axolotl.fields import Fields, Out, bad, refusal, show
from ndjax.runtime.errors import ConfigError

# Optimizers that are AdamW as ndjax's is (decoupled decay, float32 moments).
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
         "adamw_torch_xla", "adamw_torch_npu_fused", "paged_adamw_32bit")

# Every lr_scheduler Axolotl runs: transformers' (trainer_utils.SchedulerType) and its
# own one_cycle and rex. transformers refuses any other name when the trainer starts.
TRANSFORMERS_SCHEDULERS = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
    "constant_with_warmup", "inverse_sqrt", "reduce_lr_on_plateau", "cosine_with_min_lr",
    "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy")
AXOLOTL_SCHEDULERS = ("one_cycle", "rex")
# Those ndjax has, as train.schedule (the others are listed as not mapped).
MAPPED_SCHEDULERS = {"cosine": "cosine", "cosine_with_min_lr": "cosine", "linear": "linear",
                     "constant_with_warmup": "constant", "constant": "constant"}


class Layout(NamedTuple):
    data: int     # GPUs that each read their own micro-batches (the global batch's factor)
    context: int  # context_parallel_size
    expert: int   # expert_parallel_size


# Where a size was refused: the rest of the conversion goes on with one GPU.
NO_LAYOUT = Layout(1, 1, 1)


def mesh(f: Fields, out: Out, devices: int | None) -> Layout:
    """Sets the mesh as Axolotl lays out its ranks: accelerate's ParallelismConfig with
    the expert-parallel axis Axolotl adds to it (axolotl/monkeypatch/accelerate/
    parallelism_config.py), so the GPUs are expert_parallel_size x dp_replicate_size x
    dp_shard_size x context_parallel_size x tensor_parallel_size, and the first three
    are data axes (each rank reads its own micro-batches)."""
    start = len(out.problems)
    expert = f.integer("expert_parallel_size", 1, minimum=1)
    tensor = f.integer("tensor_parallel_size", 1, minimum=1)
    context = f.integer("context_parallel_size", None, minimum=1)
    old = f.integer("sequence_parallel_degree", None, minimum=1)  # its deprecated name
    if context is not None and old is not None and old != context:
        out.problem(f"context_parallel_size: {context} and sequence_parallel_degree: {old} "
                    "disagree; keep context_parallel_size only.")
    context = context or old or 1
    shard = f.integer("dp_shard_size", None, minimum=1)
    replica = f.integer("dp_replicate_size", None, minimum=1)
    if len(out.problems) > start:
        return NO_LAYOUT  # a layout of the other sizes would only add wrong counts
    if devices is None:
        if shard is None:
            out.problem("dp_shard_size is not set: Axolotl then shards over the GPUs it is "
                        "launched on (those that expert, context and tensor parallelism "
                        "leave), and its global batch (micro_batch_size x "
                        "gradient_accumulation_steps x data-parallel GPUs) depends on how "
                        "many; pass --devices=N, the GPUs you will train on, or set "
                        "dp_shard_size.")
            return NO_LAYOUT
        replica = replica or 1
    else:
        # Axolotl's inference (axolotl.utils.distributed._get_parallel_config_kwargs):
        # the experts' GPUs come out of the world size first, then tensor and context
        # parallelism's; an unset dp_shard_size takes what dp_replicate_size leaves, an
        # unset dp_replicate_size what dp_shard_size leaves.
        if devices % expert:
            out.problem(f"expert_parallel_size: {expert} does not divide --devices={devices}; "
                        "Axolotl refuses that too (expert_parallel_size x dp_shard_size x "
                        "the other sizes is the GPU count): use a divisor of the GPUs, or "
                        "change --devices.")
            return NO_LAYOUT
        rest = devices // (expert * tensor * context)
        if shard is None:
            shard = max(rest // (replica or 1), 1)
        replica = replica or max(rest // shard, 1)
    total = expert * replica * shard * context * tensor
    if devices is not None and total != devices:
        out.problem(f"--devices={devices}: expert_parallel_size {expert} x dp_replicate_size "
                    f"{replica} x dp_shard_size {shard} x context_parallel_size {context} x "
                    f"tensor_parallel_size {tensor} is {total} GPUs; change a size or "
                    "--devices.")
        return NO_LAYOUT
    inferred = f"inferred as Axolotl does from --devices={devices}" if devices else "unset: 1"
    # ndjax's axes are Axolotl's: fsdp is dp_shard, and expert is its ep axis, one more
    # data axis whose GPUs split the experts while the other weights shard over it too
    # (as Axolotl's FSDP shards them over ep x dp_shard x cp).
    for axis, size, source in (("replica", replica, "dp_replicate_size"),
                               ("fsdp", shard, "dp_shard_size"),
                               ("expert", expert, "expert_parallel_size"),
                               ("context", context, "context_parallel_size"),
                               ("tensor", tensor, "tensor_parallel_size")):
        if f.has(source):
            note = source
        elif axis == "context" and old is not None:
            note = "sequence_parallel_degree (context_parallel_size's old name)"
        else:
            note = f"{source} {inferred if axis in ('replica', 'fsdp') else 'unset: 1'}"
        out.set(f"mesh.{axis}", size, note)
    out.set("runtime.cpu_devices", total, "the same mesh simulated on a CPU-only host")
    return Layout(expert * replica * shard, context, expert)


def schedule(f: Fields, out: Out, dp: int) -> int | None:
    """Batch, length, AdamW and the learning-rate schedule; returns the steps (1 where
    max_steps is refused; None for a length in epochs, whose steps the data decides).
    Fields Axolotl leaves unset get its defaults (HF Trainer's), not ndjax's."""
    micro = f.integer("micro_batch_size", 1, minimum=1)
    accum = f.integer("gradient_accumulation_steps", 1, minimum=1)
    out.set("train.batch_size", micro * accum * dp, f"micro_batch_size {micro} x "
            f"gradient_accumulation_steps {accum} x {dp} data-parallel GPUs")
    out.set("train.grad_accum", accum, "gradient_accumulation_steps")
    steps = f.integer("max_steps", None, minimum=1)
    if steps is None and f.has("max_steps"):  # a refused value is reported by the read
        steps = 1
    if steps is not None:
        out.set("train.steps", steps, "max_steps")
        if f.has("num_epochs"):
            out.skip("num_epochs", f.value("num_epochs"), "max_steps sets the length, as in "
                     "Axolotl")
    else:  # the length in epochs, counted from the data once it is packed, as Axolotl does
        epochs = f.number("num_epochs", 1.0)
        if not epochs > 0:
            out.problem(refusal("num_epochs", epochs, "a number of passes > 0", ""))
            epochs = 1.0
        out.set("train.epochs", float(epochs), f.note("num_epochs", "Axolotl's default") +
                ": steps from the rows an epoch packs into")
    lr = out.attempt(f.number, "learning_rate", fallback=0.0)
    for path, key, default in (("train.weight_decay", "weight_decay", 0.0),
                               ("train.b1", "adam_beta1", 0.9), ("train.b2", "adam_beta2", 0.999),
                               ("train.eps", "adam_epsilon", 1e-8),
                               ("train.clip_norm", "max_grad_norm", 1.0)):
        below = 1.0 if key.startswith("adam_beta") else None
        value = f.number(key, None, below=below)
        out.set(path, default if value is None else value, f.note(key, "Axolotl's default"))
    optimizer = f.text("optimizer", "adamw_torch_fused")
    out.set("train.lr", lr, f"learning_rate, of ndjax's AdamW ({f.note('optimizer', optimizer)})")
    if optimizer not in ADAMW:
        low_bit = "adamw" in optimizer and re.search(r"8bit|4bit|fp8", optimizer)
        out.skip("optimizer", optimizer,
                 "ndjax's AdamW keeps float32 moments (train.opt_state_dtype=bfloat16 halves "
                 "them); the config uses it" if low_bit else
                 "ndjax has AdamW only; the config uses it")
    _lr_schedule(f, out, steps, lr)
    return steps


def _warmup(f: Fields, out: Out, steps: int | None) -> tuple[int | float, str]:
    """train.warmup_steps and its note, as Axolotl hands warmup to transformers
    (AxolotlTrainerBuilder._configure_warmup_and_logging) and transformers counts it
    (TrainingArguments.get_warmup_steps)."""
    value = f.value("warmup_steps")
    ratio = f.number("warmup_ratio", None, maximum=1.0)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not 0 <= value < math.inf or (value >= 1 and value != int(value))):
        out.problem(refusal("warmup_steps", value, "a whole number of steps >= 0, or a "
                            "fraction of max_steps below 1 (transformers' rule)",
                            "; e.g. warmup_steps: 10, or warmup_steps: 0.1 for a tenth of "
                            "the steps, without quotes"))
        return 0, "warmup_steps refused"
    if value and ratio:  # Axolotl's check: warmup_steps: 0 beside a ratio is allowed
        out.problem(f"warmup_steps: {show(value)} and warmup_ratio: {ratio:g} are both set; "
                    "Axolotl refuses that too: keep one.")
        return 0, "warmup_steps and warmup_ratio refused"
    if value is not None and ratio is not None:
        out.skip("warmup_ratio", ratio, "unused: warmup_steps is set, and Axolotl reads it "
                 "first")
    if value is not None and 0 < value < 1:
        # transformers reads a warmup_steps below 1 as that fraction of the run's steps,
        # rounded up, and Axolotl passes the value on as it is (so its "1 becomes 2"
        # below, on the value, never applies here).
        if steps is None:  # train.warmup_ratio: the same ceil(fraction x steps)
            return float(value), f"warmup_steps {value:g} < 1: a fraction of the steps"
        return math.ceil(value * steps), (f"warmup_steps {value:g} < 1: that fraction of "
                                          "max_steps, rounded up (transformers' rule)")
    if value is not None:
        warmup, note = int(value), "warmup_steps"
    elif steps is None:  # a length in epochs: the share of steps, as train.warmup_ratio
        share = 0.03 if ratio is None else ratio
        return float(share), (f"warmup_ratio {ratio:g}" if ratio is not None else
                              "Axolotl's default: 3% of the steps (its cap of 100 steps is not "
                              "kept)")
    elif ratio is not None:
        warmup, note = int(ratio * steps), f"warmup_ratio {ratio:g} x max_steps"
    else:
        warmup, note = min(int(0.03 * steps), 100), "Axolotl's default: 3% of max_steps, <= 100"
    if warmup == 1:
        warmup, note = 2, note + " (Axolotl makes 1 step 2)"
    return warmup, note


def _lr_schedule(f: Fields, out: Out, steps: int | None, lr: float) -> None:
    """train.schedule, warmup_steps and min_lr_ratio as Axolotl's scheduler runs
    (axolotl/core/trainers/mixins/scheduler.py): its own cosine to lr x
    cosine_min_lr_ratio under lr_scheduler: cosine, else transformers' get_scheduler
    with lr_scheduler_kwargs."""
    kind = f.text("lr_scheduler", "cosine")
    note = f.note("lr_scheduler", "Axolotl's cosine")
    warmup, warmup_note = _warmup(f, out, steps)
    min_ratio = f.number("cosine_min_lr_ratio", None, maximum=1.0)
    raw_kwargs = f.value("lr_scheduler_kwargs", {})
    if not raw_kwargs:
        f.read.discard("lr_scheduler_kwargs")  # listed as off
    elif not isinstance(raw_kwargs, Mapping):
        out.problem(refusal("lr_scheduler_kwargs", raw_kwargs, "a mapping of the scheduler's "
                            "arguments", ", e.g. {min_lr_rate: 0.1}"))
        raw_kwargs = {}
    kwargs = f.child(raw_kwargs, "lr_scheduler_kwargs.")
    if kind not in TRANSFORMERS_SCHEDULERS + AXOLOTL_SCHEDULERS:
        out.problem(refusal("lr_scheduler", kind, "one of transformers' schedulers ("
                            f"{', '.join(TRANSFORMERS_SCHEDULERS)}) or Axolotl's one_cycle or "
                            "rex", "; transformers refuses any other when training starts"))
        kind = "cosine"
    elif kind not in MAPPED_SCHEDULERS:
        out.skip("lr_scheduler", kind, "ndjax's schedules are cosine (to a floor), linear and "
                 "constant, with linear warmup; the config uses cosine, Axolotl's default")
        kind, note = "cosine", f"lr_scheduler {kind} is not mapped: cosine"
    schedule = MAPPED_SCHEDULERS[kind]
    if kind == "constant":  # HF's constant schedule has no warmup; constant_with_warmup has
        for key in ("warmup_steps", "warmup_ratio"):
            if f.has(key):
                out.skip(key, f.raw[key], "lr_scheduler: constant has no warmup in Axolotl; "
                         "use constant_with_warmup")
        warmup, warmup_note = 0, "lr_scheduler: constant"
    out.set("train.schedule", schedule, note)
    if isinstance(warmup, float):  # a share of steps the data decides
        out.set("train.warmup_ratio", warmup, warmup_note)
    else:
        out.set("train.warmup_steps", warmup, warmup_note)
    if kind == "cosine":
        _cosine(f, out, kwargs, min_ratio)
    elif kind == "cosine_with_min_lr":
        _cosine_with_min_lr(out, kwargs, lr)
    if min_ratio is not None and kind != "cosine":
        out.skip("cosine_min_lr_ratio", min_ratio, "Axolotl reads it only with lr_scheduler: "
                 "cosine" + ("; cosine_with_min_lr's floor is lr_scheduler_kwargs.min_lr_rate"
                             if kind == "cosine_with_min_lr" else ""))
    for key in kwargs.rest():
        out.skip(f"lr_scheduler_kwargs.{key}", raw_kwargs[key],
                 f"ndjax's {schedule} schedule has no such argument")


def _cosine(f: Fields, out: Out, kwargs: Fields, min_ratio: float | None) -> None:
    """lr_scheduler: cosine. With a cosine_min_lr_ratio, Axolotl's own cosine to lr x
    that ratio (its lr_scheduler_kwargs unread); without, transformers' cosine to 0."""
    if f.flag("lr_quadratic_warmup", False):
        out.skip("lr_quadratic_warmup", True, "ndjax warms up linearly")
    constant = f.number("cosine_constant_lr_ratio", None, maximum=1.0)
    f.read -= {k for k in ("lr_quadratic_warmup", "cosine_constant_lr_ratio")
               if not f.raw.get(k)}  # off: listed as such
    if min_ratio:
        out.set("train.min_lr_ratio", min_ratio, "cosine_min_lr_ratio")
        if constant:
            out.skip("cosine_constant_lr_ratio", constant, "ndjax's cosine decays over the "
                     "whole run, not to cosine_min_lr_ratio by this fraction of it")
        for key in kwargs.rest():
            kwargs.read.add(key)
            out.skip(f"lr_scheduler_kwargs.{key}", kwargs.raw[key], "unused: Axolotl's cosine "
                     "with cosine_min_lr_ratio takes no arguments")
        return
    out.set("train.min_lr_ratio", 0.0, ("cosine_min_lr_ratio 0: " if min_ratio is not None
                                        else "") + "cosine decays to 0 (transformers' "
            "get_cosine_schedule_with_warmup)")
    if constant:
        out.skip("cosine_constant_lr_ratio", constant, "unused: Axolotl reads it only with a "
                 "cosine_min_lr_ratio")
    _half_cycle(out, kwargs)


def _cosine_with_min_lr(out: Out, kwargs: Fields, lr: float) -> None:
    """lr_scheduler: cosine_with_min_lr, transformers' get_cosine_with_min_lr_schedule_
    with_warmup: a cosine to lr x min_lr_rate (or to min_lr) of lr_scheduler_kwargs,
    which it requires; Axolotl's cosine_min_lr_ratio does not reach it."""
    rate, floor = kwargs.number("min_lr_rate", None), kwargs.number("min_lr", None)
    if kwargs.has("min_lr_rate") and kwargs.has("min_lr"):
        out.problem("lr_scheduler_kwargs: min_lr_rate and min_lr are both set; transformers "
                    "refuses that too: keep one.")
        return
    if not kwargs.has("min_lr_rate") and not kwargs.has("min_lr"):
        out.problem("lr_scheduler: 'cosine_with_min_lr' needs lr_scheduler_kwargs' "
                    "min_lr_rate or min_lr, and transformers refuses it without (Axolotl "
                    "reads cosine_min_lr_ratio only with lr_scheduler: cosine); set "
                    "lr_scheduler_kwargs: {min_lr_rate: 0.1} for a floor of a tenth of "
                    "learning_rate, or use lr_scheduler: cosine with cosine_min_lr_ratio.")
        return
    if rate is None and floor is None:
        return  # the value was refused, and reported by the read
    if rate is not None:
        ratio, source = rate, "min_lr_rate"
    else:
        ratio, source = (floor / lr if lr > 0 else math.inf), f"min_lr {floor:g} / learning_rate"
    if ratio > 1:
        out.problem(f"lr_scheduler_kwargs: {source} is {ratio:g}, a floor above "
                    "learning_rate; ndjax's cosine decays from learning_rate down "
                    "(train.min_lr_ratio <= 1): set a floor below learning_rate.")
        return
    out.set("train.min_lr_ratio", ratio, f"lr_scheduler_kwargs.{source} (transformers' "
            "cosine_with_min_lr)")
    _half_cycle(out, kwargs)


def _half_cycle(out: Out, kwargs: Fields) -> None:
    """transformers' cosines take num_cycles (0.5: down once); ndjax's is that one."""
    cycles = kwargs.number("num_cycles", None)
    if cycles is not None and cycles != 0.5:
        out.skip("lr_scheduler_kwargs.num_cycles", cycles, "ndjax's cosine goes down once "
                 "(num_cycles 0.5)")
    elif cycles is not None:
        out.notes["train.schedule"] += " (lr_scheduler_kwargs.num_cycles 0.5: down once)"


def precision(f: Fields, out: Out) -> None:
    bf16 = f.value("bf16", "auto")
    if bf16 not in ("auto", "full", True, False):
        out.problem(refusal("bf16", bf16, "true, false, auto or full", "; write one of those, "
                            "without quotes for true and false"))
        bf16 = "auto"
    fp16, pure = f.flag("fp16", None), f.flag("bfloat16", None)
    f.read -= {k for k, v in (("fp16", fp16), ("bfloat16", pure)) if not v}  # listed as off
    if pure:  # no mixed precision: parameters in bfloat16 too
        out.set("model.param_dtype", "bfloat16", "bfloat16")
        out.set("model.dtype", "bfloat16", "bfloat16")
    elif bf16 in (True, "full"):
        out.set("model.dtype", "bfloat16", "bf16")
    elif bf16 == "auto":
        out.set("model.dtype", "auto", f.note("bf16", "auto") + " (bfloat16 on GPUs)")
    elif not fp16:
        out.set("model.dtype", "float32", "bf16: false")
    if fp16:
        out.skip("fp16", fp16, "ndjax has no float16 training with loss scaling; it computes in "
                 "model.dtype")
    checkpointing = f.value("gradient_checkpointing", False)
    remat = {False: "none", True: "full", "offload": "offload"}.get(checkpointing) \
        if isinstance(checkpointing, bool | str) else None
    if remat is None:
        if checkpointing == "offload_disk":
            out.skip("gradient_checkpointing", checkpointing, "ndjax offloads to host memory, "
                     "not disk; the config recomputes every layer (model.remat=full)")
        else:
            out.problem(refusal("gradient_checkpointing", checkpointing, "true, false or "
                                "offload", "; write one of those"))
        remat = "full"
    out.set("model.remat", remat, f.note("gradient_checkpointing", "false"))


def steps_of(f: Fields, key: str, steps: int | None) -> int | None:
    """save_steps / eval_steps: N steps, or a fraction of the run below 1 (HF's rule;
    refused for a length in epochs, whose steps ndjax counts once the data is read)."""
    value = f.value(key)
    if value is None:
        return None
    if isinstance(value, float) and 0 < value < 1:
        if steps is None:
            bad(key, value, "a whole number of steps when num_epochs sets the length (ndjax "
                "counts the steps once it reads the data); or give the count per epoch "
                f"({'evals' if key == 'eval_steps' else 'saves'}_per_epoch)")
        return math.ceil(value * steps)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1 \
            or value != int(value):
        bad(key, value, "a whole number of steps >= 1, or a fraction of max_steps below 1")
    return int(value)


def outputs(f: Fields, out: Out, steps: int | None) -> None:
    seed = f.integer("seed", None)
    if seed is not None:
        out.set("train.seed", seed, "seed")
    every = out.attempt(steps_of, f, "save_steps", steps)
    saves = f.integer("saves_per_epoch", None, minimum=0)
    if saves and steps is None and every is None:
        out.set("checkpoint.saves_per_epoch", saves, "saves_per_epoch")
    elif saves:
        out.skip("saves_per_epoch", saves, "ndjax counts saves per epoch only when num_epochs "
                 "sets the length" if steps is not None else "save_steps is set, and Axolotl "
                 "reads it first")
    if every is not None:
        out.set("checkpoint.every", every, "save_steps")
        if f.raw.get("save_strategy") in (None, "steps"):  # what save_steps implies
            f.read.add("save_strategy")
    keep = f.integer("save_total_limit", None)
    if keep is not None:
        out.set("checkpoint.keep", keep, "save_total_limit")
    log = f.integer("logging_steps", None, minimum=1)
    if log is not None:
        out.set("log.every", log, "logging_steps")


def workdir(f: Fields, out: Out, adapters: bool) -> str:
    workdir = f.text("output_dir", "./model-out")
    # Axolotl writes the tuned model (with an adapter: the adapter alone, in PEFT's
    # format) into output_dir; ndjax's workdir holds the run, so the export goes beside it.
    if adapters:
        out.set("export.adapter_dir", os.path.join(workdir, "adapter"),
                "output_dir: the adapter, as Axolotl saves it (merged: ndjax export)")
    else:
        out.set("export.hf_dir", os.path.join(workdir, "hf"), "output_dir: the tuned model")
    return workdir


def base_model(f: Fields) -> str:
    base = f.text("base_model")
    if not os.path.isdir(base):
        hub = " If it is a Hugging Face hub id: ndjax does not download, so run " \
              f"`hf download {base} --local-dir DIR` (or `huggingface-cli download`) and set " \
              "base_model: DIR." if re.fullmatch(r"[\w.-]+/[\w.-]+", base) else ""
        raise ConfigError(f"base_model: {base!r} is not a local directory.{hub}")
    return base


def tokenizer(f: Fields, base: str | None) -> str | None:
    """data.tokenizer: tokenizer_config's, else base_model's (None: base_model refused)."""
    other = f.text("tokenizer_config", None)
    if other is None:
        return None if base is None else os.path.join(base, "tokenizer.json")
    if os.path.isdir(other):
        return os.path.join(other, "tokenizer.json")
    if os.path.isfile(other) and other.endswith(".json"):
        return other
    raise ConfigError(f"tokenizer_config: {other!r} is not a local directory with a "
                      "tokenizer.json (ndjax does not download); point it at one.")


# special_tokens' keys that ndjax's data section names (the others are listed as not mapped).
NAMED_TOKENS = {"eos_token": "data.eos_token", "bos_token": "data.bos_token",
                "pad_token": "data.pad_token"}


def tokens(f: Fields, out: Out) -> None:
    """Axolotl's ``tokens`` (data.added_tokens) and ``special_tokens`` (each added as a
    special token, as Axolotl's ``add_special_tokens`` does, and named by data.eos_token,
    bos_token, pad_token); the model grows to hold new ids when it trains."""
    added = f.value("tokens")
    if added is not None:
        if isinstance(added, str):
            added = [added]
        if not isinstance(added, list) or not all(isinstance(t, str) and t for t in added):
            out.problem(refusal("tokens", added, "a list of token strings",
                                ", e.g. tokens: ['<tool_call>', '</tool_call>']"))
        elif added:
            out.set("data.added_tokens", tuple(added), "tokens")
    special = f.value("special_tokens")
    if special is None:
        return
    if not isinstance(special, Mapping):
        out.problem(refusal("special_tokens", special, "a mapping of names to tokens",
                            ", e.g. special_tokens: {pad_token: '<|end_of_text|>'}"))
        return
    chosen = []
    for key, value in special.items():
        if not isinstance(value, str) or not value:
            out.problem(refusal(f"special_tokens.{key}", value, "a non-empty string"))
        elif key in NAMED_TOKENS:
            out.set(NAMED_TOKENS[key], value, f"special_tokens.{key}")
            chosen.append(value)
        else:
            out.skip(f"special_tokens.{key}", value, "ndjax names only a tokenizer's eos, bos "
                     "and pad tokens; add it with tokens: if the data holds it")
    if chosen:
        out.set("data.added_special_tokens", tuple(dict.fromkeys(chosen)),
                "special_tokens (added where the tokenizer lacks them, as Axolotl does)")


def _config_json(base: str) -> dict:
    path = os.path.join(base, "config.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(f"base_model: cannot read {path} ({e}); point base_model at a "
                          "directory written by transformers' save_pretrained.") from None


def family(base: str) -> str:
    from ndjax.models import registry

    try:
        return registry.for_config_json(_config_json(base), base).name
    except ConfigError as e:
        raise ConfigError(f"base_model: {e}") from None


OVERRIDES = ("overrides_of_model_config", "model_config")  # the field and its alias


def router(f: Fields, out: Out, base: str | None) -> None:
    """``output_router_logits`` and ``router_aux_loss_coef`` of overrides_of_model_config
    (alias model_config), which Axolotl sets on base_model's config: transformers then
    adds router_aux_loss_coef x the load-balancing loss to the loss only where
    output_router_logits is true, so model.router_aux_loss_coef is that weight or 0 (each
    unset key as base_model's config.json has it). Its other keys are not mapped."""
    from ndjax.models import hf_config, registry

    key = next((k for k in OVERRIDES if f.has(k)), None)
    if key is None:
        return
    overrides = f.value(key)
    if not isinstance(overrides, dict):
        bad(key, overrides, "a mapping of config.json fields", "; write one per line under "
            f"{key}:")
    g = f.child(overrides, f"{key}.")
    on, coef = g.flag("output_router_logits", None), g.number("router_aux_loss_coef", None)
    for other in g.rest():
        out.skip(f"{key}.{other}", overrides[other], "ndjax's model comes from base_model's "
                 "config.json")
    if on is None and coef is None or base is None:  # None: base_model refused, reported
        return
    config = _config_json(base)
    fam = registry.for_config_json(config, base)
    if fam.moe_names is None:
        for name, value in (("output_router_logits", on), ("router_aux_loss_coef", coef)):
            if value is not None:
                out.skip(f"{key}.{name}", value, "base_model is dense: it has no router")
        return
    set_here = {k: v for k, v in (("output_router_logits", on), ("router_aux_loss_coef", coef))
                if v is not None}
    c = {**fam.hf_defaults, **config, **set_here}
    # transformers' rule, as an import from config.json reads it.
    weight = hf_config.read_aux_loss(c, f"base_model {base}")["router_aux_loss_coef"]
    out.set("model.router_aux_loss_coef", weight,
            f"{key}: output_router_logits {str(c['output_router_logits']).lower()}, "
            f"router_aux_loss_coef {float(c['router_aux_loss_coef']):g} (transformers adds the "
            "load-balancing loss only with output_router_logits true)")


def experts(base: str, expert: int) -> None:
    """expert_parallel_size against base_model: ndjax's expert axis splits a mixture of
    experts' experts (on a dense model it is refused when the run starts), and divides
    them, as Axolotl's expert-parallel plugin requires of num_experts too."""
    if expert == 1:
        return
    from ndjax.models import registry

    config = _config_json(base)
    fam = registry.for_config_json(config, base)
    if fam.moe_names is None:
        raise ConfigError(f"expert_parallel_size: {expert}: base_model is a dense "
                          f"{fam.name}, with no experts to split; set expert_parallel_size: 1 "
                          "(or leave it out).")
    try:
        n = fam.read_config_json(config, base).get("n_experts")
    except ConfigError:
        return  # ndjax's checks of the converted config name what config.json lacks
    if n and n % expert:
        raise ConfigError(f"expert_parallel_size: {expert} does not divide base_model's {n} "
                          "experts (each GPU of the expert axis holds an equal share); use a "
                          f"divisor of {n}.")
