"""Qwen3-MoE (``model_type`` qwen3_moe): Qwen 3's block (q/k norms, an explicit
head_dim) with a mixture of experts for every layer's MLP: 128 SwiGLU experts of
``moe_ffn_dim`` (config.json's moe_intermediate_size) and the top 8 per token in the
released sizes, their weights renormalised where ``norm_topk_prob`` says, no shared
expert (``ndjax.models.moe``). Dense layers among the MoE ones
(``decoder_sparse_step`` > 1, ``mlp_only_layers``) are refused."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.mixtral import n_experts
from ndjax.models.registry import EXPERT, Family, register

_QWEN = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, norm_topk_prob=True,
             router_aux_loss_coef=0.001)

PRESETS = {
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64,
                 ffn_dim=768, moe_ffn_dim=128, n_experts=8, experts_per_token=2, **_QWEN),
    # Dimensions of the public Qwen3-30B-A3B and Qwen3-235B-A22B models.
    "qwen3_30b_a3b": dict(vocab_size=151_936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                          head_dim=128, ffn_dim=6144, moe_ffn_dim=768, n_experts=128,
                          experts_per_token=8, **_QWEN),
    "qwen3_235b_a22b": dict(vocab_size=151_936, dim=4096, n_layers=94, n_heads=64,
                            n_kv_heads=4, head_dim=128, ffn_dim=12_288, moe_ffn_dim=1536,
                            n_experts=128, experts_per_token=8, **_QWEN),
}

# Qwen3MoeConfig's values for absent keys (no head_dim of its own: hidden_size over
# the heads).
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=4, max_position_embeddings=32_768,
                   hidden_act="silu", use_sliding_window=False, attention_bias=False,
                   num_local_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                   norm_topk_prob=False, router_aux_loss_coef=0.001,
                   output_router_logits=False, decoder_sparse_step=1,
                   mlp_only_layers=[])

# The Hub's names, one tensor per expert, which transformers 5 writes too (it fuses them
# into 3-d experts.gate_up_proj / down_proj in memory only).
MOE_NAMES = {
    "router": ("mlp.gate.weight", 1),
    "w_gate": (f"mlp.experts.{EXPERT}.gate_proj.weight", 1),
    "w_up": (f"mlp.experts.{EXPERT}.up_proj.weight", 1),
    "w_down": (f"mlp.experts.{EXPERT}.down_proj.weight", 1),
}


def read_qwen_moe(c: dict, where: str, family: str) -> dict:
    """The dims and expert fields Qwen's MoE config.json files share (Qwen 2 MoE's and
    Qwen3-MoE's); a config.json with dense layers among the MoE ones
    (``decoder_sparse_step`` > 1 or ``mlp_only_layers``) is refused."""
    hf_config.require(c, where, family, hidden_act="silu", use_sliding_window=False)
    if c["decoder_sparse_step"] != 1 or c["mlp_only_layers"]:
        raise hf_config.config_error(
            where, f"decoder_sparse_step={c['decoder_sparse_step']!r}, mlp_only_layers="
            f"{c['mlp_only_layers']!r}", f"ndjax's {family} has experts in every layer "
            "(decoder_sparse_step=1, mlp_only_layers=[]).")
    return {**hf_config.read_dims(c, where),
            "n_experts": n_experts(c), "experts_per_token": int(c["num_experts_per_tok"]),
            "moe_ffn_dim": int(c["moe_intermediate_size"]),
            "norm_topk_prob": bool(c["norm_topk_prob"]),
            **hf_config.read_aux_loss(c, where)}


def write_qwen_moe(cfg: DecoderConfig) -> dict:
    """``read_qwen_moe``'s fields, written."""
    return dict(hf_config.write_dims(cfg), hidden_act="silu", use_sliding_window=False,
                num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.expert_dim, norm_topk_prob=cfg.norm_topk_prob,
                **hf_config.write_aux_loss(cfg), decoder_sparse_step=1, mlp_only_layers=[])


def read_hf(c: dict, where: str) -> dict:
    return {**read_qwen_moe(c, where, "Qwen3-MoE"), "qkv_bias": bool(c["attention_bias"])}


def write_hf(cfg: DecoderConfig) -> dict:
    return dict(write_qwen_moe(cfg), attention_bias=cfg.qkv_bias)


QWEN3_MOE = register(Family(
    name="qwen3_moe", description="Qwen3-MoE (30B-A3B, 235B-A22B)", model_types=("qwen3_moe",),
    architecture="Qwen3MoeForCausalLM", presets=PRESETS, read_hf=read_hf, write_hf=write_hf,
    hf_defaults=HF_DEFAULTS, fixed=dict(qk_norm=True),
    options=("qkv_bias", "n_experts", "experts_per_token", "moe_ffn_dim", "norm_topk_prob",
             "router_aux_loss_coef"), moe_names=MOE_NAMES))
