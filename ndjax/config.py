"""Experiment configuration: typed sections, every field checked once, in one place.

Users write configs as ml_collections files (``configs/*.py`` call
``default_config()`` and change what their experiment needs) and override them
with ``--config.train.steps=5``. ``Settings.parse`` turns that ConfigDict into
frozen dataclasses: each field has a type and, where it has one, its allowed
values or range, declared beside its default below. Unknown keys, wrong types
and out-of-range values are one ``ConfigError`` naming the field, the value and
a fix, raised before anything is built. Checks that need the mesh or the model
(divisibility, kernels) stay in ``Experiment.from_config``.

The code below ``Experiment`` receives these typed sections, never the ConfigDict.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections
from ml_collections import config_dict

from ndjax.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a field accepts beyond its type. ``choices`` may be a function, so that
    tables defined in heavier modules (kernels, presets) are read only when checked."""

    choices: Sequence[Any] | Callable[[], Sequence[Any]] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    hint: str = ""  # appended to the error: what the field means or how to fix it


def setting(default: Any, **spec: Any) -> Any:
    return dataclasses.field(default=default, metadata={"spec": Spec(**spec)})


def _families() -> Sequence[str]:
    from ndjax.models import registry
    return tuple(registry.families())


def _remat() -> Sequence[str]:
    from ndjax.models import decoder
    return tuple(decoder.REMAT_POLICIES)


def _attn_impls() -> Sequence[str]:
    from ndjax.ops import attention
    return attention.IMPLS


def _moe_impls() -> Sequence[str]:
    from ndjax.ops import grouped_matmul
    return grouped_matmul.IMPLS


def _cp_impls() -> Sequence[str]:
    from ndjax.ops import attention
    return attention.CP_IMPLS


def _cp_layouts() -> Sequence[str]:
    from ndjax.ops import ring_attention
    return ring_attention.LAYOUTS


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """LoRA fine-tuning (ndjax.models.lora), PEFT's fields by their PEFT meaning: the base
    is frozen, only the adapters train. Unset rank: no LoRA."""

    rank: int | None = setting(None, ge=1, hint=" (the adapters' rank, PEFT's r: 8-64 is "
                                                "usual; unset: no LoRA)")
    alpha: float = setting(8.0, gt=0, hint=" (PEFT's lora_alpha: the update is scaled by "
                                            "alpha / rank)")
    # "all-linear" (every projection of the blocks; not the LM head), or comma-separated
    # names in PEFT's or ndjax's spelling: "q_proj,v_proj" or "q,v".
    target_modules: str = setting("all-linear")
    use_rslora: bool = setting(False, hint=" (scale by alpha / sqrt(rank))")
    # PEFT's lora_dropout: each adapter's input loses this fraction of its elements in
    # training (a mask per projection, layer, token and step; the same on every layout).
    dropout: float = setting(0.0, ge=0, lt=1, hint=" (PEFT's lora_dropout: 0.05-0.1 is "
                                                    "usual; 0: none)")
    # QLoRA: the frozen base's projections stored quantized (ndjax.models.quant), nf4
    # (bitsandbytes' load_in_4bit, bnb_4bit_quant_type="nf4") or int8; "none": in
    # model.param_dtype.
    quantize: str = setting("none", choices=("none", "int8", "nf4"))
    # Values per absmax scale, along each weight's last axis (bitsandbytes' blocksize).
    quant_block: int = setting(64, ge=2, hint=" (values per scale: 64 is bitsandbytes' "
                                              "NF4 default)")
    # A PEFT adapter directory (adapter_config.json, adapter_model.safetensors: what
    # export.adapter_dir writes) whose adapters start the run instead of fresh ones, as
    # PEFT's PeftModel.from_pretrained; checked against rank, alpha, target_modules and
    # use_rslora before anything compiles. A resume's checkpoint holds the adapters, and
    # takes precedence.
    init_from: str | None = setting(None)
    # PEFT's modules_to_save: embed_tokens and/or lm_head (comma-separated) trained in
    # full beside the adapters and exported with them (Axolotl's lora_modules_to_save;
    # what tokens added to the tokenizer need); "": none.
    modules_to_save: str = setting("")

    @property
    def saved_modules(self) -> tuple[str, ...]:
        """model.lora.modules_to_save as a tuple of PEFT's module names."""
        return tuple(m.strip() for m in self.modules_to_save.split(",") if m.strip())

    def check(self) -> None:
        from ndjax.models import lora

        bad = [m for m in self.saved_modules if m not in lora.SAVABLE]
        if bad:
            raise ConfigError(f"model.lora.modules_to_save={self.modules_to_save!r}: {bad[0]!r} "
                              f"cannot be trained beside the adapters; name "
                              f"{' and/or '.join(lora.SAVABLE)}, comma-separated.")
        if self.rank is None and self.saved_modules:
            raise ConfigError(f"model.lora.modules_to_save={self.modules_to_save!r} trains "
                              "modules beside LoRA adapters, and model.lora.rank is unset: set "
                              "model.lora.rank (e.g. 16) or model.lora.modules_to_save=''.")
        if self.rank is None:
            if self.init_from is not None:
                raise ConfigError(
                    f"model.lora.init_from={self.init_from!r} loads LoRA adapters, and "
                    "model.lora.rank is unset: set model.lora.rank to the adapter's r (in its "
                    "adapter_config.json).")
            if self.quantize != "none":
                raise ConfigError(
                    f"model.lora.quantize={self.quantize!r} quantizes the frozen base of a "
                    "LoRA, and model.lora.rank is unset: set model.lora.rank (e.g. 16) or "
                    "model.lora.quantize='none'.")
            return
        targets = lora.parse_targets(self.target_modules)
        if isinstance(targets, str):
            raise ConfigError(
                f"model.lora.target_modules={self.target_modules!r}: {targets!r} is no module "
                f"LoRA can target; use {lora.ALL_LINEAR!r} or names among "
                f"{', '.join(lora.TARGETS.values())} (or {', '.join(lora.TARGETS)}).")


