"""The mesh, batch, optimiser, schedule, precision, checkpoints and model of an Axolotl
config. Fields Axolotl leaves unset get Axolotl's defaults (HF Trainer's), not ndjax's."""

from __future__ import annotations

import json
import math
import os
import re

from ndjax.axolotl.fields import Fields, Out, bad
from ndjax.runtime.errors import ConfigError

# Optimizers that are AdamW as ndjax's is (decoupled decay, float32 moments).
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused",
         "adamw_torch_xla", "adamw_torch_npu_fused", "paged_adamw_32bit")


def mesh(f: Fields, out: Out, devices: int | None) -> tuple[int, int]:
    """Sets the mesh as Axolotl lays out its ranks; returns (data-parallel GPUs, context)."""
    expert = f.integer("expert_parallel_size", 1, minimum=1)
    tensor = f.integer("tensor_parallel_size", 1, minimum=1)
    context = f.integer("context_parallel_size", None, minimum=1)
    old = f.integer("sequence_parallel_degree", None, minimum=1)  # its deprecated name
    if context is not None and old is not None and old != context:
        raise ConfigError(f"context_parallel_size: {context} and sequence_parallel_degree: "
                          f"{old} disagree; keep context_parallel_size only.")
    context = context or old or 1
    shard = f.integer("dp_shard_size", None, minimum=1)
    replica = f.integer("dp_replicate_size", None, minimum=1)
    if devices is None:
        if shard is None:
            raise ConfigError(
                "dp_shard_size is not set: Axolotl then shards over every GPU it is launched "
                "on, and its global batch (micro_batch_size x gradient_accumulation_steps x "
                "data-parallel GPUs) depends on how many; pass --devices=N, the GPUs you will "
                "train on, or set dp_shard_size.")
        replica = replica or 1
    else:  # Axolotl's inference (axolotl.utils.distributed._get_parallel_config_kwargs)
        rest = devices // (tensor * context)
        if shard is None:
            shard = max(rest // (replica or 1), 1)
        replica = replica or max(rest // shard, 1)
    layout = (f"dp_replicate_size {replica} x dp_shard_size {shard} x context_parallel_size "
              f"{context} x tensor_parallel_size {tensor}")
    total = replica * shard * context * tensor
    if devices is not None and total != devices:
        raise ConfigError(f"--devices={devices}: {layout} is {total} GPUs; change a size or "
                          "--devices.")
    inferred = f"inferred as Axolotl does from --devices={devices}" if devices else "unset: 1"
    if expert > 1:
        # ndjax's expert axis is one more data axis outside the experts: it takes its
        # degree out of the sharded data-parallel group (as torchtitan's EP does), so the
        # GPU count and the global batch stay Axolotl's.
        if shard % expert:
            raise ConfigError(
                f"expert_parallel_size: {expert} does not divide dp_shard_size: {shard}: "
                "ndjax's expert axis takes its GPUs out of the dp_shard group. Use a "
                f"divisor of {shard}.")
        out.set("mesh.expert", expert, "expert_parallel_size (out of dp_shard_size's GPUs)")
    for axis, size, source in (("replica", replica, "dp_replicate_size"),
                               ("fsdp", shard // expert, "dp_shard_size"),
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
    return replica * shard, context


def schedule(f: Fields, out: Out, dp: int) -> int:
    """Batch, length, AdamW and the learning-rate schedule; returns the steps. Fields
    Axolotl leaves unset get its defaults (HF Trainer's), not ndjax's."""
    micro = f.integer("micro_batch_size", 1, minimum=1)
    accum = f.integer("gradient_accumulation_steps", 1, minimum=1)
    out.set("train.batch_size", micro * accum * dp, f"micro_batch_size {micro} x "
            f"gradient_accumulation_steps {accum} x {dp} data-parallel GPUs")
    out.set("train.grad_accum", accum, "gradient_accumulation_steps")
    steps = f.integer("max_steps", None, minimum=1)
    if steps is None:
        raise ConfigError("max_steps is not set: ndjax counts a run in optimizer steps and "
                          "cannot turn num_epochs into steps without reading the data; set "
                          "max_steps (the rows of an epoch x num_epochs / the global batch).")
    out.set("train.steps", steps, "max_steps")
    if f.has("num_epochs"):
        out.skip("num_epochs", f.value("num_epochs"), "max_steps sets the length, as in Axolotl")
    lr = f.number("learning_rate")
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
    _lr_schedule(f, out, steps)
    return steps


def _lr_schedule(f: Fields, out: Out, steps: int) -> None:
    kind = f.text("lr_scheduler", "cosine")
    kind_note = f.note("lr_scheduler", "Axolotl's cosine")
    warmup_steps = f.integer("warmup_steps", None)
    ratio = f.number("warmup_ratio", None, maximum=1.0)
    if warmup_steps is not None and ratio is not None:
        raise ConfigError(f"warmup_steps: {warmup_steps} and warmup_ratio: {ratio} are both "
                          "set; Axolotl refuses that too: keep one.")
    if warmup_steps is not None:
        warmup, note = warmup_steps, "warmup_steps"
    elif ratio is not None:
        warmup, note = int(ratio * steps), f"warmup_ratio {ratio} x max_steps"
    else:
        warmup, note = min(int(0.03 * steps), 100), "Axolotl's default: 3% of max_steps, <= 100"
    if warmup == 1:
        warmup, note = 2, note + " (Axolotl makes 1 step 2)"
    min_ratio = f.number("cosine_min_lr_ratio", None)
    if kind == "constant":  # HF's constant schedule has no warmup; constant_with_warmup has
        for key in ("warmup_steps", "warmup_ratio"):
            if f.has(key):
                out.skip(key, f.raw[key], "lr_scheduler: constant has no warmup in Axolotl; "
                         "use constant_with_warmup")
        warmup, note = 0, "lr_scheduler: constant"
    elif kind not in ("cosine", "constant_with_warmup"):
        out.skip("lr_scheduler", kind, "ndjax has cosine and constant(_with_warmup) schedules; "
                 "the config uses cosine")
        kind, kind_note = "cosine", f"lr_scheduler {kind} is not mapped: cosine"
    schedule = "cosine" if kind == "cosine" else "constant"
    out.set("train.schedule", schedule, kind_note)
    out.set("train.warmup_steps", warmup, note)
    if schedule == "cosine":
        out.set("train.min_lr_ratio", min_ratio or 0.0,
                "cosine_min_lr_ratio" if min_ratio is not None else "cosine decays to 0")
    elif min_ratio is not None:
        out.skip("cosine_min_lr_ratio", min_ratio, "the schedule is not cosine")


def precision(f: Fields, out: Out) -> None:
    bf16 = f.value("bf16", "auto")
    if bf16 not in ("auto", "full", True, False):
        bad("bf16", bf16, "true, false, auto or full", "; write one of those, without quotes "
            "for true and false")
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
        if checkpointing != "offload_disk":
            bad("gradient_checkpointing", checkpointing, "true, false or offload",
                "; write one of those")
        out.skip("gradient_checkpointing", checkpointing, "ndjax offloads to host memory, not "
                 "disk; the config recomputes every layer (model.remat=full)")
        remat = "full"
    out.set("model.remat", remat, f.note("gradient_checkpointing", "false"))


def steps_of(f: Fields, key: str, steps: int) -> int | None:
    """save_steps / eval_steps: N steps, or a fraction of the run below 1 (HF's rule)."""
    value = f.value(key)
    if value is None:
        return None
    if isinstance(value, float) and 0 < value < 1:
        return math.ceil(value * steps)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 1 \
            or value != int(value):
        bad(key, value, "a whole number of steps >= 1, or a fraction of max_steps below 1")
    return int(value)


def outputs(f: Fields, out: Out, steps: int) -> None:
    seed = f.integer("seed", None)
    if seed is not None:
        out.set("train.seed", seed, "seed")
    every = steps_of(f, "save_steps", steps)
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


def tokenizer(f: Fields, base: str) -> str:
    other = f.text("tokenizer_config", None)
    if other is None:
        return os.path.join(base, "tokenizer.json")
    if os.path.isdir(other):
        return os.path.join(other, "tokenizer.json")
    if os.path.isfile(other) and other.endswith(".json"):
        return other
    raise ConfigError(f"tokenizer_config: {other!r} is not a local directory with a "
                      "tokenizer.json (ndjax does not download); point it at one.")


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


def router(f: Fields, out: Out, base: str) -> None:
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
    g = Fields(overrides, f"{key}.")
    on, coef = g.flag("output_router_logits", None), g.number("router_aux_loss_coef", None)
    for other in g.rest():
        out.skip(f"{key}.{other}", overrides[other], "ndjax's model comes from base_model's "
                 "config.json")
    if on is None and coef is None:
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
