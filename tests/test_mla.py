"""Multi-head latent attention (ndjax.models.mla, DeepSeek V3's): the module equals
transformers' DeepseekV3Attention with the same weights, copied through the Hugging Face
names of ``registry.mla_names``; packed documents do not see each other; a mesh of
fsdp x tensor computes what one device does; the KV-cache decode, which caches the
latents, gives the full forward's logits; the parameter and FLOP counts.

Tolerance: 1e-5 absolute in float32 on outputs of order 0.1 to 1 (the same sums in
another order).
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from ndjax.models import decode, decoder, lora, mla, quant, registry
from ndjax.models.decoder import FULL, DecoderConfig
from ndjax.models.layers import RopeScaling
from ndjax.parallel import rules as rules_lib
from ndjax.parallel.mesh import ParallelDims, build_mesh
from ndjax.runs.hf import _hf_shape
from ndjax.runtime.errors import ConfigError

TOL = dict(atol=1e-5, rtol=0)
DIM, HEADS, NOPE, ROPE, V, Q_RANK, KV_RANK = 64, 4, 16, 8, 12, 24, 16
# factor 4 over 8 original positions, rows of 32: YaRN's ramp and both of its scales
# (cos/sin by mscale / mscale_all_dim, the scores by mscale_all_dim's square) matter.
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=1.0,
            mscale_all_dim=0.707, beta_fast=32.0, beta_slow=1.0)
B, S = 2, 32


def mla_config(q_rank=Q_RANK, interleave=True, yarn=True, **overrides) -> DecoderConfig:
    """A DecoderConfig with MLA, built directly (no family's checks)."""
    return DecoderConfig(**{**dict(
        vocab_size=128, dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=HEADS, ffn_dim=96,
        head_dim=NOPE + ROPE, rope_theta=10_000.0,
        rope_scaling=RopeScaling(**YARN) if yarn else None, rms_norm_eps=1e-5,
        q_lora_rank=q_rank, kv_lora_rank=KV_RANK, rope_head_dim=ROPE, v_head_dim=V,
        rope_interleave=interleave, attn_impl="dense"), **overrides})


def hf_attention(q_rank, interleave, yarn, bias=False
                 ) -> tuple[DeepseekV3Attention, DeepseekV3Config]:
    rope = {"rope_theta": 10_000.0, **(YARN if yarn else {"rope_type": "default"})}
    config = DeepseekV3Config(
        hidden_size=DIM, num_attention_heads=HEADS, num_key_value_heads=HEADS,
        q_lora_rank=q_rank or None, kv_lora_rank=KV_RANK, qk_rope_head_dim=ROPE,
        qk_nope_head_dim=NOPE, v_head_dim=V, rope_interleave=interleave,
        rope_parameters=rope, max_position_embeddings=32, rms_norm_eps=1e-5,
        num_hidden_layers=1, attention_bias=bias)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():  # outputs of order 1, norms away from 1
        for p in attn.parameters():
            if p.ndim == 2:
                p.normal_(0, p.shape[1] ** -0.5)
            else:  # norms and biases
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return attn, config


def load(module: mla.MLA, attn: DeepseekV3Attention, cfg: DecoderConfig) -> None:
    """transformers' weights into ``module`` through the family's HF names and splits."""
    state = {k: v.detach().numpy() for k, v in attn.state_dict().items()}
    for path, (name, split) in registry.get("llama").hf_names(cfg)[1].items():
        if path[0] != "attn":
            continue
        var = functools.reduce(getattr, path[1:], module)
        w = state.pop(name.removeprefix("self_attn."))
        shape = var[...].shape
        assert _hf_shape(shape, split) == w.shape, (name, shape, w.shape)
        var[...] = jnp.asarray(w.T.reshape(shape) if isinstance(split, int) else w)
    assert not state, f"not mapped: {sorted(state)}"


def tables(cfg: DecoderConfig, positions) -> tuple[jax.Array, jax.Array]:
    """``Decoder.rope_tables``' cos and sin (the rope_head_dim rotary dims)."""
    return decoder.Decoder.rope_tables(types.SimpleNamespace(cfg=cfg), positions)[FULL]


@pytest.mark.parametrize("yarn", [True, False], ids=["yarn", "default_rope"])
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "rotate_half"])
@pytest.mark.parametrize("q_rank", [Q_RANK, 0], ids=["q_latent", "q_proj"])
def test_mla_is_transformers_deepseek_v3_attention(q_rank, interleave, yarn, bias=False):
    attn, config = hf_attention(q_rank, interleave, yarn, bias)
    x = torch.randn(B, S, DIM, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(S)[None].expand(B, S)
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, positions)
    mask = torch.full((S, S), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        want = attn(x, (cos, sin), mask)[0].numpy()

    cfg = mla_config(q_rank, interleave, yarn, qkv_bias=bias, o_bias=bias)
    module = mla.MLA(cfg, nnx.Rngs(0))
    load(module, attn, cfg)
    assert module.kv_a_norm.eps == mla.LATENT_NORM_EPS != cfg.rms_norm_eps  # as transformers'
    assert cfg.spec(FULL).scale == pytest.approx(attn.scaling, rel=1e-12)
    got = jax.jit(lambda x, pos: module(x, *tables(cfg, pos), jnp.ones((B, S), jnp.int32),
                                        cfg.spec(FULL)))(x.numpy(), positions.numpy())
    assert np.abs(want).mean() > 0.2
    np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("q_rank", [Q_RANK, 0], ids=["q_latent", "q_proj"])
def test_attention_bias_is_qkv_and_o_bias(q_rank):
    """transformers' attention_bias: biases on q_a_proj (where there is one),
    kv_a_proj_with_mqa and o_proj, as qkv_bias and o_bias."""
    test_mla_is_transformers_deepseek_v3_attention(q_rank, True, True, bias=True)


@pytest.mark.parametrize("impl", ["dense", "blocked", "tiled"])
def test_packed_documents_are_each_alone(impl):
    """A row of two documents (positions restarting) equals each document alone, with
    the kernels that pad the values."""
    cfg = mla_config(attn_impl=impl, attn_kv_tile=4)
    module = mla.MLA(cfg, nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (1, S, DIM))
    cut = 8
    positions = jnp.concatenate([jnp.arange(cut), jnp.arange(S - cut)])[None]
    seg = jnp.where(jnp.arange(S) < cut, 1, 2)[None].astype(jnp.int32)

    @jax.jit
    def run(x, positions, seg):
        return module(x, *tables(cfg, positions), seg, cfg.spec(FULL))

    packed = run(x, positions, seg)
    first = run(x[:, :cut], positions[:, :cut], seg[:, :cut])
    second = run(x[:, cut:], positions[:, cut:], jnp.ones((1, S - cut), jnp.int32))
    np.testing.assert_allclose(packed, jnp.concatenate([first, second], axis=1), **TOL)


def _loss_and_grads(graphdef, params, tokens, positions, seg):
    def loss(params):
        logits = nnx.merge(graphdef, params)(tokens, positions, seg)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits
    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, logits, grads


@pytest.mark.parametrize("mesh, kernel", [
    (dict(fsdp=2, tensor=2), {}),
    (dict(fsdp=2, context=2, tensor=2), dict(attn_impl="ring", cp_impl="ring")),
    (dict(fsdp=2, context=2), dict(attn_impl="dense", cp_impl="all_to_all")),
], ids=["fsdp_tp", "ring", "all_to_all"])
def test_layouts_compute_what_one_device_does(mesh, kernel):
    """The decoder with MLA on a mesh under the default rules (the latent ranks' rows
    FSDP-sharded, the heads over tensor; rows of two documents, each sequence split over
    context by ring or all-to-all attention, the padded values passed round): logits and
    every parameter's gradient as on one device."""
    cfg = mla_config(cp_layout="contiguous", attn_kv_tile=4, **kernel)
    graphdef, params = nnx.split(decoder.Decoder(cfg, nnx.Rngs(params=0)))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, S)), jnp.int32)
    first = np.arange(S) < 10
    seg = jnp.asarray(np.where(first, 1, 2)[None].repeat(4, 0), jnp.int32)
    positions = jnp.asarray(np.where(first, np.arange(S), np.arange(S) - 10)[None].repeat(4, 0),
                            jnp.int32)
    one = nnx.split(decoder.Decoder(mla_config(), nnx.Rngs(params=0)))[0]
    want = jax.jit(functools.partial(_loss_and_grads, one))(params, tokens, positions, seg)
    devices = jax.devices()[:int(np.prod(list(mesh.values())))]
    rules = rules_lib.Rules("default", build_mesh(ParallelDims(**mesh), devices))
    names = decoder.logical_axes(params)["layers"]["attn"]
    fsdp = rules.spec(names["wq_a"])[1]  # embed's: fsdp (x context)
    heads = ("tensor",) if "tensor" in mesh else ()
    assert fsdp and rules.spec(names["wkv_a"]) == jax.P(None, fsdp)
    for name in ("wq_b", "wkv_b"):
        assert rules.spec(names[name]) == jax.P(None, fsdp, *heads)
    with rules_lib.use(rules):
        got = jax.jit(functools.partial(_loss_and_grads, graphdef))(params, tokens, positions,
                                                                     seg)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=1e-5)


