"""Qwen 2.5 (``model_type`` qwen2: biases on q, k and v) and Qwen 3 (qwen3: an
RMSNorm over each head of q and k before the rotary embedding, an explicit
head_dim). Both: Llama's block otherwise; tied embeddings on the small sizes."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.registry import Family, register

_QWEN = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6)

QWEN2_PRESETS = {
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, ffn_dim=768,
                 tie_embeddings=True, **_QWEN),
    # Dimensions of the public Qwen2.5 0.5B, 7B and 32B models.
    "qwen2_5_0_5b": dict(vocab_size=151_936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2,
                         ffn_dim=4864, tie_embeddings=True, **_QWEN),
    "qwen2_5_7b": dict(vocab_size=152_064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4,
                       ffn_dim=18_944, **_QWEN),
    "qwen2_5_32b": dict(vocab_size=152_064, dim=5120, n_layers=64, n_heads=40, n_kv_heads=8,
                        ffn_dim=27_648, **_QWEN),
}

QWEN3_PRESETS = {
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64,
                 ffn_dim=768, tie_embeddings=True, **_QWEN),
    # Dimensions of the public Qwen3 0.6B, 8B and 32B models.
    "qwen3_0_6b": dict(vocab_size=151_936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       head_dim=128, ffn_dim=3072, tie_embeddings=True, **_QWEN),
    "qwen3_8b": dict(vocab_size=151_936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8,
                     head_dim=128, ffn_dim=12_288, **_QWEN),
    "qwen3_32b": dict(vocab_size=151_936, dim=5120, n_layers=64, n_heads=64, n_kv_heads=8,
                      head_dim=128, ffn_dim=25_600, **_QWEN),
}


# Qwen2Config's and Qwen3Config's values for absent keys: 32 kv heads whatever the
# heads (null: as many as the heads); Qwen 3's head_dim is 128 whatever hidden_size.
QWEN2_HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=32,
                         max_position_embeddings=32_768, hidden_act="silu",
                         use_sliding_window=False)
QWEN3_HF_DEFAULTS = dict(QWEN2_HF_DEFAULTS, head_dim=128, attention_bias=False)


def _read(c: dict, where: str, family: str) -> dict:
    hf_config.require(c, where, family, hidden_act="silu", use_sliding_window=False)
    return hf_config.read_dims(c, where)


def read_qwen2(c: dict, where: str) -> dict:
    return _read(c, where, "Qwen 2.5")


def read_qwen3(c: dict, where: str) -> dict:
    return {**_read(c, where, "Qwen 3"), "qkv_bias": bool(c["attention_bias"])}


def write_qwen2(cfg: DecoderConfig) -> dict:
    return dict(hf_config.write_dims(cfg), hidden_act="silu", use_sliding_window=False)


def write_qwen3(cfg: DecoderConfig) -> dict:
    return dict(write_qwen2(cfg), attention_bias=cfg.qkv_bias)


QWEN2 = register(Family(
    name="qwen2", description="Qwen 2.5", model_types=("qwen2",),
    architecture="Qwen2ForCausalLM", presets=QWEN2_PRESETS, read_hf=read_qwen2,
    write_hf=write_qwen2, hf_defaults=QWEN2_HF_DEFAULTS, fixed=dict(qkv_bias=True)))

QWEN3 = register(Family(
    name="qwen3", description="Qwen 3 (dense)", model_types=("qwen3",),
    architecture="Qwen3ForCausalLM", presets=QWEN3_PRESETS, read_hf=read_qwen3,
    write_hf=write_qwen3, hf_defaults=QWEN3_HF_DEFAULTS, fixed=dict(qk_norm=True),
    options=("qkv_bias",)))