_DIMS = dict(ge=1, hint=" (or unset: the preset's)")
# The model fields a config (or model.init_from's config.json) may set over the preset.
MODEL_DIMS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "head_dim",
              "rope_theta", "rms_norm_eps", "tie_embeddings")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    # The decoder family (ndjax.models.registry); model.init_from's config.json says
    # its own, by model_type.
    family: str = setting("llama", choices=_families)
    # A preset of the family (every family has "tiny", for tests and demos).
    preset: str = setting("tiny")
    # Dims left at None come from the preset (or model.init_from's config.json).
    vocab_size: int | None = setting(None, **_DIMS)
    dim: int | None = setting(None, **_DIMS)
    n_layers: int | None = setting(None, **_DIMS)
    n_heads: int | None = setting(None, **_DIMS)
    n_kv_heads: int | None = setting(None, **_DIMS)
    ffn_dim: int | None = setting(None, **_DIMS)
    head_dim: int | None = setting(None, **_DIMS)
    rope_theta: float | None = setting(None, gt=0)
    # Rotary frequency scaling: {rope_type: llama3 (default) | linear | yarn, factor,
    # original_max_position_embeddings; llama3's low_freq_factor, high_freq_factor;
    # yarn's beta_fast, beta_slow, truncate, attention_factor, mscale, mscale_all_dim}
    # (linear reads only factor; ndjax.models.layers.RopeScaling); {}: none; None: the
    # preset's. A run saves the model it trained in full (ndjax.runs.workdir), so its
    # workdir needs no model.init_from.
    rope_scaling: dict | None = setting(None)
    rms_norm_eps: float | None = setting(None, gt=0)
    tie_embeddings: bool | None = setting(None)
    # Options some families have (unset: the family's preset's). Set on a family that
    # lacks them, they are refused (ndjax.models.registry.check_options).
    qkv_bias: bool | None = setting(None)
    qk_norm: bool | None = setting(None)
    # Keys a local layer's query sees, itself included; 0: no window.
    sliding_window: int | None = setting(None, ge=0)
    # With a window, every n-th layer global (Gemma 3: 6); unset: every layer local.
    sliding_window_pattern: int | None = setting(None, ge=1)
    query_pre_attn_scalar: float | None = setting(None, gt=0)
    # Mixture of experts (the MoE families; ndjax.models.moe): the experts per layer,
    # those each token runs through (top-k), each one's width (Qwen3-MoE's
    # moe_intermediate_size; Mixtral's are ffn_dim wide), whether the top-k weights are
    # renormalised to sum to 1, and the load-balancing loss's weight in the loss (unset:
    # the preset's; with model.init_from, its config.json's router_aux_loss_coef where
    # output_router_logits is true, else 0, as transformers trains it).
    n_experts: int | None = setting(None, ge=0)
    experts_per_token: int | None = setting(None, ge=1)
    moe_ffn_dim: int | None = setting(None, ge=1)
    norm_topk_prob: bool | None = setting(None)
    router_aux_loss_coef: float | None = setting(None, ge=0)
    # Qwen 2 MoE's shared expert: its width (shared_expert_intermediate_size).
    shared_expert_dim: int | None = setting(None, ge=1)
    # GPT-OSS's experts: gate clamped above at swiglu_limit and up to +-limit, then
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate).
    swiglu_limit: float | None = setting(None, gt=0)
    swiglu_alpha: float | None = setting(None, gt=0)
    # DeepSeek V3's multi-head latent attention: the query latent's rank (0: a plain
    # query projection), the key/value latent's, the rotary dims of head_dim (the rest
    # take no rotation), the values' head dim, and the rotary dims in interleaved pairs.
    q_lora_rank: int | None = setting(None, ge=0)
    kv_lora_rank: int | None = setting(None, ge=1)
    rope_head_dim: int | None = setting(None, ge=2)
    v_head_dim: int | None = setting(None, ge=1)
    rope_interleave: bool | None = setting(None)
    # DeepSeek V3: its first layers' MLP dense (ffn_dim wide); the experts in n_group
    # groups, a token's chosen among the topk_group best, weighted by their scores times
    # routed_scaling_factor.
    first_k_dense: int | None = setting(None, ge=0)
    n_group: int | None = setting(None, ge=1)
    topk_group: int | None = setting(None, ge=1)
    routed_scaling_factor: float | None = setting(None, gt=0)
    # DeepSeek V3's auxiliary-loss-free balancing: the step by which each expert's
    # routing bias moves after each train step, towards balance (unset: the preset's,
    # its paper's 0.001; 0: the bias stays as loaded).
    score_bias_rate: float | None = setting(None, ge=0)
    # ST-MoE's router z-loss (the squared logsumexp of the router's logits, averaged
    # over tokens and layers) in the loss: its weight, 0 = off (ST-MoE used 1e-3).
    router_z_loss_coef: float = setting(0.0, ge=0)
    # Unset: dropless (every (token, expert) pair computed). Set: capacity mode, each
    # expert takes at most ceil(capacity_factor x seq_len x experts_per_token /
    # n_experts) of a row's pairs, earliest first, the others dropped (their tokens
    # keep the residual only), as Switch Transformer and MaxText do; under mesh.expert
    # the exchange's buffers shrink to that bound.
    capacity_factor: float | None = setting(None, gt=0, hint=" (unset: dropless)")
    # The experts' grouped matmuls (ndjax.ops.grouped_matmul): xla (jax.lax.ragged_dot),
    # mosaic (jax's Mosaic GPU kernels for Hopper), auto: mosaic on Hopper GPUs.
    moe_impl: str = setting("auto", choices=_moe_impls,
                            hint=" (auto: mosaic on Hopper GPUs, else xla)")
    local_rope_theta: float | None = setting(None, gt=0)
    # compute dtype: auto = bfloat16 on GPU/TPU, float32 on CPU
    dtype: str = setting("auto", choices=("auto", "float32", "bfloat16", "float16"))
    # dtype parameters are stored in (no float16: its range needs loss scaling); auto:
    # float32, but bfloat16 for a LoRA's frozen base (its adapters stay float32)
    param_dtype: str = setting("auto", choices=("auto", "float32", "bfloat16"))
    # The decoder layers: True = one scanned block (compile time flat in depth),
    # False = unrolled; unset = unrolled on CPU up to 8 layers, else scanned
    # (ndjax.models.decoder.default_scan_layers says why).
    scan_layers: bool | None = setting(None)
    remat: str = setting("none", choices=_remat)
    # Under mesh.stage > 1: gather each stage's layers over the data axes (fsdp) once per
    # step and keep them gathered, instead of once per tick; their gradients come back
    # once. Fewer, larger gathers for a stage's whole weights in memory.
    pipeline_gather_once: bool = setting(False)
    # Attention: auto = ring over mesh.context, cuDNN or Pallas on a GPU, else by
    # length: dense, blocked, tiled (ndjax.ops.attention.choose); or a kernel by name.
    attn_impl: str = setting("auto", choices=_attn_impls,
                             hint=" (auto picks by mesh, device and sequence length)")
    # Ring attention's layout (zigzag balances the causal work over the context
    # shards, contiguous does not).
    cp_layout: str = setting("zigzag", choices=_cp_layouts)
    # How context shards meet: ring (key/value blocks pass around the context axis)
    # or all_to_all (sequence shards become head shards around a one-shard kernel,
    # model.attn_impl); auto: all_to_all where the heads split and a fused kernel runs
    # (GPUs), else ring (ndjax.ops.attention.choose says why).
    cp_impl: str = setting("auto", choices=_cp_impls)
    # The tiled and ring key tile (memory O(local_len x tile)).
    attn_kv_tile: int = setting(512, ge=1)
    # The most documents one row may hold where the kernel needs a bound: cudnn keeps
    # softmax statistics for max_docs x seq_len per head and layer (a row's padding
    # counts as one document). The packers then start a new row rather than exceed it.
    attn_max_docs: int = setting(64, ge=2, hint=" (a row's documents and, after them, its "
                                                "padding: one each)")
    # A local Hugging Face directory of a supported family (config.json +
    # safetensors): its config.json sets the family and dims above, its weights the
    # initial parameters.
    init_from: str | None = setting(None)
    # LoRA: adapters on a frozen base (ndjax.models.lora; docs/lora.md).
    lora: LoraSettings = dataclasses.field(default_factory=LoraSettings)

    @property
    def stored_dtype(self) -> str:
        """param_dtype with auto resolved: bfloat16 under LoRA, else float32."""
        if self.param_dtype != "auto":
            return self.param_dtype
        return "float32" if self.lora.rank is None else "bfloat16"

    @property
    def resolved(self) -> bool:
        """Whether the model is set in full (a run's saved config.json sets it:
        ``ndjax.runs.workdir.resolved_model``), so that no preset is read."""
        return all(getattr(self, f) is not None for f in MODEL_DIMS) and \
            self.rope_scaling is not None

    def check(self) -> None:
        if self.rope_scaling:
            self._check_rope_scaling(self.rope_scaling)
        from ndjax.models import registry
        family = registry.get(self.family)
        if self.init_from is None:  # else config.json says the family and its presets
            if not self.resolved:
                registry.preset_dims(family, self.preset)
            registry.check_options(family, {f: getattr(self, f)
                                            for f in registry.OPTION_FIELDS})

    @staticmethod
    def _check_rope_scaling(scaling: dict) -> None:
        """Keys of RopeScaling, values it can use; a key another rope_type reads only
        at its default (a run's saved config.json has them all)."""
        from ndjax.models.layers import ROPE_FIELDS, ROPE_TYPES, RopeScaling
        fields = {f.name: f.default for f in dataclasses.fields(RopeScaling)}
        unknown = sorted(set(scaling) - set(fields))
        if unknown:
            raise ConfigError(f"model.rope_scaling={scaling!r}: unknown keys "
                              f"{unknown}; it takes {sorted(fields)}.")
        kind = scaling.get("rope_type", "llama3")
        if kind not in ROPE_TYPES:
            raise ConfigError(f"model.rope_scaling: rope_type={kind!r}; choose one of "
                              f"{ROPE_TYPES}.")
        reads = ROPE_FIELDS[kind]
        for key, value in scaling.items():
            if key == "rope_type":
                continue
            if key not in reads and value != fields[key]:
                raise ConfigError(f"model.rope_scaling: {key}={value!r} is not read by "
                                  f"rope_type={kind!r}, which takes {list(reads)}; drop it or "
                                  f"set rope_type.")
            optional = key in ("attention_factor", "mscale", "mscale_all_dim")
            if key == "truncate":
                ok, want = isinstance(value, bool), "True or False"
            elif key == "original_max_position_embeddings":
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                want = "an int >= 1"
            else:
                ok = (optional and value is None) or (
                    isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and value > 0)
                want = "a number > 0" + (" or None (unset)" if optional else "")
            if not ok:
                raise ConfigError(f"model.rope_scaling: {key}={value!r} must be {want}.")
        if kind == "llama3" and not (scaling.get("high_freq_factor", 4.0)
                                     > scaling.get("low_freq_factor", 1.0)):
            raise ConfigError(f"model.rope_scaling: high_freq_factor="
                              f"{scaling.get('high_freq_factor', 4.0)!r} must exceed "
                              f"low_freq_factor={scaling.get('low_freq_factor', 1.0)!r}.")


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    # Degrees of the axes; -1 (one axis at most): all remaining devices. The
    # values are checked against the device count in ndjax.parallel.mesh.ParallelDims.
    replica: int = setting(1)
    fsdp: int = setting(-1)
    # A mixture of experts' experts split over it (each device holds n_experts / expert
    # of them, tokens travel to them and back); the other layers see one more data axis.
    expert: int = setting(1)
    context: int = setting(1)
    tensor: int = setting(1)
    # Pipeline stages (ndjax.parallel.pipeline): each holds a contiguous run of the layers;
    # the batch runs through them in train.microbatches micro-batches.
    stage: int = setting(1)
    # Chunks of layers each stage holds (> 1: the circular schedule, a micro-batch going
    # round the stages this many times; its bubble is this many times smaller).
    virtual_stages: int = setting(1, ge=1)
    # gpipe: every micro-batch's forward, then every backward (circular where
    # virtual_stages > 1); 1f1b: from the S-th tick each stage runs one micro-batch's
    # forward and an earlier one's backward, so a stage holds at most 2 x stage - 1
    # micro-batches' activations where GPipe holds all of them.
    pipeline_schedule: str = setting("gpipe", choices=("gpipe", "1f1b"))
    # train.py plans the layout (ndjax.planning.auto): the degrees above, the rule table,
    # model.remat, train.grad_accum and model.cp_impl become ndjax plan's best for the
    # devices present.
    auto: bool = setting(False)


