"""Gemma 3, text (``model_type`` gemma3_text): embeddings scaled by sqrt(dim),
``(1 + w)`` RMSNorms, four norms per block (before and after attention and the
MLP), q/k norms, a GELU-tanh gated MLP, scores scaled by
``query_pre_attn_scalar ** -0.5``, and layers alternating between local ones
(a sliding window, rotary base ``local_rope_theta``) and a global one every
``sliding_window_pattern`` layers (rotary base ``rope_theta``, with the linear
scaling of the 4B and larger models). Embeddings tied."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import FULL, SLIDING, DecoderConfig
from ndjax.models.layers import RopeScaling
from ndjax.models.registry import Family, register

_GEMMA = dict(rope_theta=1_000_000.0, local_rope_theta=10_000.0, rms_norm_eps=1e-6,
              tie_embeddings=True, sliding_window_pattern=6)
_LINEAR8 = RopeScaling(factor=8.0, rope_type="linear")

PRESETS = {
    # 8 layers: one whole period of 6 and two more, local and windowed.
    "tiny": dict(vocab_size=2048, dim=256, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=64,
                 ffn_dim=768, sliding_window=16, query_pre_attn_scalar=48,
                 rope_scaling=_LINEAR8, **_GEMMA),
    # Dimensions of the public Gemma 3 1B, and of the 4B, 12B and 27B text decoders.
    "gemma3_1b": dict(vocab_size=262_144, dim=1152, n_layers=26, n_heads=4, n_kv_heads=1,
                      head_dim=256, ffn_dim=6912, sliding_window=512,
                      query_pre_attn_scalar=256, **_GEMMA),
    "gemma3_4b": dict(vocab_size=262_208, dim=2560, n_layers=34, n_heads=8, n_kv_heads=4,
                      head_dim=256, ffn_dim=10_240, sliding_window=1024,
                      query_pre_attn_scalar=256, rope_scaling=_LINEAR8, **_GEMMA),
    "gemma3_12b": dict(vocab_size=262_208, dim=3840, n_layers=48, n_heads=16, n_kv_heads=8,
                       head_dim=256, ffn_dim=15_360, sliding_window=1024,
                       query_pre_attn_scalar=256, rope_scaling=_LINEAR8, **_GEMMA),
    "gemma3_27b": dict(vocab_size=262_208, dim=5376, n_layers=62, n_heads=32, n_kv_heads=16,
                       head_dim=128, ffn_dim=21_504, sliding_window=1024,
                       query_pre_attn_scalar=168, rope_scaling=_LINEAR8, **_GEMMA),
}

_ACT = "gelu_pytorch_tanh"

# Gemma3TextConfig's values for absent keys (a 4B-like model: a 4096 window, rotary
# bases 1e6 global and 1e4 local). sliding_window_pattern, the older form of
# layer_types, is still on the Hub and still read where layer_types is absent.
# hidden_act is not read: transformers takes the activation from hidden_activation.
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=4, head_dim=256,
                   tie_word_embeddings=True, rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0, max_position_embeddings=131_072,
                   hidden_activation=_ACT, query_pre_attn_scalar=256, sliding_window=4096,
                   layer_types=None, sliding_window_pattern=6, attn_logit_softcapping=None,
                   final_logit_softcapping=None, use_bidirectional_attention=False,
                   attention_bias=False)


def layer_types(c: dict, where: str, n_layers: int) -> list[str]:
    """config.json's layer_types, or as Gemma3TextConfig derives them from
    sliding_window_pattern: every pattern-th layer global."""
    if c["layer_types"] is not None:
        return list(c["layer_types"])
    every = c["sliding_window_pattern"]
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise hf_config.config_error(where, f"sliding_window_pattern={every!r} must be an "
                                     "int >= 1", "Fix it, or give config.json layer_types.")
    return [SLIDING if (i + 1) % every else FULL for i in range(n_layers)]


def read_hf(c: dict, where: str) -> dict:
    hf_config.require(c, where, "Gemma 3", hidden_activation=_ACT, final_logit_softcapping=None,
                      use_bidirectional_attention=False, attention_bias=False)
    dims = hf_config.read_dims(c, where)
    # The local layers' parameters, or (none, as in 4.x's rope_scaling) rope_local_base_freq.
    local = hf_config.rope_parameters(c).get(SLIDING) or {}
    theta, scaling = hf_config.read_rope(local, c, where, theta_key="rope_local_base_freq")
    if scaling is not None:
        raise hf_config.config_error(where, "scales the local layers' rotary embedding",
                                     "ndjax's Gemma 3 scales only the global layers'.")
    types = layer_types(c, where, dims["n_layers"])
    softcap = c["attn_logit_softcapping"]
    return {**dims, **hf_config.read_window({**c, "layer_types": types}, where, dims["n_layers"]),
            "query_pre_attn_scalar": hf_config.number(c, "query_pre_attn_scalar", where),
            "local_rope_theta": theta,
            "attn_softcap": None if softcap is None else float(softcap)}


def write_hf(cfg: DecoderConfig) -> dict:
    out = hf_config.write_dims(cfg)
    out.pop("rope_scaling")
    full = out.pop("rope_parameters")
    scalar = cfg.query_pre_attn_scalar or cfg.hd
    # transformers' Gemma3TextConfig takes an int where it is one (it checks the type).
    out.update(hidden_activation=_ACT,
               query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
               rope_parameters={FULL: full, SLIDING: {"rope_type": "default",
                                                      "rope_theta": cfg.rope(SLIDING).theta}},
               rope_local_base_freq=cfg.rope(SLIDING).theta,
               sliding_window=cfg.sliding_window, layer_types=list(cfg.types),
               attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=None,
               attention_bias=False)
    return out


GEMMA3 = register(Family(
    name="gemma3", description="Gemma 3 (text)", model_types=("gemma3_text",),
    architecture="Gemma3ForCausalLM", presets=PRESETS, read_hf=read_hf, write_hf=write_hf,
    hf_defaults=HF_DEFAULTS,
    fixed=dict(norm_plus_one=True, post_norms=True, qk_norm=True, embed_scale=True,
               activation=_ACT),
    options=("sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
             "local_rope_theta"),
    norm_names={"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm",
                "post_mlp_norm": "post_feedforward_layernorm"}))
