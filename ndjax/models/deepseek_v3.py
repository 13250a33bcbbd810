"""DeepSeek V3 / R1 (``model_type`` deepseek_v3; Kimi K2's ``kimi_k2`` and Moonlight on
the same architecture): multi-head latent attention (``ndjax.models.mla``: keys and
values from a compressed latent, queries from another, rotary dims of their own in
interleaved pairs, YaRN with its softmax scale), and a mixture of experts in every layer
after the first ``first_k_dense`` dense ones (``decoder.stacks``): sigmoid scores, the
top-k experts chosen by the scores plus a load-balancing bias among the best
``topk_group`` of ``n_group`` groups, weighted by their scores renormalised and times
``routed_scaling_factor``, beside ungated shared experts (``ndjax.models.moe``).

The bias (the checkpoint's ``e_score_correction_bias``) takes no gradient: after each
step it moves by ``model.score_bias_rate`` towards balance (auxiliary-loss-free
balancing, ``moe.update_score_bias``), and checkpoints and exports carry it. The
Hub's multi-token-prediction layers (``num_nextn_predict_layers``) are not read; nor
is DeepSeek's sequence-wise auxiliary loss built."""

from __future__ import annotations

from ndjax.models import hf_config
from ndjax.models.decoder import DecoderConfig
from ndjax.models.layers import RopeScaling
from ndjax.models.registry import EXPERT, Family, register

# DeepSeek V3's (the paper's bias update speed, gamma = 0.001).
_YARN = RopeScaling(rope_type="yarn", factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                    mscale_all_dim=1.0, original_max_position_embeddings=4096)
_ROUTING = dict(router_score="sigmoid", score_bias=True, score_bias_rate=0.001,
                norm_topk_prob=True, shared_expert_gate=False, rope_interleave=True,
                router_aux_loss_coef=0.0)

PRESETS = {
    # Every feature on: MLA with both latents, a dense first layer, 8 experts in 4 groups
    # of which 2 are searched, a shared expert.
    "tiny": dict(vocab_size=2048, dim=256, n_layers=4, n_heads=8, n_kv_heads=8, head_dim=48,
                 v_head_dim=32, rope_head_dim=16, q_lora_rank=64, kv_lora_rank=64,
                 ffn_dim=512, moe_ffn_dim=128, shared_expert_dim=128, n_experts=8,
                 experts_per_token=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                 first_k_dense=1, rope_theta=10_000.0, rms_norm_eps=1e-6, **_ROUTING),
    # Dimensions of the public DeepSeek-V3 (and R1): 671B, 37B active.
    "deepseek_v3": dict(vocab_size=129_280, dim=7168, n_layers=61, n_heads=128,
                        n_kv_heads=128, head_dim=192, v_head_dim=128, rope_head_dim=64,
                        q_lora_rank=1536, kv_lora_rank=512, ffn_dim=18_432, moe_ffn_dim=2048,
                        shared_expert_dim=2048, n_experts=256, experts_per_token=8, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, first_k_dense=3,
                        rope_theta=10_000.0, rope_scaling=_YARN, rms_norm_eps=1e-6,
                        **_ROUTING),
    # Moonshot's Moonlight-16B-A3B, the 16B-class model of this architecture (no query
    # latent, 64 experts in one group, two shared experts' width, one dense layer).
    "moonlight_16b_a3b": dict(vocab_size=163_840, dim=2048, n_layers=27, n_heads=16,
                              n_kv_heads=16, head_dim=192, v_head_dim=128, rope_head_dim=64,
                              q_lora_rank=0, kv_lora_rank=512, ffn_dim=11_264,
                              moe_ffn_dim=1408, shared_expert_dim=2816, n_experts=64,
                              experts_per_token=6, routed_scaling_factor=2.446,
                              first_k_dense=1, rope_theta=50_000.0, rms_norm_eps=1e-5,
                              **_ROUTING),
}

# DeepseekV3Config's values for absent keys (transformers' head_dim is the rotary dims;
# ndjax's is the query/key head, read from the nope and rope dims).
HF_DEFAULTS = dict(hf_config.DEFAULTS, num_key_value_heads=None, head_dim=None,
                   max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
                   moe_intermediate_size=2048, n_shared_experts=1, n_routed_experts=256,
                   routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                   qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                   topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
                   norm_topk_prob=True, rope_interleave=True, attention_bias=False,
                   router_aux_loss_coef=0.0, output_router_logits=False,
                   scoring_func="sigmoid", topk_method="noaux_tc")

# The Hub's names: one tensor per expert, the router's bias beside its weight, the
# shared experts as one MLP of their summed width.
MOE_NAMES = {
    "router": ("mlp.gate.weight", 1),
    "score_bias": ("mlp.gate.e_score_correction_bias", None),
    "w_gate": (f"mlp.experts.{EXPERT}.gate_proj.weight", 1),
    "w_up": (f"mlp.experts.{EXPERT}.up_proj.weight", 1),
    "w_down": (f"mlp.experts.{EXPERT}.down_proj.weight", 1),
    ("shared", "w_gate"): ("mlp.shared_experts.gate_proj.weight", 1),
    ("shared", "w_up"): ("mlp.shared_experts.up_proj.weight", 1),
    ("shared", "w_down"): ("mlp.shared_experts.down_proj.weight", 1),
}