@dataclasses.dataclass(frozen=True)
class RuntimeSettings:
    # simulated devices per process on a CPU-only host; ignored on GPU
    cpu_devices: int = setting(8, ge=1)
    # Several processes (one per host or per GPU) joined by jax.distributed. Left
    # unset, a launcher's environment (srun, mpirun, JAX_COORDINATOR_ADDRESS)
    # decides, and a plain single-process run needs nothing. See
    # docs/multi-host.md.
    coordinator: str | None = setting(None, hint=" (host:port of process 0)")
    num_processes: int | None = setting(None, ge=1)
    process_id: int | None = setting(None, ge=0)
    # GPUs this process uses, e.g. "0,1,2,3,4,5,6,7"; unset: all (under srun, jax
    # gives each task only the GPU of its SLURM_LOCALID unless this is set).
    local_device_ids: str | None = setting(None)
    # seconds to wait for the coordinator and every process
    init_timeout: int = setting(300, ge=1)
    # A process silent for this many seconds is declared dead and the others stop.
    heartbeat_timeout: int = setting(100, ge=1)
    # jax's persistent compilation cache for train.py runs (ndjax.runtime.xla_cache): auto
    # ($JAX_COMPILATION_CACHE_DIR, else ~/.cache/ndjax/xla) | off | a directory
    compilation_cache: str = setting("auto")

    def check(self) -> None:
        from ndjax.runtime import xla_cache
        xla_cache.directory(self.compilation_cache, {})


