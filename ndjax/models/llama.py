"""Llama 3 (``model_type`` llama): the decoder with its defaults, SiLU-gated MLP, no
biases, one norm before attention and one before the MLP."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.layers import RopeScaling
from ndjax.models.registry import Family, register

PRESETS = {
    # CPU demo, about 10M parameters.
    "tiny": dict(vocab_size=2048, dim=256, n_layers=8, n_heads=8, n_kv_heads=4,
                 ffn_dim=1024, rope_theta=10_000.0),
    # Dimensions of the public Llama 3.2 1B, Llama 3.1 8B, 70B and 405B models.
    "llama3_1b": dict(vocab_size=128_256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                      ffn_dim=8192, head_dim=64, tie_embeddings=True,
                      rope_scaling=RopeScaling(factor=32.0)),
    "llama3_8b": dict(vocab_size=128_256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      ffn_dim=14_336, rope_scaling=RopeScaling(factor=8.0)),
    "llama3_70b": dict(vocab_size=128_256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                       ffn_dim=28_672, rope_scaling=RopeScaling(factor=8.0)),
    "llama3_405b": dict(vocab_size=128_256, dim=16_384, n_layers=126, n_heads=128,
                        n_kv_heads=8, ffn_dim=53_248, rope_scaling=RopeScaling(factor=8.0)),
}


# LlamaConfig's values for absent keys.
HF_DEFAULTS = dict(hf_config.DEFAULTS, hidden_act="silu", attention_bias=False, mlp_bias=False)


def read_hf(c: dict, where: str) -> dict:
    hf_config.require(c, where, "Llama", hidden_act="silu", attention_bias=False,
                      mlp_bias=False)
    return hf_config.read_dims(c, where)


def write_hf(cfg: DecoderConfig) -> dict:
    return dict(hf_config.write_dims(cfg), hidden_act="silu", attention_bias=False,
                mlp_bias=False)


LLAMA = register(Family(
    name="llama", description="Llama 3, 3.1, 3.2", model_types=("llama",),
    architecture="LlamaForCausalLM", presets=PRESETS, read_hf=read_hf, write_hf=write_hf,
    hf_defaults=HF_DEFAULTS))
