"""config -> mesh + rules -> model + state -> compiled step, validated up front.

``Experiment.from_config`` runs every check that can be made without compiling
(mesh degrees, rule table, model dims against the mesh, batch and sequence
against the data axes) and raises ``ConfigError`` naming the config field, the
values and a fix. Everything after that is shapes and shardings derived from
the config: parameters and optimizer state are created already sharded, and
the train step is one ``jax.jit`` with shardings from the rule table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ndjax import rewards
from ndjax.config import (
    MODEL_DIMS,
    PREFERENCE_OBJECTIVES,
    LoraSettings,
    ModelSettings,
    Settings,
    TrainSettings,
)
from ndjax.data import BATCH_FIELDS, KTO_FIELDS, loader
from ndjax.hardware import gpu_target
from ndjax.models import decoder, registry
from ndjax.models import lora as lora_lib
from ndjax.models.decoder import DecoderConfig
from ndjax.models.layers import RopeScaling
from ndjax.models.quant import QuantConfig
from ndjax.ops import attention as attention_ops
from ndjax.ops import grouped_matmul
from ndjax.parallel import distributed, platforms
from ndjax.parallel import mesh as mesh_lib
from ndjax.parallel import rules as rules_lib
from ndjax.parallel.mesh import ParallelDims, build_mesh, cross_process_axes
from ndjax.runs import hf
from ndjax.runtime import compiler
from ndjax.runtime.errors import ConfigError
from ndjax.step import state as state_lib
from ndjax.step.grpo import GRPO
from ndjax.step.objectives import CrossEntropy, Objective
from ndjax.step.precision import DTYPES, Precision
from ndjax.step.preference import Preference
from ndjax.step.train_step import Batch, StepOptions, eval_step, train_step

# Which config field sets the size of each logical parameter axis (for errors).
FIELD_OF_AXIS = {
    "vocab": "model.vocab_size", "embed": "model.dim", "q_heads": "model.n_heads",
    "kv_heads": "model.n_kv_heads", "head_dim": "model.head_dim", "mlp": "model.ffn_dim",
    "layers": "model.n_layers", "dense_layers": "model.first_k_dense", "norm": "model.dim",
    "experts": "model.n_experts",
    "expert_mlp": "model.moe_ffn_dim", "lora_rank": "model.lora.rank",
    "q_lora": "model.q_lora_rank", "kv_lora": "model.kv_lora_rank",
}

def slow_axes_warning(mesh: Mesh, host_of: Callable[[jax.Device], str]) -> str | None:
    """Tensor parallelism all-reduces activations inside every layer: between
    hosts that traffic leaves NVLink for the network. (Between processes on one
    host, e.g. one process per GPU, it does not.)"""
    if "tensor" not in cross_process_axes(mesh, host_of):
        return None
    hosts = {host_of(d) for d in mesh.devices.flat}
    return (f"mesh: the tensor axis (mesh.tensor={mesh.shape['tensor']}) spans hosts, so every "
            "layer all-reduces its activations over the network between them; this is "
            "usually several times slower. Keep mesh.tensor within a host "
            f"({mesh.devices.size // len(hosts)} devices each) and put the rest in fsdp or "
            "replica.")


def config_dims(model: ModelSettings) -> dict:
    """DecoderConfig fields from the config: the family's fixed options, its preset,
    then every field the config sets."""
    family = registry.get(model.family)
    dims = ({**family.fixed, "family": family.name} if model.resolved
            else registry.preset_dims(family, model.preset))
    options = {f: getattr(model, f) for f in registry.OPTION_FIELDS}
    registry.check_options(family, options)
    for field in MODEL_DIMS:
        if getattr(model, field) is not None:
            dims[field] = getattr(model, field)
    for field, value in options.items():
        if value is not None:
            dims[field] = value or None if field == "sliding_window" else value
    if model.rope_scaling is not None:  # {}: none, over a preset's
        dims["rope_scaling"] = RopeScaling(**model.rope_scaling) if model.rope_scaling else None
    return dims


def model_config(model: ModelSettings, checkpoint: hf.Checkpoint | None = None,
                 platform: str | None = None) -> DecoderConfig:
    """The model: the family's preset, overridden by any field set in the config, all
    overridden (with a warning) by the checkpoint's config.json if there is one.
    ``platform`` (default: jax's backend) decides what ``auto`` fields become."""
    platform = platform or jax.default_backend()
    dims = config_dims(model) if checkpoint is None else hf.override_dims(model, checkpoint)
    for field in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        if dims[field] < 1:
            raise ConfigError(f"model.{field}={dims[field]} must be >= 1.")
    if dims["n_heads"] % dims["n_kv_heads"]:
        raise ConfigError(
            f"model.n_heads={dims['n_heads']} is not a multiple of model.n_kv_heads="
            f"{dims['n_kv_heads']}: grouped-query attention shares each kv head between "
            "n_heads / n_kv_heads query heads. Pick n_kv_heads dividing n_heads.")
    registry.check_moe(dims)
    head_dim = dims.get("head_dim") or dims["dim"] // dims["n_heads"]
    if head_dim % 2 or (not dims.get("head_dim") and dims["dim"] % dims["n_heads"]):
        raise ConfigError(
            f"model: head_dim={head_dim} (model.dim={dims['dim']} / model.n_heads="
            f"{dims['n_heads']} unless model.head_dim is set) must be a whole, even number "
            "for rotary embeddings. Set model.head_dim or change model.dim.")
    precision = Precision.of(model.dtype, model.stored_dtype, "float32", platform)  # no moments
    scan_layers = model.scan_layers
    if model.remat == "offload" and scan_layers is False:
        # XLA's host offloader moves the inputs the layer scan saves; unrolled layers'
        # copies to the host were dropped (compiled for H100s: nothing offloaded).
        raise ConfigError("model.remat='offload' keeps the inputs the layer scan saves in host "
                          "memory, and model.scan_layers=False unrolls the layers. Unset "
                          "model.scan_layers, or use model.remat='full'.")
    if scan_layers is None:
        scan_layers = (model.remat == "offload"
                       or decoder.default_scan_layers(dims["n_layers"], platform))
    return DecoderConfig(**dims, dtype=precision.compute, param_dtype=precision.params,
                         scan_layers=bool(scan_layers),
                         remat=model.remat, attn_impl=model.attn_impl,
                         cp_layout=model.cp_layout, cp_impl=model.cp_impl,
                         attn_kv_tile=model.attn_kv_tile,
                         attn_max_docs=model.attn_max_docs, moe_impl=model.moe_impl,
                         capacity_factor=model.capacity_factor,
                         lora=lora_config(model, dims))


def lora_config(model: ModelSettings, dims: dict) -> lora_lib.LoraConfig | None:
    """``model.lora`` for this model (None: no LoRA), its targets checked against the
    family's blocks: a mixture of experts has no dense MLP to adapt."""
    s = model.lora
    if s.rank is None:
        return None
    targets = lora_lib.parse_targets(s.target_modules)
    mlp = [t for t in targets if t in lora_lib.MLP_TARGETS]
    # Latent attention (DeepSeek V3) takes adapters on o_proj only, not yet on its latents.
    latent = [t for t in targets if t in ("q", "k", "v")] if dims.get("kv_lora_rank") else []
    if latent:
        raise ConfigError(
            f"model.lora.target_modules={s.target_modules!r}: model.family={dims['family']!r} "
            f"has multi-head latent attention (model.kv_lora_rank={dims['kv_lora_rank']}), "
            f"whose {', '.join(lora_lib.TARGETS[t] for t in latent)} take no adapters yet "
            "(its q_a/q_b/kv_a/kv_b projections). Use model.lora.target_modules='o_proj'.")
    if dims.get("n_experts") and mlp:
        attention = ",".join(lora_lib.TARGETS[t] for t in targets
                             if t not in lora_lib.MLP_TARGETS) or "q_proj,k_proj,v_proj,o_proj"
        raise ConfigError(
            f"model.lora.target_modules={s.target_modules!r}: model.family="
            f"{dims['family']!r} is a mixture of experts, whose blocks have no "
            f"{', '.join(lora_lib.TARGETS[t] for t in mlp)} of a dense MLP, and its experts "
            f"take no adapters yet. Target the attention: model.lora.target_modules="
            f"{attention!r}.")
    if dims.get("tie_embeddings") and s.saved_modules == ("lm_head",):
        raise ConfigError(
            f"model.lora.modules_to_save={s.modules_to_save!r}: this model ties its LM head "
            "to embed_tokens (tie_embeddings), so training it trains embed_tokens: set "
            "model.lora.modules_to_save='embed_tokens'.")
    return lora_lib.LoraConfig(rank=s.rank, alpha=s.alpha, targets=targets,
                               rslora=s.use_rslora, dropout=s.dropout,
                               quant=quant_config(s, dims),
                               saved=tuple(m for m in s.saved_modules if not (
                                   m == "lm_head" and dims.get("tie_embeddings"))))


def quant_config(s: LoraSettings, dims: dict) -> QuantConfig | None:
    """``model.lora.quantize`` for this model's weights (None: not quantized), checked
    against each projection's last dimension (its blocks run along it)."""
    if s.quantize == "none":
        return None
    q = QuantConfig(s.quantize, s.quant_block)
    hd = dims.get("head_dim") or dims["dim"] // dims["n_heads"]
    # The widths weights end in: a mixture of experts' is its experts' (its MLP).
    mlp = (("moe_ffn_dim", dims.get("moe_ffn_dim") or dims["ffn_dim"]) if dims.get("n_experts")
           else ("ffn_dim", dims["ffn_dim"]))
    shared = [("shared_expert_dim", dims["shared_expert_dim"])] if dims.get(
        "shared_expert_dim") else []
    for name, last in (("head_dim", hd), ("dim", dims["dim"]), mlp, *shared):
        problem = q.problem((last,))
        if problem:
            good = [b for b in (64, 32, 16, 8) if not QuantConfig(s.quantize, b).problem((last,))]
            raise ConfigError(
                f"model.lora.quant_block={s.quant_block}: the {s.quantize} blocks run along "
                f"each weight's last dimension, and model {name}={last} is not a multiple of "
                f"{s.quant_block} ({problem}); use "
                + (f"model.lora.quant_block={good[0]}." if good else "an even divisor of it."))
    return q


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the config names outside itself, opened and checked once: the checkpoint of
    model.init_from (opened, not read) and the data, with its tokenizer loaded
    (``ndjax.data.loader.check``). No layout changes them: the planner checks them
    once and builds every layout's experiment on them."""

    checkpoint: hf.Checkpoint | None
    data: loader.DataInput


def check_inputs(settings: Settings, platform: str | None = None,
                 problems: list[str] | None = None) -> tuple[DecoderConfig, Inputs]:
    """Checks step 1 of 5, what does not depend on the mesh: the export fields, the
    checkpoint of model.init_from, the model's dims and the data. Returns the model
    (``platform`` as for ``model_config``) and the inputs.

    With ``problems``, a check that fails adds its message there and the checks that do
    not need its result go on (ndjax from_axolotl reports them all at once); the
    return value is then meaningless if ``problems`` grew."""
    def attempt(check: Callable[..., Any], *args: Any) -> Any:
        if problems is None:
            return check(*args)
        try:
            return check(*args)
        except ConfigError as e:
            problems.append(str(e))
            return None

    attempt(hf.check_export, settings.export)
    init_from = settings.model.init_from
    checkpoint = attempt(hf.open_checkpoint, init_from) if init_from else None
    if checkpoint is not None and attempt(_adds_tokens, settings):
        grown = attempt(lambda: loader.data_tokenizer(settings.data).vocab_size)
        checkpoint = hf.grow_vocab(checkpoint, grown) if grown else checkpoint
    model_cfg = attempt(model_config, settings.model, checkpoint, platform) \
        if checkpoint is not None or not init_from else None
    attempt(_check_lora_inputs, settings, model_cfg)
    attempt(_check_objective, settings)
    if settings.preference.ref_model is not None and model_cfg is not None:
        attempt(_check_ref_model, settings, model_cfg)
    if checkpoint is not None:
        hf.check_tokenizer(settings, checkpoint)
    t = settings.train
    attempt(_check_epochs, settings)
    # Without a model (its check failed above), the data's own checks still run: no
    # vocabulary to compare the tokenizer's with.
    vocab = model_cfg.vocab_size if model_cfg is not None else 2**62
    data = attempt(loader.check, settings.data, _batches(settings), vocab,
                   t.eval_every or t.evals_per_epoch)
    return model_cfg, Inputs(checkpoint, data)


def _batches(settings: Settings) -> loader.Batches:
    """What the data is read into: rows of train.seq_len tokens; GRPO's prompts, each
    within the row's room beside its completion, batch_size / num_generations a step."""
    t, g = settings.train, settings.grpo
    if t.objective == "grpo" and settings.data.format == "prompt":
        return loader.Batches(max(t.batch_size // g.num_generations, 1),
                              max(t.seq_len - g.max_completion_length, 1), t.seed,
                              repeat=g.num_iterations)
    return loader.Batches(t.batch_size, t.seq_len, t.seed)


def _check_lora_inputs(settings: Settings, model_cfg: DecoderConfig | None) -> None:
    """export.adapter_dir needs LoRA; model.lora.init_from must fit the model."""
    if model_cfg is None:
        return
    if settings.export.adapter_dir is not None and model_cfg.lora is None:
        raise ConfigError(f"export.adapter_dir={settings.export.adapter_dir!r} exports LoRA "
                          "adapters, and model.lora.rank is unset: set model.lora.rank (e.g. "
                          "16) or drop export.adapter_dir.")
    if settings.model.lora.init_from is not None:  # (LoraSettings.check: a rank is set)
        hf.check_adapter(settings.model.lora.init_from, model_cfg)


def _check_objective(settings: Settings) -> None:
    """A preference objective learns from preference pairs (KTO: from desirable and
    undesirable examples), and its reference model (dpo, ipo, kto) must be one the run
    has."""
    t, d, p, lora = settings.train, settings.data, settings.preference, settings.model.lora
    if t.objective == "sft":
        if d.format in ("preference", "unpaired_preference", "prompt"):
            raise ConfigError(f"data.format={d.format!r} reads data for post-training, and "
                              "train.objective='sft' learns next tokens: set train.objective "
                              f"to one of {', '.join(PREFERENCE_OBJECTIVES)} or grpo, or use "
                              "data.format=chat for SFT.")
        return
    where = f"train.objective={t.objective!r}"
    if settings.mesh.pipeline_schedule == "1f1b":
        raise ConfigError(f"mesh.pipeline_schedule='1f1b' with {where}: 1F1B forms the loss "
                          "per micro-batch inside the pipeline, which only the sft "
                          "cross-entropy does so far. Use mesh.pipeline_schedule=gpipe.")
    if t.eval_every or t.evals_per_epoch:
        raise ConfigError(f"{where}: evaluation on a validation split is not built yet for "
                          "the post-training objectives; set train.eval_every=0 and "
                          "train.evals_per_epoch=0.")
    if t.objective == "grpo":
        _check_grpo(settings)
        if settings.grpo.beta == 0:
            if p.reference != "auto" or p.ref_model is not None:
                raise ConfigError(f"preference.reference={p.reference!r}, preference.ref_model="
                                  f"{p.ref_model!r}: grpo.beta=0 compares with no reference "
                                  "model; set grpo.beta > 0 for the KL term, or leave them.")
            return
    elif t.objective == "kto":
        if d.format != "unpaired_preference":
            raise ConfigError(f"{where} learns from desirable and undesirable examples, and "
                              f"data.format={d.format!r}: set data.source=chat and data.format="
                              "unpaired_preference (records with prompt, completion and label, "
                              "or pairs of chosen and rejected, unpaired; docs/post-training.md).")
    elif d.format != "preference":
        raise ConfigError(f"{where} learns from preference pairs, and data.format="
                          f"{d.format!r}: set data.source=chat and data.format=preference "
                          "(records with prompt, chosen and rejected; docs/post-training.md).")
    if t.objective in ("orpo", "simpo"):
        if p.reference != "auto":
            raise ConfigError(f"preference.reference={p.reference!r}: {where} uses no "
                              "reference model (only dpo, ipo and kto do); leave it 'auto'.")
        return
    if p.ref_model is not None:
        if lora.rank is not None:
            raise ConfigError(f"preference.ref_model={p.ref_model!r} under LoRA (model.lora."
                              f"rank={lora.rank}) is not built yet: the reference is the "
                              "policy's base with its starting adapters (preference.reference="
                              "auto); unset preference.ref_model, or fine-tune fully.")
        if p.reference != "auto":
            raise ConfigError(f"preference.ref_model={p.ref_model!r} is the reference, and "
                              f"preference.reference={p.reference!r} names another: leave "
                              "preference.reference 'auto' or unset preference.ref_model.")
        return
    if p.reference in ("adapters_off", "initial_adapters") and lora.rank is None:
        raise ConfigError(f"preference.reference={p.reference!r} is the policy's LoRA "
                          "adapters, and model.lora.rank is unset: set model.lora.rank, or "
                          "preference.reference=frozen_copy (or auto).")
    if p.reference == "adapters_off" and lora.saved_modules:
        raise ConfigError(f"preference.reference='adapters_off' keeps model.lora."
                          f"modules_to_save={lora.modules_to_save!r} as they train, not as "
                          "they started: use preference.reference=initial_adapters (or auto).")


def _check_grpo(settings: Settings) -> None:
    """GRPO's prompts, groups, lengths and reward functions (imported here, before
    anything compiles)."""
    t, d, g = settings.train, settings.data, settings.grpo
    where = "train.objective='grpo'"
    if settings.mesh.virtual_stages > 1:
        raise ConfigError(
            f"{where} with mesh.virtual_stages={settings.mesh.virtual_stages}: GRPO samples "
            "from the train state, whose layers the circular schedule stores out of order; "
            "not built yet. Set mesh.virtual_stages=1.")
    if d.format != "prompt":
        raise ConfigError(f"{where} samples completions of prompts, and data.format="
                          f"{d.format!r}: set data.source=chat and data.format=prompt (records "
                          "with a prompt and the columns the rewards read).")
    if t.batch_size % g.num_generations:
        multiple = g.num_generations * max(t.batch_size // g.num_generations, 1)
        raise ConfigError(f"train.batch_size={t.batch_size} counts completions, and "
                          f"grpo.num_generations={g.num_generations} does not divide it: use a "
                          f"multiple, e.g. train.batch_size={multiple}.")
    if t.seq_len <= g.max_completion_length:
        raise ConfigError(f"train.seq_len={t.seq_len} holds a prompt and its completion, and "
                          f"grpo.max_completion_length={g.max_completion_length} leaves no room "
                          "for a prompt: raise train.seq_len or lower the completion length.")
    if not g.reward_funcs.strip():
        raise ConfigError(f"{where} needs reward functions: set grpo.reward_funcs to one or "
                          "more, comma-separated, e.g. 'ndjax.rewards.math.accuracy'.")
    fns = rewards.load(g.reward_funcs)
    if g.reward_weights and len(g.reward_weights) != len(fns):
        raise ConfigError(f"grpo.reward_weights={g.reward_weights!r} has {len(g.reward_weights)} "
                          f"weights for {len(fns)} reward functions (grpo.reward_funcs="
                          f"{g.reward_funcs!r}): give one each, or () for all 1.")


def _check_ref_model(settings: Settings, model_cfg: DecoderConfig) -> None:
    """preference.ref_model: a checkpoint of the policy's architecture and dims."""
    where = f"preference.ref_model={settings.preference.ref_model!r}"
    ckpt = hf.open_checkpoint(settings.preference.ref_model, field="preference.ref_model")
    differ = [f"{f} {ckpt.dims.get(f)!r} (the policy's {getattr(model_cfg, f)!r})"
              for f in ("family", *MODEL_DIMS) if f in ckpt.dims and hasattr(model_cfg, f)
              and ckpt.dims.get(f) != getattr(model_cfg, f)]
    if differ:
        raise ConfigError(f"{where}: its config.json has {', '.join(differ)}; the reference "
                          "must be the policy's architecture: use a checkpoint of the same "
                          "model (e.g. the SFT model the policy starts from).")


def reference_mode(settings: Settings) -> str:
    """Where the step finds the reference model (``train_step.REFERENCES``): none,
    adapters_off (fresh LoRA adapters: the base with them off is the starting model), or
    held (the trainable part's starting values, given to the step beside the state)."""
    t, p, lora = settings.train, settings.preference, settings.model.lora
    if t.objective not in ("dpo", "ipo", "kto") and not (
            t.objective == "grpo" and settings.grpo.beta > 0):
        return "none"
    if p.reference == "adapters_off" or (
            p.reference == "auto" and lora.rank is not None and lora.init_from is None
            and not lora.saved_modules):
        return "adapters_off"
    return "held"


def _adds_tokens(settings: Settings) -> bool:
    """Whether data.added_tokens / added_special_tokens give the tokenizer new ids; under
    LoRA, whose frozen embedding would never learn their rows, that is refused."""
    d = settings.data
    if not (d.added_tokens or d.added_special_tokens):
        return False
    tok = loader.data_tokenizer(d)
    new = tok.vocab_size - tok.file_vocab_size
    lora = settings.model.lora
    if new and lora.rank is not None and "embed_tokens" not in lora.saved_modules:
        raise ConfigError(
            f"data.added_tokens={d.added_tokens!r}, data.added_special_tokens="
            f"{d.added_special_tokens!r} give {new} new token id(s) whose embedding and LM "
            f"head rows must be trained, and model.lora.rank={lora.rank} trains adapters "
            "only: set model.lora.modules_to_save='embed_tokens,lm_head' to train those "
            "in full beside them, fine-tune fully (unset model.lora.rank), or use tokens "
            "the tokenizer has.")
    return bool(new)


def _check_epochs(settings: Settings) -> None:
    """A length in epochs needs a corpus to count them in; what is counted per epoch
    needs the length in epochs (``Settings.in_steps``)."""
    t = settings.train
    if t.epochs and settings.data.source == "synthetic":
        raise ConfigError(f"train.epochs={t.epochs:g} counts passes over a corpus, and "
                          "data.source='synthetic' has none: set train.steps instead.")
    if not t.epochs:
        for field, value in (("train.evals_per_epoch", t.evals_per_epoch),
                             ("checkpoint.saves_per_epoch", settings.checkpoint.saves_per_epoch)):
            if value:
                raise ConfigError(f"{field}={value} counts per epoch, and train.epochs is 0: "
                                  "set train.epochs (e.g. 3), or count in steps "
                                  "(train.eval_every, checkpoint.every).")


def check_fields(config: ml_collections.ConfigDict | Settings, platform: str | None = None
                 ) -> tuple[Settings, DecoderConfig, hf.Checkpoint | None]:
    """The checks that do not depend on the mesh: every field's type and range
    (``Settings.parse``), then ``check_inputs``. Returns the typed settings, the
    model's dims and the checkpoint of model.init_from (opened, not read)."""
    settings = config if isinstance(config, Settings) else Settings.parse(config)
    model_cfg, inputs = check_inputs(settings, platform)
    return settings, model_cfg, inputs.checkpoint


def degrees(settings: Settings, devices: Sequence[jax.Device]) -> ParallelDims:
    """The mesh's degrees for these devices (checked before anything else)."""
    m = settings.mesh
    if m.auto:
        raise ConfigError("mesh.auto=True: train.py plans the layout; here, set the mesh's "
                          "degrees (`ndjax plan` ranks them) and mesh.auto=False.")
    return ParallelDims(m.replica, m.fsdp, m.context, m.tensor, m.expert, m.stage).resolve(
        len(devices))


def build_layout(settings: Settings, dims: ParallelDims, devices: Sequence[jax.Device]
                 ) -> tuple[Mesh, rules_lib.Rules]:
    """Step 2: the mesh of these degrees over these devices, and the rule table."""
    mesh = build_mesh(dims, devices)
    warning = slow_axes_warning(mesh, distributed.host_of)
    if warning and jax.process_index() == 0:
        warnings.warn(warning, stacklevel=3)
    return mesh, rules_lib.Rules(settings.rules, mesh)


def place_model(model_cfg: DecoderConfig, settings: Settings, rules: rules_lib.Rules,
                devices: Sequence[jax.Device]
                ) -> tuple[DecoderConfig, attention_ops.Choice, np.ndarray | None]:
    """Step 3: the model on this layout. Checks the batch, the loss chunks and the
    experts against the mesh, and decides the kernels once (the model then runs them
    by name): the attention kernel, which sees one micro-batch's rows at once
    (``_check_batch``: they divide evenly), with the sequence order it needs, and
    the experts' grouped matmuls."""
    t = settings.train
    _check_placement(model_cfg, settings, rules)
    stages = mesh_lib.stages(rules.mesh)
    if stages > 1:
        model_cfg = dataclasses.replace(model_cfg, stages=stages,
                                        microbatches=t.microbatches or stages,
                                        virtual_stages=settings.mesh.virtual_stages,
                                        pipeline_gather_once=settings.model.pipeline_gather_once,
                                        pipeline_schedule=settings.mesh.pipeline_schedule)
    site = attention_ops.Site.of(model_cfg, t.seq_len, rules, t.batch_size // t.grad_accum)
    chosen = attention_ops.choose(model_cfg.attn_impl, site)
    model_cfg = dataclasses.replace(model_cfg, attn_impl=chosen.name,
                                    cp_impl=chosen.cp or "ring")
    seq_permutation = attention_ops.KERNELS[chosen.name].permutation(site)
    if model_cfg.n_experts:
        model_cfg = dataclasses.replace(model_cfg, moe_impl=grouped_matmul.choose(
            model_cfg.moe_impl, grouped_matmul.Site.of(
                model_cfg, devices, grouped_matmul.width_shards(rules),
                mesh_lib.stages(rules.mesh))))
    return model_cfg, chosen, seq_permutation


def _check_placement(model_cfg: DecoderConfig, settings: Settings,
                     rules: rules_lib.Rules) -> None:
    """The experts, the batch and the loss chunks against the mesh (no kernel chosen)."""
    _check_experts(model_cfg, rules, settings.model.family)
    _check_pipeline(model_cfg, settings.train, rules, settings.mesh.virtual_stages,
                    settings.model.pipeline_gather_once)
    _check_one_f_one_b(model_cfg, settings, mesh_lib.stages(rules.mesh))
    _check_batch(settings.train, rules, rules.mesh)
    _check_loss_chunk(settings.train, rules, rules.mesh)


def check_layout(settings: Settings, model_cfg: DecoderConfig,
                 devices: Sequence[jax.Device]) -> None:
    """The layout's checks that hold on any platform, on ``devices`` as stand-ins for
    the GPUs (ndjax from_axolotl runs them on simulated CPU devices): the degrees, the
    experts, the batch and loss chunks, every parameter dim against the axes that split
    it. The attention and grouped-matmul kernels' own checks are left to ``place_model``
    on the devices that run them: a CPU stand-in would choose other kernels."""
    _, rules = build_layout(settings, degrees(settings, devices), devices)
    _check_placement(model_cfg, settings, rules)
    parameter_shardings(model_cfg, rules, settings.model.init_from)


def parameter_shardings(model_cfg: DecoderConfig, rules: rules_lib.Rules,
                        init_from: str | None) -> tuple[Any, Any, Any, Any]:
    """Step 4: the model's graph, its parameters' shapes and logical names, and their
    shardings, each dimension checked against the mesh axes the rules split it over."""
    mesh = rules.mesh
    abstract = nnx.eval_shape(lambda: decoder.Decoder(model_cfg, nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    param_shapes = nnx.to_pure_dict(abstract_state)
    param_names = decoder.logical_axes(abstract_state)
    _check_kv_heads(model_cfg, rules, mesh, init_from)
    # Mixtral's experts are model.ffn_dim wide (no moe_ffn_dim of its own).
    labels = FIELD_OF_AXIS if model_cfg.moe_ffn_dim else {**FIELD_OF_AXIS,
                                                          "expert_mlp": "model.ffn_dim"}

    # Qwen 2 MoE's shared expert is a dense MLP of model.shared_expert_dim.
    shared = {**labels, "mlp": "model.shared_expert_dim"}

    def param_sharding(path, shape, names):
        names = rules.stored_names(names, model_cfg.n_kv_heads)
        spec = rules.spec(names)
        where = _path(path)
        try:
            rules_lib.check_divisible(spec, shape.shape, names, mesh, f"parameter {where}",
                                      labels=shared if "/shared/" in where else labels)
        except ConfigError as e:
            if init_from is None:
                raise
            raise ConfigError(f"{e} (The model's dims come from model.init_from="
                              f"{init_from!r}, config.json.)") from None
        return NamedSharding(mesh, spec)

    shardings = jax.tree_util.tree_map_with_path(param_sharding, param_shapes, param_names)
    return graphdef, param_shapes, param_names, shardings


def _path(keys: Sequence[Any]) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in keys)


@dataclasses.dataclass
class Experiment:
    config: ml_collections.ConfigDict  # as written (saved with the run, sent to workers)
    settings: Settings                 # the same, typed and checked: what the code reads
    dims: ParallelDims
    mesh: Mesh
    rules: rules_lib.Rules
    model_cfg: DecoderConfig
    graphdef: Any
    param_shapes: Any     # nested dict of ShapeDtypeStruct
    param_names: Any      # nested dict of logical-name tuples
    schedule: optax.Schedule
    optimizer: optax.GradientTransformation
    state_sharding: state_lib.TrainState
    batch_sharding: NamedSharding
    precision: Precision  # the run's dtypes, in one place
    # The attention kernel that runs (model_cfg.attn_impl is its name) and why.
    attention: attention_ops.Choice | None = None
    # Host-side order of the sequence that the kernel needs (ring attention's
    # zigzag); None keeps the data's order. ``device_batch`` applies it.
    seq_permutation: np.ndarray | None = None
    checkpoint: hf.Checkpoint | None = None  # model.init_from, checked
    data: loader.DataInput | None = None     # what the data loader is opened with
    # in_layer_order's and in_storage_order's compiled moves, by direction and tree.
    _reorder_fns: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: ml_collections.ConfigDict | Settings,
                    devices: Sequence[jax.Device] | None = None,
                    inputs: Inputs | None = None) -> Experiment:
        """Every check, then the experiment, in five named steps: ``check_inputs`` (what
        no mesh changes; given ``inputs``, already done), ``build_layout``,
        ``place_model``, ``parameter_shardings`` and the optimizer state's
        (``state.state_shardings``). The step compiles when first asked for."""
        devices = list(jax.devices() if devices is None else devices)
        settings = config if isinstance(config, Settings) else Settings.parse(config)
        if isinstance(config, Settings):  # what is saved with the run, sent to workers
            config = ml_collections.ConfigDict(settings.to_dict())
        dims = degrees(settings, devices)
        platform = platforms.of(devices)
        if inputs is None:
            model_cfg, inputs = check_inputs(settings, platform)
        else:
            model_cfg = model_config(settings.model, inputs.checkpoint, platform)
        mesh, rules = build_layout(settings, dims, devices)
        model_cfg, chosen, seq_permutation = place_model(model_cfg, settings, rules, devices)
        graphdef, param_shapes, param_names, param_shardings = parameter_shardings(
            model_cfg, rules, settings.model.init_from)
        t = settings.train
        schedule = state_lib.make_schedule(t)
        precision = Precision(params=model_cfg.param_dtype, compute=model_cfg.dtype,
                              moments=DTYPES[t.opt_state_dtype])
        # Under LoRA only the adapters are optimised: the optimizer sees them alone.
        adapters_only = model_cfg.lora is not None
        trained = functools.partial(lora_lib.trainable, adapters_only=adapters_only,
                                    saved=model_cfg.lora.saved_params if adapters_only else ())
        optimizer = state_lib.make_optimizer(t, trained(param_names), schedule,
                                             precision.moments)
        state_sharding = state_lib.state_shardings(
            optimizer, trained(param_shapes), trained(param_shardings),
            NamedSharding(mesh, PartitionSpec()), params=param_shardings)
        batch_sharding = rules.sharding(("act_batch", "act_seq"))
        return cls(config, settings, dims, mesh, rules, model_cfg, graphdef, param_shapes,
                   param_names, schedule, optimizer, state_sharding, batch_sharding, precision,
                   attention=chosen, seq_permutation=seq_permutation,
                   checkpoint=inputs.checkpoint, data=inputs.data)

    @property
    def platform(self) -> str:
        """Of the devices the step is built for (a GPU target's from a CPU process)."""
        return platforms.of(self.mesh.devices.flat)

    def for_target(self) -> contextlib.AbstractContextManager:
        """Where the step is traced and compiled: for GPUs that are not here
        (``ndjax.hardware.gpu_target``), jax's questions about the GPU answered for them."""
        return gpu_target.compiling_for(list(self.mesh.devices.flat))

    # ----- model ---------------------------------------------------------------

    def apply(self, params: Any, inputs: jax.Array, positions: jax.Array,
              segment_ids: jax.Array) -> jax.Array:
        """Logits (b, s, vocab) float32: for inspection; training never builds them all."""
        return nnx.merge(self.graphdef, params)(inputs, positions, segment_ids)

    def features(self, params: Any, inputs: jax.Array, positions: jax.Array,
                 segment_ids: jax.Array, dropout: lora_lib.Dropout | None = None,
                 head_loss: decoder.HeadLoss | None = None) -> tuple:
        """(final hidden states, LM head, MoE router metrics): what the loss needs; with
        ``head_loss``, (its sums, the router's metrics): ``Decoder.features``."""
        return nnx.merge(self.graphdef, params).features(inputs, positions, segment_ids,
                                                         dropout, head_loss)

    @property
    def objective(self) -> Objective:
        """The loss the step minimises (ndjax.step.objectives): train.objective's."""
        t, p, g = self.settings.train, self.settings.preference, self.settings.grpo
        if t.objective == "sft":
            return CrossEntropy()
        if t.objective == "grpo":
            return GRPO(g.loss_type, epsilon=g.epsilon, epsilon_high=g.epsilon_high or g.epsilon,
                        beta=g.beta, temperature=g.temperature,
                        max_completion_length=g.max_completion_length)
        return Preference(t.objective, beta=p.beta, label_smoothing=p.label_smoothing,
                          simpo_gamma=p.simpo_gamma, cpo_alpha=p.cpo_alpha,
                          desirable_weight=p.desirable_weight,
                          undesirable_weight=p.undesirable_weight)

    @property
    def reference_mode(self) -> str:
        """Where a preference objective's reference model is (``reference_mode``)."""
        return reference_mode(self.settings)

    def held_reference(self, state: state_lib.TrainState | None = None) -> Any:
        """The reference model's parameters the step is given (``reference_mode`` held;
        None otherwise): the trainable part of step 0's parameters, copied from ``state``
        (a fresh run's step 0, which the step then donates) or drawn again as step 0 had
        them (a resume)."""
        if self.reference_mode != "held":
            return None
        ref_model = self.settings.preference.ref_model
        if ref_model is not None:  # (full fine-tuning: the whole model)
            return hf.load_params(hf.open_checkpoint(ref_model, field="preference.ref_model"),
                                  self.param_shapes, self.state_sharding.params)
        params = (state if state is not None else self.init_state()).params
        return jax.tree.map(jnp.copy, self.trainable(params))

    def step_fn(self, reference: Any = None) -> Callable[..., Any]:
        """(state, batch) -> (state, metrics): the compiled step, given ``reference``
        (``held_reference``) where the objective holds one."""
        compiled = self.compiled_step
        if self.reference_mode != "held":
            return compiled
        return lambda state, batch: compiled(state, batch, reference)

    @property
    def step_options(self) -> StepOptions:
        t = self.settings.train
        return StepOptions(objective=self.objective, reference=self.reference_mode,
                           skip_nonfinite=t.on_nan == "skip",
                           nan_at_step=int(self.settings.debug.nan_at_step),
                           loss_chunk=t.loss_chunk, grad_accum=t.grad_accum,
                           grad_dtype=self.precision.grad_accum,
                           aux_loss_coef=float(self.model_cfg.router_aux_loss_coef),
                           z_loss_coef=float(self.settings.model.router_z_loss_coef),
                           score_bias_rate=float(self.model_cfg.score_bias_rate),
                           adapters_only=self.adapters_only, saved=self.saved_params,
                           lora_dropout=self.model_cfg.lora.dropout if self.adapters_only else 0.0,
                           dropout_seed=self.settings.train.seed,
                           seq_permutation=self.seq_permutation)

    # ----- state ---------------------------------------------------------------

    @property
    def adapters_only(self) -> bool:
        """Whether only LoRA adapters train (the rest of the parameters frozen, but for
        ``saved_params``)."""
        return self.model_cfg.lora is not None

    @property
    def saved_params(self) -> tuple[str, ...]:
        """Under LoRA, the top-level parameters trained in full beside the adapters
        (model.lora.modules_to_save)."""
        return self.model_cfg.lora.saved_params if self.adapters_only else ()

    def trainable(self, params: Any) -> Any:
        """What of a parameter tree trains: all of it, or under LoRA its adapters (and
        model.lora.modules_to_save's parameters)."""
        return lora_lib.trainable(params, self.adapters_only, self.saved_params)

    @staticmethod
    def adapters(params: Any) -> Any:
        """The LoRA adapters of a parameter tree (a PEFT directory's, fresh ones)."""
        return lora_lib.split(params, True)[0]

    def saved(self, state: state_lib.TrainState) -> state_lib.TrainState:
        """What a checkpoint holds of ``state``: all of it, or under LoRA the adapters
        and their optimizer state (the frozen base is model.init_from's, or the seed's:
        ``with_base``), in layer order (``in_layer_order``)."""
        return self.in_layer_order(state.replace(params=self.trainable(state.params)))

    @property
    def abstract_saved_state(self) -> state_lib.TrainState:
        state = self.abstract_state
        return state.replace(params=self.trainable(state.params))

    def with_base(self, params: Any) -> Any:
        """Restored parameters (``saved``'s, in layer order) -> every parameter, in layer
        order: under LoRA the frozen base is read again from where step 0 had it."""
        if not self.adapters_only:
            return params
        base = lora_lib.split(self.init_state().params, True)[1]
        return lora_lib.merge(self.in_layer_order(base), params)

    def in_layer_order(self, tree: Any) -> Any:
        """A tree of this layout's device arrays (the state, its parameters, a part of
        them) from the train state's order of the pipelined layers to layer order, which
        checkpoints and exports hold: the same tree under the circular pipeline
        (``decoder.layer_order``), whose stages hold every S-th chunk. Same shardings;
        the layers move between stages once."""
        return self._reordered(tree, False)

    @functools.cached_property
    def layer_order_model(self) -> tuple[Any, DecoderConfig]:
        """The graph and config that run ``in_layer_order``'s parameters outside the
        pipeline (the sample hook's decoding): the model's, with one chunk per stage."""
        if decoder.layer_order(self.model_cfg) is None:
            return self.graphdef, self.model_cfg
        cfg = dataclasses.replace(self.model_cfg, virtual_stages=1)
        return nnx.split(nnx.eval_shape(lambda: decoder.Decoder(cfg, nnx.Rngs(0))))[0], cfg

    def in_storage_order(self, tree: Any) -> Any:
        """``in_layer_order``'s inverse: a restored or imported tree into the train
        state's order."""
        return self._reordered(tree, True)

    def _reordered(self, tree: Any, to_storage: bool) -> Any:
        if decoder.layer_order(self.model_cfg) is None:
            return tree
        leaves, treedef = jax.tree.flatten(tree)
        shardings = tuple(a.sharding for a in leaves)
        key = (to_storage, treedef, shardings)
        if key not in self._reorder_fns:
            self._reorder_fns[key] = jax.jit(
                lambda t: decoder.reorder_layers(t, self.model_cfg, to_storage),
                out_shardings=jax.tree.unflatten(treedef, shardings))
        with jax.set_mesh(self.mesh):
            return self._reorder_fns[key](tree)

    def _fresh_state(self, params: Any) -> state_lib.TrainState:
        return state_lib.TrainState(step=state_lib.zero_step(), params=params,
                                    opt_state=self.optimizer.init(self.trainable(params)))

    def _init(self, seed: jax.Array) -> state_lib.TrainState:
        model = decoder.Decoder(self.model_cfg, nnx.Rngs(params=jax.random.key(seed)))
        return self._fresh_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    @functools.cached_property
    def compiled_init(self) -> jax.stages.Compiled:
        """Init compiled with sharded outputs: no device ever holds a full copy."""
        with rules_lib.use(self.rules):
            lowered = jax.jit(self._init, out_shardings=self.state_sharding).lower(
                jax.ShapeDtypeStruct((), jnp.uint32))
        return compiler.compile_step(lowered, self._init_options, self.platform)

    @property
    def _init_options(self) -> dict[str, Any]:
        return compiler.init_options(self.platform, decoder.num_params(self.model_cfg))

    def init_state(self, seed: int | None = None) -> state_lib.TrainState:
        """Step 0: parameters from ``model.init_from`` if set, else random from ``seed``;
        under LoRA, the adapters of ``model.lora.init_from`` if set. Optimizer state
        fresh (moments zero), as PEFT and Axolotl start from trained adapters."""
        seed = self.settings.train.seed if seed is None else seed
        if self.checkpoint is not None:
            return self.state_from_params(self.checkpoint_params(seed))
        state = self.compiled_init(jnp.asarray(seed, jnp.uint32))
        if self.settings.model.lora.init_from is None:
            return state
        # The random base of the very program a resume draws it again with (with_base),
        # so that the two agree bit for bit; the drawn adapters are replaced.
        base = {**lora_lib.split(state.params, True)[1], **self._saved_modules()}
        return self.state_from_params(lora_lib.merge(base, self._adapters(seed)))

    def checkpoint_params(self, seed: int | None = None) -> Any:
        """The parameters of ``model.init_from``, sharded, with no optimizer state (what
        generation needs); under LoRA the base from the checkpoint (quantized as it is
        read, under QLoRA) and the adapters of ``_adapters``."""
        seed = self.settings.train.seed if seed is None else seed
        if not self.adapters_only:
            return self.in_storage_order(hf.load_params(
                self.checkpoint, self.param_shapes, self.state_sharding.params))
        base = hf.load_params(self.checkpoint, *(lora_lib.split(t, True)[1] for t in (
            self.param_shapes, self.state_sharding.params)), quant=self.model_cfg.lora.quant)
        return lora_lib.merge({**self.in_storage_order(base), **self._saved_modules()},
                              self._adapters(seed))

    def _saved_modules(self) -> dict[str, Any]:
        """model.lora.modules_to_save's parameters as ``model.lora.init_from`` holds them
        (they replace the base's); none without it."""
        directory = self.settings.model.lora.init_from
        if directory is None or not self.saved_params:
            return {}
        return hf.load_saved_modules(directory, self.model_cfg, self.param_shapes,
                                     self.state_sharding.params)

    def _adapters(self, seed: int) -> Any:
        """Step 0's LoRA adapters, sharded: ``model.lora.init_from``'s if set, else fresh
        from ``seed``."""
        directory = self.settings.model.lora.init_from
        if directory is None:
            return self._compiled_adapters(jnp.asarray(seed, jnp.uint32))
        return self.in_storage_order(hf.load_adapter(
            directory, self.model_cfg, *(self.adapters(t) for t in (
                self.param_shapes, self.state_sharding.params))))

    @functools.cached_property
    def _compiled_adapters(self) -> jax.stages.Compiled:
        """Fresh LoRA adapters from a seed, as ``_init`` draws them (the base weights it
        would draw are no output, and XLA leaves them out)."""
        with rules_lib.use(self.rules):
            lowered = jax.jit(lambda seed: self.adapters(self._init(seed).params),
                              out_shardings=self.adapters(self.state_sharding.params)).lower(
                jax.ShapeDtypeStruct((), jnp.uint32))
        return compiler.compile_step(lowered, self._init_options, self.platform)

    def state_from_params(self, params: Any) -> state_lib.TrainState:
        """Step 0 around given parameters (in ``state_sharding.params``, donated):
        optimizer state freshly initialised, already sharded."""
        return self._compiled_wrap(params)

    @functools.cached_property
    def _compiled_wrap(self) -> jax.stages.Compiled:
        wrap = self._fresh_state
        with rules_lib.use(self.rules):
            params = jax.tree.map(
                lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                self.param_shapes, self.state_sharding.params)
            lowered = jax.jit(wrap, out_shardings=self.state_sharding,
                              donate_argnums=0).lower(params)
        return compiler.compile_step(lowered, self._init_options, self.platform)

    @functools.cached_property
    def abstract_state(self) -> state_lib.TrainState:
        # From the parameters' shapes (no second trace of the model's init: the
        # planner asks this of every layout it checks).
        shapes = jax.eval_shape(self._fresh_state, self.param_shapes)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_sharding)

    # ----- step ----------------------------------------------------------------

    @property
    def abstract_batch(self) -> Batch:
        t = self.settings.train
        return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtype,
                                        sharding=self.batch_sharding)
                for k, dtype in self.batch_fields.items()}

    @property
    def batch_fields(self) -> dict[str, Any]:
        """The fields of a batch and their dtypes: ``BATCH_FIELDS`` (int32), KTO's
        examples' ``desirable``, GRPO's rows' ``advantages`` (float32)."""
        fields = dict.fromkeys(BATCH_FIELDS, jnp.int32)
        if self.settings.data.format == "unpaired_preference":
            fields.update(dict.fromkeys(KTO_FIELDS, jnp.int32))
        if self.settings.train.objective == "grpo":
            fields["advantages"] = jnp.float32
            if self.settings.grpo.num_iterations > 1:  # the sampling policy's
                fields["old_logps"] = jnp.float32
        return fields

    @functools.cached_property
    def compiled_token_logps(self) -> jax.stages.Compiled:
        """(params, batch) -> the policy's log-probability of each target (GRPO's objective
        at its temperature), (b, s) float32: the sampling policy's, kept for the steps
        that reuse its rollouts (grpo.num_iterations)."""
        objective, chunk = self.objective, self.settings.train.loss_chunk
        fields = {k: v for k, v in self.abstract_batch.items() if k != "old_logps"}

        def logps(params, batch):
            return objective.token_logps(self.features, params, batch, chunk)[0]

        with rules_lib.use(self.rules), self.for_target():
            lowered = jax.jit(logps, in_shardings=(self.state_sharding.params,
                                                   self.batch_sharding),
                              out_shardings=self.batch_sharding).lower(
                self.abstract_state.params, fields)
            return compiler.compile_step(lowered, platform=self.platform)

    def lower_step(self) -> jax.stages.Lowered:
        """The train step lowered under the mesh and rules (constraints included)."""
        step = functools.partial(train_step, self.features, self.optimizer, self.schedule,
                                 self.step_options, self.state_sharding.params)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        shardings, args = (self.state_sharding, self.batch_sharding), [self.abstract_state,
                                                                         self.abstract_batch]
        if self.reference_mode == "held":  # the reference's parameters, beside the state
            shardings += (self.trainable(self.state_sharding.params),)
            args.append(self.trainable(self.abstract_state.params))
        with rules_lib.use(self.rules), self.for_target():
            jitted = jax.jit(step, in_shardings=shardings,
                             out_shardings=(self.state_sharding, replicated),
                             donate_argnums=0)
            return jitted.lower(*args)

    @functools.cached_property
    def compiled_step(self) -> jax.stages.Compiled:
        with self.for_target():
            return compiler.compile_step(self.lower_step(), platform=self.platform)

    def lower_eval(self) -> jax.stages.Lowered:
        """The loss without the update, in the train step's shardings: (params, batch) ->
        {loss, tokens}."""
        step = functools.partial(eval_step, self.features, self.objective,
                                 self.settings.train.loss_chunk)  # (no preference: checked)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        with rules_lib.use(self.rules), self.for_target():
            jitted = jax.jit(step, in_shardings=(self.state_sharding.params, self.batch_sharding),
                             out_shardings=replicated)
            return jitted.lower(self.abstract_state.params, self.abstract_batch)

    @functools.cached_property
    def compiled_eval(self) -> jax.stages.Compiled:
        with self.for_target():
            return compiler.compile_step(self.lower_eval(), platform=self.platform)

    @functools.cached_property
    def local_rows(self) -> tuple[int, int]:
        """``(start, count)``: the global batch rows this process's devices hold.

        Not simply batch_size / processes: when context (or tensor) parallelism
        spans processes, several processes hold pieces of the same rows, and each
        loads those rows whole.
        """
        t = self.settings.train
        indices = self.batch_sharding.addressable_devices_indices_map((t.batch_size, t.seq_len))
        rows = sorted({idx[0].indices(t.batch_size)[:2] for idx in indices.values()})
        start, stop = rows[0][0], max(r[1] for r in rows)
        covered = set().union(*(range(*r) for r in rows))
        if covered != set(range(start, stop)):  # a mesh from build_mesh never does this
            raise ConfigError(f"this process's devices hold batch rows {rows}, not one "
                              "contiguous range; use a mesh from ndjax.parallel.mesh.build_mesh.")
        return start, stop - start

    @property
    def max_runs(self) -> int | None:
        """The most runs of equal segment ids (documents, and a row's padding) that the
        chosen attention kernel takes in a row, None for any: ``make_loader`` packs
        every row within it, so ``device_batch``'s check never stops a run."""
        return attention_ops.KERNELS[self.model_cfg.attn_impl].max_runs(self.model_cfg)

    def device_batch(self, batch: dict[str, np.ndarray]) -> Batch:
        """Host numpy batch (this process's ``local_rows``, whole) -> global arrays in
        the batch sharding; each local device gets its block of rows and positions.

        With ring attention's zigzag layout the sequence axis of every field is
        permuted here, all alike, so each context shard receives its two chunks;
        the token-weighted loss is a sum over tokens and does not change.
        """
        t, perm = self.settings.train, self.seq_permutation
        attention_ops.KERNELS[self.model_cfg.attn_impl].check_batch(batch["segment_ids"],
                                                                   self.model_cfg)
        start = self.local_rows[0]
        shape = (t.batch_size, t.seq_len)

        def field(rows: np.ndarray) -> jax.Array:
            rows = rows if perm is None else rows[:, perm]
            return jax.make_array_from_callback(
                shape, self.batch_sharding,
                lambda idx: rows[slice(*(i - start for i in idx[0].indices(shape[0])[:2])),
                                 idx[1]])

        # old_logps: computed on the devices (compiled_token_logps), never read from a host.
        return {k: field(batch[k]) for k in self.batch_fields if k != "old_logps"}


def _check_experts(model_cfg: DecoderConfig, rules: rules_lib.Rules, family: str) -> None:
    """The expert axis: only a mixture of experts has experts to split, and its axis
    must divide them (each device holds n_experts / ways of them)."""
    from ndjax.models.moe import expert_axes

    if model_cfg.capacity_factor is not None:
        if not model_cfg.n_experts:
            raise ConfigError(f"model.capacity_factor={model_cfg.capacity_factor}: "
                              f"model.family={family!r} is dense (it has no experts). "
                              "Unset model.capacity_factor.")
        seq = [a for a in rules.axes_of("act_seq") if rules.mesh.shape[a] > 1]
        if seq:
            raise ConfigError(
                f"model.capacity_factor={model_cfg.capacity_factor}: capacity mode ranks each "
                f"row's tokens per expert, and the rules split the sequence over {seq} "
                "(act_seq). Unset model.capacity_factor (dropless), or keep the sequence "
                "whole (mesh.context=1).")
    split = expert_axes(rules)
    ways = math.prod(rules.mesh.shape[a] for a in split)
    if ways == 1:
        return
    field = "mesh.expert" if split == ("expert",) else f"rules' 'experts' axes {split}"
    if not model_cfg.n_experts:
        raise ConfigError(f"{field}={ways}: model.family={family!r} is dense (it has no "
                          "experts to split). Set mesh.expert=1, or train a mixture of "
                          "experts (model.family='mixtral' or 'qwen3_moe').")
    n = model_cfg.n_experts
    if n % ways:
        fit = max(d for d in range(1, ways + 1) if n % d == 0)
        raise ConfigError(f"{field}={ways} does not divide model.n_experts={n}: each device "
                          f"holds n_experts / {ways} experts. Use a divisor of {n}, e.g. "
                          f"mesh.expert={fit}.")


def _check_kv_heads(model_cfg: DecoderConfig, rules: rules_lib.Rules, mesh: Mesh,
                    init_from: str | None) -> None:
    """The kv heads split over their mesh axes, or those axes are a multiple of them
    (each kv head then replicated on the shards that share it); anything else is
    an error that says what would work."""
    n = model_cfg.n_kv_heads
    ways, parts = _ways(rules, mesh, ("kv_heads",))
    if n % ways == 0 or ways % n == 0:
        return
    fits = sorted({d for d in range(1, ways + 1) if n % d == 0 or d % n == 0}
                  | {n * (ways // n + 1)})
    where = f" (from model.init_from={init_from!r}, config.json)" if init_from else ""
    raise ConfigError(
        f"model.n_kv_heads={n}{where} cannot be laid over {ways} = {parts}, the mesh axes of "
        f"the kv heads: that degree must divide n_kv_heads or be a multiple of it (then each "
        f"kv head is replicated on the shards that share it). Use mesh.tensor in "
        f"{[d for d in fits if model_cfg.n_heads % d == 0]}, or map 'kv_heads' to other "
        "mesh axes in the rule table.")


def _check_batch(t: TrainSettings, rules: rules_lib.Rules, mesh: Mesh) -> None:
    checks = (("train.batch_size", t.batch_size, ("act_batch",)),
              ("train.seq_len", t.seq_len, ("act_seq", "act_res_seq")))
    for field, value, names in checks:
        ways, parts = _ways(rules, mesh, names)
        if value % ways:
            raise ConfigError(
                f"{field}={value} is not divisible by {ways} = {parts}, the mesh axes that "
                f"split it (rules for {', '.join(names)}). Use a multiple of {ways}, e.g. "
                f"{field}={(value // ways + 1) * ways}.")
    k = t.grad_accum
    ways, parts = _ways(rules, mesh, ("act_batch",))
    if t.batch_size % (k * ways):
        fits = [d for d in range(1, t.batch_size // ways + 1)
                if t.batch_size % (d * ways) == 0]
        raise ConfigError(
            f"train.grad_accum={k}: each micro-batch of train.batch_size={t.batch_size} / {k} "
            f"rows must split evenly over {ways} = {parts}, the mesh axes that split the "
            f"batch, so batch_size must be a multiple of {k} x {ways} = {k * ways}. Use "
            f"train.grad_accum in {fits} or a larger batch_size.")


def _check_pipeline(model_cfg: DecoderConfig, t: TrainSettings, rules: rules_lib.Rules,
                    virtual: int = 1, gather_once: bool = False) -> None:
    """mesh.stage, mesh.virtual_stages and model.pipeline_gather_once against the layers,
    the layer pattern and the micro-batches."""
    stages = mesh_lib.stages(rules.mesh)
    if stages == 1:
        if virtual > 1:
            raise ConfigError(
                f"mesh.virtual_stages={virtual} needs pipeline stages: it is the chunks of "
                "layers each stage holds. Set mesh.stage > 1 or mesh.virtual_stages=1.")
        if gather_once:
            raise ConfigError(
                "model.pipeline_gather_once=True needs pipeline stages: it gathers each "
                "stage's layers once per step instead of once per tick. Set mesh.stage > 1 "
                "or model.pipeline_gather_once=False.")
        return
    # DeepSeek V3's dense first layers run before the stages; the stages cut the rest.
    n, k = model_cfg.n_layers, model_cfg.first_k_dense
    chunks = stages * virtual
    what = f"model.n_layers={n}" if not k else (
        f"the {n - k} MoE layers (model.n_layers={n} less model.first_k_dense={k}, "
        "which run before the stages)")
    if (n - k) % stages:
        fits = [d for d in range(2, n - k + 1) if (n - k) % d == 0][:6]
        raise ConfigError(
            f"mesh.stage={stages} does not divide {what}: each stage runs an "
            f"equal run of layers. Use mesh.stage in {fits}.")
    if (n - k) % chunks:
        fits = [d for d in range(1, (n - k) // stages + 1) if (n - k) % (stages * d) == 0]
        raise ConfigError(
            f"mesh.virtual_stages={virtual}: {stages} stages x {virtual} chunks do not "
            f"divide {what}: each chunk is an equal run of layers. Use "
            f"mesh.virtual_stages in {fits}.")
    per_chunk, period = (n - k) // chunks, model_cfg.period
    if per_chunk % period:
        if virtual == 1:
            asked, each, fix = f"mesh.stage={stages}", "each stage", "a mesh.stage"
        else:
            asked = f"mesh.stage={stages} x mesh.virtual_stages={virtual}"
            each, fix = "each chunk", "mesh.stage x mesh.virtual_stages"
        raise ConfigError(
            f"{asked} gives {each} {per_chunk} layers, not whole periods of the model's "
            f"{period}-layer pattern of layer types, so the stages would run different "
            f"layers. Use {fix} that divides {(n - k) // period}.")
    m = t.microbatches or stages
    if virtual > 1 and m < stages:
        raise ConfigError(
            f"train.microbatches={m} with mesh.stage={stages}, mesh.virtual_stages="
            f"{virtual}: the circular schedule sends a micro-batch from the last stage "
            f"back to the first, which needs at least as many micro-batches as stages. "
            f"Use train.microbatches >= {stages}.")
    rows = t.batch_size // t.grad_accum
    data, parts = _ways(rules, rules.mesh, ("act_batch",))
    if rows % (m * data):
        fits = [d for d in range(1, rows + 1) if rows % (d * data) == 0]
        raise ConfigError(
            f"train.microbatches={m}: the pipeline cuts each grad_accum slice's "
            f"{rows} rows (train.batch_size={t.batch_size} / train.grad_accum={t.grad_accum}) "
            f"into {m} micro-batches whose rows split over {data} = {parts}, the mesh axes "
            f"that split the batch, so {rows} must be a multiple of {m} x {data}. Use "
            f"train.microbatches in {fits} or a larger batch_size.")


def _check_one_f_one_b(model_cfg: DecoderConfig, settings: Settings, stages: int) -> None:
    """mesh.pipeline_schedule=1f1b: stages, one chunk each, micro-batches >= stages, and no
    loss over the whole batch's router statistics (ndjax.parallel.pipeline.OneFOneB; the
    objective is _check_objective's)."""
    if settings.mesh.pipeline_schedule != "1f1b":
        return
    where = "mesh.pipeline_schedule='1f1b'"
    m = settings.train.microbatches or stages
    z_loss = settings.model.router_z_loss_coef
    for bad, message in (
            (stages == 1, "needs pipeline stages. Set mesh.stage > 1 or "
                          "mesh.pipeline_schedule=gpipe."),
            (settings.mesh.virtual_stages > 1,
             f"with mesh.virtual_stages={settings.mesh.virtual_stages}: interleaved 1F1B is "
             "not built. Set mesh.virtual_stages=1 (1F1B) or mesh.pipeline_schedule=gpipe "
             "(the circular schedule)."),
            (m < stages, f"with train.microbatches={m} < mesh.stage={stages}: 1F1B's "
                         f"steady state runs a forward and a backward on every stage, which "
                         f"needs at least as many micro-batches as stages. Use "
                         f"train.microbatches >= {stages}."),
            (bool(model_cfg.router_aux_loss_coef or z_loss),
             f"with the router's losses in the loss (model.router_aux_loss_coef="
             f"{model_cfg.router_aux_loss_coef}, model.router_z_loss_coef={z_loss}): they are "
             "formed over the whole batch, and 1F1B starts a micro-batch's backward pass "
             "before the last one's forward. Set both to 0 or use "
             "mesh.pipeline_schedule=gpipe.")):
        if bad:
            raise ConfigError(f"{where} {message}")


def _ways(rules: rules_lib.Rules, mesh: Mesh, names: Sequence[str]) -> tuple[int, str]:
    """How many ways the mesh axes of these logical names split a dimension, and
    the axes as text ("fsdp(4) x context(2)")."""
    axes = sorted({a for n in names for a in rules.axes_of(n)}, key=mesh.axis_names.index)
    return (math.prod(mesh.shape[a] for a in axes),
            " x ".join(f"{a}({mesh.shape[a]})" for a in axes) or "none")


def _check_loss_chunk(t: TrainSettings, rules: rules_lib.Rules, mesh: Mesh) -> None:
    """The chunked loss cuts each row into seq_len / loss_chunk chunks on every
    device, so a chunk must split over the sequence's mesh axes like the sequence."""
    chunk, seq_len = t.loss_chunk, t.seq_len
    if seq_len <= chunk:
        return
    ways, axes = _ways(rules, mesh, ("act_seq",))
    fits = [c for c in range(chunk, 0, -1) if seq_len % c == 0 and c % ways == 0]
    if seq_len % chunk or chunk % ways:
        hint = f" e.g. train.loss_chunk={fits[0]}" if fits else ""
        raise ConfigError(
            f"train.loss_chunk={chunk} must divide train.seq_len={seq_len} and be a multiple "
            f"of {ways} = {axes}, the mesh axes that split the sequence (act_seq). Use such a "
            f"chunk,{hint} or a loss_chunk >= seq_len (no chunking).")