# train.objective's values; all but sft learn from preference pairs.
OBJECTIVES = ("sft", "dpo", "ipo", "orpo", "simpo", "kto", "grpo")
PREFERENCE_OBJECTIVES = OBJECTIVES[1:-1]
# grpo.loss_type's values (TRL's names): how the per-token losses are averaged.
GRPO_LOSSES = ("dapo", "grpo", "bnpo", "dr_grpo")
# preference.reference's values: where DPO's and IPO's reference log-probabilities come from.
REFERENCES = ("auto", "adapters_off", "initial_adapters", "frozen_copy")


@dataclasses.dataclass(frozen=True)
class PreferenceSettings:
    """Preference objectives' settings (train.objective dpo, ipo, orpo, simpo), TRL's by
    their TRL meaning (DPOConfig, ORPOConfig, CPOConfig)."""

    # DPO's beta, IPO's tau, ORPO's lambda, SimPO's beta (TRL's beta; Axolotl's rl_beta).
    beta: float = setting(0.1, gt=0)
    # dpo: conservative DPO's share of flipped labels (the cDPO loss); simpo: the same
    # smoothing as TRL's CPOTrainer. TRL 1.16's sigmoid DPO ignores it (docs/post-training.md).
    label_smoothing: float = setting(0.0, ge=0, lt=0.5)
    # simpo: the target margin gamma (TRL's simpo_gamma), the logits shifted by gamma / beta.
    simpo_gamma: float = setting(0.5, ge=0)
    # simpo: the weight of the chosen completions' cross-entropy (TRL's cpo_alpha; its
    # default 1.0; the SimPO paper's 0).
    cpo_alpha: float = setting(1.0, ge=0)
    # kto: the weights of desirable and undesirable examples' losses (TRL's
    # desirable_weight, undesirable_weight).
    desirable_weight: float = setting(1.0, gt=0)
    undesirable_weight: float = setting(1.0, gt=0)
    # dpo, ipo, kto: the reference model. auto: adapters_off under fresh LoRA adapters,
    # initial_adapters under model.lora.init_from, frozen_copy without LoRA.
    # adapters_off: the policy's base with the adapters off (no copy); initial_adapters:
    # the adapters the run started from (a copy of the adapters only, as TRL's "ref"
    # adapter); frozen_copy: the starting weights, held beside the policy (one more copy
    # of the parameters, sharded like them).
    reference: str = setting("auto", choices=REFERENCES)
    # dpo, ipo: a Hugging Face directory whose model is the reference instead (TRL's
    # ref_model; the policy's architecture and dims), held beside the state like
    # frozen_copy. Full fine-tuning only.
    ref_model: str | None = setting(None)