def _int(c: dict, key: str, where: str, least: int = 1) -> int:
    value = c[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise hf_config.config_error(where, f"{key}={value!r} must be an int >= {least}",
                                     "Fix config.json.")
    return value


def read_hf(c: dict, where: str) -> dict:
    hf_config.require(c, where, "DeepSeek V3", hidden_act="silu", scoring_func="sigmoid",
                      topk_method="noaux_tc")
    dims = hf_config.read_dims(c, where)
    experts = _int(c, "n_routed_experts", where)
    groups, top_groups = _int(c, "n_group", where), _int(c, "topk_group", where)
    if experts % groups or top_groups > groups:
        raise hf_config.config_error(
            where, f"n_group={groups}, topk_group={top_groups} with n_routed_experts="
            f"{experts}", "The experts split into n_group equal groups, topk_group of them "
            "searched.")
    moe_ffn = _int(c, "moe_intermediate_size", where)
    rope, nope = _int(c, "qk_rope_head_dim", where), _int(c, "qk_nope_head_dim", where)
    first = _int(c, "first_k_dense_replace", where, least=0)
    if first >= dims["n_layers"]:
        raise hf_config.config_error(
            where, f"first_k_dense_replace={first} with num_hidden_layers={dims['n_layers']}",
            "ndjax's DeepSeek V3 has experts in its last layers at least.")
    return {**dims, "n_kv_heads": dims["n_heads"], "head_dim": nope + rope,
            "rope_head_dim": rope, "v_head_dim": _int(c, "v_head_dim", where),
            "q_lora_rank": c["q_lora_rank"] and _int(c, "q_lora_rank", where) or 0,
            "kv_lora_rank": _int(c, "kv_lora_rank", where),
            "rope_interleave": bool(c["rope_interleave"]),
            # transformers' attention_bias: on q_a_proj, kv_a_proj_with_mqa and o_proj.
            "qkv_bias": bool(c["attention_bias"]), "o_bias": bool(c["attention_bias"]),
            "n_experts": experts, "experts_per_token": _int(c, "num_experts_per_tok", where),
            "moe_ffn_dim": moe_ffn,
            "shared_expert_dim": _int(c, "n_shared_experts", where, least=0) * moe_ffn,
            "n_group": groups, "topk_group": top_groups,
            "routed_scaling_factor": hf_config.number(c, "routed_scaling_factor", where),
            "norm_topk_prob": bool(c["norm_topk_prob"]), "first_k_dense": first,
            **hf_config.read_aux_loss(c, where)}


def write_hf(cfg: DecoderConfig) -> dict:
    out = hf_config.write_dims(cfg)
    out.pop("head_dim")  # transformers derives it (the rotary dims)
    shared, rest = divmod(cfg.shared_expert_dim, cfg.expert_dim)
    assert not rest, "DeepSeek's shared experts are a whole number of experts wide"
    return dict(out, hidden_act="silu", attention_bias=cfg.o_bias,
                num_key_value_heads=cfg.n_heads,
                qk_rope_head_dim=cfg.rope_head_dim,
                qk_nope_head_dim=cfg.hd - cfg.rope_head_dim, v_head_dim=cfg.v_head_dim,
                q_lora_rank=cfg.q_lora_rank or None, kv_lora_rank=cfg.kv_lora_rank,
                rope_interleave=cfg.rope_interleave, n_routed_experts=cfg.n_experts,
                num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.expert_dim,
                n_shared_experts=shared, n_group=cfg.n_group, topk_group=cfg.topk_group,
                routed_scaling_factor=cfg.routed_scaling_factor,
                norm_topk_prob=cfg.norm_topk_prob, first_k_dense_replace=cfg.first_k_dense,
                scoring_func="sigmoid", topk_method="noaux_tc",
                **hf_config.write_aux_loss(cfg))


DEEPSEEK_V3 = register(Family(
    name="deepseek_v3",
    description="DeepSeek V3 / R1, Kimi K2, Moonlight (latent attention, 256 experts)",
    model_types=("deepseek_v3", "kimi_k2"), architecture="DeepseekV3ForCausalLM",
    presets=PRESETS, read_hf=read_hf, write_hf=write_hf, hf_defaults=HF_DEFAULTS,
    fixed=dict(_ROUTING),
    options=("n_experts", "experts_per_token", "moe_ffn_dim", "norm_topk_prob",
             "router_aux_loss_coef", "shared_expert_dim", "score_bias_rate", "q_lora_rank",
             "kv_lora_rank", "rope_head_dim", "v_head_dim", "rope_interleave", "first_k_dense",
             "n_group", "topk_group", "routed_scaling_factor"),
    moe_names=MOE_NAMES))
