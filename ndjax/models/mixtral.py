"""Mixtral (``model_type`` mixtral): Mistral's block with a mixture of experts for the
MLP, 8 SwiGLU experts of ``ffn_dim`` each and the top 2 per token, their weights
renormalised to sum to one (``ndjax.models.moe``); a sliding window where the config
sets one (the released models: none)."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.registry import EXPERT, Family, register

_MIXTRAL = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-5, n_experts=8, experts_per_token=2)

PRESETS = {
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=256,
                 router_aux_loss_coef=0.02, **_MIXTRAL),
    # Dimensions of the public Mixtral 8x7B and 8x22B (v0.1) models.
    "mixtral_8x7b": dict(vocab_size=32_000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         ffn_dim=14_336, router_aux_loss_coef=0.02, **_MIXTRAL),
    "mixtral_8x22b": dict(vocab_size=32_000, dim=6144, n_layers=56, n_heads=48, n_kv_heads=8,
                          ffn_dim=16_384, router_aux_loss_coef=0.001, **_MIXTRAL),
}

# MixtralConfig's values for absent keys (null sliding_window: none).
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=8, max_position_embeddings=131_072,
                   hidden_act="silu", sliding_window=None, rope_theta=1_000_000.0,
                   rms_norm_eps=1e-5, num_local_experts=8, num_experts_per_tok=2,
                   router_aux_loss_coef=0.001, output_router_logits=False,
                   router_jitter_noise=0.0)

# The Hub's names, one tensor per expert, which transformers 5 writes too (it fuses them
# into 3-d experts.gate_up_proj / down_proj in memory only).
MOE_NAMES = {
    "router": ("block_sparse_moe.gate.weight", 1),
    "w_gate": (f"block_sparse_moe.experts.{EXPERT}.w1.weight", 1),
    "w_up": (f"block_sparse_moe.experts.{EXPERT}.w3.weight", 1),
    "w_down": (f"block_sparse_moe.experts.{EXPERT}.w2.weight", 1),
}


def n_experts(c: dict) -> int:
    """The experts of a config.json: ``num_local_experts``, or ``num_experts`` (what
    transformers' attribute map reads as it)."""
    return int(c["num_experts"] if "num_experts" in c else c["num_local_experts"])


def read_hf(c: dict, where: str) -> dict:
    hf_config.require(c, where, "Mixtral", hidden_act="silu", router_jitter_noise=0.0)
    dims = hf_config.read_dims(c, where)
    return {**dims, "sliding_window": int(c["sliding_window"]) if c["sliding_window"] else None,
            "n_experts": n_experts(c), "experts_per_token": int(c["num_experts_per_tok"]),
            **hf_config.read_aux_loss(c, where)}


def write_hf(cfg: DecoderConfig) -> dict:
    out = {**hf_config.write_dims(cfg), "hidden_act": "silu",
           "sliding_window": cfg.sliding_window, "num_local_experts": cfg.n_experts,
           "num_experts_per_tok": cfg.experts_per_token, **hf_config.write_aux_loss(cfg),
           "router_jitter_noise": 0.0}
    out.pop("layer_types", None)
    return out


MIXTRAL = register(Family(
    name="mixtral", description="Mixtral 8x7B, 8x22B (mixture of experts)",
    model_types=("mixtral",), architecture="MixtralForCausalLM", presets=PRESETS,
    read_hf=read_hf, write_hf=write_hf, hf_defaults=HF_DEFAULTS,
    fixed=dict(norm_topk_prob=True),
    options=("sliding_window", "n_experts", "experts_per_token", "router_aux_loss_coef"),
    moe_names=MOE_NAMES))