@dataclasses.dataclass(frozen=True)
class GRPOSettings:
    """GRPO (train.objective=grpo): completions sampled by ndjax's own sampler on the
    training mesh, scored by reward functions, trained with the clipped ratio loss; TRL's
    GRPOConfig fields by their TRL meaning (docs/post-training.md)."""

    # Completions per prompt (a group); train.batch_size counts completions, so it must
    # be a multiple of this.
    num_generations: int = setting(8, ge=2, hint=" (completions per prompt, at least 2)")
    # New tokens per completion at most; train.seq_len holds the prompt and them.
    max_completion_length: int = setting(256, ge=1)
    temperature: float = setting(1.0, gt=0, hint=" (the sampler's and the log-probs')")
    top_p: float = setting(1.0, gt=0, le=1)
    top_k: int = setting(0, ge=0, hint=" (0: off)")
    # Comma-separated functions, package.module.function (Axolotl's and TRL's form):
    # fn(prompts, completions, completion_ids, **the records' columns) -> list of floats.
    reward_funcs: str = setting("")
    reward_weights: tuple = setting(())  # one per function; (): all 1
    # dapo (TRL's default): tokens of the whole batch | grpo: each completion's token
    # mean, averaged | bnpo: as dapo per batch | dr_grpo: / (completions x
    # max_completion_length)
    loss_type: str = setting("dapo", choices=GRPO_LOSSES)
    epsilon: float = setting(0.2, gt=0, lt=1, hint=" (the ratio's lower clip: 1 - epsilon)")
    # The upper clip, 1 + epsilon_high (DAPO's clip-higher); 0: epsilon.
    epsilon_high: float = setting(0.0, ge=0)
    # The KL term's weight (k3 estimator, against the reference model); 0: none, and no
    # reference is held.
    beta: float = setting(0.0, ge=0)
    # Advantages: rewards minus their group's mean, divided by the std of the group |
    # batch | none (Dr. GRPO).
    scale_rewards: str = setting("group", choices=("group", "batch", "none"))
    # A completion that hit max_completion_length without its end token: no loss.
    mask_truncated_completions: bool = setting(False)
    # Optimizer steps on each batch of rollouts (TRL's num_iterations, GRPO's mu): the
    # ratio is to the sampling policy's log-probabilities, kept from when it sampled.
    num_iterations: int = setting(1, ge=1)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    # Defaults are the CPU demo (tiny model, builtin corpus).
    steps: int = setting(100, ge=0)
    # Passes over the data; > 0 sets steps from the rows an epoch packs into (Axolotl's
    # num_epochs, counted after packing): steps = ceil(epochs x max(rows // batch_size, 1)).
    epochs: float = setting(0.0, ge=0, hint=" (passes over the data; 0: train.steps sets the "
                                            "length)")
    batch_size: int = setting(8, ge=1, hint=" (global batch, in rows of seq_len tokens)")
    seq_len: int = setting(64, ge=1)
    seed: int = setting(0, ge=0, lt=2**32)
    lr: float = setting(3e-3, ge=0)
    # After a linear warmup from 0: cosine (cosine decay to lr * min_lr_ratio) | linear
    # (linear decay to 0 at train.steps, transformers' get_linear_schedule_with_warmup)
    # | constant (flat)
    schedule: str = setting("cosine", choices=("cosine", "linear", "constant"))
    warmup_steps: int = setting(5, ge=0)
    # > 0: ceil(ratio x steps) warmup steps in place of warmup_steps, transformers' rule
    # (for a run whose length is counted in epochs).
    warmup_ratio: float = setting(0.0, ge=0, le=1, hint=" (a fraction of the steps; 0: "
                                                        "train.warmup_steps)")
    min_lr_ratio: float = setting(0.1, ge=0, le=1, hint=" (cosine decays to lr * min_lr_ratio)")
    weight_decay: float = setting(0.1, ge=0)
    b1: float = setting(0.9, ge=0, lt=1)
    b2: float = setting(0.95, ge=0, lt=1)
    eps: float = setting(1e-8, gt=0)
    clip_norm: float = setting(1.0, ge=0, hint=" (global-norm clipping; 0 disables)")
    # dtype AdamW's two moments are stored in (computed in float32).
    opt_state_dtype: str = setting("float32", choices=("float32", "bfloat16"))
    # A NaN/Inf loss or gradient norm: "stop" (exit non-zero, save nothing) or
    # "skip" (drop that update, count it in the metrics).
    on_nan: str = setting("stop", choices=("stop", "skip"))
    # Micro-batches per step: the batch runs as grad_accum slices of batch_size /
    # grad_accum rows in one jitted step, gradients summed (activation memory of
    # one slice; the update is the same as one big batch's).
    grad_accum: int = setting(1, ge=1, hint=" (micro-batches per step)")
    # Under mesh.stage > 1: the pipeline's micro-batches per grad_accum slice (0: as many
    # as stages). GPipe idles (stage-1)/(microbatches+stage-1) of the time: more shrink it.
    microbatches: int = setting(0, ge=0, hint=" (pipeline micro-batches; 0: mesh.stage)")
    # Sequence positions per chunk of the LM head + cross-entropy: the logits of
    # one chunk exist at a time, never the whole batch's (b x seq x vocab).
    loss_chunk: int = setting(1024, ge=1, hint=" (sequence positions per chunk of the LM "
                                               "head and loss)")
    eval_every: int = setting(0, ge=0, hint=" (loss on the validation split every N steps; "
                                            "0 = never)")
    eval_steps: int = setting(4, ge=1, hint=" (batches per evaluation)")
    # With train.epochs: evaluations an epoch, which set eval_every (Axolotl's
    # evals_per_epoch); 0: eval_every as given.
    evals_per_epoch: int = setting(0, ge=0)
    # The loss minimised (ndjax.step.objectives, docs/post-training.md): sft (next-token
    # cross-entropy) | dpo | ipo | orpo | simpo (preference pairs: data.format=preference)
    # | kto (desirable and undesirable examples: data.format=unpaired_preference);
    # settings in the preference section | grpo (prompts, completions sampled and
    # rewarded: data.format=prompt, the grpo section).
    objective: str = setting("sft", choices=OBJECTIVES)

    def in_steps(self, rows_per_epoch: int) -> TrainSettings:
        """This section with its epoch-based fields turned into steps, for an epoch of
        ``rows_per_epoch`` rows (the data's, after packing); as it is without epochs."""
        if not self.epochs:
            return self
        per_epoch = max(rows_per_epoch // self.batch_size, 1)
        steps = math.ceil(self.epochs * per_epoch)
        changes: dict[str, Any] = {"steps": steps}
        if self.evals_per_epoch:
            changes["eval_every"] = max(per_epoch // self.evals_per_epoch, 1)
        return dataclasses.replace(self, **changes)


# data.source's values. The pipeline (ndjax/data/) reads them from here: it is handed
# this section, and the config sits below it.
SOURCES = ("builtin", "synthetic", "text", "jsonl", "parquet", "tokens", "chat")
FILE_SOURCES = ("text", "jsonl", "parquet", "tokens", "chat")  # those that read data.files
# data.format's values: how a chat record becomes tokens and a mask (Axolotl's dataset
# types; ndjax.data.prompt_formats for all but chat).
FORMATS = ("chat", "alpaca", "completion", "input_output", "preference",
           "unpaired_preference", "prompt")
# The roles of chat messages, and which end-of-turn tokens chat data learns
# (data.roles_to_train, data.train_on_eos: Axolotl's settings of those names).
CHAT_ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON_EOS = ("turn", "all", "last", "none")


@dataclasses.dataclass(frozen=True)
class DataSettings:
    # Where batches come from (see ndjax/data/ and docs/data.md).
    # builtin: this Python's standard library source | synthetic: a seeded Markov
    # chain | text | jsonl | parquet: local files | tokens: pre-tokenized files |
    # chat: conversations (JSON Lines or Parquet)
    source: str = setting("builtin", choices=SOURCES)
    files: str = setting("", hint=" (comma-separated paths or globs)")
    eval_files: str = setting("")  # the validation split of those sources, same format
    # Or a seeded share of data.files' documents held out as the validation split
    # (Axolotl's val_set_size); 0: none.
    eval_fraction: float = setting(0.0, ge=0, lt=1, hint=" (the share of data.files held "
                                                         "out for evaluation; 0: none)")
    text_field: str = setting("text")  # JSON Lines key / Parquet column holding the text
    # chat: JSON Lines / Parquet conversations, rendered with the tokenizer's chat
    # template; only the assistant's tokens are learned (docs/fine-tuning.md).
    messages_field: str = setting("messages")      # a list of {role, content}
    prompt_field: str = setting("prompt")          # or a prompt (user) ...
    completion_field: str = setting("completion")  # ... and completion (assistant) pair
    # data.format=preference: the preferred and the dispreferred completion (strings, or
    # lists of messages; without a prompt field, whole conversations whose common
    # beginning is the prompt, as TRL's implicit prompt).
    chosen_field: str = setting("chosen")
    rejected_field: str = setting("rejected")
    # data.format=unpaired_preference (KTO's): a prompt, a completion (data.completion_field)
    # and whether it is desirable, a boolean (TRL's label).
    label_field: str = setting("label")
    # Each message's role and content keys (Axolotl's message_property_mappings:
    # ShareGPT's from / value); other keys than these read roles human and gpt as user
    # and assistant, as Axolotl does.
    role_field: str = setting("role")
    content_field: str = setting("content")
    # How a record becomes tokens (Axolotl's dataset type): chat (the above, rendered
    # with the chat template) | alpaca (instruction, input, output) | completion (one
    # text field, every token learned) | input_output (segments of text and label) |
    # preference (prompt, chosen and rejected: TRL's preference records; for the
    # preference objectives, train.objective) | unpaired_preference (prompt, completion
    # and label: TRL's unpaired preference records, for kto) | prompt (prompts and the
    # columns reward functions read, for grpo)
    format: str = setting("chat", choices=FORMATS)
    # a template ndjax ships by name (chatml, llama3, qwen3, gemma3), a Jinja template
    # file, or "" = the tokenizer's own
    chat_template: str = setting("")
    # The roles whose turns are learned, comma-separated (Axolotl's roles_to_train):
    # system, user, assistant, tool.
    roles_to_train: str = setting("assistant")
    # Which turns' end-of-turn tokens are learned (Axolotl's train_on_eos): turn (those of
    # the learned turns) | all (every turn's) | last (the last learned turn's) | none
    train_on_eos: str = setting("turn", choices=TRAIN_ON_EOS,
                                hint=" (turn: the learned turns' end-of-turn tokens, all: "
                                     "every turn's, last: the last learned turn's, none)")
    # a conversation longer than seq_len + 1 tokens: drop | truncate
    overlong: str = setting("drop", choices=("drop", "truncate"),
                            hint=" (drop leaves out a conversation longer than train.seq_len "
                                 "+ 1 tokens, truncate keeps its beginning)")
    # byte (256 bytes + EOS/BOS/PAD) or a tokenizer.json path
    tokenizer: str = setting("byte")
    # a tokenizer.json's end-of-document token; "" = its tokenizer_config.json's, else a guess
    eos_token: str = setting("")
    # a tokenizer.json's BOS and padding tokens (exports name them); "" = the files' own
    bos_token: str = setting("")
    pad_token: str = setting("")
    # Tokens added to a tokenizer.json (Axolotl's tokens and special_tokens): new ids
    # after its own, the model's embedding and LM head grown to hold them (new rows
    # start at the mean of the old ones and are trained; under LoRA, with
    # model.lora.modules_to_save).
    added_tokens: tuple = setting(())
    added_special_tokens: tuple = setting(())  # never split, and skipped when decoding
    # raw token files: uint16 | uint32; auto = from the sidecar
    token_dtype: str = setting("auto", choices=("auto", "uint16", "uint32"))
    packing: bool = setting(True)  # pack documents into full rows; False: one piece per row
    # batches a loader thread prepares ahead; 0 = no thread
    prefetch: int = setting(2, ge=0, hint=" (0: no thread)")

    @property
    def trained_roles(self) -> tuple[str, ...]:
        """data.roles_to_train as a tuple of roles."""
        return tuple(r.strip() for r in self.roles_to_train.split(","))

    def check(self) -> None:
        bad = [r for r in self.trained_roles if r not in CHAT_ROLES]
        if bad:
            raise ConfigError(f"data.roles_to_train={self.roles_to_train!r}: "
                              f"{', '.join(map(repr, bad))} is not a role; list one or more "
                              f"of {', '.join(CHAT_ROLES)}, comma-separated, e.g. "
                              "'assistant' or 'user,assistant'.")


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    every: int = setting(0, ge=0, hint=" (save every N steps; 0: only at the end and on "
                                       "SIGTERM)")
    # With train.epochs: saves an epoch, which set every (Axolotl's saves_per_epoch).
    saves_per_epoch: int = setting(0, ge=0)
    keep: int = setting(3, ge=0, hint=" (newest checkpoints kept; 0: all)")
    # write files in the background while training goes on (was ``async``, a Python
    # keyword that a --config override cannot name)
    async_save: bool = setting(True)
    # auto (newest complete one) | never | a step number
    resume: str = setting("auto")
    # resume=auto and the newest checkpoint does not read (a file cut short by a host
    # crash or a bad disk): fallback = move it to <step>.unreadable and resume from the
    # newest that reads; stop = a one-line error naming it
    on_unreadable: str = setting("fallback", choices=("fallback", "stop"))

    def check(self) -> None:
        if self.resume not in ("auto", "never") and not self.resume.isdigit():
            raise ConfigError(f"checkpoint.resume={self.resume!r}: use 'auto', 'never' or a "
                              "step number.")


# log.wandb_mode's values: wandb.init's mode ('': W&B's default).
WANDB_MODES = ("", "online", "offline", "disabled")
WANDB_RESERVED = ":;,#?/'"  # characters W&B refuses in a run id


@dataclasses.dataclass(frozen=True)
class LogSettings:
    every: int = setting(1, ge=1)
    tensorboard: bool = setting(True)  # event files under <workdir>/tb/
    # per device; default from the device kind
    peak_tflops: float | None = setting(None, gt=0)
    # (first, last): jax.profiler trace into <workdir>/profile/
    profile_steps: tuple = setting(())
    # Every N steps (0: never), the greedy completion of sample_prompt (tokenized as
    # the training data) in sample_tokens new tokens, printed and appended to
    # <workdir>/samples.jsonl: what fine-tuning users watch besides the loss.
    sample_every: int = setting(0, ge=0)
    sample_prompt: str = setting("")
    sample_tokens: int = setting(32, ge=1)
    # Weights & Biases (ndjax.training.trackers; pip install wandb), from process 0: the
    # settings as the run's config, every metrics record at its step. Off while
    # wandb_project is ''. wandb_mode '': W&B's own ($WANDB_MODE, else online);
    # wandb_run_id '': a new run, which a resume from the workdir's checkpoint continues.
    wandb_project: str = setting("")
    wandb_entity: str = setting("")
    wandb_name: str = setting("")
    wandb_mode: str = setting("", choices=WANDB_MODES, hint=" ('': W&B's default, "
                                                            "$WANDB_MODE or online)")
    wandb_run_id: str = setting("")
    # MLflow (pip install mlflow-skinny), the same records: off while mlflow_tracking_uri is
    # ''; a server (http://host:5000) or a local directory (a path or file: URI, offline).
    # mlflow_experiment '': MLflow's default experiment; mlflow_run_name '': MLflow's name.
    mlflow_tracking_uri: str = setting("")
    mlflow_experiment: str = setting("")
    mlflow_run_name: str = setting("")

    def check(self) -> None:
        run_id = self.wandb_run_id
        if run_id and (run_id != run_id.strip() or any(c in WANDB_RESERVED for c in run_id)):
            raise ConfigError(f"log.wandb_run_id={run_id!r}: a W&B run id has no spaces at "
                              f"either end and none of {WANDB_RESERVED!r}; e.g. "
                              "--config.log.wandb_run_id=llama-sft-1.")
        p = self.profile_steps
        if p and not (len(p) == 2 and all(isinstance(s, int) and not isinstance(s, bool)
                                           for s in p) and 1 <= p[0] <= p[1]):
            raise ConfigError(
                f"log.profile_steps={p!r} must be empty or (first, last) with "
                "1 <= first <= last, e.g. --config.log.profile_steps='(5, 7)'.")
        if self.sample_every and not self.sample_prompt:
            raise ConfigError(f"log.sample_every={self.sample_every} needs log.sample_prompt, "
                              "the text to complete, e.g. --config.log.sample_prompt='def '.")


@dataclasses.dataclass(frozen=True)
class DebugSettings:
    nan_at_step: int = setting(-1)  # poison the loss at this step (tests of train.on_nan)


# export.dtype's values -> the safetensors dtype code ndjax.runs.hf writes them as.
EXPORT_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# export.max_shard_size's default: Hugging Face's own before transformers 5 (which
# went to 50GB); a file's tensors are all on the host while it is written.
SHARD_BYTES = 5 * 10**9
_SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_size(value: Any) -> int:
    """``export.max_shard_size`` in bytes: an int, or a string like "5GB", "500MB", "2GiB"."""
    size = value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)?\s*", value, re.IGNORECASE)
        size = int(float(m[1]) * _SIZE_UNITS[(m[2] or "B").upper()]) if m else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"export.max_shard_size={value!r}: write a positive number of bytes "
                          "or a size like '5GB' or '500MB'.")
    return size


