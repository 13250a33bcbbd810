"""Mistral (``model_type`` mistral): Llama's block, every layer optionally limited to
a sliding window of keys (Mistral 7B v0.1: 4,096; v0.3 and later: none)."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.registry import Family, register

PRESETS = {
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768,
                 rope_theta=10_000.0, rms_norm_eps=1e-6, sliding_window=48),
    "mistral_7b_v0_1": dict(vocab_size=32_000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            ffn_dim=14_336, rope_theta=10_000.0, rms_norm_eps=1e-5,
                            sliding_window=4096),
    "mistral_7b_v0_3": dict(vocab_size=32_768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                            ffn_dim=14_336, rope_theta=1_000_000.0, rms_norm_eps=1e-5),
}


# MistralConfig's values for absent keys: 8 kv heads and Mistral 7B v0.1's window
# (null: every head its own kv head, no window).
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=8, max_position_embeddings=131_072,
                   hidden_act="silu", sliding_window=4096, layer_types=None)


def read_hf(c: dict, where: str) -> dict:
    hf_config.require(c, where, "Mistral", hidden_act="silu")
    dims = hf_config.read_dims(c, where)
    window = hf_config.read_window(c, where, dims["n_layers"])
    if window["sliding_window_pattern"]:
        raise hf_config.config_error(where, f"layer_types={c['layer_types']!r}",
                                     "ndjax's Mistral windows every layer or none.")
    return {**dims, "sliding_window": window["sliding_window"]}


def write_hf(cfg: DecoderConfig) -> dict:
    # MistralConfig reads a missing sliding_window as 4096 (HF_DEFAULTS): say null. No
    # layer_types: AutoModel takes a Mistral config.json with them for Ministral.
    out = {**hf_config.write_dims(cfg), "hidden_act": "silu", "sliding_window": cfg.sliding_window}
    out.pop("layer_types", None)
    return out


MISTRAL = register(Family(
    name="mistral", description="Mistral 7B (v0.1 windowed, v0.3)", model_types=("mistral",),
    architecture="MistralForCausalLM", presets=PRESETS, read_hf=read_hf, write_hf=write_hf,
    hf_defaults=HF_DEFAULTS, options=("sliding_window",)))
