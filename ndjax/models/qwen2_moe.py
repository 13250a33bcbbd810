"""Qwen 2 MoE (``model_type`` qwen2_moe: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen 2.5's
block (biases on q, k and v) with a mixture of experts for every layer's MLP, 60 or
64 SwiGLU experts of ``moe_ffn_dim`` (moe_intermediate_size), the top 4 or 8 per token,
their weights not renormalised, and a **shared expert**: a SwiGLU MLP of
``shared_expert_dim`` (shared_expert_intermediate_size) that every token runs through,
its output scaled by ``sigmoid(x . w)`` of a gate of its own, added to the routed
experts' (``ndjax.models.moe``). Dense layers among the MoE ones
(``decoder_sparse_step`` > 1, ``mlp_only_layers``) are refused, as for Qwen3-MoE."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.qwen3_moe import read_qwen_moe, write_qwen_moe
from ndjax.models.registry import EXPERT, Family, register

_QWEN = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, qkv_bias=True, norm_topk_prob=False,
             router_aux_loss_coef=0.001)

PRESETS = {
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=512,
                 moe_ffn_dim=128, shared_expert_dim=512, n_experts=8, experts_per_token=2,
                 **_QWEN),
    # Dimensions of the public Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B models.
    "qwen1_5_moe_a2_7b": dict(vocab_size=151_936, dim=2048, n_layers=24, n_heads=16,
                              n_kv_heads=16, ffn_dim=5632, moe_ffn_dim=1408,
                              shared_expert_dim=5632, n_experts=60, experts_per_token=4, **_QWEN),
    "qwen2_57b_a14b": dict(vocab_size=151_936, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                           ffn_dim=18_944, moe_ffn_dim=2560, shared_expert_dim=20_480,
                           n_experts=64, experts_per_token=8, **_QWEN),
}

# Qwen2MoeConfig's values for absent keys.
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=16, max_position_embeddings=32_768,
                   hidden_act="silu", use_sliding_window=False, qkv_bias=True,
                   num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                   shared_expert_intermediate_size=5632, norm_topk_prob=False,
                   router_aux_loss_coef=0.001, output_router_logits=False,
                   decoder_sparse_step=1, mlp_only_layers=[])

# The Hub's names: one tensor per expert (as Qwen3-MoE's), the shared expert's three
# and its gate, a (1, dim) Linear that is the ndjax (dim,) vector.
MOE_NAMES = {
    "router": ("mlp.gate.weight", 1),
    "w_gate": (f"mlp.experts.{EXPERT}.gate_proj.weight", 1),
    "w_up": (f"mlp.experts.{EXPERT}.up_proj.weight", 1),
    "w_down": (f"mlp.experts.{EXPERT}.down_proj.weight", 1),
    ("shared", "w_gate"): ("mlp.shared_expert.gate_proj.weight", 1),
    ("shared", "w_up"): ("mlp.shared_expert.up_proj.weight", 1),
    ("shared", "w_down"): ("mlp.shared_expert.down_proj.weight", 1),
    "shared_gate": ("mlp.shared_expert_gate.weight", 1),
}


def read_hf(c: dict, where: str) -> dict:
    return {**read_qwen_moe(c, where, "Qwen 2 MoE"), "qkv_bias": bool(c["qkv_bias"]),
            "shared_expert_dim": int(c["shared_expert_intermediate_size"])}


def write_hf(cfg: DecoderConfig) -> dict:
    return dict(write_qwen_moe(cfg), qkv_bias=cfg.qkv_bias,
                shared_expert_intermediate_size=cfg.shared_expert_dim)


QWEN2_MOE = register(Family(
    name="qwen2_moe", description="Qwen 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; shared expert)",
    model_types=("qwen2_moe",), architecture="Qwen2MoeForCausalLM", presets=PRESETS,
    read_hf=read_hf, write_hf=write_hf, hf_defaults=HF_DEFAULTS,
    options=("qkv_bias", "n_experts", "experts_per_token", "moe_ffn_dim", "norm_topk_prob",
             "router_aux_loss_coef", "shared_expert_dim"), moe_names=MOE_NAMES))