@dataclasses.dataclass(frozen=True)
class ExportSettings:
    # At the end of training, write a directory that transformers loads
    # (AutoModelForCausalLM.from_pretrained); None: no export.
    hf_dir: str | None = setting(None)
    # Under model.lora: at the end of training, the adapters alone in PEFT's format
    # (adapter_model.safetensors + adapter_config.json; peft loads them onto the base
    # model.init_from names); hf_dir, if set too, gets the base with the adapters merged.
    adapter_dir: str | None = setting(None)
    # of the exported weights
    dtype: str = setting("bfloat16", choices=tuple(EXPORT_DTYPES))
    # Largest weight file, bytes (int) or "5GB" / "500MB" / "2GiB"; bigger models are split
    # into files with an index, as transformers does. The host holds one file while writing.
    max_shard_size: Any = setting("5GB")

    def check(self) -> None:
        shard_size(self.max_shard_size)


SECTIONS: dict[str, type] = {
    "model": ModelSettings, "mesh": MeshSettings, "runtime": RuntimeSettings,
    "train": TrainSettings, "preference": PreferenceSettings, "grpo": GRPOSettings,
    "data": DataSettings,
    "checkpoint": CheckpointSettings,
    "log": LogSettings, "debug": DebugSettings, "export": ExportSettings,
}
# Keys that were renamed: old saved configs and config files still read.
RENAMED = {("checkpoint", "async"): "async_save"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """The whole experiment, typed and checked. ``rules`` is a preset name from
    ndjax.parallel.rules.PRESETS or a full table of (logical_name, mesh_axes) pairs, checked
    against the mesh by ndjax.parallel.rules.Rules."""

    model: ModelSettings
    mesh: MeshSettings
    runtime: RuntimeSettings
    train: TrainSettings
    preference: PreferenceSettings
    grpo: GRPOSettings
    data: DataSettings
    checkpoint: CheckpointSettings
    log: LogSettings
    debug: DebugSettings
    export: ExportSettings
    rules: Any = "default"

    @classmethod
    def parse(cls, config: Mapping[str, Any]) -> Settings:
        """Checks every key and value of ``config`` (a ConfigDict or plain dicts);
        the first problem is a ConfigError."""
        known = [*SECTIONS, "rules"]
        for key in config.keys():
            if key not in known:
                _unknown(key, "", known)
        sections = {}
        for name, section in SECTIONS.items():
            values = config[name] if name in config else {}
            if not isinstance(values, Mapping | ml_collections.ConfigDict):
                raise ConfigError(f"config key {name!r} must be a group of fields, got "
                                  f"{values!r}.")
            sections[name] = _parse_section(name, section, values)
        return cls(**sections, rules=config["rules"] if "rules" in config else "default")

    def in_steps(self, rows_per_epoch: int) -> Settings:
        """The settings with train.epochs (and what is counted per epoch) turned into
        steps, for an epoch of ``rows_per_epoch`` rows: ``TrainSettings.in_steps``, and
        checkpoint.every from checkpoint.saves_per_epoch."""
        t = self.train
        if not t.epochs:
            return self
        c = self.checkpoint
        if c.saves_per_epoch:
            per_epoch = max(rows_per_epoch // t.batch_size, 1)
            c = dataclasses.replace(c, every=max(per_epoch // c.saves_per_epoch, 1))
        return dataclasses.replace(self, train=t.in_steps(rows_per_epoch), checkpoint=c)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for config.json (a table of rules as lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self), default=list))


@functools.cache
def _hints(section: type) -> dict[str, Any]:
    return typing.get_type_hints(section)


def _unknown(key: str, prefix: str, known: Sequence[str]) -> typing.NoReturn:
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f" Did you mean {prefix}{close[0]}?" if close else ""
    raise ConfigError(f"unknown config key {prefix + key!r}.{hint} Known keys here: "
                      f"{', '.join(prefix + k for k in sorted(known))}.")


def _parse_section(name: str, section: type, values: Mapping[str, Any]) -> Any:
    fields = {f.name: f for f in dataclasses.fields(section)}
    kwargs = {}
    for key in values.keys():
        field = RENAMED.get((name, key), key)
        if field not in fields:
            _unknown(key, f"{name}.", list(fields))
        kwargs[field] = _parse_value(f"{name}.{key}", values[key], _hints(section)[field],
                                     fields[field].metadata.get("spec", Spec()))
    parsed = section(**kwargs)
    if hasattr(parsed, "check"):
        parsed.check()
    return parsed


def _kind(tp: Any) -> tuple[Any, bool]:
    """(the field's type without None, whether None is allowed)."""
    args = typing.get_args(tp)
    if type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _parse_value(name: str, value: Any, tp: Any, spec: Spec) -> Any:
    tp, optional = _kind(tp)
    if isinstance(value, ml_collections.ConfigDict):
        value = value.to_dict()
    if dataclasses.is_dataclass(tp):  # a group inside a section (model.lora)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{name}={value!r} must be a group of fields, e.g. "
                              f"--config.{name}.{dataclasses.fields(tp)[0].name}=...")
        return _parse_section(name, tp, value)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{name}=None must be {_describe(tp, spec)}{spec.hint}; set it.")
    ok = {
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool)
        and math.isfinite(v),
        bool: lambda v: isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        tuple: lambda v: isinstance(v, tuple | list),
        dict: lambda v: isinstance(v, Mapping),
    }.get(tp, lambda v: True)
    if not ok(value) or not _in_range(value, spec):
        raise ConfigError(f"{name}={value!r} must be {_describe(tp, spec)}{spec.hint}.")
    if tp is float:
        value = float(value)
    elif tp is tuple:
        value = tuple(value)
    elif tp is dict:
        value = dict(value)
    choices = spec.choices() if callable(spec.choices) else spec.choices
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={value!r}: choose one of {tuple(choices)}{spec.hint}.")
    return value


