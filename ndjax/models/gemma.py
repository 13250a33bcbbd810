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


def read_hf(c: dict, where: str) -> dict:
    act = c.get("hidden_activation") or c.get("hidden_act") or _ACT
    if act != _ACT:
        raise hf_config.config_error(where, f"hidden_activation={act!r}",
                                     f"ndjax's Gemma 3 has {_ACT!r}.")
    hf_config.require(c, where, "Gemma 3", final_logit_softcapping=None,
                      use_bidirectional_attention=False, attention_bias=False)
    dims = hf_config.read_dims(c, where)
    params = hf_config.rope_parameters(c)
    local = params.get(SLIDING) if SLIDING in params else {
        "rope_type": "default", "rope_theta": c.get("rope_local_base_freq", 10_000.0)}
    theta, scaling = hf_config.read_rope(local, c, where)
    if scaling is not None:
        raise hf_config.config_error(where, "scales the local layers' rotary embedding",
                                     "ndjax's Gemma 3 scales only the global layers'.")
    softcap = c.get("attn_logit_softcapping")
    return {**dims, **hf_config.read_window(c, where, dims["n_layers"]),
            "query_pre_attn_scalar": float(c.get("query_pre_attn_scalar", dims["head_dim"])),
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
    fixed=dict(norm_plus_one=True, post_norms=True, qk_norm=True, embed_scale=True,
               activation=_ACT),
    options=("sliding_window", "sliding_window_pattern", "query_pre_attn_scalar",
             "local_rope_theta"),
    norm_names={"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                "mlp_norm": "pre_feedforward_layernorm",
                "post_mlp_norm": "post_feedforward_layernorm"}))