def test_the_latent_cache_decodes_as_the_full_forward():
    """Greedy decoding with the cache of latents (a row left-padded): each step's logits
    are the full forward's at that position, over the prompt and the tokens chosen."""
    cfg = mla_config(n_layers=3)
    model = decoder.Decoder(cfg, nnx.Rngs(params=0))
    graphdef, params = nnx.split(model)
    prompt, new, pad = 6, 5, (0, 2)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, prompt)).astype(np.int32)
    tokens[1, :pad[1]] = 0  # the padding of row 1
    cache = decode.init_cache(cfg, 2, prompt + new, jnp.asarray(pad, jnp.int32))
    assert cache.k.shape == (3, 2, prompt + new, KV_RANK + ROPE) and cache.v is None
    step = jax.jit(lambda params, tokens, start, cache: decode.forward(
        nnx.merge(graphdef, params), tokens, start, cache))
    logits, cache = step(params, jnp.asarray(tokens), 0, cache)
    seen = [logits]
    for i in range(new - 1):
        chosen = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        tokens = np.concatenate([tokens, np.asarray(chosen)], axis=1)
        logits, cache = step(params, chosen, prompt + i, cache)
        seen.append(logits)
    full = jax.jit(lambda params, t: nnx.merge(graphdef, params)(
        t, jnp.arange(t.shape[1])[None], jnp.ones_like(t)))
    for row in range(2):
        want = full(params, jnp.asarray(tokens[row:row + 1, pad[row]:]))[0, prompt - 1 - pad[row]:]
        got = jnp.stack([s[row] for s in seen])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides", [{}, dict(q_lora_rank=0), dict(qkv_bias=True, o_bias=True),
                                       dict(q_lora_rank=0, qkv_bias=True)],
                         ids=["q_latent", "q_proj", "biases", "q_proj_biases"])