def _in_range(value: Any, spec: Spec) -> bool:
    return ((spec.ge is None or value >= spec.ge) and (spec.gt is None or value > spec.gt)
            and (spec.le is None or value <= spec.le) and (spec.lt is None or value < spec.lt))


def _describe(tp: Any, spec: Spec) -> str:
    what = {int: "an int", float: "a number", bool: "True or False", str: "a string",
            tuple: "a tuple", dict: "a dict"}.get(tp, "a value")
    bounds = [f"{op} {_num(v)}" for op, v in
              ((">=", spec.ge), (">", spec.gt), ("<=", spec.le), ("<", spec.lt)) if v is not None]
    return " ".join([what, " and ".join(bounds)]).strip()


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e15 else repr(v)


def _default_group(section: type) -> ml_collections.ConfigDict:
    group = ml_collections.ConfigDict()
    for f in dataclasses.fields(section):
        tp, optional = _kind(_hints(section)[f.name])
        if dataclasses.is_dataclass(tp):
            group[f.name] = _default_group(tp)
        elif tp in (dict, Any, typing.Any):
            group[f.name] = config_dict.FieldReference(f.default, field_type=object)
        elif optional and f.default is None:
            group[f.name] = config_dict.placeholder(tp)
        else:
            group[f.name] = f.default
    return group


