"""Model families by name (``model.family``) and by Hugging Face ``model_type``.

A family is one module under ``ndjax/models/`` that registers a ``Family``: its
presets, the decoder options it fixes and those a config may change, how it reads
and writes a Hugging Face ``config.json``, its parameter names there, its FLOPs
per token and its KV-cache decode. The rest of ndjax asks this registry and never
names a family; adding one is a module here and its name in ``FAMILY_MODULES``.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from collections.abc import Callable, Mapping
from typing import Any

from ndjax.models import decoder
from ndjax.models.decoder import DecoderConfig
from ndjax.runtime.errors import ConfigError

# The modules that register the families (imported on first use).
FAMILY_MODULES = ("llama", "mistral", "qwen", "gemma", "mixtral", "qwen3_moe", "qwen2_moe",
                  "gpt_oss", "deepseek_v3")

# The mixture-of-experts fields (ndjax.models.moe); 0 / False on a dense family.
MOE_FIELDS = ("n_experts", "experts_per_token", "moe_ffn_dim", "norm_topk_prob",
              "router_aux_loss_coef", "shared_expert_dim")

# Of those, what is a choice of training rather than of the model: a config sets it over
# model.init_from's config.json (ndjax.runs.hf.override_dims).
TRAINING_FIELDS = ("router_aux_loss_coef", "score_bias_rate")

# DecoderConfig fields beyond the dims that some families have, as config fields
# (ndjax.config.ModelSettings): set on a family that lacks them, they are refused.
OPTION_FIELDS = ("qkv_bias", "qk_norm", "sliding_window", "sliding_window_pattern",
                 "query_pre_attn_scalar", "local_rope_theta", *MOE_FIELDS,
                 # GPT-OSS's experts
                 "swiglu_limit", "swiglu_alpha",
                 # DeepSeek V3's latent attention and routing
                 "q_lora_rank", "kv_lora_rank", "rope_head_dim", "v_head_dim", "rope_interleave",
                 "first_k_dense", "n_group", "topk_group", "routed_scaling_factor",
                 "score_bias_rate")
_WHAT = {"qkv_bias": "q/k/v biases", "qk_norm": "q/k norms", "sliding_window": "sliding window",
         "sliding_window_pattern": "pattern of local and global layers",
         "query_pre_attn_scalar": "query scalar", "local_rope_theta": "local rotary base",
         **{f: "experts (it is dense)" for f in MOE_FIELDS},
         "moe_ffn_dim": "expert width of its own (its experts are ffn_dim wide)",
         "norm_topk_prob": "choice of renormalising the top-k weights",
         "shared_expert_dim": "shared expert",
         "score_bias_rate": "load-balancing bias (DeepSeek V3's)",
         "swiglu_limit": "clamped SwiGLU (GPT-OSS's)", "swiglu_alpha": "clamped SwiGLU (GPT-OSS's)",
         **{f: "latent attention (DeepSeek V3's)" for f in (
             "q_lora_rank", "kv_lora_rank", "rope_head_dim", "v_head_dim", "rope_interleave")},
         "first_k_dense": "dense first layers (DeepSeek V3's)",
         **{f: "group-limited routing (DeepSeek V3's)" for f in (
             "n_group", "topk_group", "routed_scaling_factor")}}

# ndjax layer paths of the norms -> Hugging Face names, without ".weight".
STANDARD_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
FLAT = "flat"  # an HF tensor that is the ndjax parameter flattened (biases)
# The ndjax parameter is the even (EVEN) or odd (ODD) columns of the HF tensor's last
# axis, which interleaves two parameters (GPT-OSS's experts' gate_up_proj: gate, up).
EVEN, ODD = "even", "odd"
INTERLEAVED = (EVEN, ODD)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    description: str                 # a few words for tables and errors
    model_types: tuple[str, ...]     # Hugging Face model_type values it reads
    architecture: str                # the class its exports name
    presets: Mapping[str, Mapping[str, Any]]  # every family has a "tiny" one for tests
    read_hf: Callable[[dict, str], dict]  # (config.json, where) -> DecoderConfig fields
    write_hf: Callable[[DecoderConfig], dict]  # -> the family's own config.json fields
    # config.json key -> the value transformers' config class gives it when absent, for
    # every key read_hf reads but hf_config.REQUIRED (tests/test_families.py checks them).
    hf_defaults: Mapping[str, Any]
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    options: tuple[str, ...] = ()    # OPTION_FIELDS a config may change
    norm_names: Mapping[str, str] = dataclasses.field(default_factory=lambda: STANDARD_NORMS)
    # MoE families: ndjax MLP parameter (a name, or a path under the MLP) -> its Hugging
    # Face name, "{expert}" standing for each expert's index where the checkpoint holds
    # one tensor per expert (the ndjax parameter's leading axis), and the split as in
    # ``hf_names``. None: a dense MLP.
    moe_names: Mapping[str | tuple[str, ...], tuple[str, Any]] | None = None

    def read_config_json(self, c: dict, where: str) -> dict:
        """The DecoderConfig fields of config.json ``c`` (``where``: its directory, for
        errors), absent keys read as hf_defaults."""
        return {**self.fixed, **self.read_hf({**self.hf_defaults, **c}, where),
                "family": self.name}

    def flops_per_token(self, cfg: DecoderConfig, seq_len: int) -> float:
        return decoder.train_flops_per_token(cfg, seq_len)

    @property
    def decode(self) -> types.ModuleType:
        """The KV-cache decode (``init_cache``, ``forward``)."""
        from ndjax.models import decode
        return decode

    def hf_names(self, cfg: DecoderConfig, moe: bool | None = None) -> tuple[dict, dict]:
        """(top-level, per-layer) maps: ndjax parameter path -> (Hugging Face name,
        split). ``split`` None: the same layout; FLAT: the HF tensor is the parameter
        flattened; EVEN / ODD: the parameter is those columns of the HF tensor's last
        axis (another parameter the others); an int: the HF weight is a Linear's (out,
        in) matrix and the ndjax parameter its transpose with in = shape[:split], out =
        shape[split:]. A name with
        "{expert}" is one tensor per expert: the parameter's leading axis, each slice
        with that split (``expert_names``). ``moe``: the per-layer map of a stack whose
        MLP is (True) or is not (False) a mixture of experts; None: the model's
        (``decoder.stacks``: DeepSeek V3's first layers are dense)."""
        top = {("embed",): ("model.embed_tokens.weight", None),
               ("final_norm", "scale"): ("model.norm.weight", None)}
        if not cfg.tie_embeddings:
            top[("lm_head",)] = ("lm_head.weight", 1)
        layer = ({("attn", "wq"): ("self_attn.q_proj.weight", 1),
                  ("attn", "wk"): ("self_attn.k_proj.weight", 1),
                  ("attn", "wv"): ("self_attn.v_proj.weight", 1),
                  ("attn", "wo"): ("self_attn.o_proj.weight", 2)}
                 if not cfg.kv_lora_rank else mla_names(cfg))
        if bool(cfg.n_experts) if moe is None else moe:
            layer.update({("mlp", *((p,) if isinstance(p, str) else p)): entry
                          for p, entry in (self.moe_names or {}).items()})
        else:
            layer.update({("mlp", "w_gate"): ("mlp.gate_proj.weight", 1),
                          ("mlp", "w_up"): ("mlp.up_proj.weight", 1),
                          ("mlp", "w_down"): ("mlp.down_proj.weight", 1)})
        for path, name in self.norm_names.items():
            if cfg.post_norms or not path.startswith("post_"):
                layer[(path, "scale")] = (f"{name}.weight", None)
        if cfg.qkv_bias and not cfg.kv_lora_rank:
            layer.update({("attn", f"b{x}"): (f"self_attn.{x}_proj.bias", FLAT) for x in "qkv"})
        if cfg.o_bias:
            layer[("attn", "bo")] = ("self_attn.o_proj.bias", None)
        if cfg.attn_sinks:
            layer[("attn", "sinks")] = ("self_attn.sinks", None)
        if cfg.qk_norm:
            layer.update({("attn", f"{x}_norm", "scale"): (f"self_attn.{x}_norm.weight", None)
                          for x in "qk"})
        return top, layer

    def hf_config(self, cfg: DecoderConfig) -> dict:
        return dict(self.write_hf(cfg), architectures=[self.architecture],
                    model_type=self.model_types[0])


def mla_names(cfg: DecoderConfig) -> dict:
    """``hf_names`` of multi-head latent attention (``ndjax.models.mla``), transformers'
    DeepseekV3Attention: each HF matrix is the parameter transposed. kv_b_proj's rows
    are per head [the no-rope key dims, the value's] and kv_a_proj_with_mqa's [the
    latent, the rotary key], as wkv_b's and wkv_a's last axes hold them. ``qkv_bias``
    (transformers' attention_bias, with ``o_bias``): the biases of q_a_proj (where there
    is a query latent) and kv_a_proj_with_mqa."""
    attn = "self_attn."
    if cfg.q_lora_rank:
        names = {("attn", "wq_a"): (attn + "q_a_proj.weight", 1),
                 ("attn", "q_a_norm", "scale"): (attn + "q_a_layernorm.weight", None),
                 ("attn", "wq_b"): (attn + "q_b_proj.weight", 1)}
    else:
        names = {("attn", "wq"): (attn + "q_proj.weight", 1)}
    names.update({("attn", "wkv_a"): (attn + "kv_a_proj_with_mqa.weight", 1),
                  ("attn", "kv_a_norm", "scale"): (attn + "kv_a_layernorm.weight", None),
                  ("attn", "wkv_b"): (attn + "kv_b_proj.weight", 1),
                  ("attn", "wo"): (attn + "o_proj.weight", 2)})
    if cfg.qkv_bias:
        if cfg.q_lora_rank:
            names[("attn", "bq_a")] = (attn + "q_a_proj.bias", None)
        names[("attn", "bkv_a")] = (attn + "kv_a_proj_with_mqa.bias", None)
    return names


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """Every family, by name, in FAMILY_MODULES' order."""
    for module in FAMILY_MODULES:
        importlib.import_module(f"ndjax.models.{module}")
    return dict(_FAMILIES)


def get(name: str) -> Family:
    known = families()
    if name not in known:
        raise ConfigError(f"model.family={name!r}: choose one of {sorted(known)}.")
    return known[name]


def of(cfg: DecoderConfig) -> Family:
    return get(cfg.family)


def for_config_json(c: dict, where: str) -> Family:
    """The family of a Hugging Face config.json, by its model_type."""
    model_type = c.get("model_type")
    for family in families().values():
        if model_type in family.model_types:
            return family
    supported = sorted(t for f in families().values() for t in f.model_types)
    raise ConfigError(
        f"model.init_from={where!r}: config.json has model_type={model_type!r} "
        f"(architectures {c.get('architectures')}), which ndjax does not implement; it "
        f"reads the model_types {supported}.")


def preset_dims(family: Family, preset: str) -> dict:
    if preset not in family.presets:
        raise ConfigError(f"model.preset={preset!r}: choose one of {sorted(family.presets)} "
                          f"(the presets of model.family={family.name!r}).")
    return {**family.fixed, **family.presets[preset], "family": family.name}


EXPERT = "{expert}"


def expert_names(name: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The Hugging Face tensors of one layer's parameter named ``name`` (``hf_names``):
    [(name, None)] for one tensor, else [(each expert's name, its index along the
    leading axis)]."""
    if EXPERT not in name:
        return [(name, None)]
    return [(name.replace(EXPERT, str(e)), e) for e in range(shape[0])]


def check_moe(dims: Mapping[str, Any]) -> None:
    """Refuses mixture-of-experts fields that do not make a model, in one line."""
    n, k = dims.get("n_experts", 0), dims.get("experts_per_token", 0)
    family = dims.get("family")
    if not n:
        if family is not None and get(family).moe_names is not None:
            raise ConfigError(f"model.n_experts={n}: model.family={family!r} is a mixture of "
                              "experts; set model.n_experts >= 1, or use a dense family.")
        return
    if n < 1:
        raise ConfigError(f"model.n_experts={n} must be >= 1 (model.family={family!r}).")
    if not 1 <= k <= n:
        raise ConfigError(f"model.experts_per_token={k}: each token runs through between 1 "
                          f"and model.n_experts={n} experts; pick one in that range.")
    if dims.get("moe_ffn_dim", 0) < 0:
        raise ConfigError(f"model.moe_ffn_dim={dims['moe_ffn_dim']} must be >= 1.")
    if dims.get("router_aux_loss_coef", 0.0) < 0:
        raise ConfigError(f"model.router_aux_loss_coef={dims['router_aux_loss_coef']} must "
                          "be >= 0.")


def check_options(family: Family, values: Mapping[str, Any]) -> None:
    """Refuses an OPTION_FIELDS value the family cannot have (None: unset)."""
    defaults = {f.name: f.default for f in dataclasses.fields(DecoderConfig)}
    for field, value in values.items():
        if value is None or field in family.options:
            continue
        if family.fixed.get(field, defaults[field]) in (value, None if value == 0 else value):
            continue  # what the family has anyway
        having = sorted(f.name for f in families().values()
                        if field in f.options or f.fixed.get(field))
        raise ConfigError(
            f"model.{field}={value!r}: model.family={family.name!r} has no {_WHAT[field]} to "
            f"change (it always has {field}={family.fixed.get(field, defaults[field])!r}). "
            f"Unset it, or use a family that has one: {having}.")


def config_from_preset(family: str, preset: str, **overrides: Any) -> DecoderConfig:
    """The DecoderConfig of a preset (tests, benchmarks, the planner's references)."""
    return DecoderConfig(**{**preset_dims(get(family), preset), **overrides})