def test_param_count_formula_matches_the_model(overrides):
    cfg = mla_config(**overrides)
    params = _params(cfg)
    assert sum(x.size for x in jax.tree.leaves(params)) == decoder.num_params(cfg)
    # Every parameter's HF name, with a plain reshape of its shape.
    _, per_layer = registry.get("llama").hf_names(cfg)
    attn = params["layers"]["attn"]
    assert sorted(per_layer[p][0] for p in per_layer if p[0] == "attn") == sorted(
        per_layer[("attn", *k)][0] for k in _leaf_paths(attn))


def _leaf_paths(tree, prefix=()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaf_paths(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _params(cfg: DecoderConfig) -> dict:
    """The model's parameters, abstract, as a nested dict."""
    model = nnx.eval_shape(lambda: decoder.Decoder(cfg, nnx.Rngs(0)))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_flops_count_the_latent_projections_and_narrow_values():
    """6 per matmul weight (MLA's five), and per query-key pair 2 x head_dim (QK^T) and
    2 x v_head_dim (PV), times 3, over the causal half of the keys."""
    cfg = mla_config()
    attn = _params(cfg)["layers"]["attn"]
    names = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo")
    weights = sum(attn[n].size for n in names) // cfg.n_layers
    matmul = cfg.n_layers * (weights + 3 * cfg.dim * cfg.ffn_dim) + cfg.dim * cfg.vocab_size
    keys = (S + 1) / 2 * cfg.n_layers
    want = 6.0 * matmul + 3 * 2 * (cfg.hd + V) * HEADS * keys
    assert decoder.train_flops_per_token(cfg, S) == pytest.approx(want, rel=1e-12)


def test_lora_adapts_the_output_projection_only():
    cfg = mla_config(lora=lora.LoraConfig(rank=4, alpha=8.0, targets=("o", "gate")))
    attn = _params(cfg)["layers"]["attn"]
    assert [k for k in attn if k.startswith("lora_")] == ["lora_o"]
    assert attn["lora_o"]["a"].shape == (2, HEADS, V, 4)
    qlora = dataclasses.replace(cfg, lora=dataclasses.replace(
        cfg.lora, quant=quant.QuantConfig("nf4", 4)))
    attn = _params(qlora)["layers"]["attn"]
    assert all(quant.is_quantized(attn[n]) for n in ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo"))
    refused = dataclasses.replace(cfg, lora=lora.LoraConfig(4, 8.0, tuple(lora.TARGETS)))
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules: q_proj, k_proj, "
                                          r"v_proj are not projections of multi-head latent"):
        _params(refused)


@pytest.mark.parametrize("preset", sorted(rules_lib.PRESETS))
def test_every_rule_preset_places_the_latents(preset):
    rules = rules_lib.Rules(preset, build_mesh(ParallelDims(fsdp=2, tensor=2),
                                               jax.devices()[:4]))
    for name in ("q_lora", "kv_lora"):
        assert rules.axes_of(name) == ("fsdp",)
    assert rules.axes_of("kv_lora_rope") == ()