def default_config() -> ml_collections.ConfigDict:
    """The defaults as the ConfigDict that config files start from: built from the
    sections above, so the defaults and their types live in one place. A field that
    may be None is a typed placeholder, so ``--config.model.dim=512`` parses as int."""
    c = ml_collections.ConfigDict()
    for name, section in SECTIONS.items():
        c[name] = _default_group(section)
    c.rules = config_dict.FieldReference("default", field_type=object)
    return c


def as_settings(config: Settings | Mapping[str, Any]) -> Settings:
    """``config`` typed and checked (already typed: as it is)."""
    return config if isinstance(config, Settings) else Settings.parse(config)


def check_keys(config: Mapping[str, Any]) -> None:
    """Raises ConfigError for any key that the defaults do not have (and any bad value)."""
    Settings.parse(config)


def _paths(prefix: str, section: type) -> list[str]:
    out = []
    for f in dataclasses.fields(section):
        tp, _ = _kind(_hints(section)[f.name])
        out += (_paths(f"{prefix}{f.name}.", tp) if dataclasses.is_dataclass(tp)
                else [prefix + f.name])
    return out


def field_paths() -> list[str]:
    """Every field as ``section.name`` (``section.group.name`` inside a group): what a
    test sets from the command line."""
    return [p for name, section in SECTIONS.items() for p in _paths(f"{name}.", section)] + [
        "rules"]


def run_config(workdir: str) -> ml_collections.ConfigDict:
    """The config a train.py run saved in its workdir (see ndjax.runs.workdir)."""
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--workdir={workdir!r} has no config.json: point it at the --workdir "
                          "of a train.py run.")
    with open(path) as f:
        saved = json.load(f)
    return over_defaults(saved)


def over_defaults(saved: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """A saved config over the defaults: a run saved before a field existed gets that
    field's default, which is what it ran with; renamed keys take their new names."""
    config = default_config()
    for name, values in saved.items():
        if isinstance(values, Mapping) and name in SECTIONS:
            for key, value in values.items():
                key = RENAMED.get((name, key), key)
                if key not in config[name]:
                    continue
                if isinstance(config[name][key], ml_collections.ConfigDict) and isinstance(
                        value, Mapping):  # a group (model.lora): its known fields
                    for k, v in value.items():
                        if k in config[name][key]:
                            config[name][key][k] = v
                else:
                    config[name][key] = value
        else:
            config[name] = values
    return config
