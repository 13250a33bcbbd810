"""GPT-OSS (``model_type`` gpt_oss): Llama's pre-norm block with biases on q, k, v and o,
a learned sink logit per head in each row's softmax (``AttentionSpec.sinks``), layers
alternating between a 128-token sliding window and full attention, YaRN rotary
scaling, and a mixture of experts in every layer: a router with a bias whose top-k
logits are softmaxed (``norm_topk_prob``), experts with biases on their three
projections and a clamped SwiGLU (``moe.gated``). The Hub's files hold the experts'
gate and up interleaved in one tensor (``registry.EVEN`` / ``ODD``), in bfloat16 or
MXFP4 (``ndjax.models.mxfp4``, dequantized as they are read)."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.layers import RopeScaling
from ndjax.models.registry import EVEN, ODD, Family, register

# GptOssConfig's rotary scaling (the released models').
_YARN = RopeScaling(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                    truncate=False, original_max_position_embeddings=4096)
_GPT_OSS = dict(rope_theta=150_000.0, rope_scaling=_YARN, rms_norm_eps=1e-5, head_dim=64,
                sliding_window=128, sliding_window_pattern=2, router_aux_loss_coef=0.0)

PRESETS = {
    # Every feature on: 4 layers (two windowed, two full), a window shorter than a row.
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2,
                 ffn_dim=256, n_experts=8, experts_per_token=2,
                 **{**_GPT_OSS, "sliding_window": 16}),
    # Dimensions of the public gpt-oss-20b and gpt-oss-120b.
    "gpt_oss_20b": dict(vocab_size=201_088, dim=2880, n_layers=24, n_heads=64, n_kv_heads=8,
                        ffn_dim=2880, n_experts=32, experts_per_token=4, **_GPT_OSS),
    "gpt_oss_120b": dict(vocab_size=201_088, dim=2880, n_layers=36, n_heads=64, n_kv_heads=8,
                         ffn_dim=2880, n_experts=128, experts_per_token=4, **_GPT_OSS),
}

# GptOssConfig's values for absent keys (its defaults are the 120b's dims).
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=8, head_dim=64,
                   max_position_embeddings=131_072, rms_norm_eps=1e-5, rope_theta=150_000.0,
                   rope_parameters=None, sliding_window=128, layer_types=None,
                   num_local_experts=128, num_experts_per_tok=4, swiglu_limit=7.0,
                   swiglu_alpha=1.702, router_aux_loss_coef=0.001, output_router_logits=False,
                   attention_bias=True, hidden_act="silu")

# transformers' names: the experts as 3-d tensors (experts, in, out), gate and up
# interleaved along the last axis (gate the even columns).
MOE_NAMES = {
    "router": ("mlp.router.weight", 1),
    "router_bias": ("mlp.router.bias", None),
    "w_gate": ("mlp.experts.gate_up_proj", EVEN),
    "w_up": ("mlp.experts.gate_up_proj", ODD),
    "b_gate": ("mlp.experts.gate_up_proj_bias", EVEN),
    "b_up": ("mlp.experts.gate_up_proj_bias", ODD),
    "w_down": ("mlp.experts.down_proj", None),
    "b_down": ("mlp.experts.down_proj_bias", None),
}

def _rope(c: dict) -> dict:
    """GptOssConfig's rope_parameters where config.json has none (its yarn)."""
    if hf_config.rope_parameters(c):
        return c
    return {**c, "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False,
                                     "original_max_position_embeddings": 4096}}


def _layer_types(c: dict, n_layers: int) -> list[str]:
    """config.json's layer_types, or GptOssConfig's: windowed, then full, alternating."""
    if c["layer_types"] is not None:
        return list(c["layer_types"])
    return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]


def read_hf(c: dict, where: str) -> dict:
    hf_config.require(c, where, "GPT-OSS", attention_bias=True)
    dims = hf_config.read_dims(_rope(c), where)
    types = _layer_types(c, dims["n_layers"])
    return {**dims, **hf_config.read_window({**c, "layer_types": types}, where, dims["n_layers"]),
            "n_experts": int(c["num_local_experts"]),
            "experts_per_token": int(c["num_experts_per_tok"]),
            "swiglu_limit": hf_config.number(c, "swiglu_limit", where),
            "swiglu_alpha": hf_config.number(c, "swiglu_alpha", where),
            **hf_config.read_aux_loss(c, where)}


def write_hf(cfg: DecoderConfig) -> dict:
    return dict(hf_config.write_dims(cfg), hidden_act="silu", attention_bias=True,
                num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha,
                **hf_config.write_aux_loss(cfg))


GPT_OSS = register(Family(
    name="gpt_oss", description="GPT-OSS (20B, 120B; mixture of experts, attention sinks)",
    model_types=("gpt_oss",), architecture="GptOssForCausalLM", presets=PRESETS,
    read_hf=read_hf, write_hf=write_hf, hf_defaults=HF_DEFAULTS,
    fixed=dict(qkv_bias=True, o_bias=True, attn_sinks=True, router_bias=True,
               expert_bias=True, norm_topk_prob=True, swiglu_limit=7.0, swiglu_alpha=1.702),
    options=("sliding_window", "sliding_window_pattern", "n_experts", "experts_per_token",
             "router_aux_loss_coef", "swiglu_limit", "swiglu_alpha"),
    moe_names=MOE_NAMES))
